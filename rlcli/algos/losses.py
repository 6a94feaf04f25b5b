"""Policy losses: registry `POLICY_LOSSES`, one signature for all (docs/algorithms.md, "Policy loss").

    fn(logp, old_logp, advantages, mask, cfg) -> (loss_mat [N, T], metrics)

`cfg` is an `rlcli.algos.config.AlgoConfig` or the composed `algo` DictConfig, hence annotated `Any`.

`loss_mat` is the per-token loss, 0 at masked positions; the trainer reduces it with
`aggregate(loss_mat, mask, cfg.loss_agg, num_tokens=..., num_seqs=..., max_len=...)`, the counts
summed over the whole optimizer mini-batch (`aggregation_counts`). `metrics` are detached 0-dim
tensors named as in docs/metrics.md (without the `actor/` prefix).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlcli.algos import functional as F
from rlcli.core import names
from rlcli.core.registry import Registry

POLICY_LOSSES = Registry(names.POLICY_LOSSES)
AGG_MODES = F.AGG_MODES
aggregate = F.aggregate
aggregation_counts = F.aggregation_counts
value_loss = F.value_loss


@POLICY_LOSSES.register("clipped")
def clipped(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO/DAPO clipped surrogate: clip_low/clip_high, optional dual clip and ratio clamp."""
    return F.clipped_policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        ratio_clamp=cfg.ratio_clamp,
    )


def _clip_bounded(fn: Any) -> Any:
    """The registry entry of a loss whose only knobs are its clip bounds (algo.clip_low / clip_high)."""

    def loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: Any) -> tuple[Tensor, dict]:
        return fn(logp, old_logp, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high)

    loss.__doc__ = fn.__doc__
    return loss


# GSPO (arXiv:2507.18071): the clipped surrogate on the length-normalised sequence ratio s_i.
POLICY_LOSSES.register("gspo")(_clip_bounded(F.gspo_policy_loss))
# CISPO (arXiv:2506.13585): -sg(clip(ρ))·A·logp, every token keeps its gradient.
POLICY_LOSSES.register("cispo")(_clip_bounded(F.cispo_policy_loss))
