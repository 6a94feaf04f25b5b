"""The one final-answer extractor: what the reward verifies, what maj@k votes on, what arith checks.

Rules (:func:`extract_final_answer`):
- the final answer is the later of (a) the last box, ``\\boxed{...}`` or ``\\fbox{...}``, and (b) the
  last line starting with ``Answer:`` (DAPO's prompt format; case-insensitive, ``**Answer:**`` and
  ``**Answer**:`` allowed);
- a box is read with balanced braces; an escaped character (``\\{``, ``\\}``, ``\\\\``) is content,
  never structure; spaces may separate the macro from its ``{``; the brace-less ``\\boxed 7`` (MATH's
  solutions use it) is one token, up to whitespace or ``$``;
- a last box whose braces never close (a truncated response) means no answer; there is no fallback
  to an earlier box, because the model did not finish the answer it gave last;
- an ``Answer:`` line loses surrounding ``*``, a final ``.`` and one pair of ``$``/``$$`` delimiters
  that enclose all of it (``**Answer:** $7$.`` -> ``7``; ``$1$ or $2$`` keeps its dollars); a box's
  content is only stripped of whitespace;
- by default (``answer_format="boxed"``) a response without either form, or whose final answer is empty, has
  no answer (None), even if a bare number appears in it: RL must not reward an answer the model did not
  commit to;
- with ``answer_format="last_number"`` (for tasks that ask for the number alone, e.g. "Reply with only the
  number"), a response without either form answers with its last number (``-12``, ``1,234``, ``3.5``; commas
  dropped): "78", "The answer is 78." and "63 + 15 = 78" all answer 78. A box or an ``Answer:`` line still
  wins, and the rules above hold for it;
- braces nested deeper than :data:`MAX_BRACE_DEPTH` anywhere in the text raise
  :class:`MalformedResponse` (the reward counts it in ``reward/errors`` and scores 0);
  :func:`extract_final_answer_or_none` maps that to None, for callers that must not fail (maj@k).

Extraction is linear-time and imports nothing heavy: sandbox reward workers, data adapters and
evaluation all import this module.
"""

from __future__ import annotations

import re

# LaTeX in real answers nests a few levels (\frac{\sqrt{..}}{..}); recursive-descent parsers
# (antlr, sympy) blow their stacks or stall on thousands. 64 is far above any honest answer.
MAX_BRACE_DEPTH = 64

_BOX_MACRO = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # not \boxedcolor
_BARE_TOKEN = re.compile(r"[^\s$]+")  # the content of a brace-less "\boxed 7"
_ANSWER_LINE = re.compile(
    r"^[ \t]*(?:\*\*)?answer(?:\*\*)?[ \t]*:(?:\*\*)?(.*)$", re.IGNORECASE | re.MULTILINE
)
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped char (\{, \}, \\) or a brace
# One $...$ or $$...$$ span that is the whole answer: no unescaped $ inside.
_MATH_SPAN = re.compile(r"\$\$((?:[^$\\]|\\.)+)\$\$|\$((?:[^$\\]|\\.)+)\$", re.DOTALL)


_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.])-?\d+(?:\.\d+)?(?![\w])")
ANSWER_FORMATS = ("boxed", "last_number")
"""How a response states its final answer (reward.answer_format): a box or an Answer: line | also a last number."""


class MalformedResponse(ValueError):
    """Untrusted text that the reward refuses to parse (counted in reward/errors, scores 0)."""


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


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = None
    for found in pattern.finditer(text):  # noqa: B007 -- we want the last match
        pass
    return found


def _box_content(text: str, end: int) -> str | None:
    """Content of the box whose macro name ends at `end`, or None if it has none or never closes."""
    i = end
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 1
        for m in _BRACE_TOKEN.finditer(text, i + 1):
            tok = m.group()
            if tok == "{":
                depth += 1
            elif tok == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : m.start()]
        return None
    if i > end:  # "\boxed 7": one token
        token = _BARE_TOKEN.match(text, i)
        return token.group() if token else None
    return None


def _clean_answer_line(content: str) -> str:
    # Markdown and sentence punctuation around a DAPO answer line: "**Answer:** $5$." -> "5".
    s = content.strip().strip("*").strip().rstrip(".").strip()
    span = _MATH_SPAN.fullmatch(s)
    if span:
        s = span.group(1) if span.group(1) is not None else span.group(2)
    return s


def last_boxed(text: str) -> str | None:
    """Content of the last box in `text` (rules above), stripped; None if there is no box, or the last
    one never closes or is empty. No nesting limit: for trusted text such as dataset solutions."""
    box = _last(_BOX_MACRO, text)
    content = _box_content(text, box.end()) if box else None
    return (content.strip() or None) if content is not None else None


def extract_final_answer(text: str, answer_format: str = "boxed") -> str | None:
    """The final answer's text (module docstring), or None if `text` gives none.

    Raises MalformedResponse when braces are nested deeper than MAX_BRACE_DEPTH.
    """
    _check_nesting(text)
    box = _last(_BOX_MACRO, text)
    line = _last(_ANSWER_LINE, text)
    if box is not None and (line is None or box.start() > line.start()):
        answer = _box_content(text, box.end())
    elif line is not None:
        answer = _clean_answer_line(line.group(1))
    elif answer_format == "last_number" and (number := _last(_NUMBER, text)) is not None:
        return number.group(0).replace(",", "")
    else:
        return None
    if answer is None or not answer.strip():
        return None
    return answer.strip()


def extract_final_answer_or_none(text: str, answer_format: str = "boxed") -> str | None:
    """:func:`extract_final_answer`, with None where it raises MalformedResponse (the reward scores
    such a response 0 with no answer, so it must not vote in maj@k either)."""
    try:
        return extract_final_answer(text, answer_format)
    except MalformedResponse:
        return None
