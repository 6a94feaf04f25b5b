"""Reductions over ranks for what the loop logs and decides: every rank calls these at the same places.

In one process they are local computations; with several ranks each is one collective (gloo or nccl).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


def all_reduce(x: Tensor, op: str = "sum") -> Tensor:
    """A copy of `x` reduced over ranks with `op` in sum | max | min."""
    x = x.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return x


def barrier() -> None:
    """Wait for every rank (under hw.collective_timeout_s, like every collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def rank_zero_first(fn: Callable[[], T]) -> T:
    """fn() on rank 0, then on the other ranks, which may read what rank 0 cached (a warm start, a conversion)."""
    later = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() != 0
    if later:
        barrier()
    out = fn()
    if dist.is_initialized() and dist.get_world_size() > 1 and not later:
        barrier()
    return out


def gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's `obj` (picklable), in rank order, on every rank (of `group`, default all)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_rank(group: dist.ProcessGroup) -> int:
    """This rank's index in `group`."""
    return dist.get_rank(group)


def consecutive_groups(k: int, timeout_s: int) -> dist.ProcessGroup | None:
    """This rank's group of `k` consecutive ranks (0..k-1, k..2k-1, ...): a gloo group for Python objects, made
    collectively (every rank creates every group, in the same order), whose collectives fail after `timeout_s`
    (hw.collective_timeout_s). None when k == 1."""
    from datetime import timedelta

    if k == 1:
        return None
    world, mine = dist.get_world_size(), None
    for start in range(0, world, k):
        group = dist.new_group(list(range(start, start + k)), backend="gloo", timeout=timedelta(seconds=timeout_s))
        if start <= dist.get_rank() < start + k:
            mine = group
    return mine


def agree_min(k: int) -> int:
    """The smallest `k` over all ranks (ranks agree on a count before running collectives on it)."""
    return int(all_reduce(torch.tensor([k], dtype=torch.long), "min").item())


def agree_max(k: int) -> int:
    """The largest `k` over all ranks."""
    return int(all_reduce(torch.tensor([k], dtype=torch.long), "max").item())


def global_stats(values: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    """{name: 1-D values on this rank} -> {name: {mean, std, max, n}} over every rank's values.

    std is the unbiased (n-1) standard deviation (0 for n <= 1); an empty set has mean 0 and max -inf.
    Two collectives whatever the number of names.
    """
    names = sorted(values)
    flat = [values[k].detach().reshape(-1).to(torch.float64).cpu() for k in names]
    sums = torch.tensor([[v.sum().item(), (v * v).sum().item(), float(v.numel())] for v in flat],
                        dtype=torch.float64).reshape(-1, 3)  # [K, 3]
    maxes = torch.tensor([v.max().item() if v.numel() else float("-inf") for v in flat], dtype=torch.float64)
    sums, maxes = all_reduce(sums), all_reduce(maxes, "max")
    out = {}
    for k, (s, sq, n), mx in zip(names, sums.tolist(), maxes.tolist()):
        mean = s / n if n else 0.0
        var = max(sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
        out[k] = {"mean": mean, "std": var**0.5, "max": mx, "n": n}
    return out
