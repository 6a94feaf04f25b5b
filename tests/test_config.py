"""Config composition: every option of every group composes and validates; typos and wrong types
fail at compose time with the key named; --help and --cfg job work through the real CLI."""

import subprocess
import sys

import pytest
from conftest import CONF, ROOT, compose
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from rlcli.config import validate
from rlcli.core.schema import ConfigError
from rlcli.schema_doc import group_options


def make(overrides=()):
    return compose(*overrides)


# Options that need a value only the user can give.
NEEDS = {("model", "hf"): ["model.path=/some/dir"],
         ("reward", "judge"): ["reward.judge.url=http://127.0.0.1:8000", "reward.judge.model=judge"],
         ("reward", "rm"): ["reward.rm.path=/some/dir"],
         ("reward", "reasoning_gym"): ["data=reasoning_gym"],  # it scores reasoning-gym's ground truths only
         ("recipe", "rlhf/ppo_rm"): ["reward.rm.path=/some/dir"],
         ("recipe", "rlhf/grpo_rm"): ["reward.rm.path=/some/dir"],
         ("recipe", "rlhf/grpo_judge"): ["reward.judge.url=http://127.0.0.1:8000", "reward.judge.model=judge"],
         ("algo", "distill"): ["distill.teacher=tiny_exact_carry"],
         ("env", "openenv"): ["env.openenv.app=rlcli.envs.openenv_example:app"],  # a server to name (imported here)
         ("env", "verifiers"): ["env.verifiers.id=vf_envs.arith"],  # a taskset to name (tests/vf_envs, loaded here)
         ("reward", "none"): ["rollout.agent=rlcli.envs.calculator:agent"]}  # the agent's reward is the reward


def test_the_rlhf_and_code_recipes_are_what_they_say():
    """recipe=rlhf/*: the policy is trained on the model part alone, the verifier logged at weight 0 (PPO with its
    critic for ppo_rm); recipe=code/smollm2_code_fns: SmolLM2 on code_fns, rewarded by its tests, with room to answer."""
    ppo = make(["recipe=rlhf/ppo_rm", "reward.rm.path=/some/dir"])
    assert (ppo.algo.name, ppo.algo.adv_estimator, dict(ppo.reward.weights)) == ("ppo", "gae", {"math_verify": 0.0, "rm": 1.0})
    assert dict(make(["recipe=rlhf/grpo_rm", "reward.rm.path=/d"]).reward.weights) == {"math_verify": 0.0, "rm": 1.0}
    judge = make(["recipe=rlhf/grpo_judge", *NEEDS[("reward", "judge")]])
    assert (judge.algo.name, dict(judge.reward.weights)) == ("grpo", {"math_verify": 0.0, "judge": 1.0})
    code = make(["recipe=code/smollm2_code_fns"])
    assert (code.model.name, code.data.name, dict(code.reward.weights), code.rollout.max_new_tokens) == (
        "smollm2-135m", "code_fns", {"code": 1.0}, 128)


@pytest.mark.parametrize(
    "group,option", [(g, o) for g, opts in group_options(CONF).items() for o in opts]
)
def test_every_option_composes_and_validates(group, option):
    # A fit is <model>_<hw>: it is chosen by, and composed with, that model and that machine.
    fit = [f"model={option.split('_', 1)[0]}", f"hw={option.split('_', 1)[1]}"] if group == "fit" else []
    cfg = make([*fit, f"{group}={option}", *NEEDS.get((group, option), [])])
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
    with pytest.raises(ConfigCompositionException) as e:
        compose("algo=typo", config_dir=bad)
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
        [sys.executable, "-m", "rlcli.commands.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
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
    from rlcli.models.cache import task_args

    assert task_args(**warm_start_data(make(["data=gsm8k"]).data)) == task_args(**warm_start_data(make().data))
    assert warm_start_data(make(["data=gsm8k", "data.max_digits=3"]).data)["max_digits"] == 3


def test_dapo_at_paper_scale_is_the_papers_setup():
    """DAPO arXiv:2503.14476 §4.1: 512 prompts x 16 responses, mini-batch 512 responses = 16 gradient
    updates per rollout step, lr 1e-6 with a linear warm-up over 20 rollout steps, clip 0.2 / 0.28,
    16,384 + 4,096 = 20,480 new tokens; verl's script generates 3 x 512 prompts per refill batch."""
    from rlcli.core.units import units

    cfg = make(["algo=dapo", "model=qwen2.5-32b", "hw=8xa100"])
    validate(cfg)
    a, r, o = cfg.algo, cfg.rollout, cfg.optim
    assert (units(cfg).P, units(cfg).G) == (512, 16) and (r.prompts_per_step, r.n) == (512, 16)
    assert a.mini_batches == 16 and a.ppo_epochs == 1
    assert r.prompts_per_step * r.n // a.mini_batches == 512  # responses per optimizer step
    assert o.lr == 1e-6 and o.warmup_steps == 20 * a.mini_batches and o.scheduler == "constant_with_warmup"
    assert (a.clip_low, a.clip_high, a.loss_agg) == (0.2, 0.28, "token_mean")
    assert (r.max_new_tokens, r.overlong_buffer_len) == (20480, 4096)
    assert a.soft_overlong and a.dynamic_sampling and not a.overlong_filter and a.kl_coef == 0
    assert r.gen_prompts_per_step == 3 * 512 and a.max_gen_batches == 10


def test_vapo_at_paper_scale_is_the_papers_batch():
    """VAPO arXiv:2504.05118 §5.1: "Used 512 prompts per sampling, with each prompt sampled 16 times, and
    set the mini-batch size to 512"; actor lr 1e-6, critic 2e-6, value warmup 50 steps, α = 0.05, μ = 0.1."""
    from rlcli.core.units import units

    cfg = make(["algo=vapo", "model=qwen2.5-32b", "hw=8xa100"])
    validate(cfg)
    a = cfg.algo
    assert a.group_sampling and (units(cfg).P, units(cfg).G) == (512, 16)
    assert 512 * 16 // a.mini_batches == 512
    assert (cfg.optim.lr, cfg.critic.lr, cfg.critic.pretrain_steps) == (1e-6, 2e-6, 50) and a.value_pretrain
    assert (a.length_adaptive_alpha, a.nll_coef, a.lam_critic, a.clip_low, a.clip_high) == (0.05, 0.1, 1.0, 0.2, 0.28)
    # Without group sampling the same budget is spent as the paper's PPO baseline: each prompt sampled once.
    u = units(make(["algo=vapo", "model=qwen2.5-32b", "algo.group_sampling=false"]))
    assert (u.P, u.G, u.N) == (8192, 1, 8192)


@pytest.mark.parametrize("overrides,fix", [
    (["algo=vapo", "model=hf", "model.path=/x", "critic.pretrain_steps=0"], "critic.pretrain_steps=0"),
    (["algo=grpo", "algo.value_pretrain=true"], "builds none"),
    (["algo=vapo", "critic.aug_w0=0.5", "algo.value_pretrain=false"], "algo.value_pretrain=true"),
    (["algo=grpo", "algo.group_sampling=false"], "compares the responses of a group"),
    (["algo=pkpo", "rollout.n=3"], "it needs 2 <= algo.pass_k <= rollout.n, got algo.pass_k=4, rollout.n=3"),
    (["algo=pkpo", "algo.pass_k=1"], "2 <= algo.pass_k"),
    (["algo=maxrl", "algo.pass_k=4"], "algo.pass_k=4 is read only by algo.adv_estimator=pkpo"),
    (["algo=grpo_passk", "rollout.n=1"], "rollout.n >= 2"),
    (["algo=grpo", "algo.kl_coef=0.04", "algo.kl_target=0.1"], "kl_in_reward"),
    (["hw=cpu_x2", "algo=dapo", "rollout.gen_prompts_per_step=5"], "divisible by hw.nproc=2"),
    (["rollout.engine=sglang"], "rollout.engine='sglang' is not a known rollout engine; valid names: hf, vllm"),
    (["rollout.engine=vllm", "rollout.sleep_mode=true"], "rollout.sleep_mode=true needs hw.device=cuda"),
    (["rollout.sleep_mode=true"], "rollout.engine=hf has none"),
    (["algo=grpo", "rollout.gen_prompts_per_step=32"], "algo.dynamic_sampling=false"),
    (["hw.offload_params=true"], "hw.offload_params=true needs hw.zero_stage=3"),
    (["hw.offload_optimizer=true"], "hw.offload_optimizer=true needs hw.zero_stage >= 1"),
    (["algo=dapo", "algo.filter_metric=reward"], "algo.filter_metric='reward' must be one of: acc, score"),
    (["hw.nnodes=2"], "set hw.master_port"),
    (["hw.nnodes=2", "hw.master_port=29500", "hw.node_rank=2"], "hw.node_rank=2 must lie in [0, hw.nnodes=2)"),
    (["hw=cpu_x2", "hw.nnodes=3", "hw.master_port=29500"], "divisible by hw.nproc x hw.nnodes = 6 ranks"),
    (["hw=cpu_x2", "hw.sp_size=4", "rollout.prompts_per_step=8"], "hw.sp_size=4 must divide the 2 training ranks"),
    (["hw=cpu_x2", "hw.sp_size=2", "model.tiny.attn_implementation=eager", "model.attn_implementation=eager"],
     "wraps sdpa and flash attention, not model.attn_implementation=eager"),
    (["hw=cpu_x2", "hw.sp_size=2", "algo=distill", "distill.teacher=/x", "distill.full_kl_coef=1.0"], "does not gather"),
    (["hw.offload_checkpoints=true"], "set model.gradient_checkpointing=true too"),
    (["hw.tiled_mlp=true", "model.lora.r=4", "model.lora.dropout=0.1"], "set model.lora.dropout=0"),
    (["hw=cpu_x2", "hw.nproc=3", "hw.sp_size=2", "rollout.async.max_staleness=1", "rollout.async.rollout_ranks=1"],
     "rollout ranks included"),
    (["algo.entropy_control=kl_cov"], "is 0 with a zero gradient"),
])
def test_a_switch_that_is_on_acts_or_fails_validation_with_the_fix(overrides, fix):
    with pytest.raises(ValueError, match=None) as e:
        validate(make(overrides))
    assert fix in str(e.value), str(e.value)


def test_value_pretraining_acts_with_every_model_preset():
    """It used to be a no-op for every model preset without critic.pretrain_steps (e.g. model=hf)."""
    cfg = make(["algo=vapo", "model=hf", "model.path=/x"])
    validate(cfg)
    assert cfg.algo.value_pretrain and cfg.critic.pretrain_steps == 50


def test_every_schema_field_is_read_by_code_outside_the_schema():
    """An airtight config: a field nobody reads is a knob that silently does nothing. Each leaf name must
    be read (`.name` or a quoted "name") somewhere in rlcli/ outside the dataclass that declares it."""
    import dataclasses
    import inspect
    import re

    from rlcli.config import Config

    sources = {p: p.read_text() for p in (ROOT / "rlcli").rglob("*.py")}

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            t = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(t):
                yield from leaves(type(t), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", cls

    unread = []
    for key, cls in leaves(Config):
        name = key.rsplit(".", 1)[-1]
        defining = sys.modules[cls.__module__].__file__
        pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
        # Strip the declarations only: a method of the declaring class (RewardConfig.function_options) is a reader.
        fields_only = inspect.getsource(cls).split("\n    def ")[0]
        texts = [t.replace(fields_only, "") if str(p) == defining else t for p, t in sources.items()]
        if not any(pattern.search(text) for text in texts):
            unread.append(key)
    assert not unread, f"schema fields read by no code: {unread}"


def test_no_citation_of_unshipped_documents():
    """Comments, docstrings, help strings and docs cite only what ships with rlcli: papers by arXiv id
    and docs/*.md, never the design brief, the style notes or the seed documents the project was
    written from (they are not in the repository, so users cannot read them)."""
    import re

    # Built from pieces so that this file does not match itself.
    unshipped = re.compile("|".join(["DESIGN" + r"\.md", "STYLE" + r"\.md", "[Ss]eed" + r"[ -]00\d",
                                     "shared" + "/seeds"]))
    suffixes = {".py", ".yaml", ".yml", ".md", ".toml", ".txt", ".cfg", ".ini"}
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in ("rlcli", "conf", "recipes", "docs", "tests"):
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in suffixes
                  and "results" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in files if p.exists()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if unshipped.search(line)]
    assert not hits, "citations of documents the repository does not ship:\n" + "\n".join(hits)


HEAVY = ("torch", "transformers", "deepspeed", "vllm", "math_verify")


@pytest.mark.parametrize("argv", [
    ["train", "algo.cliphigh_typo=0.3"],  # a typo: fails at compose time
    ["train", "rollout.n=0"],  # a bad value: fails in validation, before anything loads
    ["train", "--help"],
    ["train", "algo=dapo", "--cfg", "job"],
    ["explain", "algo"],
    ["plan", "algo=dapo", "model=qwen2.5-32b", "hw=8xa100"],
    ["train", "recipe=tools/calculator", "hw=cpu_x2", "rollout.prompts_per_step=3"],  # fails after the tools import
])  # fmt: skip
def test_the_cli_answers_without_importing_the_heavy_stack(argv, tmp_path):
    """Composing, validating, --help, --cfg, explain and plan need the schema, not torch (issue 21 §5): a
    typo must fail before `import torch` alone would have finished."""
    code = (
        "import sys\nfrom rlcli.commands.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\nprint('LIGHT')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "LIGHT" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_the_32b_generation_batch_follows_dynamic_sampling():
    """verl's 3 x 512 prompts per dynamic-sampling batch belongs to dynamic sampling at 32B scale: algo=dapo and
    the DAPO ladder's top rung get it; every other algorithm leaves it null (it would do nothing there, and
    fail validation)."""
    for dapo in (["algo=dapo"], ["recipe=dapo/05_dynamic_sampling"]):
        assert compose(*dapo, "model=qwen2.5-32b").rollout.gen_prompts_per_step == 1536
    for algo in ("grpo", "vapo", "ppo"):
        cfg = compose(f"algo={algo}", "model=qwen2.5-32b")
        assert cfg.rollout.gen_prompts_per_step is None
        validate(cfg)


def test_model_hf_needs_a_model_path_or_a_gguf_file():
    """conf/model/hf.yaml's `path: ???` never acted (merging onto the schema's null keeps null): model=hf alone trained
    the embedded tiny model. validate refuses it; a path or a GGUF file (docs/usage.md's two commands) passes."""
    with pytest.raises(ConfigError, match=r"model=hf needs model\.path="):
        validate(compose("model=hf", run_dir="/runs/x"))
    validate(compose("model=hf", "model.path=/models/Qwen2.5-0.5B-Instruct", run_dir="/runs/x"))
    validate(compose("model=hf", "model.path=null", "model.gguf_file=/models/m.gguf", run_dir="/runs/x"))
