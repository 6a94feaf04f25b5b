"""The embedded synthetic task: column arithmetic with digit-by-digit worked solutions.

    Q: 347+85=?
    A: 7+5=12
    4+8+1=13
    3+0+1=4
    \\boxed{432}

The prompt ends at `A:`; the target response (`solution`) is everything after it. One line per
column from the right, the shorter operand padded with 0, the carry (`+1`) or borrow (`-1`) from
the previous column written only when it is 1, and a borrowing column written with its
borrowed ten (`14-8=6`). Why worked steps: on direct answers the tiny model stays under 12% after
150 s of supervised training, with steps it passes 75% (docs/design.md#tiny-model); and the response
length then grows with the number of digits, which the DAPO/VAPO length techniques need.

`difficulty` is the number of digits of the longer operand. Splits are disjoint by construction: a
problem belongs to `eval` iff a hash of its text falls in the eval bucket (10%), so no eval problem
can ever be drawn for `train`, whatever the seed or size.
"""

from __future__ import annotations

import hashlib
import random
import re

from rlcli.core.answers import extract_final_answer_or_none

SPLITS = ("train", "eval")
OPS = ("+", "-")
EVAL_PERCENT = 10
"""Share of all problems (by hash of the problem text) reserved for the eval split."""


def is_eval_problem(question: str) -> bool:
    """True iff `question` (e.g. '347+85') belongs to the eval split."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < EVAL_PERCENT


def worked_steps(
    a: int, b: int, op: str, forget: frozenset[int] = frozenset(), invent: frozenset[int] = frozenset()
) -> list[str]:
    """Column-by-column steps for `a op b` (units first); for '-' requires a >= b.

    `forget` holds the columns (0 = units) whose incoming carry or borrow the solver forgets: the
    step is then written and computed without it, as a careless human would (see `arith_examples`' carry_slip).
    `invent` holds columns that take a carry or borrow of 1 whatever came in (the opposite slip; a reward model's
    negative examples, rlcli/rm/pairs.py).
    """
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    xs, ys = xs.ljust(width, "0"), ys.ljust(width, "0")
    steps, carry = [], 0
    for col, (x, y) in enumerate(zip(map(int, xs), map(int, ys))):
        carry_in = 1 if col in invent else 0 if col in forget else carry
        if op == "+":
            total = x + y + carry_in
            steps.append(f"{x}+{y}{'+1' if carry_in else ''}={total}")
            carry = total // 10
        else:
            total = x - y - carry_in
            carry = int(total < 0)
            shown_x = x + 10 * carry  # '14-8=6': the borrowed ten is written into the column
            steps.append(f"{shown_x}-{y}{'-1' if carry_in else ''}={total + 10 * carry}")
    return steps


def read_answer(steps: list[str]) -> str:
    """The answer a solver reads off its steps: the last column's result, then the units digit of
    each earlier column's result, most significant first ('7+5=12', '4+8+1=13', '3+0+1=4' -> 432)."""
    results = [step.rsplit("=", 1)[1] for step in steps]
    return str(int(results[-1] + "".join(r[-1] for r in reversed(results[:-1]))))


def carry_columns(a: int, b: int, op: str) -> list[int]:
    """Columns (0 = units) that receive a carry (for '+') or a borrow (for '-') in `a op b`."""
    terms = [len(re.split(r"[+-]", step.split("=")[0])) for step in worked_steps(a, b, op)]
    return [col for col, n in enumerate(terms) if n == 3]  # 'x+y+1' / 'x-y-1': a third term


PROMPT_FORMAT = re.compile(r"Q: \d+[+-]\d+=\?\nA:")
"""The prompts of the embedded task (make_example): the only text the warm-started tiny model has learned to read."""


def reads(prompt: object) -> bool:
    """Whether `prompt` (a data row's, after its template) is in the embedded task's format, PROMPT_FORMAT."""
    return isinstance(prompt, str) and PROMPT_FORMAT.fullmatch(prompt.strip()) is not None

def make_example(
    a: int, b: int, op: str, forget: frozenset[int] = frozenset(), invent: frozenset[int] = frozenset()
) -> dict:
    """One problem as {prompt, answer, solution, difficulty}. The solution ends in \\boxed{} of what
    its steps give: the true answer, unless `forget` or `invent` makes it a flawed solution (worked_steps)."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is not supported; valid: {OPS}")
    if op == "-" and a < b:
        raise ValueError(f"subtraction needs a >= b (answers stay non-negative), got {a}-{b}")
    answer = str(a + b if op == "+" else a - b)
    steps = worked_steps(a, b, op, forget, invent)
    return {
        "prompt": f"Q: {a}{op}{b}=?\nA:",
        "answer": answer,
        "solution": " " + "\n".join(steps) + f"\n\\boxed{{{read_answer(steps)}}}",
        "difficulty": max(len(str(a)), len(str(b))),
    }


def _random_operand(rng: random.Random, digits: int) -> int:
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def arith_examples(
    split: str,
    size: int,
    seed: int = 0,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: str = "+",
    carry_slip: float = 0.0,
) -> list[dict]:
    """`size` problems of `split` ('train' or 'eval'), drawn i.i.d. (repeats possible).

    Difficulty (digits of the longer operand) is uniform in [min_digits, max_digits]; the other
    operand has a uniform 1..difficulty digits. `ops` is a string of operators to draw uniformly
    from, e.g. '+' or '+-'. `carry_slip` is the chance that a worked solution forgets each carry
    or borrow it should take (`worked_steps`), for imperfect supervised demonstrations; the
    problems drawn do not depend on it (slips come from their own random stream). Deterministic
    in all arguments, and a longer list extends a shorter one drawn with the same arguments.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; valid splits: {SPLITS}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not 0.0 <= carry_slip <= 1.0:
        raise ValueError(f"carry_slip={carry_slip} must be a probability in [0, 1]")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops={ops!r}: use a non-empty string of operators from {OPS}")
    want_eval = split == "eval"
    rng = random.Random(f"arith/{split}/{seed}")  # str seeds hash via sha512: stable across runs
    slips = random.Random(f"arith/{split}/{seed}/slips")
    out = []
    while len(out) < size:
        digits = rng.randint(min_digits, max_digits)
        a = _random_operand(rng, digits)
        b = _random_operand(rng, rng.randint(1, digits))
        op = rng.choice(ops)
        if op == "-":
            a, b = max(a, b), min(a, b)
        elif rng.random() < 0.5:
            a, b = b, a  # the longer operand comes first or second equally often
        if is_eval_problem(f"{a}{op}{b}") == want_eval:
            carries = carry_columns(a, b, op) if carry_slip else []  # slips is its own stream: the problems are the same
            forget = frozenset(c for c in carries if slips.random() < carry_slip)
            out.append(make_example(a, b, op, forget))
    return out


def is_correct(response: str, answer: str) -> bool:
    """Exact match of the final answer, read by the reward's extractor (rlcli.core.answers), with the
    ground truth: a cheap stand-in for math-verify on this task."""
    return extract_final_answer_or_none(response) == answer
