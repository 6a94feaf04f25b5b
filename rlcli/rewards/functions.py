"""Reward functions (DESIGN.md §5.1) and the per-response scorer that runs inside sandbox workers.

Every reward function has one signature, ``fn(response: str, ground_truth: str, **options) -> float``,
is a top-level function (the worker imports it by name) and is registered in :data:`REWARDS`.
``options`` are RewardConfig fields the built-ins read (``length_target``, ``length_scale``); a
function ignores the ones it does not use. User functions (``reward.custom``) take no options.

Final-answer extraction (shared by ``math_verify`` and ``format``):
- the final answer is the later of (a) the last ``\\boxed{...}`` and (b) the last line starting with
  ``Answer:`` (DAPO's prompt format; case-insensitive, ``**Answer:**`` allowed);
- a ``\\boxed{`` whose braces never close (a truncated response) means no answer; there is no fallback
  to an earlier box, because the model did not finish the answer it gave last;
- a response without either form has no answer and scores 0, even if a bare number appears in it:
  RL must not reward an answer the model did not commit to.

Pre-filters (why: they bound the work untrusted text can cause, cheaply, before any parser runs):
text that is not valid Unicode (lone surrogates, e.g. undecodable UTF-8 bytes), contains NUL, or is
longer than ``max_response_chars`` is rejected as a whole response; braces nested deeper than
:data:`MAX_BRACE_DEPTH` anywhere in the response make answer extraction raise. Both count as
``reward/errors`` and score 0. Extraction itself is linear-time; only the extracted answer (never
the whole response) reaches math-verify's parsers.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from rlcli.registry import Registry

REWARDS = Registry("reward function")

# LaTeX in real answers nests a few levels (\frac{\sqrt{..}}{..}); recursive-descent parsers
# (antlr, sympy) blow their stacks or stall on thousands. 64 is far above any honest answer.
MAX_BRACE_DEPTH = 64

_BOXED = "\\boxed{"
_ANSWER_LINE = re.compile(
    r"^[ \t]*(?:\*\*)?answer(?:\*\*)?[ \t]*:(?:\*\*)?(.*)$", re.IGNORECASE | re.MULTILINE
)
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped char (\{, \}, \\) or a brace
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


class MalformedResponse(ValueError):
    """Untrusted text that the reward refuses to parse (counted in reward/errors, scores 0)."""


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


def _check_nesting(text: str) -> None:
    if text.count("{") <= MAX_BRACE_DEPTH:  # fast path: cannot nest deeper than it has braces
        return
    depth = 0
    for m in _BRACE_TOKEN.finditer(text):
        tok = m.group()
        if tok == "{":
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                raise MalformedResponse(f"braces nested deeper than {MAX_BRACE_DEPTH}")
        elif tok == "}":
            depth = max(depth - 1, 0)


def _boxed_content(text: str, start: int) -> str | None:
    """Content of the brace group opened just before `start`, or None if it never closes."""
    depth = 1
    for m in _BRACE_TOKEN.finditer(text, start):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return text[start : m.start()]
    return None


def extract_final_answer(response: str) -> str | None:
    """The final answer's text (see module docstring), or None if the response gives none.

    Raises MalformedResponse when braces are nested deeper than MAX_BRACE_DEPTH.
    """
    _check_nesting(response)
    boxed_at = response.rfind(_BOXED)
    line = None
    for line in _ANSWER_LINE.finditer(response):  # noqa: B007 -- we want the last match
        pass
    if boxed_at >= 0 and (line is None or boxed_at > line.start()):
        answer = _boxed_content(response, boxed_at + len(_BOXED))
    elif line is not None:
        # Markdown and sentence punctuation around a DAPO answer line: "**Answer:** 5." -> "5".
        answer = line.group(1).strip().strip("*").strip().rstrip(".").strip()
    else:
        return None
    if answer is None or not answer.strip():
        return None
    return answer.strip()


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
def math_verify_reward(response: str, ground_truth: str, **options: Any) -> float:
    """acc ∈ {0, 1}: the final answer equals the ground truth according to math-verify."""
    from math_verify import verify

    answer = extract_final_answer(response)
    if answer is None:
        return 0.0
    if not ground_truth.strip():
        raise ValueError("ground truth is empty")
    gold = list(_parse_gold(ground_truth))
    pred = _parse_math(answer)
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


@REWARDS.register("format")
def format_reward(response: str, ground_truth: str, **options: Any) -> float:
    """1 if the response ends with a usable final answer (a closed, non-empty last \\boxed{} or a
    non-empty last ``Answer:`` line, whichever comes later), else 0."""
    return 1.0 if extract_final_answer(response) is not None else 0.0


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


# ---------------------------------------------------------------------------------------------
# Inside a sandbox worker: setup_worker() once, then score_item() per response (see pool.py).

_PARTS: list[tuple[str, Callable[..., float], dict[str, Any]]] = []
_MAX_CHARS: list[int] = [0]


def import_dotted(path: str) -> Any:
    """Import ``"pkg.module.attr"`` and return the attribute."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a dotted path like 'pkg.module.function'")
    return getattr(importlib.import_module(module), attr)


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
    # acc is always computed (metrics, dynamic sampling), so math_verify is always the first part.
    for name in ["math_verify", *(n for n in spec["parts"] if n != "math_verify")]:
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
    """Score one (response, ground_truth) pair: {"acc", "parts": {name: value}, "error"}.

    A part that raises scores 0 and is reported in "error"; a malformed response or ground truth
    raises MalformedResponse, which the pool reports as an error for the whole response.
    """
    response = check_text(item[0], _MAX_CHARS[0], "response")
    ground_truth = check_text(item[1], _MAX_CHARS[0], "ground truth")
    values: dict[str, float] = {}
    errors: list[str] = []
    for name, fn, options in _PARTS:
        try:
            value = float(fn(response, ground_truth, **options))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as e:  # the soft timeout is a BaseException and passes through
            value = 0.0
            errors.append(f"{name}: {type(e).__name__}: {describe_args(e)}")
        values[name] = value
    return {"acc": values["math_verify"], "parts": values, "error": "; ".join(errors) or None}


def describe_args(exc: BaseException) -> str:
    """An exception's message without calling repr on its arguments.

    str() of an exception holding a sympy object can itself take forever (math-verify warns about
    this), so only string arguments are shown.
    """
    return ", ".join(a[:200] for a in exc.args if isinstance(a, str))
