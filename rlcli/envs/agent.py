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

Agents run here, in worker processes of rlcli.core.workers (a clock and a memory cap; it isolates nothing: an agent
is trusted code of the user's), each worker running a chunk of episodes at once, a thread each, so that many
requests wait at the gateway together and are answered in one batch. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

MODEL_NAME = "policy"
"""The model name the gateway serves (/v1/models); requests may name any model, the policy answers."""
API_KEY = "rlcli"
"""The gateway asks for no key; the openai client needs one."""

_AGENT: list[Any] = []  # in a worker: [the agent function, env.agent_metrics, one HTTP client for every episode]


def load_agent(path: str) -> Callable[..., Any]:
    """`pkg.module:function` (or `pkg.module.function`) -> the function."""
    from rlcli.core.registry import import_dotted

    fn = import_dotted(path.replace(":", "."))
    if not callable(fn):
        raise TypeError(f"{path} is not callable")
    return fn


def setup_worker(path: str, metrics: list[str], timeout_s: float, env: dict[str, Any]) -> None:
    """Once per worker: import the agent and the openai client (their import time is not an episode's), run the
    agent's own set-up if it has one (`function.setup(env, timeout_s)`, with the run's env config: env=verifiers loads
    its environment there), and open the HTTP connection pool the episodes' clients share (a client of its own would
    cost each episode its set-up)."""
    import httpx
    import openai  # noqa: F401

    fn = load_agent(path)
    if callable(getattr(fn, "setup", None)):
        fn.setup(env, timeout_s)
    http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    _AGENT[:] = [fn, list(metrics), http]


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


def run_episode(base_url: str, row: dict[str, Any]) -> dict[str, float]:
    """One episode -> outcome(...): the agent with a client of the episode's base URL."""
    from openai import OpenAI

    fn, metrics, http = _AGENT
    return outcome(fn(OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, http_client=http), dict(row)), metrics)


def run_episodes(item: tuple[list[tuple[str, dict[str, Any]]], float]) -> list[tuple[str, Any]]:
    """In a worker: a chunk of episodes (base URL, row) at once, a thread each, within `timeout_s` seconds together.
    -> per episode ("ok", outcome) | ("error", why) | ("timeout", why). A thread still running at the deadline cannot
    be stopped: the pool then replaces this worker once the reply is back."""
    from rlcli.core.workers import describe_args, retire_after_reply

    episodes, timeout_s = item
    threads = ThreadPoolExecutor(len(episodes), thread_name_prefix="rlcli-episode")
    futures = [threads.submit(run_episode, url, row) for url, row in episodes]
    _, running = wait(futures, timeout=timeout_s)
    out: list[tuple[str, Any]] = []
    for f in futures:
        if f in running:
            out.append(("timeout", f"interrupted after {timeout_s:g} s"))
        elif (e := f.exception()) is not None:
            out.append(("error", f"{type(e).__name__}: {describe_args(e)}"))
        else:
            out.append(("ok", f.result()))
    threads.shutdown(wait=False, cancel_futures=True)
    if running:
        retire_after_reply()
    return out
