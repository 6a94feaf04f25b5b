"""Who runs what in a job, derived from the config (root config `cfg`) and answered here only: the ranks, whether
rollout is asynchronous, how stale a trained row may be. Torch-free; every module that asks imports it from here."""

from __future__ import annotations

from typing import Any


def world_size(hw: Any) -> int:
    """Ranks of the job over all nodes (training and, with asynchronous rollout, rollout ranks)."""
    return hw.nproc * hw.nnodes


def asynchronous(cfg: Any) -> bool:
    """Whether rollout runs on ranks of its own (rollout.async.max_staleness set, 0 included): the one place that
    answers it."""
    return cfg.rollout["async"].max_staleness is not None


def staleness(cfg: Any) -> int:
    """How many policy versions a trained row may lag: rollout.async.max_staleness, 0 when rollout is synchronous."""
    return cfg.rollout["async"].max_staleness or 0


def rollout_ranks(cfg: Any) -> int:
    """Ranks that only generate: 0 unless rollout is asynchronous (then rollout.async.rollout_ranks, null = half of
    the job's ranks)."""
    a = cfg.rollout["async"]
    if not asynchronous(cfg):
        return 0
    return a.rollout_ranks if a.rollout_ranks is not None else world_size(cfg.hw) // 2


def trainer_ranks(cfg: Any) -> int:
    """Data-parallel training ranks: the job's ranks minus the rollout ranks."""
    return world_size(cfg.hw) - rollout_ranks(cfg)


def generates_partitioned(cfg: Any) -> bool:
    """Whether HF generation samples from ZeRO-3 partitions over several training ranks (rollout.engine=hf at
    hw.zero_stage=3): where rollout.zero3_generation applies and its auto waits for the memory plan."""
    return cfg.rollout.engine == "hf" and cfg.hw.zero_stage == 3 and trainer_ranks(cfg) > 1


def free_port() -> int:
    """A TCP port nobody listens on now, so concurrent runs on one machine never collide."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def splits_heads(heads: int, kv_heads: int, sp_size: int) -> bool:
    """Whether Ulysses attention can share a model's heads over a sequence-parallel group of `sp_size` ranks: each
    rank attends with heads / sp_size query heads, and the key-value heads either split too or are replicated (they
    divide the group's size)."""
    return heads % sp_size == 0 and (kv_heads % sp_size == 0 or sp_size % kv_heads == 0)
