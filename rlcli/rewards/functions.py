"""Reward functions (docs/rewards.md) and the per-response scorer that runs inside the reward workers (pool.py).

Every reward function has one signature, ``fn(response: str, ground_truth: str, **options) -> float``
(or ``(float, {metric: count})``, counts the step's metrics sum, as ``code`` reports how each execution ended; the
key ``audit_flagged`` is no count but the response's flag for the reward audit, rlcli.rewards.code.AUDIT),
is a top-level function (the worker imports it by name) and is registered in :data:`REWARDS`.
``options`` are RewardConfig fields the built-ins read (``length_target``, ``length_scale``); a
function ignores the ones it does not use. User functions (``reward.custom``) take no options.

Final-answer extraction (shared by ``math_verify`` and ``format``) is
:func:`rlcli.core.answers.extract_final_answer`, the one extractor that evaluation's maj@k and the arith
task use too (its rules are in rlcli/core/answers.py): the later of the last box and the last ``Answer:``
line; an unclosed last box is no answer; a response without either form has no answer and scores 0,
even if a bare number appears in it.

Pre-filters (why: they bound the work untrusted text can cause, cheaply, before any parser runs):
text that is not valid Unicode (lone surrogates, e.g. undecodable UTF-8 bytes), contains NUL, or is
longer than ``max_response_chars`` is rejected as a whole response; braces nested deeper than
:data:`MAX_BRACE_DEPTH` anywhere in the response make answer extraction raise. Both count as
``reward/errors`` and score 0. Extraction itself is linear-time; only the extracted answer (never
the whole response) reaches math-verify's parsers.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from rlcli.core.answers import MAX_BRACE_DEPTH as MAX_BRACE_DEPTH  # re-exported, see the docstring
from rlcli.core.answers import MalformedResponse, extract_final_answer
from rlcli.core.registry import Registry, import_dotted
from rlcli.core.workers import describe_args
from rlcli.rewards import code, reasoning_gym

REWARDS = Registry("reward function")

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def check_text(text: Any, max_chars: int, what: str = "response") -> str:
    """Return `text` as a str, or raise MalformedResponse if it must not reach a parser."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedResponse(f"{what} is not valid UTF-8 (byte {e.start})") from None
    if not isinstance(text, str):
        raise MalformedResponse(f"{what} is a {type(text).__name__}, expected str")
    if len(text) > max_chars:
        raise MalformedResponse(f"{what} has {len(text)} characters > reward.max_response_chars={max_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MalformedResponse(f"{what} is not valid Unicode (lone surrogate at {e.start})") from None
    if "\x00" in text:
        raise MalformedResponse(f"{what} contains a NUL character")
    return text


def _parse_math(text: str) -> list[Any]:
    """math-verify parse of an answer or a ground truth, as LaTeX math unless it carries delimiters."""
    from math_verify import parse

    if "\\boxed" not in text and not _UNESCAPED_DOLLAR.search(text):
        text = f"${text}$"
    # parsing_timeout=None: math-verify's own timeout is signal.alarm; its alarm(0) would cancel the
    # worker's soft-timeout timer (measured: \boxed{9^{9^{9^{9}}}} then hung > 30 s). pool.py times us.
    return parse(text, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)  # the G responses of a group share one ground truth
def _parse_gold(ground_truth: str) -> tuple[Any, ...]:
    return tuple(_parse_math(ground_truth))


@REWARDS.register("math_verify")
def math_verify_reward(response: str, ground_truth: str, *, answer_format: str = "boxed", **options: Any) -> float:
    """acc ∈ {0, 1}: the final answer (read as reward.answer_format says) equals the ground truth according
    to math-verify."""
    from math_verify import verify

    answer = extract_final_answer(response, answer_format)
    if answer is None:
        return 0.0
    if not ground_truth.strip():
        raise ValueError("ground truth is empty")
    gold = list(_parse_gold(ground_truth))
    pred = _parse_math(answer)
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


@REWARDS.register("format")
def format_reward(response: str, ground_truth: str, *, answer_format: str = "boxed", **options: Any) -> float:
    """1 if the response ends with a usable final answer (a closed, non-empty last box or a non-empty
    last ``Answer:`` line, whichever comes later: :func:`rlcli.core.answers.extract_final_answer`), else 0."""
    return 1.0 if extract_final_answer(response, answer_format) is not None else 0.0


@REWARDS.register("length")
def length_reward(
    response: str, ground_truth: str, *, length_target: int, length_scale: int, **options: Any
) -> float:
    """``max(0, 1 − |len(response) − length_target| / length_scale)`` in characters, ∈ [0, 1].

    With ``length_target = 0`` shorter is better (1 for empty, 0 from ``length_scale`` characters on);
    with a positive target it is a triangle peaking at the target. Its floor is 0, the value every
    failed call gets, so a timeout can never earn more than an honest response.
    """
    return max(0.0, 1.0 - abs(len(response) - length_target) / length_scale)


# Code run against the task's tests (rlcli/rewards/code.py): the fraction passed or all-or-nothing, and a count of
# how the execution ended (code/ok, code/failed, code/timeout, ...).
REWARDS.register("code")(code.code_reward)

# A reasoning-gym task's own scorer of the response's last <answer>...</answer> (rlcli/rewards/reasoning_gym.py), in
# [0, 1], partial where the task gives partial credit; acc is a full score.
REWARDS.register("reasoning_gym")(reasoning_gym.reasoning_gym_reward)

ACC_PARTS = ("code", "reasoning_gym")
"""Reward functions that define acc themselves when they are a part (acc = their value >= 1: all tests pass, a full
score); without one, math_verify does."""


# ---------------------------------------------------------------------------------------------
# Inside a reward worker: setup_worker() once, then score_item() per response (see pool.py).

_PARTS: list[tuple[str, Callable[..., float], dict[str, Any]]] = []
_MAX_CHARS: list[int] = [0]
_ACC: list[str] = ["math_verify"]  # the part whose value 1 is acc = 1


def setup_worker(spec: dict[str, Any]) -> None:
    """Build the scorer from a spec made by RewardManager: import math-verify and user functions once."""
    from math_verify import verify

    # math-verify warns that its own timeout is disabled; here that is by design (pool.py).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Pay the import (~0.5 s) and the LaTeX parser's lazy set-up (~0.1 s) at start-up, not on the
    # first response of the first step.
    verify(_parse_math("0.5"), _parse_math("\\frac{1}{2}"), timeout_seconds=None)
    _MAX_CHARS[0] = spec["max_response_chars"]
    _PARTS.clear()
    # acc is always computed (metrics, dynamic sampling): by the first of ACC_PARTS that is a part (`code`: all tests
    # pass; `reasoning_gym`: a full score), else by math_verify, which is then always the first part.
    _ACC[0] = next((n for n in ACC_PARTS if n in spec["parts"]), "math_verify")
    for name in [_ACC[0], *(n for n in spec["parts"] if n != _ACC[0])]:
        if name == "code":
            code.interpreter()  # no sandbox here: the worker fails at start-up with the fix, before any step
        if name == "reasoning_gym":
            reasoning_gym.warm_up()
        if name in spec["custom"]:
            try:
                fn = import_dotted(spec["custom"][name])
            except Exception as e:
                raise ImportError(
                    f"reward.custom.{name}={spec['custom'][name]!r} cannot be imported in the reward "
                    f"worker ({type(e).__name__}: {e}); it must be importable from the trainer's "
                    f"sys.path"
                ) from None
            if not callable(fn):
                raise TypeError(f"reward.custom.{name}={spec['custom'][name]!r} is not callable")
            _PARTS.append((name, fn, {}))
        else:
            _PARTS.append((name, REWARDS[name], spec["options"]))


def score_item(item: tuple[Any, Any]) -> dict[str, Any]:
    """Score one (response, ground_truth) pair: {"acc", "parts": {name: value}, "counts", "flagged", "error"};
    "flagged" is 1 when any part returned AUDIT = 1 (rlcli.rewards.code.AUDIT: it scored its maximum and failed an
    independent check), else 0.

    A part that raises scores 0 and is reported in "error"; a malformed response or ground truth
    raises MalformedResponse, which the pool reports as an error for the whole response.
    """
    response = check_text(item[0], _MAX_CHARS[0], "response")
    ground_truth = check_text(item[1], _MAX_CHARS[0], "ground truth")
    values: dict[str, float] = {}
    counts: dict[str, float] = {}
    flagged = 0.0
    errors: list[str] = []
    for name, fn, options in _PARTS:
        try:
            value = fn(response, ground_truth, **options)
            if isinstance(value, tuple):  # (value, counts to add to the step's metrics, and its AUDIT flag)
                value, more = value
                more = dict(more)
                flagged = max(flagged, float(more.pop(code.AUDIT, 0.0)))
                counts.update(more)
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as e:  # the soft timeout is a BaseException and passes through
            value = 0.0
            errors.append(f"{name}: {type(e).__name__}: {describe_args(e)}")
        values[name] = value
    return {"acc": float(values[_ACC[0]] >= 1.0), "parts": values, "counts": counts, "flagged": flagged,
            "error": "; ".join(errors) or None}


