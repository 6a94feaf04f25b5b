"""The environment protocol, and the tool-calling environment built from @tool functions.

An environment is one trajectory's counterpart, made fresh for each trajectory:

    reset(row) -> messages        row = {"prompt": ..., "answer": ...} (a data row); the first messages
    step(message) -> StepResult   the model's turn (decoded text) -> observation messages, reward, done

Its messages are chat messages ({"role", "content"}, tool results with role "tool"); the rollout renders them
with the chat template (rlcli.envs.chat) and feeds the tokens to the policy. The reward of a trajectory is the
configured task reward of its text plus the sum of the environment's step rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlcli.envs.chat import Message
from rlcli.envs.tools import TOOL_FORMATS, load_tools, schema


@dataclass
class StepResult:
    observations: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    """Counts added up per trajectory; tool_calls, tool_errors, tool_timeouts, errors and timeouts are logged as
    env/<key> means (docs/metrics.md; rlcli.rollout.multiturn.ENV_METRICS), other keys are not. A trajectory with
    errors or timeouts above 0 scores 0 (and acc 0), in training and in evaluation."""


class Environment(Protocol):
    def reset(self, row: dict[str, str]) -> list[Message]: ...

    def step(self, message: str) -> StepResult: ...


class Toolbox:
    """The configured tools: their schemas here, their calls in worker processes (rlcli.envs.tools)."""

    def __init__(self, cfg: Any):
        from rlcli.core.workers import WorkerPool

        self.cfg = cfg
        self.tools = load_tools(list(cfg.tools))
        self.schemas = [schema(fn) for fn in self.tools.values()]
        self.parse = TOOL_FORMATS[cfg.tool_format]
        self.pool = WorkerPool("rlcli.envs.tools.run_call", setup="rlcli.envs.tools.setup_worker",
                                setup_args=(list(cfg.tools),), num_workers=cfg.tool_workers,
                                timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb) if self.tools else None

    def run(self, message: str) -> tuple[list[Message], dict[str, float]]:
        """The calls in `message`, run -> (one tool message per call, counts). A failure is the text
        `error: ...`; every output is cut to env.max_observation_chars."""
        calls = self.parse(message, set(self.tools)) if self.tools else []
        if not calls:
            return [], {}
        results = self.pool.map([(c.name, c.args, c.kwargs) for c in calls])
        out, limit = [], self.cfg.max_observation_chars
        for call, r in zip(calls, results):
            text = str(r.value) if r.status == "ok" else f"error: {r.message}"
            out.append({"role": "tool", "name": call.name, "content": text[:limit]})
        return out, {
            "tool_calls": float(len(calls)),
            "tool_errors": float(sum(r.status == "error" for r in results)),
            "tool_timeouts": float(sum(r.status == "timeout" for r in results)),
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def rendered_prompts(tokenizer: Any, cfg: Any, prompts: list[str]) -> list[str]:
    """The first prompts of multi-turn rollout as text: ToolEnv's first messages (env.system_prompt, the prompt) in
    the chat template, with the tools' schemas. The memory plan measures these; a user environment's own first
    messages may differ."""
    from rlcli.envs.chat import ChatFormat

    chat = ChatFormat(tokenizer, cfg.template, [schema(fn) for fn in load_tools(list(cfg.tools)).values()])
    env = ToolEnv(cfg, None)
    return [chat.render(env.reset({"prompt": p, "answer": ""}), True) for p in prompts]


class ToolEnv:
    """env.name=tools: the user's prompt (after env.system_prompt); each turn with tool calls gets their results,
    a turn without one ends the trajectory. No step reward: the task reward scores the final text."""

    def __init__(self, cfg: Any, toolbox: Toolbox):
        self.cfg, self.toolbox = cfg, toolbox

    def reset(self, row: dict[str, str]) -> list[Message]:
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return system + [{"role": "user", "content": row["prompt"]}]

    def step(self, message: str) -> StepResult:
        observations, info = self.toolbox.run(message)
        return StepResult(observations, done=not observations, info=info)
