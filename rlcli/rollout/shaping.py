"""Reward shapers (DAPO, Yu et al. 2025, arXiv:2503.14476 §3.4), applied in registration order after the
task reward.

One signature: `fn(batch, algo_cfg, rollout_cfg) -> (batch, metrics)`; each reads its own switch and
returns the batch with `scores` or `loss_mask` replaced, and per-trajectory [N] metric tensors (averaged
over every sampled trajectory of the step, all ranks). Dynamic sampling, the third DAPO step, is a
filter over whole groups: `rlcli.rollout.sampler`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlcli.algos.functional import soft_overlong_penalty
from rlcli.core.batch import RolloutBatch
from rlcli.core.registry import Registry

SHAPERS = Registry("reward shaper")


@SHAPERS.register("soft_overlong_punishment")
def soft_overlong(b: RolloutBatch, algo: Any, rollout: Any) -> tuple[RolloutBatch, dict[str, Tensor]]:
    """DAPO Eq. 13: a linear penalty inside the last `rollout.overlong_buffer_len` tokens, added to the reward. The
    length is the whole response's (`token_mask`): in a multi-turn row the budget holds the observations too."""
    if not algo.soft_overlong:
        return b, {}
    pen = soft_overlong_penalty(
        b.token_mask.sum(-1).float(), rollout.max_new_tokens, rollout.overlong_buffer_len, algo.overlong_penalty_factor
    )  # [N]
    return b.replace(scores=b.scores + pen), {"overlong/penalty_mean": pen}


@SHAPERS.register("overlong_filter")
def overlong_filter(b: RolloutBatch, algo: Any, rollout: Any) -> tuple[RolloutBatch, dict[str, Tensor]]:
    """DAPO overlong filtering: truncated responses keep their reward but are masked out of the loss."""
    loss_mask = b.response_mask.clone()  # [N, T]
    if algo.overlong_filter:
        loss_mask[b.truncated] = 0.0
    return b.replace(loss_mask=loss_mask), {"overlong/truncated_frac": b.truncated.float()}


def shape(b: RolloutBatch, algo: Any, rollout: Any) -> tuple[RolloutBatch, dict[str, Tensor]]:
    metrics: dict[str, Tensor] = {}
    for fn in SHAPERS.values():
        b, m = fn(b, algo, rollout)
        metrics.update(m)
    return b, metrics
