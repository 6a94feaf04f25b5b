"""Config composition: every option of every group composes and validates; typos and wrong types
fail at compose time with the key named; --help and --cfg job work through the real CLI."""

import subprocess
import sys

import pytest
from conftest import CONF, ROOT
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from rlcli.config import register_configs, validate
from rlcli.schema_doc import group_options

register_configs()


def make(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return cfg


# Options that need a value only the user can give.
NEEDS = {("model", "hf"): ["model.path=/some/dir"]}


@pytest.mark.parametrize(
    "group,option", [(g, o) for g, opts in group_options(CONF).items() for o in opts]
)
def test_every_option_composes_and_validates(group, option):
    cfg = make([f"{group}={option}", *NEEDS.get((group, option), [])])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    if cfg.hw.device == "cuda" or cfg.hw.nproc > 1:
        # Divisibility still holds on the GPU layouts; nothing is built here.
        assert cfg.rollout.prompts_per_step % cfg.hw.nproc == 0
    validate(cfg)


def test_defaults_are_the_embedded_job():
    cfg = make()
    assert (cfg.algo.name, cfg.model.name, cfg.hw.name, cfg.data.name) == ("grpo", "tiny", "cpu", "arith")
    assert cfg.model.path is None and dict(cfg.reward.weights) == {"math_verify": 1.0}


@pytest.mark.parametrize("bad", ["algo.clip_hihg=0.3", "rollout.temprature=1.0", "hw.zero=2"])
def test_misspelled_key_fails_at_compose_naming_it(bad):
    with pytest.raises(ConfigCompositionException) as e:
        make([bad])
    assert bad.split("=")[0].split(".")[-1] in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("bad", ["algo.clip_high=wide", "rollout.n=many", "hw.nproc=1.5", "algo.overlong_filter=maybe"])
def test_wrong_type_fails_at_compose_naming_it(bad):
    with pytest.raises(ConfigCompositionException) as e:
        make([bad])
    assert bad.split("=")[0].split(".")[-1] in str(e.value) + str(e.value.__cause__)


def test_typo_inside_a_yaml_fails(tmp_path):
    bad = tmp_path / "conf"
    subprocess.run(["cp", "-r", str(CONF), str(bad)], check=True)
    (bad / "algo" / "typo.yaml").write_text("name: typo\nclip_hihg: 0.3\n")
    with initialize_config_dir(config_dir=str(bad), version_base=None), pytest.raises(ConfigCompositionException) as e:
        compose("config", overrides=["algo=typo"])
    assert "clip_hihg" in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize(
    "override,key",
    [
        ("algo.loss_agg=token_sum", "algo.loss_agg"),
        ("algo.adv_estimator=gpro", "algo.adv_estimator"),
        ("algo.clip_low=1.5", "algo.clip_low"),
        ("rollout.prompts_per_step=15 hw=cpu_x2", "rollout.prompts_per_step"),
        ("algo.mini_batches=3", "algo.mini_batches"),
        ("hw.precision=fp16", "hw.precision"),
    ],
)
def test_semantic_errors_name_the_key_and_the_choices(override, key):
    cfg = make(override.split())
    with pytest.raises(ValueError) as e:
        validate(cfg)
    assert key in str(e.value)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="grpo.*rloo|rloo.*grpo"):
        validate(make(["algo.adv_estimator=nope"]))


def rlcli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_groups_options_and_knob_docs():
    out = rlcli("train", "--help")
    assert out.returncode == 0, out.stderr
    for group in ("algo", "model", "hw", "reward", "data", "logger"):
        assert f"  {group} " in out.stdout
    assert "cpu_x2" in out.stdout and "grpo" in out.stdout
    assert "algo.clip_high" in out.stdout and "clip-higher" in out.stdout  # a knob with its docstring


def test_cfg_job_prints_the_composed_config():
    out = rlcli("train", "algo=dr_grpo", "algo.clip_high=0.3", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.algo.name == "dr_grpo" and cfg.algo.clip_high == 0.3


def test_cli_typo_fails_before_any_model_is_built():
    out = rlcli("train", "algo.clip_hihg=0.3")
    assert out.returncode != 0
    assert "clip_hihg" in out.stderr + out.stdout
    assert "warm-start" not in out.stdout.lower()


def test_run_dir_on_the_command_line_fails_with_the_hydra_key(tmp_path):
    out = rlcli("train", f"run_dir={tmp_path}/x", f"hydra.run.dir={tmp_path}/h")
    assert out.returncode != 0
    assert f"hydra.run.dir={tmp_path}/x" in out.stderr + out.stdout  # the fix, spelled out
    assert "warm-start" not in out.stdout.lower()


def test_warm_start_range_is_the_same_whatever_the_rl_data():
    """The tiny model's warm start trains on the data config's arith range for every data source, so
    `model=tiny data=gsm8k` reuses the warm start `rlcli sft` builds (not arith_examples' own defaults)."""
    from rlcli.models import warm_start_data
    from rlcli.sft import task_args

    assert task_args(**warm_start_data(make(["data=gsm8k"]).data)) == task_args(**warm_start_data(make().data))
    assert warm_start_data(make(["data=gsm8k", "data.max_digits=3"]).data)["max_digits"] == 3
