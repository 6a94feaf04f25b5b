"""The chat loop that drives a verifiers environment's policy inside rlcli's worker (env=verifiers; docs/environments.md,
"verifiers"): a `verifiers.v1.Harness` that runs in-process.

verifiers' own plain chat harnesses (`null`, and `bash` with its shell tools) are programs it launches per rollout
through `uv`, which installs their dependencies from PyPI on first use: offline, and on a training machine where every
rollout would pay a Python start-up, that does not run. verifiers' Harness contract allows a loop in-process "as long
as every model call goes through `endpoint` + `secret`" (verifiers.v1.harness.Harness.launch); this is that loop, on
the wire exactly what `null` sends: the system prompt and the task's prompt (text or messages), the tools of the
task's MCP servers as OpenAI function tools, every request `stream=true` read with verifiers' own stream reader, each
tool call run on its MCP server and its result sent back as a `tool` message, until a reply without tool calls. The
environment's interception server (its turn limit, stop conditions, rubric) stands between this loop and rlcli's
gateway as it stands before any harness.

verifiers finds a harness by a top-level module name (`agent.harness.id`); `register()` enters this module under
HARNESS_ID. Imported only by rlcli.envs.verifiers, only with env=verifiers.
"""

from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack
from typing import Any

from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils import core
from verifiers.v1.harnesses.utils.compaction import bound_tool_message
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult

HARNESS_ID = "rlcli_verifiers_chat"
"""The id env=verifiers gives verifiers for this harness (env.verifiers.harness=null and no harness of the task's)."""


class ChatHarnessConfig(HarnessConfig):
    pass


class ChatHarness(Harness[ChatHarnessConfig]):
    """The in-process chat loop (module doc)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any) -> ProgramResult:
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=shared_http())
        try:
            async with AsyncExitStack() as stack:
                servers_cfg = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                              for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(servers_cfg, stack) if mcp_urls else ([], {}, {})
                while True:
                    completion = await core.chat(client, ctx.model, messages, tools)
                    message = completion.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        return ProgramResult(0, "", "")
                    for call in message.tool_calls:
                        messages.append(bound_tool_message({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                                            "content": await run_tool(servers, dispatch, call)}))
        except SystemExit as stop:  # core.chat's way of saying the model's transport failed
            return ProgramResult(int(stop.code or 1), "", "the model's connection failed")
        except Exception as err:  # the interception refused a turn (a stop condition), a tool server failed, ...
            return ProgramResult(1, "", f"{type(err).__name__}: {err}")


_HTTP: dict[int, Any] = {}


def shared_http() -> Any:
    """One connection pool per event loop (the worker's one loop) for every episode's client: a client of its own
    would load the CA bundle per episode (~30 ms of CPU each, measured), for a loopback address."""
    import asyncio

    import httpx

    loop = id(asyncio.get_running_loop())
    if loop not in _HTTP:
        _HTTP[loop] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    return _HTTP[loop]


async def run_tool(servers: dict, dispatch: dict, call: Any) -> Any:
    """A tool call's result, or the error the policy reads in its place (a malformed call is the policy's to fix)."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as err:
        return f"error: invalid JSON in tool arguments ({err}); resend the call with valid JSON"
    if not isinstance(args, dict):
        return f"error: tool arguments must be a JSON object, got {type(args).__name__}"
    if call.function.name not in dispatch:
        return f"error: unknown tool {call.function.name!r}"
    return await call_mcp(servers, dispatch, call.function.name, args)


__all__ = ["ChatHarness"]


def register() -> str:
    """Make this harness findable by verifiers under HARNESS_ID; -> the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID
