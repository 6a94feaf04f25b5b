"""Reward shapers (DESIGN.md §5.1), applied in registration order after the task reward.

One signature: `fn(batch, algo_cfg, rollout_cfg) -> metrics`; each reads its own switch and
edits `batch.scores` or `batch.loss_mask` in place. Dynamic sampling, the third DAPO shaping step,
is a filter over whole groups and lives in the trainer's collect stage.
"""

from __future__ import annotations

from typing import Any

from rlcli.algos.functional import soft_overlong_penalty
from rlcli.batch import RolloutBatch
from rlcli.registry import Registry

SHAPERS = Registry("reward shaper")


@SHAPERS.register("soft_overlong_punishment")
def soft_overlong(batch: RolloutBatch, algo: Any, rollout: Any) -> dict[str, float]:
    """DAPO Eq. 13: a linear penalty inside the last `rollout.overlong_buffer_len` tokens."""
    if not algo.soft_overlong:
        return {}
    pen = soft_overlong_penalty(
        batch.lengths.float(), rollout.max_new_tokens, rollout.overlong_buffer_len, algo.overlong_penalty_factor
    )  # [N]
    batch.scores = batch.scores + pen
    return {"overlong/penalty_mean": pen.mean().item()}


@SHAPERS.register("overlong_filter")
def overlong_filter(batch: RolloutBatch, algo: Any, rollout: Any) -> dict[str, float]:
    """DAPO §3.4: truncated responses keep their reward but are masked out of the loss."""
    batch.loss_mask = batch.response_mask.clone()
    if algo.overlong_filter:
        batch.loss_mask[batch.truncated] = 0.0
    return {"overlong/truncated_frac": batch.truncated.float().mean().item()}


def shape(batch: RolloutBatch, algo: Any, rollout: Any) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for fn in SHAPERS.values():
        metrics.update(fn(batch, algo, rollout))
    return metrics
