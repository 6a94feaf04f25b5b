"""Metric sinks (stdout, run_dir/metrics.jsonl, the logger backends of rlcli.core.loggers) and stage timers.

Metric names follow the field's habits and are defined once in docs/metrics.md:
`reward/mean`, `acc/mean`, `actor/pg_loss`, `timing_s/rollout`, ...
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _fixed(decimals: int) -> Callable[[float], str]:
    """Fixed point: rounding noise (-1.1e-08) reads 0.0000, without a minus sign."""
    def fmt(x: float) -> str:
        text = f"{x:.{decimals}f}"
        return text[1:] if text.startswith("-") and float(text) == 0 else text
    return fmt


def _significant(floor: float = 0.0, unit: str = "", spec: str = ".3g") -> Callable[[float], str]:
    """Three significant digits (`spec`), where the scale is the point (a KL, the learning rate); a magnitude below
    `floor` is rounding noise and reads 0."""
    return lambda x: "0" if abs(x) < floor else f"{x:{spec}}{unit}"


def _nonzero(fmt: Callable[[float], str], floor: float = 1e-6) -> Callable[[float], str | None]:
    """`fmt`, but nothing at all below `floor`: a value that is 0 by construction (GRPO's on-policy policy loss,
    sum_i A_i / N over group-centred advantages, while its gradient is not 0) is left out instead of reading as a
    stalled run."""
    return lambda x: None if abs(x) < floor else fmt(x)


# The one-line step summary: (metric names, the first one present is shown; label; format). Everything else goes
# to metrics.jsonl and the logger backends (docs/metrics.md defines them all).
HEADLINE: tuple[tuple[tuple[str, ...], str, Callable[[float], str | None]], ...] = (
    (("acc/mean",), "acc", _fixed(3)),
    (("reward/mean",), "reward", _fixed(3)),
    (("reward/rm",), "rm", _fixed(3)),  # the reward model's raw score (reward/mean holds it normalised)
    (("reward/judge_unparsed",), "judge_unparsed", _fixed(0)),  # a judge's replies without a verdict (scored 0)
    (("reward/audit_flagged",), "audit", _nonzero(_fixed(3))),  # paid the maximum, failed an independent check
    (("response_length/mean",), "len", _fixed(1)),
    (("actor/pg_loss",), "pg_loss", _nonzero(_fixed(4))),
    (("critic/vf_loss",), "vf_loss", _fixed(4)),
    (("actor/kl_loss", "actor/reward_kl"), "kl", _significant(1e-6)),  # to the reference: in the loss or the reward
    (("actor/ppo_kl",), "ppo_kl", _significant(1e-6)),  # old -> current policy over the update
    (("actor/entropy",), "entropy", _fixed(3)),
    (("actor/grad_norm",), "grad_norm", _significant(spec="#.3g")),
    (("actor/lr",), "lr", _significant()),
    (("perf/tokens_per_s",), "tok/s", _fixed(0)),
    (("perf/device_peak_mem_gb", "perf/peak_mem_gb"), "mem", _significant(unit="GiB", spec=".2f")),
    (("timing_s/step",), "s/step", _fixed(2)),
)


def headline(metrics: dict[str, Any], step: int) -> str:
    """`step 3  acc=0.250  reward=0.188  len=15.1  pg_loss=0.0123  kl=0.000123  ...`: the metrics of HEADLINE
    that the step logged, are finite and are shown (a pg_loss of 0 is not)."""
    parts = [f"step {step}"]
    for keys, label, fmt in HEADLINE:
        key = next((k for k in keys if k in metrics and math.isfinite(float(metrics[k]))), None)
        shown = fmt(float(metrics[key])) if key is not None else None
        if shown is not None:
            parts.append(f"{label}={shown}")
    return "  ".join(parts)


class RunLog:
    """What the run tells the terminal (the start-up summary, step lines, accuracies, the end summary), also
    appended to run_dir/cli.log: through the log file Hydra opened there for this job if there is one (the same
    file then holds rlcli's log messages, in order), else through its own handler (a torchrun worker's rank 0, a
    Trainer built in code). Rank 0 only."""

    FILE = "cli.log"  # Hydra's job log: <hydra.job.name>.log, and the job is rlcli/commands/cli.py's

    def __init__(self, run_dir: str):
        run_dir = os.path.realpath(run_dir)
        hydra = (h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
                 and os.path.dirname(os.path.realpath(h.baseFilename)) == run_dir)
        self.own: logging.Handler | None = None
        self.handler = next(hydra, None)
        if self.handler is None:
            os.makedirs(run_dir, exist_ok=True)
            self.own = self.handler = logging.FileHandler(os.path.join(run_dir, self.FILE), delay=True)
            self.handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s] %(message)s"))

    def __call__(self, msg: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(msg)  # above a progress bar, if one is showing
        self.handler.handle(logging.LogRecord("rlcli.loop.trainer", logging.INFO, __file__, 0, msg, None, None))

    def close(self) -> None:
        if self.own is not None:
            self.own.close()


class Timer:
    """Accumulates wall seconds per stage: `with timer("rollout"): ...` -> {"timing_s/rollout": s}."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.stage: str | None = None  # the stage entered last (named in errors)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self.stage = stage
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def peak_mem_gb() -> float:
    """Peak resident memory of this process (CPU), in GiB: the kernel's high-water mark of this program's own
    memory (VmHWM). Not getrusage's ru_maxrss: Linux carries that across fork and exec, so a process started by
    a larger one (torchrun's workers, a test's subprocess) reports at least its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20  # kB
    except (OSError, StopIteration):  # not Linux: ru_maxrss (bytes on macOS)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def memory_metrics() -> dict[str, float]:
    """perf/peak_mem_gb (the process's resident peak) and, where this process uses a CUDA device,
    perf/device_peak_mem_gb (torch's peak allocated on it): on a GPU the host's resident memory (3.2 GiB for
    SmolLM2 on an H100, 2026-11-26) says nothing of the device's."""
    import torch

    out = {"perf/peak_mem_gb": peak_mem_gb()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["perf/device_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class MetricsLogger:
    """Writes every metric to run_dir/metrics.jsonl, and to each logger backend the config turns on (wandb,
    tensorboard, mlflow: rlcli.core.loggers). Rank 0 only.

    A resumed run passes `rows_from` (the checkpoint's metrics.jsonl: the rows up to its step, so rows a killed
    run wrote after it are dropped), the checkpoint's `resume_step` and its `run_ids` (each backend's run id, from
    meta.json): each backend continues its run from there without a step written twice or missing."""

    @classmethod
    def of_run(cls, cfg: Any, resumed_from: str | None, meta: dict[str, Any], enabled: bool) -> MetricsLogger:
        """The logger of a run with config `cfg` (a trainer's; `cfg.logger` says where to): a fresh one, or, resumed
        from the checkpoint `resumed_from` whose meta.json is `meta`, one that continues its rows and run ids."""
        from omegaconf import OmegaConf

        return cls(cfg.logger, cfg.run_dir, OmegaConf.to_container(cfg, resolve=True), enabled=enabled,
                   rows_from=os.path.join(resumed_from, "metrics.jsonl") if resumed_from else None,
                   resume_step=meta.get("step"), run_ids=meta.get("logger_ids"))

    def __init__(self, cfg: Any, run_dir: str, config_dict: dict[str, Any], enabled: bool = True,
                 rows_from: str | None = None, resume_step: int | None = None,
                 run_ids: dict[str, str] | None = None):
        from rlcli.core import loggers

        self.enabled = enabled
        self.cfg = cfg
        self.run_dir = run_dir
        self.config = config_dict
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.backends: list[loggers.Backend] = []
        self.curves: str | None = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if rows_from is not None:
            shutil.copyfile(rows_from, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
        # A fresh run starts an empty file, also in a reused run directory.
        self.file = open(self.path, "a" if rows_from else "w", buffering=1)  # noqa: SIM115 (the run's lifetime)
        for name in loggers.enabled(cfg):
            resume = None
            if rows_from is not None:
                assert resume_step is not None, "a resumed run passes the checkpoint's step"
                resume = loggers.Resume(resume_step, (run_ids or {}).get(name), read_jsonl(rows_from))
            sink = loggers.BACKENDS[name](cfg, run_dir, resume)
            sink.log_config(config_dict)
            self.backends.append(sink)

    @property
    def run_ids(self) -> dict[str, str]:
        """Each backend's run id, saved in checkpoints (meta.json logger_ids) so that a resumed run continues it."""
        return {b.name: b.run_id for b in self.backends if b.run_id is not None}

    def snapshot(self, path: str) -> None:
        """Copy the rows written so far to `path` (a checkpoint's metrics.jsonl); the backends flush theirs."""
        if self.enabled:
            self.file.flush()
            shutil.copyfile(self.path, path)
            for b in self.backends:
                b.flush()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        values = _clean(metrics)
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        for b in self.backends:
            b.log(values, step)

    def attach(self, figure: str, step: int) -> None:
        """Attach the run's curves figure (rlcli.loop.plot.log_curves draws it) to every backend at `step`."""
        self.curves = figure
        for b in self.backends:
            b.log_figure(figure, step)

    @property
    def notes(self) -> list[str]:
        """The curves figure, and where each backend put this run and how to look at it (the end summary's lines)."""
        curves = [f"curves.png      the training curves (rlcli plot), also in: {', '.join(b.name for b in self.backends)}"]
        return curves * (self.curves is not None) + [note for b in self.backends if (note := b.note())]

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        for b in self.backends:
            b.close()


def read_jsonl(path: str) -> list[dict[str, float]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def dump_rollouts(run_dir: str, step: int, batch: Any, tokenizer: Any) -> None:
    """logger.rollouts: the trained `batch` of every rank as run_dir/rollouts/step_<step>.jsonl (rank 0 writes it,
    whole or not at all: a resumed run rewrites the steps it repeats)."""
    import torch

    from rlcli.engine import rank
    from rlcli.engine.collectives import gather_objects

    prompts = tokenizer.batch_decode([ids[m.bool()] for ids, m in zip(batch.prompt_ids, batch.prompt_mask)])
    # the whole response: with multi-turn rollout the observations too (batch.texts holds the generated turns only)
    responses = tokenizer.batch_decode([ids[m.bool()] for ids, m in zip(batch.response_ids, batch.token_mask)],
                                       skip_special_tokens=True)
    version = batch.version if batch.version is not None else torch.full((len(batch),), step - 1)
    flagged = batch.extras.get("reward/audit_flagged", torch.zeros(len(batch)))  # [N], the reward audit's flags
    rows = [{"prompt": p, "response": t, "reward": float(r), "acc": float(a), "group": int(g), "version": int(v),
             "audit_flagged": float(f)}
            for p, t, r, a, g, v, f in zip(prompts, responses, batch.scores, batch.acc, batch.group_index, version,
                                           flagged)]
    parts = gather_objects(rows)
    if rank() != 0:
        return
    out = os.path.join(run_dir, "rollouts", f"step_{step}.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for part in parts for row in part)
    os.replace(out + ".tmp", out)