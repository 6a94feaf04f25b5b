"""The reward `reasoning_gym`: a reasoning-gym task's own scorer (data=reasoning_gym; docs/environments.md).

The ground truth is the payload rlcli.data.reasoning_gym writes, JSON `{"task", "config", "entry"}`. The answer is
read as reasoning-gym reads it, `reasoning_gym.utils.extract_answer` (the text of the last <answer>...</answer>
pair, stripped); a response without one scores 0 (as a response without a final answer does for math_verify). The
value is the task's `score_answer(answer, entry)` in [0, 1], which some tasks make partial (a right number inside
extra text, an almost sorted list); acc is a full score, value >= 1 (rlcli.rewards.functions.score_item). A scorer
that raises scores 0 and counts in reward/errors, like every reward function.

Runs in the reward workers (rlcli/core/workers.py: a clock and a memory cap per response); reasoning-gym is imported
there once, at the worker's start (`warm_up`), and each task's dataset object (its scorer) is built once per
(task, config) and reused.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from rlcli.data.reasoning_gym import INSTALL


def warm_up() -> None:
    """Import reasoning-gym in the worker at start-up (about a second), failing there with the fix if it is missing."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise ImportError(f"reward=reasoning_gym needs the reasoning-gym package: {INSTALL}") from None


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str) -> Any:
    """The task's dataset object, whose score_answer scores its entries (one per task and config)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(config_json))


def parse_ground_truth(ground_truth: str) -> tuple[str, str, dict[str, Any]]:
    """-> (task, its config as sorted JSON, the entry); ValueError if `ground_truth` is not the payload."""
    try:
        payload = json.loads(ground_truth)
    except json.JSONDecodeError as e:
        raise ValueError(f"ground truth is not reasoning-gym's payload JSON ({e.msg}): use data=reasoning_gym") from None
    if not isinstance(payload, dict) or not {"task", "entry"} <= set(payload):
        raise ValueError("ground truth is not reasoning-gym's payload {task, config, entry}: use data=reasoning_gym")
    return payload["task"], json.dumps(payload.get("config") or {}, sort_keys=True), payload["entry"]


def reasoning_gym_reward(response: str, ground_truth: str, **options: Any) -> float:
    """The task's own score_answer of the response's last <answer>...</answer>, in [0, 1]; 0 without one."""
    from reasoning_gym.utils import extract_answer

    task, config_json, entry = parse_ground_truth(ground_truth)
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    value = float(_dataset(task, config_json).score_answer(answer, entry))
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{task}.score_answer returned {value}, outside [0, 1]")
    return value
