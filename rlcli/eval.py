"""Held-out evaluation with the rollout and reward code the trainer uses."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from rlcli.rollout.hf import generate


def evaluate(
    model: Any, tokenizer: Any, examples: list[dict[str, str]], eval_cfg: Any, rollout_cfg: Any,
    rewards: Any, chunk: int = 64, progress: bool = False,
) -> dict[str, float]:
    """Sample eval.k responses per prompt (greedy when eval.temperature == 0) and verify them.

    Returns sums so callers can reduce over ranks: correct, total, length_sum, truncated.
    """
    correct = total = length_sum = truncated = 0.0
    for s in tqdm(range(0, len(examples), chunk), desc="eval", disable=not progress, leave=False):
        part = examples[s : s + chunk]
        b = generate(
            model, tokenizer, [e["prompt"] for e in part], [e["answer"] for e in part], eval_cfg.k,
            rollout_cfg.max_new_tokens, eval_cfg.temperature, eval_cfg.top_p, 0, rollout_cfg.gen_batch_size,
        )
        out = rewards(b.texts, b.answers)
        correct += out.acc.sum().item()
        total += len(b)
        length_sum += b.lengths.sum().item()
        truncated += b.truncated.sum().item()
    return {"correct": correct, "total": total, "length_sum": length_sum, "truncated": truncated}
