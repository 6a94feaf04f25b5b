"""The env group's schema (`env.*`: the multi-turn environment, its tools, OpenEnv and verifiers environments),
importable without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlcli.core.names import TOOL_FORMATS
from rlcli.core.schema import rng
from rlcli.envs.openenv import OpenEnvConfig
from rlcli.envs.verifiers import VerifiersConfig


@dataclass
class EnvConfig:
    """Multi-turn rollout with an environment between the policy's turns (rlcli/envs; docs/tools.md)."""

    name: str | None = None
    """null = single-turn rollout; tools = call env.tools and show their results; or a dotted path to a class with
    the rlcli.envs.Environment methods, built as cls(env_cfg, toolbox)."""
    tools: list[str] = field(default_factory=list)
    """Dotted paths of @rlcli.envs.tool functions, e.g. [rlcli.envs.calculator.calc]."""
    tool_format: str = rng("compact", choices=TOOL_FORMATS)
    """How the model writes a call: compact = name(argument) on its own line; hermes = <tool_call>{json}</tool_call>."""
    template: str | None = None
    """Chat template of the conversation: null = the tokenizer's; plain = text turns for tokenizers without one; or a
    literal Jinja template."""
    system_prompt: str | None = None
    """A system message before the prompt (null = none)."""
    max_turns: int = rng(4, ge=1)
    """Assistant turns per trajectory; a trajectory still calling a tool after the last one ends there."""
    max_observation_chars: int = rng(512, ge=1)
    """Each tool result is cut to this many characters before it is rendered."""
    tool_timeout_s: float = rng(5.0, gt=0)
    """Per call: a call running longer is interrupted, and its result is an error text the policy reads."""
    tool_memory_mb: int = rng(1024, ge=64)
    """Address-space cap of each tool worker process."""
    tool_workers: int = rng(2, ge=1)
    """Worker processes that run tool calls (rlcli/core/workers.py: a clock and a memory cap, no isolation)."""
    episode_workers: int = rng(2, ge=1)
    """rollout.agent: worker processes that run the agent (rlcli/core/workers.py: a clock and a memory cap each)."""
    episodes_per_worker: int = rng(32, ge=1)
    """rollout.agent: episodes a worker runs at once, a thread each: episode_workers x episodes_per_worker episodes
    run at once, and the gateway answers their waiting requests together, in one batch."""
    episode_timeout_s: float = rng(300.0, gt=0)
    """rollout.agent: an episode running longer is interrupted (killed if it must be) and scores 0, counted in
    env/timeouts; also each request's client timeout."""
    episode_memory_mb: int = rng(4096, ge=256, why="a worker needs ~150 MiB for the openai client")
    """rollout.agent: address-space cap of each worker process (its episodes' threads together)."""
    agent_metrics: list[str] = field(default_factory=list)
    """rollout.agent: names of numbers the agent returns beside its reward, logged as agent/<name> (each rank logs
    them all, so they are named here)."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """env=openenv: its server (env.openenv.url or .app) and the bounds on its episodes (rlcli/envs/openenv.py)."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """env=verifiers: its taskset, harness and rubric weights (rlcli/envs/verifiers.py)."""
