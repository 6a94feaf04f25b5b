"""verifiers environments (env=verifiers; docs/environments.md, "verifiers"): a `verifiers.v1` taskset's tasks as the
data, its harness driving the policy through rlcli's gateway, its rubric as the reward (`pip install
'rlcli[verifiers]'`; verifiers is imported only here and only when env=verifiers is used).

A verifiers environment is an agent in rlcli's sense (rollout.agent; rlcli.envs.agent): `agent` below is the
function env=verifiers names. Each rank loads the taskset's rows (`load_rows`: the task data as JSON in the row's
ground truth); in an agent worker, one verifiers Env is loaded once, its `serving()` (the interception server, the
taskset's shared tool servers) held open on an event loop thread, and each episode is `Env.run_episode(task, ctx)`
with `ctx`'s client pointed at the episode's own address on the gateway. The episode's reward is its rubric's sum,
weight x score over the trace's rewards (verifiers' `Trace.reward`, with env.verifiers.weights replacing weights by
name); each reward function's score and each @metric is logged as agent/<name>; acc is env.verifiers.acc's score
(>= 1 = solved; by default the reward of the largest weight). An episode verifiers marks as failed (its harness or a tool server failed, a reward raised) raises
here, so it scores 0 and counts in env/errors; its turn limit is env.max_turns.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlcli.core.schema import ConfigError

AGENT = "rlcli.envs.verifiers:agent"
"""rollout.agent of env=verifiers (conf/env/verifiers.yaml)."""
EXTRA = "pip install 'rlcli[verifiers]'"
API_KEY_VAR = "RLCLI_GATEWAY_KEY"
"""The environment variable verifiers reads the gateway's key from (the gateway asks for none; the client needs one)."""


@dataclass
class VerifiersConfig:
    """env.verifiers.*: the verifiers environment of env=verifiers (docs/environments.md, "verifiers")."""

    id: str | None = None
    """The taskset: a module importable here (mypkg.quiz, or a top-level name as verifiers' `taskset.id`), exporting
    one verifiers.v1.Taskset subclass in __all__; or one of verifiers' own tasksets by its name."""
    args: Any = None
    """The taskset's config fields (its TasksetConfig), e.g. {num_rows: 100}; null = its defaults."""
    harness: str | None = None
    """The harness (verifiers' `agent.harness.id`): null = the taskset's own if its module exports one, else rlcli's
    in-process chat loop (rlcli.envs.verifiers_chat: verifiers' `null` harness on the wire, without a process per
    rollout); `rlcli` = that chat loop even where the taskset has a harness; any other id is verifiers' own (e.g.
    null, bash: programs verifiers installs with uv, which needs the network once)."""
    weights: Any = None
    """Weights replacing the rubric's by reward name, e.g. {brief: 0.5} (null = the rubric's own); the reward is
    sum weight x score."""
    acc: str | None = None
    """The reward whose score >= 1 means solved (env/acc, eval/acc); null = the rubric's reward of the largest weight."""


# ------------------------------------------------------------------------------------------------ loading


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigError(f"env=verifiers needs verifiers ({err}): {EXTRA}") from None
    return vf


def env_config(v: Any, max_turns: int) -> Any:
    """The verifiers EnvConfig of env.verifiers: the taskset and its args, the harness, a local runtime, the turns."""
    vf = _vf()
    from rlcli.envs.verifiers_chat import register

    harness = v.harness
    if harness is None:
        from verifiers.v1.utils.loaders import default_harness_id

        own = default_harness_id(v.id)  # the taskset's module, if it exports a Harness; else verifiers' fallback
        harness = own if own == v.id else register()
    elif harness == "rlcli":
        harness = register()
    args = dict(v.args or {})
    return vf.resolve_env_config({"taskset": {**args, "id": top_level(v.id)},
                                  "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"},
                                            "max_turns": max_turns}})


def top_level(module: str) -> str:
    """verifiers finds a taskset by a top-level module name; a dotted one (mypkg.envs.quiz) is imported here and
    entered under a top-level alias."""
    if "." not in module:
        return module
    import importlib
    import sys

    alias = "rlcli_verifiers__" + module.replace(".", "__")
    sys.modules.setdefault(alias, importlib.import_module(module))
    return alias


def load_env(v: Any, max_turns: int) -> Any:
    """A fresh verifiers Env of env.verifiers (an agent worker's own: it serves episodes)."""
    return _vf().load_environment(env_config(v, max_turns))


def inspected_env(v: Any, max_turns: int) -> Any:
    """The Env the trainer process reads (its rubric, its tasks): loaded once per process and configuration, however
    many start-up steps ask (the checks, the metric names, both splits)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else dict(vars(v))
    return _inspected(json.dumps(plain, sort_keys=True, default=str), max_turns)


@functools.lru_cache(maxsize=4)
def _inspected(v_json: str, max_turns: int) -> Any:
    from types import SimpleNamespace

    return load_env(SimpleNamespace(**json.loads(v_json)), max_turns)


def task_of(env: Any, row: dict[str, Any]) -> Any:
    """The verifiers Task of an rlcli row (its ground truth is the task data as JSON)."""
    task_cls = type(env.taskset).task_type()
    return task_cls(task_cls.data_type().model_validate(json.loads(row["answer"])), env.taskset.config.task)


def rubric(env: Any) -> tuple[dict[str, float], list[str]]:
    """({reward name: weight}, [metric names]) of the taskset's tasks (read off its first task)."""
    first = next(iter(env.taskset), None)
    if first is None:
        raise ConfigError("env.verifiers: the taskset has no task")
    rewards = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in first.hooks("reward")}
    rewards |= {j.reward_name: float(j.config.weight) for j in first.plugged_judges()}
    return rewards, [fn.__name__ for fn in first.hooks("metric")]


def check_config(cfg: Any) -> None:
    """env.verifiers' rules, before any model loads (rlcli.config.rules.validate_env): set exactly with env=verifiers, the
    extra installed, the taskset and harness loadable, weights and acc naming rewards of its rubric."""
    v, agent = cfg.env.verifiers, cfg.rollout.agent
    if agent != AGENT:
        for key in ("id", "args", "harness", "weights", "acc"):
            if getattr(v, key) is not None:
                raise ConfigError(f"env.verifiers.{key}={getattr(v, key)} is read by env=verifiers only (rollout.agent="
                                  f"{AGENT}), but rollout.agent={agent}: add env=verifiers (or drop it)")
        return
    if v.id is None:
        raise ConfigError("env=verifiers needs its taskset: env.verifiers.id=<a module exporting a verifiers.v1.Taskset>")
    if cfg.data.source != "verifiers":
        raise ConfigError(f"env=verifiers trains on its taskset's tasks, but data.source={cfg.data.source}: keep "
                          "data.source=verifiers (env=verifiers sets it)")
    for key in ("args", "weights"):
        value = getattr(v, key)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"env.verifiers.{key}={value} must be a mapping, e.g. env.verifiers.{key}="
                              + ("{num_rows:100}" if key == "args" else "{correct:1.0}"))
    if any(isinstance(w, bool) or not isinstance(w, int | float) for w in (v.weights or {}).values()):
        raise ConfigError(f"env.verifiers.weights={v.weights}: each weight must be a number")
    try:
        rewards, _ = rubric(inspected_env(v, cfg.env.max_turns))
    except ConfigError:
        raise
    except Exception as err:  # the user's module may raise anything while it imports
        raise ConfigError(f"env.verifiers.id={v.id} cannot be loaded ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:300]}): name a module importable here that exports one "
                          "verifiers.v1.Taskset subclass in __all__") from None
    unknown = [k for k in [*(v.weights or {}), *([v.acc] if v.acc else [])] if k not in rewards]
    if unknown:
        raise ConfigError(f"env.verifiers: {unknown[0]!r} is no reward of {v.id}'s rubric; its rewards: "
                          f"{sorted(rewards)}")
    if not rewards:
        raise ConfigError(f"env.verifiers.id={v.id}: its tasks have no @vf.reward, so every episode would score 0")


def metric_names(cfg: Any) -> list[str]:
    """The agent/<name> metrics of env=verifiers: its rewards' scores, then its metrics."""
    rewards, metrics = rubric(inspected_env(cfg.env.verifiers, cfg.env.max_turns))
    return [*rewards, *(m for m in metrics if m not in rewards)]


def load_rows(v: Any, max_turns: int, train_size: int | None, eval_size: int | None,
              split: str) -> tuple[list[dict[str, str]], int, str]:
    """The rows of `split`: {"prompt": the task's prompt as text, "answer": the task data as JSON}; -> (rows, rows of
    the other split, where they came from). The held-out split is the data.eval_size tasks of least hash of their id
    (seed- and order-independent), never trained on; the training split the rest, at most data.train_size."""
    taskset = inspected_env(v, max_turns).taskset
    want = None if train_size is None or eval_size is None else train_size + eval_size
    if taskset.INFINITE and want is None:
        raise ConfigError(f"env.verifiers.id={v.id} is an endless taskset: set data.train_size and data.eval_size")
    tasks = []
    for task in taskset:
        tasks.append(task)
        if want is not None and len(tasks) >= want:
            break
    order = sorted(range(len(tasks)), key=lambda i: hashlib.sha256(str(tasks[i].data.id).encode()).hexdigest())
    held = set(order[: eval_size if eval_size is not None else len(tasks)])
    chosen = [t for i, t in enumerate(tasks) if (i in held) == (split == "eval")]
    if split == "train" and train_size is not None:
        chosen = chosen[:train_size]
    rows = [{"prompt": prompt_text(t.data), "answer": t.data.model_dump_json(exclude_defaults=True)} for t in chosen]
    return rows, len(tasks) - len(chosen), f"verifiers taskset {v.id} ({len(tasks)} tasks)"


def prompt_text(data: Any) -> str:
    """A task's prompt as plain text (what the start-up check measures and logs show; the harness sends messages)."""
    parts = [data.system_prompt] if data.system_prompt else []
    if isinstance(data.prompt, str):
        parts.append(data.prompt)
    else:
        parts += [str(m.content if hasattr(m, "content") else m.get("content", "")) for m in data.prompt or []]
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------ in a worker


class _Runner:
    """One verifiers Env in this worker, its serving() held open on an event loop thread; episodes from any thread."""

    def __init__(self, v: Any, max_turns: int, timeout_s: float):
        vf = _vf()
        self.vf, self.timeout_s = vf, timeout_s
        os.environ[API_KEY_VAR] = "rlcli"
        self.env = load_env(v, max_turns)
        self.weights = dict(v.weights or {})
        rewards = rubric(self.env)[0]
        self.acc = v.acc or max(rewards, key=lambda name: rewards[name])  # the first of the largest weight
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rlcli-verifiers", daemon=True).start()
        self.serving = self.env.serving()
        self.call(self.serving.__aenter__())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def episode(self, base_url: str, row: dict[str, Any]) -> dict[str, float]:
        vf = self.vf
        ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
                              sampling=vf.Sampling())
        ep = self.call(self.env.run_episode(task_of(self.env, row), ctx))
        trace = ep.traces[0]
        errors = [*ep.errors, *trace.errors]
        if not ep.ok or errors:
            raise RuntimeError("; ".join(f"{e.type}: {e.message}" for e in errors)[:500] or "the episode failed")
        scores = {name: (r.score if r is not None else 0.0) for name, r in trace.rewards.items()}
        reward = sum(self.weights.get(name, r.weight if r is not None else 0.0) * scores[name]
                     for name, r in trace.rewards.items())
        metrics = {k: float(x) for k, x in trace.metrics.items() if isinstance(x, int | float)}
        return {"reward": reward, "acc": float(scores.get(self.acc, 0.0) >= 1.0), **metrics, **scores}


_RUNNER: list[_Runner] = []


def setup(env_cfg: Any, timeout_s: float) -> None:
    """Once per agent worker (rlcli.envs.agent.setup_worker): load the environment and open its serving()."""
    from omegaconf import OmegaConf

    e = OmegaConf.create(env_cfg) if isinstance(env_cfg, dict) else env_cfg
    _RUNNER[:] = [_Runner(e.verifiers, e.max_turns, timeout_s)]


def agent(client: Any, row: dict[str, Any]) -> dict[str, float]:
    """env=verifiers' agent: one episode of the environment's harness against the gateway at `client`'s base URL."""
    return _RUNNER[0].episode(str(client.base_url), row)


agent.setup = setup  # type: ignore[attr-defined]  (rlcli.envs.agent: called once per worker)
agent.metric_names = metric_names  # type: ignore[attr-defined]  (rlcli.rollout.agent: the agent/<name> metrics)
