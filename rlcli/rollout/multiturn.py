"""MultiTurn: a rollout engine whose rows are conversations with an environment (rlcli.envs).

It wraps an engine (hf or vllm) and keeps its contract (`generate` -> RolloutBatch of whole groups), so the
loop, evaluation and the rollout ranks of asynchronous rollout use it unchanged. Each turn asks the engine for
the next tokens of every unfinished trajectory (`continue_tokens`: token ids in, token ids out), hands the
decoded turn to the trajectory's environment, and appends the observation tokens the chat template adds
(rlcli.envs.chat). In the batch:

    response_ids   generated₁ ⊕ observation₁ ⊕ generated₂ ⊕ ...   [N, T]
    token_mask     1 on all of them: what the model reads            [N, T]
    response_mask  1 on generated tokens only: what every loss trains [N, T]
    rollout_logp   the sampler's log-probs, 0 on observations         [N, T]
    texts          the generated tokens decoded, observations left out: the reward reads only what the policy
                   wrote (a tool result holding a number must not count as its answer)

rollout.max_new_tokens bounds the whole response (generated and observation tokens), so T and the memory plan
are those of single-turn rollout. A trajectory ends when its environment says done, after env.max_turns
assistant turns, or when the budget runs out (mid-turn, or with no room for an observation): then `truncated`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcli.core.batch import RolloutBatch
from rlcli.core.registry import import_dotted
from rlcli.envs.chat import ChatFormat, Message
from rlcli.envs.env import Environment, Toolbox, ToolEnv
from rlcli.rollout.hf import left_padded
from rlcli.rollout.sampling import Sampling

ENV_METRICS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "observation_tokens", "used_tool", "reward",
               "errors", "timeouts")
"""Per-trajectory values in RolloutBatch.extras as env/<name> (docs/metrics.md)."""


@dataclass
class Trajectory:
    env: Environment
    messages: list[Message]
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    trained: list[float] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    stats: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, ids: list[int], logp: list[float] | None, trained: bool) -> None:
        self.ids += ids
        self.trained += [float(trained)] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


def trajectory_batch(tokenizer: Any, rows: list[Trajectory], answers: list[str], n: int, group_offset: int,
                     with_logprobs: bool, metrics: tuple[str, ...]) -> RolloutBatch:
    """Whole groups of trajectories (prompt i owns rows i*n .. i*n+n-1) as a RolloutBatch: prompts left-padded
    [N, Tp], responses right-padded [N, T], each row's `metrics` stats as extras env/<name> [N]."""
    pad = tokenizer.pad_token_id
    t = max(1, max(len(r.ids) for r in rows))
    prompt_ids, prompt_mask = left_padded([r.prompt for r in rows], pad)  # [N, Tp] each
    response_ids = torch.tensor([r.ids + [pad] * (t - len(r.ids)) for r in rows])  # [N, T]
    token_mask = torch.tensor([[1.0] * len(r.ids) + [0.0] * (t - len(r.ids)) for r in rows])  # [N, T]
    response_mask = torch.tensor([r.trained + [0.0] * (t - len(r.ids)) for r in rows])  # [N, T]
    logp = torch.tensor([r.logp + [0.0] * (t - len(r.ids)) for r in rows]) if with_logprobs else None  # [N, T]
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        token_mask=token_mask, truncated=torch.tensor([r.truncated for r in rows]),
        group_index=torch.arange(len(answers)).repeat_interleave(n) + group_offset,
        answers=[a for a in answers for _ in range(n)],
        texts=tokenizer.batch_decode([[i for i, m in zip(r.ids, r.trained) if m] for r in rows],
                                     skip_special_tokens=True),
        rollout_logp=logp, stale=torch.zeros(len(rows), dtype=torch.bool),
        extras={f"env/{k}": torch.tensor([r.stats[k] for r in rows], dtype=torch.float32) for k in metrics},
    )


class Wrapped:
    """An engine that drives an hf or vllm `engine` turn by turn (`continue_tokens`) and keeps its contract
    (rlcli/rollout/__init__.py): weights, rest and close are the wrapped engine's."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.logprobs_are_free, self.collective = engine.logprobs_are_free, engine.collective
        self.model = engine.model  # the module it generates from (what asynchronous rollout pushes from)

    def update_weights(self) -> None:
        self.engine.update_weights()

    def weights_checksum(self) -> int:
        return self.engine.weights_checksum()

    def rest(self) -> None:
        self.engine.rest()

    def close(self) -> None:
        self.engine.close()


class MultiTurn(Wrapped):
    """`build_engine`'s engine when env.name is set: the wrapped hf or vllm `engine`, driven turn by turn (module doc)."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any):
        super().__init__(engine)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.toolbox = Toolbox(cfg)
        self.chat = ChatFormat(tokenizer, cfg.template, self.toolbox.schemas)
        self.env_class = ToolEnv if cfg.name == "tools" else import_dotted(cfg.name)

    def generate(self, prompts: list[str], answers: list[str], n: int, sampling: Sampling, group_offset: int = 0,
                 with_logprobs: bool = False) -> RolloutBatch:
        rows = []
        for prompt, answer in zip(prompts, answers):
            for _ in range(n):
                env = self.env_class(self.cfg, self.toolbox)
                messages = env.reset({"prompt": prompt, "answer": answer})
                rows.append(Trajectory(env, messages, self.chat.prompt_ids(messages)))
        budget, eos = sampling.max_new_tokens, self.tokenizer.eos_token_id
        for turn in range(1, self.cfg.max_turns + 1):
            active = [r for r in rows if not r.done]
            if not active:
                break
            outs = self.engine.continue_tokens([r.prompt + r.ids for r in active], [budget - len(r.ids) for r in active],
                                               sampling, with_logprobs)
            for r, (new, logp) in zip(active, outs):
                r.add(new, logp, trained=True)
                r.stats["turns"] += 1
                if not new or new[-1] != eos:  # the budget ran out inside the turn
                    r.done = r.truncated = True
                    continue
                r.messages.append({"role": "assistant", "content": self.tokenizer.decode(new, skip_special_tokens=True)})
                step = r.env.step(r.messages[-1]["content"])
                r.stats["reward"] += step.reward
                for k, v in step.info.items():
                    r.stats[k] += v
                if step.done or turn == self.cfg.max_turns:
                    r.done = True
                    continue
                observation = self.chat.observation_ids(r.messages, step.observations)
                r.messages += step.observations
                if len(r.ids) + len(observation) >= budget:  # no room for the observation and a next turn
                    r.done = r.truncated = True
                    continue
                r.add(observation, None, trained=False)
                r.stats["observation_tokens"] += len(observation)
        self.engine.rest()
        for r in rows:
            r.stats["used_tool"] = float(r.stats["tool_calls"] > 0)
            if hasattr(r.env, "close"):  # however the trajectory ended (env=openenv: its connection)
                r.env.close()
        return trajectory_batch(self.tokenizer, rows, answers, n, group_offset, with_logprobs, ENV_METRICS)

    def close(self) -> None:
        self.toolbox.close()
        if hasattr(self.env_class, "shutdown"):  # the run is over (env=openenv: the app served for it stops)
            self.env_class.shutdown()
        self.engine.close()
