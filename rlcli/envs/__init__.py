"""Multi-turn rollout: environments the policy talks to between its turns, and tools
(docs/tools.md).

    env.py      the Environment protocol (reset / step), StepResult, ToolEnv over @tool functions
    tools.py    @tool, call formats, the workers' side of tool calls (the reward's worker pool)
    chat.py     the token contract: observation tokens cut from the chat template's rendering
    rollout.py  MultiTurn: wraps a rollout engine; same `generate` contract, multi-turn rows

`env.name` picks the environment: null (single-turn, the default), `tools`, or a dotted path to a class built
as `cls(env_cfg, toolbox)` with the Environment methods.
"""

from rlcli.envs.env import Environment, StepResult, Toolbox, ToolEnv
from rlcli.envs.tools import tool

__all__ = ["Environment", "StepResult", "ToolEnv", "Toolbox", "tool"]
