"""The calculator tool of the embedded arithmetic task (`recipe=tools/calculator`), its demonstrations, and the same
conversation written as an agent against the OpenAI API (`recipe=tools/calculator_agent`).

The warm start writes a share of its demonstrations (`model.warm_start.tool_demos`) as a call, `calc(34+85)`, the
result the tool returns, and the box: the other demonstrations work the columns and forget carries
(`carry_slip`), so the errors the tiny model starts with are exactly those a calculator removes, and RL can learn
that calling it pays.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from rlcli.core.answers import extract_final_answer_or_none
from rlcli.envs.tools import tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_DIGITS = 64
"""Results longer than this are refused (the expression `9*9*...` would otherwise grow without bound)."""


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        out = _OPS[type(node.op)](_value(node.left), _value(node.right))
        if len(str(abs(out))) > MAX_DIGITS:
            raise ValueError(f"result longer than {MAX_DIGITS} digits")
        return out
    raise ValueError("only integers, + - * and parentheses")


@tool
def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, -, * and parentheses.

    Args:
        expression: The expression, e.g. 347+85
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None  # the message does not echo the model's text
    return str(_value(tree.body))


def demonstration(example: dict) -> dict:
    """An arith example (rlcli.data.arith.make_example) solved with the calculator: the call, the result the tool
    returns, the box. -> the example with `turns`, the messages after the prompt"""
    expression = example["prompt"].removeprefix("Q: ").split("=")[0]
    result = calc(expression)
    return {**example, "turns": [
        {"role": "assistant", "content": f" calc({expression})"},
        {"role": "tool", "name": "calc", "content": result},
        {"role": "assistant", "content": f"\\boxed{{{result}}}"},
    ]}


CALC_SCHEMA = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an integer arithmetic expression with +, -, * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The expression, "
                                                                   "e.g. 347+85"}}, "required": ["expression"]},
    "return": {"type": "string"}}}
"""`calc`'s schema, as rlcli.envs.tools.schema makes it from the docstring (a test keeps them equal), written out so
that an agent's worker process need not import transformers."""


def agent(client: Any, row: dict[str, str], max_result_chars: int = 32) -> dict[str, float]:
    """env=calculator's conversation as an agent (rollout.agent=rlcli.envs.calculator:agent; docs/environments.md):
    each `calc(...)` the policy writes comes back from the gateway as a tool call; the agent runs it and sends the
    result (a failure as `error: ...`, cut to `max_result_chars`) as a tool message, until a turn without a call or
    the end of the episode. Reward 1 when the last \\boxed{} of everything the policy wrote is the answer; the calls
    and requests made are logged (env.agent_metrics)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    calls = requests = 0
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALC_SCHEMA])
        requests += 1
        message = reply.choices[0].message
        messages.append({"role": "assistant", "content": message.content})
        if reply.choices[0].finish_reason == "length" or not message.tool_calls:
            break
        for tc in message.tool_calls:
            calls += 1
            try:
                result = calc(json.loads(tc.function.arguments)["expression"])
            except (ValueError, KeyError) as e:
                result = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "name": "calc", "tool_call_id": tc.id, "content": result[:max_result_chars]})
    written = "".join(m["content"] or "" for m in messages if m["role"] == "assistant")
    return {"reward": float(extract_final_answer_or_none(written) == row["answer"]), "calls": float(calls), "requests": float(requests)}
