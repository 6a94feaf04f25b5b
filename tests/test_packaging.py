"""rlcli as users install it: a wheel, installed without -e into a fresh virtual environment, run from a
directory that is not the checkout, with the user's own config directory composed over the shipped groups.

The fresh environment borrows the already installed dependencies (torch, DeepSpeed, ...) through a .pth
line pointing at this interpreter's site-packages, so the test needs no download; rlcli itself comes only
from the wheel (asserted). The wheel is built from a copy of the package's sources, so nothing is written
into the checkout.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

SOURCES = ("pyproject.toml", "README.md", "rlcli", "conf", "recipes")
TINY = ["model.warm_start.enabled=false", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=16",
        "data.eval_size=4"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(path, src / name)
    run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist")])
    wheel = next((tmp / "dist").glob("rlcli-*.whl"))
    env_dir = tmp / "venv"
    run([sys.executable, "-m", "venv", str(env_dir)])
    python = env_dir / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(site, "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)])
    work = tmp / "elsewhere"  # a job directory: not the checkout, no conf/ in sight
    work.mkdir()
    return env_dir, work


def run(cmd, cwd=None, ok=True):
    """Run `cmd` as a user would: no PYTHONPATH into the checkout, a private model cache next to `cwd`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if cwd is not None:
        env["RLCLI_CACHE"] = str(Path(cwd).parent / "cache")
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    if ok:
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def test_the_installed_package_is_the_wheel_not_the_checkout(venv):
    env_dir, work = venv
    where = run([env_dir / "bin" / "python", "-c", "import rlcli, rlcli.config; print(rlcli.__file__, rlcli.config.CONF_DIR)"],
                cwd=work).stdout
    assert str(env_dir) in where and str(ROOT) not in where
    assert run([env_dir / "bin" / "rlcli", "--version"], cwd=work).stdout.strip() == "rlcli 0.1.0"
    assert "commands:" in run([env_dir / "bin" / "python", "-m", "rlcli", "--help"], cwd=work).stdout


def test_every_command_runs_from_any_directory(venv):
    env_dir, work = venv
    rlcli = env_dir / "bin" / "rlcli"
    job = run([rlcli, "train", "--cfg", "job", "algo=dapo"], cwd=work).stdout
    assert "dynamic_sampling: true" in job
    assert "algo.clip_high" in run([rlcli, "explain", "algo"], cwd=work).stdout
    assert "--rungs" in run([rlcli, "ladder", "dapo", "--help"], cwd=work).stdout
    assert "05_dynamic_sampling" in run([rlcli, "ladder", "dapo", "--dry-run"], cwd=work).stdout
    out = run([rlcli, "train", "steps=2", "eval.before=false", *TINY], cwd=work)
    runs = list((work / "runs").glob("*/*_grpo"))  # outputs default to ./runs/ of the working directory
    assert len(runs) == 1 and (runs[0] / "policy" / "config.json").exists(), out.stdout[-2000:]
    assert f"run dir        {runs[0]}" in out.stdout
    run([rlcli, "plot", str(runs[0]), "--out", str(work / "curve.png")], cwd=work)
    assert (work / "curve.png").stat().st_size > 0
    run([rlcli, "eval", f"model.path={runs[0] / 'policy'}", "data.eval_size=4"], cwd=work)
    assert list((work / "runs" / "eval").glob("*/*/eval_summary.json"))


def test_a_user_config_dir_composes_over_the_shipped_groups(venv):
    env_dir, work = venv
    rlcli = env_dir / "bin" / "rlcli"
    mine = work / "my_conf"
    (mine / "algo").mkdir(parents=True)
    (mine / "algo" / "my_grpo.yaml").write_text("defaults:\n  - grpo\n  - _self_\nname: my_grpo\nclip_high: 0.31\n")
    (mine / "algo" / "typo.yaml").write_text("defaults:\n  - grpo\n  - _self_\nclip_hihg: 0.31\n")
    (mine / "recipe" / "mine").mkdir(parents=True)
    (mine / "recipe" / "mine" / "00_base.yaml").write_text(
        "# @package _global_\nalgo:\n  name: mine_00\nladder: {paper: mine, rung: base, index: 0}\n")
    (mine / "recipe" / "mine" / "01_higher.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /recipe/mine/00_base\n  - _self_\nalgo:\n  name: mine_01\n  clip_high: 0.28\n"
        "ladder: {paper: mine, rung: + clip-higher, index: 1, changes: [algo.clip_high]}\n")
    job = run([rlcli, "train", "--config-dir", mine, "algo=my_grpo", "--cfg", "job"], cwd=work).stdout
    assert "clip_high: 0.31" in job and "name: my_grpo" in job and "adv_estimator: grpo" in job
    bad = run([rlcli, "train", "--config-dir", mine, "algo=typo", "--cfg", "job"], cwd=work, ok=False)
    assert bad.returncode != 0 and "clip_hihg" in bad.stdout + bad.stderr  # schema-checked like the shipped ones
    rung = run([rlcli, "train", "--config-dir", mine, "recipe=mine/01_higher", "--cfg", "job"], cwd=work).stdout
    assert "clip_high: 0.28" in rung and "name: mine_01" in rung
    listed = run([rlcli, "ladder", "--config-dir", mine], cwd=work).stdout
    assert "mine" in listed and "dapo" in listed
    dry = run([rlcli, "ladder", "mine", "--config-dir", mine, "--dry-run"], cwd=work).stdout
    assert "recipe=mine/00_base,mine/01_higher" in dry and f"--config-dir {mine}" in dry
