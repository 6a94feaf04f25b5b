"""AgentRollout: `build_engine`'s engine when rollout.agent is set (docs/environments.md, "Agents").

Each row's G episodes each run the agent (rlcli.envs.agent) on a thread of a worker process (chunks of
env.episodes_per_worker episodes), with an `openai` client whose base URL is that episode's address on the gateway
(rlcli.rollout.gateway). While they run, this process (the one that
owns the engine) answers their requests in batches with the wrapped hf or vllm engine, turn by turn
(`continue_tokens`), and the gateway records each episode as a multi-turn row: the sampled tokens trained, every
other token masked. When every episode has ended, the rows are one RolloutBatch of whole groups, as single-turn
rollout makes, with per-row extras

    env/reward         the agent's reward (added to the task reward: reward=agent leaves it alone)
    env/acc            its acc (1 = solved), the row's acc in place of the task reward's
    env/turns          completions the episode asked for; env/observation_tokens: its masked tokens
    env/errors         1 where the agent raised (or returned something that is not a reward); reward and acc 0
    env/timeouts       1 where it ran past env.episode_timeout_s (interrupted, killed if it must be); reward 0
    agent/<name>       each of agent_metric_names the agent returned

At most env.episode_workers x env.episodes_per_worker episodes run at once; a worker that dies is replaced
(rlcli.core.workers), and its chunk's episodes are retried once, then counted as errors.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from omegaconf import OmegaConf

from rlcli.core.batch import RolloutBatch
from rlcli.core.workers import TaskResult, WorkerPool
from rlcli.rollout.gateway import Gateway
from rlcli.rollout.multiturn import Wrapped, trajectory_batch
from rlcli.rollout.sampling import Sampling

log = logging.getLogger(__name__)

START_S = 10.0
"""Seconds a worker may take beyond env.episode_timeout_s for a chunk (its threads' start, its reply)."""
AGENT_METRICS = ("turns", "observation_tokens", "errors", "timeouts", "reward", "acc")
"""Per-episode values in RolloutBatch.extras as env/<name> (module doc; docs/metrics.md)."""


def agent_metric_names(cfg: Any) -> tuple[str, ...]:
    """The agent/<name> metrics: env.agent_metrics, then those the agent names itself (`function.metric_names(cfg)`;
    env=verifiers: its rubric's)."""
    from rlcli.envs.agent import load_agent

    fn = load_agent(cfg.rollout.agent)
    own = fn.metric_names(cfg) if callable(getattr(fn, "metric_names", None)) else []
    return tuple(dict.fromkeys([*cfg.env.agent_metrics, *own]))


class AgentRollout(Wrapped):
    """Episodes of the agent rollout.agent through the gateway, answered by the wrapped `engine` (module doc)."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any):
        super().__init__(engine)
        e = cfg.env
        self.tokenizer, self.timeout_s, self.names = tokenizer, e.episode_timeout_s, agent_metric_names(cfg)
        self.chunk = e.episodes_per_worker
        # the worker's own clock stops a chunk after episode_timeout_s (rlcli.envs.agent.run_episodes); the pool's,
        # START_S later, stops a worker that does not answer at all
        env = OmegaConf.to_container(e, resolve=True)
        self.pool = WorkerPool("rlcli.envs.agent.run_episodes", setup="rlcli.envs.agent.setup_worker",
                                     setup_args=(cfg.rollout.agent, list(self.names), e.episode_timeout_s, env),
                                     num_workers=e.episode_workers, timeout_s=e.episode_timeout_s + START_S,
                                     memory_mb=e.episode_memory_mb)
        self.gateway = Gateway(tokenizer, e, max_batch=e.episode_workers * e.episodes_per_worker)
        self._logged: set[str] = set()

    def generate(self, prompts: list[str], answers: list[str], n: int, sampling: Sampling, group_offset: int = 0,
                 with_logprobs: bool = False) -> RolloutBatch:
        episodes = self.gateway.open(len(prompts) * n, sampling.max_new_tokens)
        rows = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers) for _ in range(n)]
        pairs = [(url, row) for (_, url), row in zip(episodes, rows)]
        items = [(pairs[i : i + self.chunk], self.timeout_s) for i in range(0, len(pairs), self.chunk)]
        results: list[TaskResult] = []
        failure: list[BaseException] = []
        finished = threading.Event()

        def run() -> None:
            try:
                results.extend(self.pool.map(items))
            except BaseException as err:  # the pool could not run them (a worker failed to start): raised below
                failure.append(err)
            finally:
                self.gateway.close([e for e, _ in episodes])  # later requests (a killed agent's) are refused
                finished.set()

        thread = threading.Thread(target=run, name="rlcli-agents", daemon=True)
        thread.start()
        self.gateway.serve(self.engine, sampling, finished)
        thread.join()
        self.engine.rest()
        if failure:
            raise RuntimeError(f"rollout.agent: {failure[0]}") from failure[0]
        outcomes = [o for (chunk, _), r in zip(items, results)  # a chunk's failure is each of its episodes'
                    for o in (r.value if r.status == "ok" else [(r.status, r.message)] * len(chunk))]
        trajectories = []
        for (e, _), (status, value) in zip(episodes, outcomes):
            if status == "ok":
                e.stats.update(value)
            else:
                e.stats["timeouts" if status == "timeout" else "errors"] += 1.0
                self.log_once(f"an episode {'timed out' if status == 'timeout' else 'failed'}: {value}")
            trajectories.append(e)
        batch = trajectory_batch(self.tokenizer, trajectories, answers, n, group_offset, with_logprobs, AGENT_METRICS)
        batch.extras.update({f"agent/{k}": torch.tensor([e.stats[k] for e in trajectories], dtype=torch.float32)
                             for k in self.names})  # [N] each
        return batch

    def log_once(self, message: str) -> None:
        key = message.split(":", 2)[:2]
        if str(key) not in self._logged:
            self._logged.add(str(key))
            log.warning("rollout.agent: %s (further failures of this kind are only counted)", message[:300])

    def close(self) -> None:
        self.pool.close()
        self.gateway.shutdown()
        self.engine.close()
