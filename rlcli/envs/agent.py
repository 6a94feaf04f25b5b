"""Agents written against the OpenAI API, run as training episodes (rollout.agent; docs/environments.md, "Agents").

An agent is a function of a client and a data row that returns the episode's reward:

    def run(client: openai.OpenAI, row: dict) -> float | dict:
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        ...                                   # as many calls, tools and turns as it likes, its own parsing
        return 1.0 if ok else 0.0             # or {"reward": r, "acc": 1.0, "<a name in env.agent_metrics>": v}

`client` talks to this episode's own address on rlcli's gateway (rlcli/rollout/gateway.py), where the policy
answers; `row` is the data row ({"prompt", "answer"}, as environments receive it). A mapping result has "reward",
optionally "acc" (1 = solved; default: reward >= 1, a full score) and the numbers named in env.agent_metrics (logged
as agent/<name>).

Agents run here, in worker processes of rlcli.rewards.pool (a clock and a memory cap per episode; it isolates
nothing: an agent is trusted code of the user's), one episode at a time per worker. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

MODEL_NAME = "policy"
"""The model name the gateway serves (/v1/models); requests may name any model, the policy answers."""
API_KEY = "rlcli"
"""The gateway asks for no key; the openai client needs one."""

_AGENT: list[Any] = []  # in a worker: [the agent function, env.agent_metrics]


def load_agent(path: str) -> Callable[..., Any]:
    """`pkg.module:function` (or `pkg.module.function`) -> the function."""
    from rlcli.core.registry import import_dotted

    fn = import_dotted(path.replace(":", "."))
    if not callable(fn):
        raise TypeError(f"{path} is not callable")
    return fn


def setup_worker(path: str, metrics: list[str]) -> None:
    """Once per worker: import the agent and the openai client (their import time is not an episode's)."""
    import openai  # noqa: F401

    _AGENT[:] = [load_agent(path), list(metrics)]


def outcome(value: Any, metrics: list[str]) -> dict[str, float]:
    """An agent's return value -> {"reward", "acc", *metrics}; a ValueError says what is wrong with it."""
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(f"the agent returned a mapping without 'reward': {sorted(value)}")
        out = {"reward": value["reward"], "acc": value.get("acc"), **{m: value.get(m, 0.0) for m in metrics}}
    else:
        out = {"reward": value, "acc": None, **dict.fromkeys(metrics, 0.0)}
    if isinstance(out["reward"], bool) or not isinstance(out["reward"], int | float):
        raise ValueError(f"the agent's reward must be a number, got {type(out['reward']).__name__}")
    if out["acc"] is None:
        out["acc"] = float(out["reward"] >= 1.0)
    result = {k: float(v) for k, v in out.items()}
    if not all(math.isfinite(v) for v in result.values()):
        raise ValueError(f"the agent returned a non-finite value: {result}")
    return result


def run_episode(item: tuple[str, dict[str, Any], float]) -> dict[str, float]:
    """In a worker: one episode -> outcome(...). item = (the episode's base URL, the data row, the client's timeout
    per request in seconds)."""
    from openai import OpenAI

    base_url, row, timeout_s = item
    fn, metrics = _AGENT
    with OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=timeout_s) as client:
        return outcome(fn(client, dict(row)), metrics)
