"""Tools: plain Python functions the policy calls between its turns, run in worker processes.

    from rlcli.envs import tool

    @tool
    def calc(expression: str) -> str:
        \"\"\"Evaluate an integer arithmetic expression.

        Args:
            expression: e.g. 347+85
        \"\"\"

A tool's schema (name, description, parameters) comes from its type hints and its Google-style docstring,
through transformers' `get_json_schema`, the format chat templates take as `tools=`; it is made when a run starts. Config names tools by
dotted path (`env.tools: [mypkg.tools.calc]`), so they import both here (schemas, call parsing) and in the
workers that run them: the `WorkerPool` (rlcli/core/workers.py), one process per worker with an
address-space cap, a soft and a hard timeout, and a replacement when a worker dies. It isolates nothing: a tool runs
as the trainer's user, with its files and network, so tools are trusted code (only their arguments are the policy's). A tool's exception or
timeout comes back as text the policy reads (`error: ...`) and as a counted metric, never as a crash.

Call formats (`env.tool_format`), how a call is written in the model's message:
- `compact`: `name(argument)` on one line, the argument string passed as the tool's first parameter. Short
  enough for the character-level tiny model.
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen2.5 and Hermes
  chat templates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlcli.core.registry import import_dotted


def tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as a tool. Its schema is made when a run starts (`schema`), not here: config validation imports
    tools by path and must stay light (no transformers)."""
    fn.is_tool = True  # type: ignore[attr-defined]
    return fn


def schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of tool `fn` (name, description, parameters) from its type hints and docstring; raises if the
    docstring does not describe every parameter."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def load_tools(paths: list[str]) -> dict[str, Callable[..., Any]]:
    """Tool name (the function's name) -> function, for dotted paths of @tool functions."""
    tools = {}
    for path in paths:
        fn = import_dotted(path)
        if not getattr(fn, "is_tool", False):
            raise TypeError(f"{path} is not decorated with rlcli.envs.tool")
        tools[fn.__name__] = fn
    return tools


@dataclass
class Call:
    name: str
    args: list[Any]
    kwargs: dict[str, Any]


_COMPACT = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.MULTILINE)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_compact(message: str, names: set[str]) -> list[Call]:
    return [Call(m[1], [m[2]], {}) for m in _COMPACT.finditer(message) if m[1] in names]


def parse_hermes(message: str, names: set[str]) -> list[Call]:
    """Calls in `<tool_call>` JSON blocks; a block that is not valid JSON is a call of the tool named '' (an
    error the policy sees)."""
    calls = []
    for block in _HERMES.findall(message):
        try:
            spec = json.loads(block)
            calls.append(Call(str(spec["name"]), [], dict(spec.get("arguments") or {})))
        except (ValueError, KeyError, TypeError, AttributeError):
            calls.append(Call("", [], {}))
    return calls


TOOL_FORMATS: dict[str, Callable[[str, set[str]], list[Call]]] = {"compact": parse_compact, "hermes": parse_hermes}


# ------------------------------------------------------------------ the workers' side (rlcli.core.workers)
_TOOLS: dict[str, Callable[..., Any]] = {}


def setup_worker(paths: list[str]) -> None:
    _TOOLS.update(load_tools(paths))


def run_call(call: tuple[str, list[Any], dict[str, Any]]) -> str:
    name, args, kwargs = call
    if name not in _TOOLS:
        raise KeyError(f"no tool named {name!r}; tools: {', '.join(sorted(_TOOLS))}")
    return str(_TOOLS[name](*args, **kwargs))
