"""What a rollout engine is asked to sample: the `rollout.*` (or `eval.*`) settings, nothing else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @classmethod
    def of_rollout(cls, r: object) -> Sampling:
        """The training rollout's settings (`rollout.*`)."""
        return cls(r.max_new_tokens, r.temperature, r.top_p, r.top_k)

    @classmethod
    def of_eval(cls, e: object, r: object) -> Sampling:
        """Evaluation's settings: `eval.*`, with `rollout.max_new_tokens` when eval.max_new_tokens is unset."""
        return cls(e.max_new_tokens or r.max_new_tokens, e.temperature, e.top_p, 0)
