"""`rlcli export RUN_DIR OUT_DIR`: the exported directory loads with AutoModelForCausalLM and equals the run's policy,
its model card holds the run's numbers, algorithm and command, refusals are one line, and `--push` is tested against
a local directory target (the Hub itself is never called here)."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, cli_env, rlcli

from rlcli import __version__

TRAIN = [*FAST, "steps=2", "eval.before=true", "checkpoint.hf_every=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One real 2-step run of the tiny model (~10 s): policy/, hf/step_1, hf/step_2, result.json with the held-out
    numbers before and after training."""
    tmp = tmp_path_factory.mktemp("export")
    rlcli(tmp, "train", *TRAIN, f"hydra.run.dir={tmp / 'run'}")
    return tmp / "run"


def export(tmp_path, *args, env=None):
    """`rlcli export <args>` in tmp_path, not asserting success; `env` values of None are unset. -> the process"""
    environ = {k: v for k, v in {**cli_env(tmp_path), **(env or {})}.items() if v is not None}
    environ.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "export", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=environ)


def assert_one_line(out, needle):
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlcli: error: ") and needle in lines[0], out.stderr


def weights(path) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(str(path)).state_dict().items()}


def assert_same_weights(a: dict, b: dict):
    import torch

    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def num(v) -> str:
    return f"{v:.4g}"


@pytest.mark.slow
def test_the_exported_directory_loads_with_automodel_and_its_card_holds_the_runs_numbers(run, tmp_path):
    import yaml
    from transformers import AutoTokenizer

    out = export(tmp_path, str(run), str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr[-3000:]
    model = tmp_path / "model"
    assert_same_weights(weights(model), weights(run / "policy"))
    assert AutoTokenizer.from_pretrained(str(model)).decode([]) == ""
    assert (model / "rlcli_config.yaml").read_text() == (run / "config.yaml").read_text()

    card = (model / "README.md").read_text()
    meta = yaml.safe_load(card.split("---", 2)[1])
    assert meta["library_name"] == "transformers" and meta["tags"] == ["rlcli", "reinforcement-learning", "grpo"]
    assert "base_model" not in meta  # the embedded tiny model has no hub id
    result = json.loads((run / "result.json").read_text())
    for key, after in result["eval_after"].items():  # every held-out number, before and after, in its row
        assert f"| {key} | {num(result['eval_before'][key])} | {num(after)} |" in card, key
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x][-1]
    assert last["step"] == 2 and f"| reward/mean | {num(last['reward/mean'])} |" in card
    assert "| `algo.adv_estimator` | grpo |" in card and "| `algo.kl_coef` | 0.04 (k3) |" in card
    assert "`sevens=1.0`" in card and "`data.name=arith`" in card and "at random initialisation" in card
    assert f"Trained with rlcli {__version__};" in card  # result.json records the version that trained it
    assert f"{result['train_seconds']:.1f} s in training steps" in card
    # The command is the run's own overrides, quoted for a shell; the run directory is left out.
    command = next(line for line in card.splitlines() if line.startswith("rlcli train"))
    assert shlex.split(command) == ["rlcli", "train", *TRAIN]


@pytest.mark.slow
def test_a_snapshot_exports_with_hf_step_and_force_replaces_an_earlier_export(run, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "stale.bin").write_text("from an earlier export")
    assert_one_line(export(tmp_path, str(run), str(model), "--hf-step", "1"), "exists and is not empty")
    assert_one_line(export(tmp_path, str(run), str(model), "--hf-step", "7", "--force"),
                    "no Hugging Face snapshot of step 7 (hf/step_7): it holds snapshots of steps 1, 2")

    out = export(tmp_path, str(run), str(model), "--hf-step", "1", "--force")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (model / "stale.bin").exists()
    assert_same_weights(weights(model), weights(run / "hf" / "step_1"))
    card = (model / "README.md").read_text()
    assert "after 1 of 2 training steps" in card and "not this snapshot's (step 1)" in card


@pytest.mark.slow
def test_push_to_a_local_directory_target_receives_the_files(run, tmp_path):
    """What upload_folder does to a repository: the export's files added or replaced, the others kept."""
    target = tmp_path / "hub" / "user" / "model"
    target.mkdir(parents=True)
    (target / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    out = export(tmp_path, str(run), str(tmp_path / "model"), "--push", f"file://{target}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"pushed {tmp_path / 'model'} to {target}" in out.stdout
    sent = {p.relative_to(tmp_path / "model") for p in (tmp_path / "model").rglob("*") if p.is_file()}
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= {str(p) for p in sent}
    assert all((target / p).read_bytes() == (tmp_path / "model" / p).read_bytes() for p in sent)
    assert (target / ".gitattributes").is_file()
    assert_same_weights(weights(target), weights(run / "policy"))


@pytest.mark.slow
@pytest.mark.parametrize("case,needle", [
    ("no_config", "is not an `rlcli train` run directory (it has no config.yaml)"),
    ("save_false", "saved no weights (save=false): train it again with save=true"),
    ("unfinished", "has no policy/ (the run did not finish): it holds snapshots of steps 1, 2 (--hf-step N)"),
    ("offline", "HF_HUB_OFFLINE=1 (rlcli runs offline by default): run with HF_HUB_OFFLINE=0"),
    ("no_token", "no Hugging Face token: set HF_TOKEN or run `hf auth login`"),
    ("into_itself", "overlaps the run's own files"),
])
def test_refusals_are_one_line_and_write_nothing(run, tmp_path, case, needle):
    from omegaconf import OmegaConf

    src, dst, flags, env = tmp_path / "run", tmp_path / "model", [], None
    shutil.copytree(run, src, ignore=shutil.ignore_patterns("checkpoints"))
    if case == "no_config":
        (src / "config.yaml").unlink()
    elif case == "save_false":
        cfg = OmegaConf.load(src / "config.yaml")
        cfg.save = False
        OmegaConf.save(cfg, src / "config.yaml")
        shutil.rmtree(src / "policy")
        shutil.rmtree(src / "hf")
    elif case == "unfinished":  # killed before the end: snapshots, no policy, no result.json
        shutil.rmtree(src / "policy")
        (src / "result.json").unlink()
    elif case == "offline":
        flags = ["--push", "user/model"]
    elif case == "no_token":  # get_token reads the environment and the token file under HF_HOME: no network
        flags = ["--push", "user/model"]
        env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": None, "HF_TOKEN_PATH": None,
               "HUGGING_FACE_HUB_TOKEN": None}
    elif case == "into_itself":
        dst, flags = src, ["--force"]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert_one_line(export(tmp_path, str(src), str(dst), *flags, env=env), needle)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, nothing removed
    if case == "into_itself":
        assert (src / "policy" / "model.safetensors").is_file()


def test_export_help_names_every_flag():
    out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "export", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ})
    assert out.returncode == 0
    for flag in ("--hf-step", "--merge-lora", "--force", "--license", "--push", "--private"):
        assert flag in out.stdout


@pytest.mark.slow
def test_the_card_keeps_before_and_after_in_their_columns(run, tmp_path):
    """Two steps of a random-init model score the same before and after training, so here the run's result.json
    (a copy) gets a distinct accuracy before training: a card that swapped the columns would pass the test above."""
    src = tmp_path / "run"
    shutil.copytree(run, src, ignore=shutil.ignore_patterns("checkpoints", "hf"))
    result = json.loads((src / "result.json").read_text())
    result["eval_before"]["eval/acc"], result["eval_after"]["eval/acc"] = 0.25, 0.5625
    (src / "result.json").write_text(json.dumps(result))
    out = export(tmp_path, str(src), str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| eval/acc | 0.25 | 0.5625 |" in (tmp_path / "model" / "README.md").read_text()
