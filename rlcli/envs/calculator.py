"""The calculator tool of the embedded arithmetic task (`recipe=tools/calculator`), and its demonstrations.

The warm start writes a share of its demonstrations (`model.warm_start.tool_demos`) as a call, `calc(34+85)`, the
result the tool returns, and the box: the other demonstrations work the columns and forget carries
(`carry_slip`), so the errors the tiny model starts with are exactly those a calculator removes, and RL can learn
that calling it pays.
"""

from __future__ import annotations

import ast
import operator

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
