"""Parts of the task reward that a model scores (rlcli.rewards.config.MODEL_PARTS): they read the prompt as well as the
response, so they run in the process that holds the batch, not in a reward worker. One interface:

    scorer = SCORERS[part](cfg, policy_tokenizer)   # loaded once per process that makes batches
    out = scorer(rollout_batch)                     # -> Scored
    scorer.close()

rm: rlcli/rewards/model.py (a trained reward model); judge: rlcli/rewards/judge.py (a generative judge).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Scored:
    """One model part's result for N rows."""

    raw: Tensor
    """[N] float32: the part's raw value, logged as reward/<part> (and in the batch's extras)."""
    value: Tensor
    """[N] float32: what enters the score, times reward.weights.<part> (rm: normalised; judge: the verdict)."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """More per-row metrics [N], logged as reward/<name>: their mean over the trained batch."""
    counts: dict[str, float] = field(default_factory=dict)
    """Counts logged as reward/<name>, summed over generation batches and ranks."""


SCORERS = {"rm": "rlcli.rewards.model:ModelScorer", "judge": "rlcli.rewards.judge:JudgeScorer"}
"""part -> the class whose `of_run(cfg, policy_tokenizer)` loads its scorer (imported only when the part is used)."""


def build_scorer(part: str, cfg: Any, policy_tokenizer: Any) -> Any:
    module, name = SCORERS[part].split(":")
    return getattr(importlib.import_module(module), name).of_run(cfg, policy_tokenizer)
