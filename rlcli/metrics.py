"""Metric sinks (stdout, run_dir/metrics.jsonl, wandb) and stage timers.

Metric names follow the field's habits and are defined once in docs/metrics.md:
`reward/mean`, `acc/mean`, `actor/pg_loss`, `timing_s/rollout`, ...
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The few metrics printed on the one-line step summary; everything goes to JSONL and wandb.
HEADLINE = {
    "acc/mean": "acc",
    "reward/mean": "reward",
    "response_length/mean": "len",
    "actor/pg_loss": "pg_loss",
    "actor/entropy": "entropy",
    "actor/grad_norm": "grad_norm",
    "timing_s/step": "s/step",
}


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
    """Peak resident memory of this process (CPU), in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class MetricsLogger:
    """Writes every metric to run_dir/metrics.jsonl, and to wandb when configured. Rank 0 only.

    A resumed run passes `rows_from` (the checkpoint's metrics.jsonl: the rows up to its step, so rows a
    killed run wrote after it are dropped) and the checkpoint's `wandb_id` (wandb continues that run)."""

    def __init__(self, cfg: Any, run_dir: str, config_dict: dict[str, Any], enabled: bool = True,
                 rows_from: str | None = None, wandb_id: str | None = None):
        self.enabled = enabled
        self.cfg = cfg
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if rows_from is not None:
            shutil.copyfile(rows_from, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
        # A fresh run starts an empty file, also in a reused run directory.
        self.file = open(self.path, "a" if rows_from else "w", buffering=1)  # noqa: SIM115 (the run's lifetime)
        if cfg.name == "wandb":
            import wandb

            os.environ.setdefault("WANDB_DIR", run_dir)
            os.environ.setdefault("WANDB_CACHE_DIR", os.path.join(run_dir, "wandb-cache"))
            self.wandb = wandb.init(
                project=cfg.project, mode=cfg.mode, dir=run_dir, config=config_dict,
                name=os.path.basename(run_dir.rstrip("/")), id=wandb_id, resume="allow" if wandb_id else None,
            )

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def snapshot(self, path: str) -> None:
        """Copy the rows written so far to `path` (a checkpoint's metrics.jsonl)."""
        if self.enabled:
            self.file.flush()
            shutil.copyfile(self.path, path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **_clean(metrics)}
        self.file.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def headline(self, metrics: dict[str, Any], step: int) -> str:
        parts = [f"step {step}"]
        for k, label in HEADLINE.items():
            if k in metrics and math.isfinite(float(metrics[k])):
                parts.append(f"{label}={float(metrics[k]):.4g}")
        return "  ".join(parts)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


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
    rows = [{"prompt": p, "response": t, "reward": float(r), "acc": float(a), "group": int(g), "version": int(v)}
            for p, t, r, a, g, v in zip(prompts, responses, batch.scores, batch.acc, batch.group_index, version)]
    parts = gather_objects(rows)
    if rank() != 0:
        return
    out = os.path.join(run_dir, "rollouts", f"step_{step}.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for part in parts for row in part)
    os.replace(out + ".tmp", out)