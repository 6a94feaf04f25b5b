"""User errors in one line (issue 25 §2): `rlcli: error: <message>` on stderr, exit status 2, no traceback;
--debug or HYDRA_FULL_ERROR=1 adds the traceback; an internal error keeps its traceback and exits 1."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT


def rlcli(tmp_path, *args, env=None, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "rlcli.cli"]
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([*cmd, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**environ, **(env or {})})


def assert_one_line(out, needle):
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlcli: error: ") and needle in lines[0], out.stderr


@pytest.mark.parametrize("argv,needle", [
    (["train", "rollout.prompts_per_step=-4"], "rollout.prompts_per_step=-4 must be >= 1"),
    (["train", "steps=-1"], "steps=-1 must be >= 1"),
    (["train", "rollout.n=0"], "rollout.n=0 must be >= 1"),
    (["train", "algo.clip_hihg=0.3"], "did you mean algo.clip_high?"),  # Hydra's compose error
    (["train", "algo=dapoo"], "Available options in 'algo': cispo, dapo"),
    (["train", "rollout.n=many"], "rollout.n"),
    (["eval", "eval.k=0"], "eval.k=0 must be >= 1"),
    (["eval", "hw=cpu_x2", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "rlcli eval is one process"),
    (["train", "rollout.tensor_parallel_size=2", "hw=cpu_x2"], "but rollout.engine=hf"),
    (["train", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "must divide hw.nproc=1"),
    (["sft", "model.path=/x"], "leave model.path unset"),
    (["plan", "algo.clip_low=2"], "algo.clip_low=2"),
    (["ladder", "nope"], "no ladder 'nope'"),
    (["plot", "/no/such/run"], "no such directory"),
])  # fmt: skip
def test_a_user_error_is_one_line_with_exit_status_2(tmp_path, argv, needle):
    out = rlcli(tmp_path, *argv, *([f"hydra.run.dir={tmp_path}/run"] if argv[0] in ("train", "eval", "sft") else []))
    assert_one_line(out, needle)


@pytest.mark.parametrize("how", [["--debug"], {"HYDRA_FULL_ERROR": "1"}])
def test_debug_shows_the_traceback(tmp_path, how):
    flags, env = (how, None) if isinstance(how, list) else ([], how)
    out = rlcli(tmp_path, "train", "rollout.n=0", f"hydra.run.dir={tmp_path}/run", *flags, env=env)
    assert out.returncode == 2 and "Traceback" in out.stderr and "rlcli: error: rollout.n=0" in out.stderr, out.stderr


def test_an_internal_error_keeps_its_traceback_and_exits_1(tmp_path):
    """A ValueError from deeper code is a bug, not a config error (the issue's `max() arg is an empty sequence`)."""
    code = ("import sys, rlcli.config\n"
            "def broken(cfg):\n    max([])\n"
            "rlcli.config.validate = broken\n"
            "from rlcli.cli import main\nmain(sys.argv[1:])\n")
    out = rlcli(tmp_path, "train", f"hydra.run.dir={tmp_path}/run", code=code)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" in out.stderr and "max() arg is an empty sequence" in out.stderr
    assert "rlcli: error:" not in out.stderr


def test_a_refused_run_directory_is_a_user_error(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2\n")
    assert_one_line(rlcli(tmp_path, "train", f"hydra.run.dir={run}"), "pass resume=auto to continue it")


def test_readme_describes_the_failures():
    text = (ROOT / "README.md").read_text()
    assert "## When things go wrong" in text and "rlcli: error:" in text
