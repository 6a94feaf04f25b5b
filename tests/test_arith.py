"""The embedded arithmetic task: deterministic, disjoint splits, correct worked solutions."""

import re
import statistics

import pytest

from rlcli.core.answers import extract_final_answer
from rlcli.data.arith import (
    arith_examples,
    carry_columns,
    is_correct,
    is_eval_problem,
    make_example,
    read_answer,
    worked_steps,
)

_QUESTION = re.compile(r"^Q: (\d+)([+-])(\d+)=\?\nA:$")


def _operands(prompt: str) -> tuple[int, str, int]:
    match = _QUESTION.match(prompt)
    assert match, prompt
    return int(match[1]), match[2], int(match[3])


@pytest.mark.parametrize("split", ["train", "eval"])
def test_deterministic_and_prefix_stable(split):
    a = arith_examples(split, 300, seed=3, ops="+-")
    assert a == arith_examples(split, 300, seed=3, ops="+-")
    assert arith_examples(split, 100, seed=3, ops="+-") == a[:100]
    assert a != arith_examples(split, 300, seed=4, ops="+-")


def test_splits_are_disjoint():
    train = {ex["prompt"] for seed in range(3) for ex in arith_examples("train", 3000, seed, ops="+-")}
    evals = {ex["prompt"] for seed in range(3) for ex in arith_examples("eval", 1000, seed, ops="+-")}
    assert not train & evals
    assert len(evals) > 500  # the eval pool is not degenerate
    for prompt in evals:
        a, op, b = _operands(prompt)
        assert is_eval_problem(f"{a}{op}{b}")


@pytest.mark.parametrize("ops", ["+", "-", "+-"])
def test_solutions_are_correct_and_boxed(ops):
    for ex in arith_examples("train", 500, seed=1, min_digits=1, max_digits=4, ops=ops):
        a, op, b = _operands(ex["prompt"])
        expected = a + b if op == "+" else a - b
        assert ex["answer"] == str(expected)
        assert ex["solution"].endswith(f"\\boxed{{{ex['answer']}}}")
        assert extract_final_answer(ex["solution"]) == ex["answer"]
        assert is_correct(ex["solution"], ex["answer"])
        assert ex["difficulty"] == max(len(str(a)), len(str(b)))
        assert 1 <= ex["difficulty"] <= 4


def test_worked_steps_examples():
    assert make_example(347, 85, "+")["solution"] == " 7+5=12\n4+8+1=13\n3+0+1=4\n\\boxed{432}"
    assert make_example(95, 17, "+")["solution"] == " 5+7=12\n9+1+1=11\n\\boxed{112}"
    assert make_example(347, 85, "-")["solution"] == " 7-5=2\n14-8=6\n3-0-1=2\n\\boxed{262}"
    assert make_example(100, 99, "-")["answer"] == "1"
    assert make_example(347, 85, "+")["prompt"] == "Q: 347+85=?\nA:"
    with pytest.raises(ValueError, match="a >= b"):
        make_example(3, 5, "-")


def test_difficulty_sets_length():
    examples = arith_examples("train", 2000, seed=0, min_digits=1, max_digits=3)
    mean_len = {
        d: statistics.mean(len(ex["solution"]) for ex in examples if ex["difficulty"] == d)
        for d in (1, 2, 3)
    }
    assert mean_len[1] < mean_len[2] < mean_len[3]
    assert max(len(ex["solution"]) for ex in examples) <= 60  # cheap CPU rollouts


def test_digit_range_and_bad_arguments():
    examples = arith_examples("eval", 200, seed=0, min_digits=2, max_digits=2)
    assert {ex["difficulty"] for ex in examples} == {2}
    with pytest.raises(ValueError, match="valid splits"):
        arith_examples("test", 1)
    with pytest.raises(ValueError, match="min_digits"):
        arith_examples("train", 1, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="ops"):
        arith_examples("train", 1, ops="*")


def test_extract_final_answer_and_is_correct():
    assert extract_final_answer("x \\boxed{1} y \\boxed{ 42 }") == "42"
    assert extract_final_answer("no box") is None
    assert not is_correct("\\boxed{43}", "42")


def test_forgotten_carries_by_hand():
    # 347+85 forgetting the tens' carry: 7+5=12, 4+8=12 (no +1), then 3+0+1=4 -> 422.
    flawed = make_example(347, 85, "+", frozenset({1}))
    assert flawed["solution"] == " 7+5=12\n4+8=12\n3+0+1=4\n\\boxed{422}"
    assert flawed["answer"] == "432"  # the ground truth never changes
    assert make_example(347, 85, "+", frozenset({1, 2}))["solution"].endswith("3+0=3\n\\boxed{322}")
    # 347-85 forgetting the hundreds' borrow: 3-0=3 -> 362.
    assert make_example(347, 85, "-", frozenset({2}))["solution"] == " 7-5=2\n14-8=6\n3-0=3\n\\boxed{362}"
    assert carry_columns(347, 85, "+") == [1, 2] and carry_columns(347, 85, "-") == [2]
    assert carry_columns(123, 456, "+") == []


def test_read_answer_is_the_true_answer_without_slips():
    for ex in arith_examples("train", 1000, seed=2, min_digits=1, max_digits=4, ops="+-"):
        a, op, b = _operands(ex["prompt"])
        assert read_answer(worked_steps(a, b, op)) == ex["answer"]


@pytest.mark.parametrize("slip", [0.3, 1.0])
def test_carry_slip_makes_consistent_flawed_demonstrations(slip):
    clean = arith_examples("train", 3000, seed=0, ops="+-")
    flawed = arith_examples("train", 3000, seed=0, ops="+-", carry_slip=slip)
    assert [ex["prompt"] for ex in flawed] == [ex["prompt"] for ex in clean]  # same problems
    assert [ex["answer"] for ex in flawed] == [ex["answer"] for ex in clean]  # same ground truth
    carried = wrong = 0
    for ex in flawed:
        steps = ex["solution"].strip().split("\n")[:-1]
        assert extract_final_answer(ex["solution"]) == read_answer(steps)  # the box follows the steps
        a, op, b = _operands(ex["prompt"])
        if carry_columns(a, b, op):
            carried += 1
            wrong += extract_final_answer(ex["solution"]) != ex["answer"]
        else:
            assert ex["solution"] == make_example(a, b, op)["solution"]
    # A slip on the first carry is an independent draw with probability `slip`, and a forgotten
    # carry always changes the answer (it changes the column digit), so the flawed share of
    # problems with carries is at least `slip`; with slip 1 every such demonstration is wrong.
    if slip == 1.0:
        assert wrong == carried
    else:
        assert slip - 0.05 < wrong / carried < 1 - (1 - slip) ** 3 + 0.05
    with pytest.raises(ValueError, match="probability"):
        arith_examples("train", 1, carry_slip=1.5)
