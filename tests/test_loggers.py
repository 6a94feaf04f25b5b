"""Logger backends (issue 40): TensorBoard's event files and MLflow's store, read back with each library's own
reader, hold every metric of metrics.jsonl at the same steps, the config and the run's curves, and a kill plus
resume=auto leaves each step there exactly once with the resumed run's values. Real libraries, no mocks."""

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, ROOT, compose, metric_rows, rlcli
from omegaconf import OmegaConf
from test_checkpoint import finish, kill_tree, logged_step, start, train, wait_for

from rlcli.core.loggers import mlflow_key
from rlcli.core.schema import ConfigError
from rlcli.loop import checkpoint as ckpt
from rlcli.loop.metrics import MetricsLogger

pytest.importorskip("tensorboard", reason="pip install 'rlcli[tensorboard]' (the dev and test extras have it)")
pytest.importorskip("mlflow", reason="pip install 'rlcli[mlflow]' (the dev and test extras have it)")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.7+ opens a file store only when asked

BOTH = "logger=[tensorboard,mlflow]"


# ------------------------------------------------------------------------------------------ reading back
def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} of metrics.jsonl rows, in step order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                out.setdefault(key, []).append((row["step"], value))
    return {k: sorted(v) for k, v in out.items()}


def tensorboard(run: Path):
    """TensorBoard's own reader over run/tensorboard, keeping every event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_scalars(acc) -> dict[str, list[tuple[int, float]]]:
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def mlflow_runs(run: Path, experiment="rlcli"):
    """(client, the active runs of the experiment) in run/mlruns."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id])


def mlflow_metrics(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def same(got: list[tuple[int, float]], want: list[tuple[int, float]], cast=float) -> bool:
    """Equal steps, and values equal after `cast` (nan equals nan)."""
    return [s for s, _ in got] == [s for s, _ in want] and all(
        (math.isnan(g) and math.isnan(cast(w))) or g == cast(w) for (_, g), (_, w) in zip(got, want))


def f32(x: float) -> float:
    return float(np.float32(x))  # TensorBoard stores a scalar as float32


def assert_backends_equal_metrics_jsonl(run: Path) -> tuple[object, str]:
    """Every metric of metrics.jsonl, with its steps and values, is in TensorBoard and in the one active MLflow run,
    each (metric, step) once. -> (the MLflow client, the run id)"""
    want = expected(metric_rows(run))
    assert want and all(len({s for s, _ in v}) == len(v) for v in want.values())  # metrics.jsonl itself: once each

    tb = tb_scalars(tensorboard(run))
    assert tb.keys() == want.keys()
    bad = {k: (tb[k], want[k]) for k in want if not same(tb[k], want[k], cast=f32)}
    assert not bad, f"TensorBoard differs from metrics.jsonl: {bad}"

    client, runs = mlflow_runs(run)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    ml = mlflow_metrics(client, runs[0].info.run_id)
    assert ml.keys() == {mlflow_key(k) for k in want}
    bad = {k: (ml[mlflow_key(k)], want[k]) for k in want if not same(ml[mlflow_key(k)], want[k])}
    assert not bad, f"MLflow differs from metrics.jsonl: {bad}"
    return client, runs[0].info.run_id


def assert_config_and_curves(run: Path, client, run_id: str, last_step: int) -> None:
    """The resolved config as hyper-parameters and the curves figure, in both backends."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    config = ckpt.flatten(OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True))
    acc = tensorboard(run)
    start_info = HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hp = start_info.session_start_info.hparams
    assert hp["algo.clip_high"].number_value == config["algo.clip_high"]
    assert hp["algo.name"].string_value == config["algo.name"] and hp["logger.tensorboard"].number_value == 1
    assert [(i.step, i.width > 400) for i in acc.Images("curves")] == [(last_step, True)]

    params = client.get_run(run_id).data.params
    assert params["algo.clip_high"] == str(config["algo.clip_high"]) and params["steps"] == str(config["steps"])
    assert params["reward.weights.sevens"] == "1.0" and params["model.path"] == "null"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"curves.png", "config.yaml"} <= artifacts
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_tensorboard_and_mlflow_hold_every_metric_of_metrics_jsonl_the_config_and_the_curves(tmp_path):
    out = rlcli(tmp_path, "train", "steps=3", *FAST, "eval.every=2", BOTH, "hydra.run.dir=run").stdout
    run = tmp_path / "run"
    client, run_id = assert_backends_equal_metrics_jsonl(run)
    assert_config_and_curves(run, client, run_id, last_step=3)
    rows = metric_rows(run)
    assert {r["step"] for r in rows} == {0, 1, 2, 3} and any("eval/acc" in r for r in rows if r["step"] == 2)
    assert f"tensorboard --logdir {run}/tensorboard" in out and f"mlflow: run {run_id} in" in out
    assert "curves.png" in out


def mlflow_file_holds(run, step: int) -> bool:
    """Whether MLflow's file store under `run` holds a metric at `step` (its metric files' lines end with the step)."""
    return any(line.split()[-1:] == [str(step)] for f in run.glob("mlruns/*/*/metrics/**/*") if f.is_file()
               for line in f.read_text().splitlines())


@pytest.mark.slow
def test_a_kill_and_resume_auto_leave_each_step_once_in_each_backend(tmp_path):
    """The pattern of test_checkpoint's SIGKILL test: checkpoint at step 2, SIGKILL once step 3 is logged (in
    metrics.jsonl, TensorBoard and MLflow), resume=auto to step 5. Both backends then hold steps 0-5 exactly once,
    with the values of the final metrics.jsonl (step 3 and after from the resumed run)."""
    cache = tmp_path / "cache"
    args = ["steps=5", *FAST, BOTH, "checkpoint.every=2", "hydra.run.dir=run"]
    run = tmp_path / "run"
    proc = start(tmp_path, cache, *args)
    # metrics.jsonl is written before the backends: wait for MLflow's file store to hold step 3 too (killing on the
    # metrics.jsonl row alone raced with MLflow's write, CI 2026-11-27)
    wait_for(lambda: logged_step(run, 3)() and mlflow_file_holds(run, 3), proc)
    kill_tree(proc)
    finish(proc)
    assert ckpt.latest(str(run)) == str(run / "checkpoints" / "step_2")
    killed_id = ckpt.read_meta(str(run / "checkpoints" / "step_2"))["logger_ids"]["mlflow"]
    client, _ = mlflow_runs(run)
    # The killed run did write step 3 to both: without purge_step / a continuation run it would show twice.
    assert any(s == 3 for v in mlflow_metrics(client, killed_id).values() for s, _ in v)
    killed_rows = metric_rows(run)

    out = train(tmp_path, cache, *args, "resume=auto")
    assert "2 of 5 steps done" in out
    rows = metric_rows(run)
    assert Counter(r["step"] for r in rows if "actor/pg_loss" in r) == Counter(range(1, 6))
    step3 = [r for r in killed_rows if r["step"] == 3][0]
    assert step3["timing_s/step"] != [r for r in rows if r["step"] == 3][0]["timing_s/step"]  # a new value for 3
    client, run_id = assert_backends_equal_metrics_jsonl(run)
    assert_config_and_curves(run, client, run_id, last_step=5)
    # MLflow: a continuation of the killed run (which holds step 3) that the final checkpoint names
    assert client.get_run(run_id).data.tags["rlcli.continues"] == killed_id
    assert ckpt.read_meta(str(run / "checkpoints" / "step_5"))["logger_ids"]["mlflow"] == run_id
    assert client.get_run(killed_id).info.lifecycle_stage == "deleted"


@pytest.mark.parametrize("after_checkpoint", [0, 1], ids=["stopped_at_the_checkpoint", "killed_after_it"])
def test_a_resumed_logger_writes_each_step_once(tmp_path, after_checkpoint):
    """In process, without training: a run logs steps 1-2, checkpoints, logs `after_checkpoint` more steps and
    dies; the resumed run logs 3-4 with other values. MLflow continues the same run when nothing followed the
    checkpoint, else a new run holding the checkpoint's rows; TensorBoard purges what followed it."""
    cfg = compose(BOTH, run_dir=str(tmp_path / "run"))
    config = OmegaConf.to_container(cfg, resolve=True)
    first = MetricsLogger(cfg.logger, cfg.run_dir, config)
    for step in (1, 2):
        first.log({"a/x": step, "eval/pass@1": step / 10}, step)
    first.snapshot(str(tmp_path / "checkpoint.jsonl"))
    ids = first.run_ids
    for step in range(3, 3 + after_checkpoint):
        first.log({"a/x": -step, "eval/pass@1": -1.0}, step)  # values the resumed run must replace
    first.snapshot(str(tmp_path / "later.jsonl"))  # flushed to disk, as a run killed later would have
    first.close()

    second = MetricsLogger(cfg.logger, cfg.run_dir, config, rows_from=str(tmp_path / "checkpoint.jsonl"),
                           resume_step=2, run_ids=ids)
    for step in (3, 4):
        second.log({"a/x": step, "eval/pass@1": step / 10}, step)
    second.close()

    want = {"a/x": [(s, float(s)) for s in (1, 2, 3, 4)], "eval/pass@1": [(s, s / 10) for s in (1, 2, 3, 4)]}
    tb = tb_scalars(tensorboard(Path(cfg.run_dir)))
    assert all(same(tb[k], want[k], cast=f32) for k in want), tb
    client, runs = mlflow_runs(Path(cfg.run_dir))
    assert len(runs) == 1 and mlflow_metrics(client, runs[0].info.run_id) == {
        "a/x": want["a/x"], "eval/pass_at_1": want["eval/pass@1"]}
    assert (runs[0].info.run_id == ids["mlflow"]) == (after_checkpoint == 0)
    assert second.run_ids["tensorboard"] == ids["tensorboard"]


def test_a_backend_turned_on_at_resume_starts_with_the_checkpoint_rows(tmp_path):
    """logger.* may change on resume: TensorBoard, off in the checkpoint's run, gets steps 1-2 from the
    checkpoint's rows and 3 from the resumed run."""
    first = compose("logger=mlflow", run_dir=str(tmp_path / "run"))
    logger = MetricsLogger(first.logger, first.run_dir, OmegaConf.to_container(first, resolve=True))
    for step in (1, 2):
        logger.log({"a/x": step}, step)
    logger.snapshot(str(tmp_path / "checkpoint.jsonl"))
    ids = logger.run_ids
    logger.close()
    assert set(ids) == {"mlflow"}

    cfg = compose(BOTH, run_dir=first.run_dir)
    second = MetricsLogger(cfg.logger, cfg.run_dir, OmegaConf.to_container(cfg, resolve=True),
                           rows_from=str(tmp_path / "checkpoint.jsonl"), resume_step=2, run_ids=ids)
    second.log({"a/x": 3}, 3)
    second.close()
    want = [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert tb_scalars(tensorboard(Path(cfg.run_dir))) == {"a/x": want}
    client, runs = mlflow_runs(Path(cfg.run_dir))
    assert [r.info.run_id for r in runs] == [ids["mlflow"]] and mlflow_metrics(client, ids["mlflow"]) == {"a/x": want}


def test_a_missing_extra_is_a_one_line_error_naming_it(tmp_path):
    """A shim hides tensorboard from importlib.util.find_spec (what validation asks): `rlcli train
    logger=tensorboard` stops before loading anything, in one line naming the extra."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'tensorboard' else real(name, *a)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT / "tests")])}
    out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "train", "logger=tensorboard", "hydra.run.dir=run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("rlcli: error: logger.tensorboard=true needs the tensorboard package, which is not "
                         "installed: pip install 'rlcli[tensorboard]'; or logger.tensorboard=false"), out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_validation_imports_no_logger_library():
    """`rlcli train <typo>` answers in a second: validating a config with every backend on imports none of them."""
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import compose; from rlcli.config import validate;"
            "validate(compose('logger=[wandb,tensorboard,mlflow]', run_dir='/tmp/unused'));"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'tensorboard', 'mlflow'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().replace("'", '"')) == []


def test_deepspeed_is_imported_without_mlflow_and_the_mlflow_logger_still_loads_it():
    """DeepSpeed's autotuner tries `import mlflow` (1.3-1.5 s of CPU per process); rlcli's one import of DeepSpeed
    (rlcli.engine.deepspeed_module) hides it, and afterwards mlflow imports as usual for `logger=mlflow`."""
    code = ("import sys; from rlcli.engine import deepspeed_module; deepspeed_module();"
            "from deepspeed.autotuning import autotuner; print(autotuner.has_mlflow, 'mlflow' in sys.modules);"
            "import mlflow; print(callable(mlflow.log_metric))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["False", "False", "True"], out.stdout

def test_missing_extra_in_process(monkeypatch):
    """validate itself raises the ConfigError (the CLI prints it as the one line above)."""
    import importlib.util

    from rlcli.config import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'rlcli\[mlflow\]'"):
        validate(compose("logger=[tensorboard,mlflow]", run_dir="/tmp/unused"))
    validate(compose("logger=tensorboard", run_dir="/tmp/unused"))
