"""Logger backends: where metrics go besides run_dir/metrics.jsonl (always written) and the terminal.

One class per backend, registered by name; `logger.<name>=true` turns one on (`logger=tensorboard`), the
list group `logger=[wandb,tensorboard,mlflow]` several. MetricsLogger (rlcli.loop.metrics) writes metrics.jsonl
and hands each backend that is on:

- every row of metrics.jsonl at its step (`log`);
- the resolved config as hyper-parameters (`log_config`, at the start);
- the training-curve figure `rlcli plot` draws, made of this run at its end (`log_figure`);
- on resume, a `Resume`: the checkpoint's step, the run id this backend had saved in it (meta.json
  `logger_ids`) and the checkpoint's rows. From it each backend continues with every step exactly once,
  the values being those of metrics.jsonl (the killed run's rows after the checkpoint are gone from it):
  - tensorboard writes on in the same folder with `purge_step` = checkpoint step + 1: TensorBoard drops the
    events a killed run wrote after the checkpoint (its writer is flushed at every checkpoint, so the events
    up to it are on disk);
  - mlflow continues the same run when that run holds no step after the checkpoint (a run stopped by a signal
    checkpoints at its last step). MLflow cannot delete a metric value, and logging a step again appends a
    second value, so otherwise it starts a new run that re-logs the checkpoint's rows, tagged
    `rlcli.continues=<old id>`, and deletes the old one (soft: `mlflow gc` purges it,
    `MlflowClient().restore_run(id)` brings it back);
  - wandb continues the same run id (resume="allow"). wandb ignores a step below the last one it holds, so
    steps a killed run logged after the checkpoint keep the killed run's values there (documented limit).
  A backend that was off in the checkpoint's run (or a branch into another run directory) starts a new history
  and first logs the checkpoint's rows.

Importing this module imports none of the libraries: validation (`check_installed`) only asks whether they are
installed, so `rlcli train <typo>` still answers in a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rlcli.core.schema import ConfigError


@dataclass
class Resume:
    """What a backend continues from when the run resumes."""

    step: int
    """The checkpoint's step: rows after it are written again by the resumed run."""
    run_id: str | None
    """This backend's run id saved in the checkpoint (None: not on then, or a branch into another run directory)."""
    rows: list[dict[str, float]]
    """The checkpoint's metrics.jsonl: every row up to its step, each with its "step"."""


class Backend:
    """One place metrics go. Subclasses register with @backend(name, needs=(module, extra))."""

    name: ClassVar[str]
    needs: ClassVar[tuple[str, str] | None] = None
    """(the module it imports, the rlcli extra that installs it); None = a core dependency."""

    run_id: str | None = None
    """Saved in each checkpoint's meta.json (logger_ids), so a resumed run continues this one."""

    def __init__(self, cfg: Any, run_dir: str, resume: Resume | None) -> None:
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_config(self, config: dict[str, Any]) -> None:
        """The resolved config (nested, as config.yaml holds it)."""
        raise NotImplementedError

    def log_figure(self, path: str, step: int) -> None:
        """Attach the PNG at `path` (the run's training curves) at `step`."""
        raise NotImplementedError

    def flush(self) -> None:
        """Everything logged so far on disk (called at each checkpoint)."""

    def note(self) -> str | None:
        """Where this backend put the run and how to look at it (the end summary's line)."""
        return None

    def close(self) -> None:
        raise NotImplementedError


BACKENDS: dict[str, type[Backend]] = {}


def backend(name: str, needs: tuple[str, str] | None = None) -> Callable[[type[Backend]], type[Backend]]:
    def register(cls: type[Backend]) -> type[Backend]:
        cls.name, cls.needs = name, needs
        BACKENDS[name] = cls
        return cls
    return register


def enabled(cfg: Any) -> list[str]:
    """The backends `cfg` (the logger group) turns on, in registry order."""
    return [name for name in BACKENDS if cfg[name]]


def check_installed(cfg: Any) -> None:
    """Raise ConfigError naming the extra to install for each backend that is on but whose library is missing.
    Asks importlib whether the module exists; imports nothing."""
    import importlib.util

    for name in enabled(cfg):
        needs = BACKENDS[name].needs
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            raise ConfigError(f"logger.{name}=true needs the {needs[0]} package, which is not installed: "
                              f"pip install 'rlcli[{needs[1]}]'; or logger.{name}=false")


def replay(sink: Backend, rows: list[dict[str, float]]) -> None:
    """Log a checkpoint's rows to a backend that starts a new history on resume."""
    for row in rows:
        sink.log({k: v for k, v in row.items() if k != "step"}, int(row["step"]))


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """{"algo.clip_high": 0.28, ...}: scalars as they are, null as "null", lists and dicts as JSON text."""
    from rlcli.core.schema import flatten

    return {k: "null" if v is None else v if isinstance(v, bool | int | float | str) else json.dumps(v)
            for k, v in flatten(config).items()}


# --------------------------------------------------------------------------------------------------- wandb
@backend("wandb")
class Wandb(Backend):
    """Weights & Biases, offline by default (logger.mode): `wandb sync` uploads later."""

    def __init__(self, cfg: Any, run_dir: str, resume: Resume | None) -> None:
        import wandb

        os.environ.setdefault("WANDB_DIR", run_dir)
        os.environ.setdefault("WANDB_CACHE_DIR", os.path.join(run_dir, "wandb-cache"))
        run_id = resume.run_id if resume else None
        self.run = wandb.init(project=cfg.project, mode=cfg.mode, dir=run_dir, name=os.path.basename(run_dir.rstrip("/")),
                              id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id
        if resume is not None and run_id is None:  # wandb was off in the checkpoint's run, or a branch
            replay(self, resume.rows)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **metrics}, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)  # a resumed run may change logger.*, eval.*, ...

    def log_figure(self, path: str, step: int) -> None:
        import wandb

        self.run.log({"curves": wandb.Image(path)}, step=step)

    def note(self) -> str | None:
        """An offline run's directory and the command that uploads it, or an online run's URL (WANDB_SILENT, which
        rlcli sets, keeps wandb from saying so itself)."""
        if self.run.disabled:
            return None
        if self.run.offline:
            where = self.run.settings.sync_dir
            return f"wandb (offline): {where}; upload it with: wandb sync {where}"
        return f"wandb: {self.run.url}"

    def close(self) -> None:
        self.run.finish()


# --------------------------------------------------------------------------------------------- tensorboard
@backend("tensorboard", needs=("tensorboard", "tensorboard"))
class TensorBoard(Backend):
    """Event files in run_dir/tensorboard (torch's SummaryWriter): scalars under the metric names, the config in
    the HParams dashboard and as text (`config`), the curves as an image (`curves`)."""

    def __init__(self, cfg: Any, run_dir: str, resume: Resume | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = self.run_id = os.path.join(os.path.abspath(run_dir), "tensorboard")
        # purge_step: readers drop every event at or after it that an earlier writer of this folder wrote: on
        # resume the steps a killed run wrote after the checkpoint; in a fresh run, an older run's whole history.
        continues = resume is not None and resume.run_id == self.dir
        self.writer = SummaryWriter(self.dir, purge_step=resume.step + 1 if continues else 0)
        if resume is not None and not continues:  # tensorboard was off in the checkpoint's run, or a branch
            replay(self, resume.rows)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)  # float32, as TensorBoard stores scalars

    def log_config(self, config: dict[str, Any]) -> None:
        from omegaconf import OmegaConf
        from torch.utils.tensorboard.summary import hparams

        # HParams dashboard: one session holding every key; its metric columns are the headline metrics.
        flat = flat_config(config)
        for summary in hparams(flat, {"acc/mean": 0, "reward/mean": 0, "eval/acc": 0}):
            self.writer.file_writer.add_summary(summary)
        yaml = OmegaConf.to_yaml(OmegaConf.create(config))
        self.writer.add_text("config", "".join(f"    {line}\n" for line in yaml.splitlines()))  # markdown code

    def log_figure(self, path: str, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            self.writer.add_image("curves", np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()

    def note(self) -> str | None:
        return f"tensorboard: {self.dir}; view it with: tensorboard --logdir {self.dir}"

    def close(self) -> None:
        self.writer.close()


# -------------------------------------------------------------------------------------------------- mlflow
MLFLOW_NAME = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A metric or param name as MLflow accepts it (letters, digits, _ - . / : and spaces): `eval/pass@4` is
    logged as `eval/pass_at_4`, any other character becomes `_`."""
    return MLFLOW_NAME.sub("_", key.replace("@", "_at_"))


@backend("mlflow", needs=("mlflow", "mlflow"))
class MLflow(Backend):
    """An MLflow run in experiment logger.project, named after the run directory: metrics (names through
    mlflow_key), the flattened config as params, config.yaml and curves.png as artifacts. The store is
    logger.mlflow_uri, by default a file store in run_dir/mlruns."""

    BATCH = 1000  # MLflow's limit of metrics per log_batch call (params and tags: 100)
    PARAM_CHARS = 6000  # MLflow's limit of a param value's length

    def __init__(self, cfg: Any, run_dir: str, resume: Resume | None) -> None:
        self.uri = cfg.mlflow_uri or "file://" + os.path.join(os.path.abspath(run_dir), "mlruns")
        if self.uri.startswith("file:"):
            # MLflow 3.7+ refuses its file store unless asked (it recommends a database); it is the one store
            # that needs nothing but mlflow-skinny, and `mlflow ui` reads it with the same variable set.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(cfg.project)
        if experiment is None:
            with contextlib.suppress(MlflowException):  # another job of a sweep created it first
                self.client.create_experiment(cfg.project)
            experiment = self.client.get_experiment_by_name(cfg.project)
        old = resume.run_id if resume else None
        if old is not None and self._active(old) and not self._steps_after(old, resume.step):
            self.run_id = old
            self.client.update_run(old, status="RUNNING")
            return
        tags = {"rlcli.run_dir": os.path.abspath(run_dir)}
        if old is not None:
            tags["rlcli.continues"] = old
        self.run_id = self.client.create_run(experiment.experiment_id, run_name=os.path.basename(run_dir.rstrip("/")),
                                             tags=tags).info.run_id
        if resume is not None:
            replay(self, resume.rows)
        if old is not None and self._active(old):
            self.client.set_tag(old, "rlcli.continued_in", self.run_id)
            self.client.set_terminated(old, status="KILLED")
            self.client.delete_run(old)

    def _active(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:  # not in this store (logger.mlflow_uri changed) or purged
            return False

    def _steps_after(self, run_id: str, step: int) -> bool:
        """Whether the run holds a value of any metric at a step after `step`."""
        keys = self.client.get_run(run_id).data.metrics
        return any(m.step > step for key in keys for m in self.client.get_metric_history(run_id, key))

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + self.BATCH], synchronous=True)

    def log_config(self, config: dict[str, Any]) -> None:
        """Params: the flattened config (values cut to MLflow's 6000 characters; config.yaml, an artifact, holds
        them whole). Params cannot change: a resumed run of the same MLflow run adds only keys it lacks."""
        import tempfile

        from mlflow.entities import Param
        from omegaconf import OmegaConf

        have = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)[: self.PARAM_CHARS]) for k, v in
                  ((mlflow_key(k), v) for k, v in flat_config(config).items()) if k not in have]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100], synchronous=True)
        with tempfile.TemporaryDirectory() as tmp:
            OmegaConf.save(OmegaConf.create(config), os.path.join(tmp, "config.yaml"))
            self.client.log_artifact(self.run_id, os.path.join(tmp, "config.yaml"))

    def log_figure(self, path: str, step: int) -> None:
        self.client.log_artifact(self.run_id, path)

    def note(self) -> str | None:
        view = f"mlflow ui --backend-store-uri {self.uri}"
        if self.uri.startswith("file:"):
            view = f"MLFLOW_ALLOW_FILE_STORE=true {view}"
        return f"mlflow: run {self.run_id} in {self.uri}; view it with: {view}"

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")
