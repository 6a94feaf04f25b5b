"""Evaluation metrics against hand-computed values: pass@k, avg@k, maj@k, answer extraction."""

import math
from types import SimpleNamespace

import pytest

import rlcli.core.answers
import rlcli.loop.eval_metrics
import rlcli.rewards.functions
from rlcli.core.answers import (
    MalformedResponse,
    extract_final_answer,
    extract_final_answer_or_none,
    last_boxed,
)
from rlcli.loop.eval_metrics import (
    acc_avg_at_k,
    maj_at_k,
    normalize_answer,
    pass_at_k,
    summarize,
)


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 2, 1, 0.4),  # pass@1 = c/n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2) = 0.7
        (5, 0, 3, 0.0),  # nothing correct
        (5, 4, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (5, 5, 5, 1.0),
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (32, 1, 1, 1 / 32),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomials_and_stays_finite_for_large_n():
    for n, c, k in [(20, 7, 5), (64, 10, 16), (100, 1, 50)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-10)
    # C(2000, 1000) overflows a float; the product form does not.
    value = pass_at_k(2000, 3, 1000)
    assert 0.0 < value < 1.0 and value == pytest.approx(1 - (1000 * 999 * 998) / (2000 * 1999 * 1998))


@pytest.mark.parametrize("n,c,k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_acc_avg_at_k_is_the_mean_over_samples():
    assert acc_avg_at_k([True, False, True, True]) == 0.75
    assert acc_avg_at_k([1.0, 0.0]) == 0.5
    with pytest.raises(ValueError):
        acc_avg_at_k([])


def test_maj_at_k_majority_and_verdicts():
    assert maj_at_k(["5", "5", "6"], [True, True, False]) == 1.0
    assert maj_at_k(["6", "5", "6"], [False, True, False]) == 0.0
    # None does not vote: one "7" beats nothing.
    assert maj_at_k([None, None, "7"], [False, False, True]) == 1.0
    assert maj_at_k([None, None], [False, False]) == 0.0


def test_maj_at_k_ties_go_to_the_first_answer_in_sample_order():
    assert maj_at_k(["4", "9", "9", "4"], [True, False, False, True]) == 1.0  # "4" appears first
    assert maj_at_k(["9", "4", "4", "9"], [False, True, True, False]) == 0.0  # "9" appears first


def test_maj_at_k_votes_on_normalized_answers():
    # "$5$", "5.0" and " 5 " are one answer with three votes; "6" has two.
    answers = ["6", "$5$", "6", "5.0", " 5 "]
    assert maj_at_k(answers, [False, True, False, True, True]) == 1.0


def test_maj_at_k_split_verdicts_within_the_winner_need_a_strict_majority():
    assert maj_at_k(["3", "3"], [True, False]) == 0.0
    assert maj_at_k(["3", "3", "3"], [True, True, False]) == 1.0


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so $x = \boxed{\frac{1}{\sqrt{2}}}$.", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{1} then \boxed{ {2}+{3} }", "{2}+{3}"),  # last box, nested braces, stripped
        (r"the set is \boxed{\{-2, 2\}}", r"\{-2, 2\}"),  # escaped braces are content
        (r"\boxed{3} and finally \boxed{\frac{1}{2", None),  # the last box never closes
        (r"it is \boxed 7 indeed", "7"),
        (r"\fbox{12}", "12"),
        ("steps...\nAnswer: 42", "42"),
        ("Answer: 1\nmore work\nanswer:  $-3$ \n", "-3"),  # last Answer: line, $ stripped
        (r"\boxed{5}" + "\nAnswer: 6", "6"),  # the later marker wins
        ("Answer: 6\n" + r"on reflection \boxed{5}", "5"),
        (r"Answer: \boxed{8}", "8"),
        ("no final answer here", None),
        ("Answer:   \n", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_last_boxed_ignores_other_macros():
    assert last_boxed(r"\boxedcolor{1} \boxed{2}") == "2"
    assert last_boxed("nothing") is None


# Texts on which the three former extractors (reward, maj@k, arith) disagreed or could disagree.
TRICKY = [
    (r"so $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),  # nested braces (arith's regex saw none)
    (r"\boxed{3} then \boxed{4}", "4"),  # two boxes: the last
    ("\\boxed{5}\nAnswer: 6", "6"),  # an Answer: line after a box wins
    ("Answer: 6\nwait, \\boxed{5}", "5"),  # a box after an Answer: line wins
    (r"\boxed{3} and finally \boxed{\frac{1}{2", None),  # unclosed last box: no answer, no fallback
    (r"\boxed{1} \boxed{12", None),  # arith used to fall back to the earlier box
    (r"\fbox{12}", "12"),  # the reward used to ignore \fbox
    (r"it is \boxed 7 indeed", "7"),  # brace-less box (MATH solutions)
    (r"\boxed {3}", "3"),
    ("**Answer:** $-3$.", "-3"),  # maj@k used to read "** $-3$."
    ("Answer: $1$ or $2$", "$1$ or $2$"),  # $ kept unless one pair encloses everything
    ("The final answer: 5", None),  # maj@k used to read "5"; only a line starting with Answer: counts
    (r"Answer: \boxed{8}", "8"),
    (r"Answer: \boxed{8", None),
    (r"\boxed{}", None),  # maj@k used to vote for ""
    (r"\boxed{\{-2, 2\}}", r"\{-2, 2\}"),  # escaped braces are content
    (r"\boxed{x\\}", r"x\\"),  # an escaped backslash does not escape the closing brace
    (r"\boxedcolor{1} \boxed{2}", "2"),
    ("just 42", None),  # no answer
    ("", None),
]


@pytest.mark.parametrize("text,expected", TRICKY)
def test_maj_at_k_extracts_the_answer_the_reward_verifies(text, expected):
    # One extractor: the reward's (run in the sandbox workers) is the one maj@k votes with.
    assert rlcli.rewards.functions.extract_final_answer is rlcli.core.answers.extract_final_answer
    assert rlcli.loop.eval_metrics.extract_final_answer_or_none is rlcli.core.answers.extract_final_answer_or_none
    assert rlcli.rewards.functions.extract_final_answer(text) == expected
    assert extract_final_answer_or_none(text) == expected
    # summarize() reads answers from responses itself: a correct sample wins maj@1 iff it gave one.
    out = summarize([{"correct": [True], "responses": [text]}])
    assert out["eval/maj@1"] == (0.0 if expected is None else 1.0)
    # The reward's format part agrees on whether there is an answer at all.
    assert rlcli.rewards.functions.format_reward(text, "1") == (0.0 if expected is None else 1.0)


def test_malformed_response_scores_zero_and_does_not_vote():
    deep = "\\boxed{" * 100 + "1" + "}" * 100
    with pytest.raises(MalformedResponse, match="nested deeper"):
        rlcli.rewards.functions.extract_final_answer(deep)
    assert extract_final_answer_or_none(deep) is None
    # Were the two malformed (but verified-correct, say) samples voting, their "1" would win.
    per_prompt = [{"correct": [True, True, False], "responses": [deep, deep, r"\boxed{2}"]}]
    assert summarize(per_prompt)["eval/maj@3"] == 0.0  # "2" wins alone


def test_eval_per_prompt_answers_use_the_reward_extractor(monkeypatch):
    import torch

    import rlcli.loop.eval

    texts = [t for t, _ in TRICKY] + ["\\boxed{" * 100 + "1" + "}" * 100]
    texts += ["pad"] * (-len(texts) % 4)  # k = 4 responses per prompt

    def fake_generate(prompts, answers, k, sampling):
        rows = texts[: len(prompts) * k]
        return SimpleNamespace(
            texts=rows,
            answers=[a for a in answers for _ in range(k)],
            lengths=torch.ones(len(rows), dtype=torch.long),
            truncated=torch.zeros(len(rows), dtype=torch.bool),
            extras={},
        )

    examples = [{"prompt": f"q{i}", "answer": "1"} for i in range(len(texts) // 4)]
    eval_cfg = SimpleNamespace(k=4, batch_prompts=len(examples), max_new_tokens=8, temperature=1.0, top_p=1.0)
    rollout_cfg = SimpleNamespace(max_new_tokens=8, gen_batch_size=8, agent=None)

    def rewards(responses, ground_truths):
        return SimpleNamespace(acc=torch.zeros(len(responses)))

    rewards.cfg = SimpleNamespace(answer_format="boxed")  # what a RewardManager carries
    rewards.functions = {"math_verify": 1.0}

    engine = SimpleNamespace(generate=fake_generate)
    per_prompt = rlcli.loop.eval.sample_and_verify(engine, examples, eval_cfg, rollout_cfg, rewards)
    got = [a for p in per_prompt for a in p["answers"]]
    assert got == [extract_final_answer_or_none(t) for t in texts]
    assert got[: len(TRICKY)] == [rlcli.rewards.functions.extract_final_answer(t) for t, _ in TRICKY]
    assert got[len(TRICKY)] is None  # the reward rejects it (MalformedResponse): no vote


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("$5$", "5"),
        ("5.0", "5"),
        ("2.50", "2.5"),
        ("1,000", "1000"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"10\text{ cm}", "10cm"),
        ("  7. ", "7"),
        ("2, 3", "2,3"),  # a list, not a thousands separator
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_summarize_hand_computed():
    per_prompt = [
        {
            "correct": [True, True, False, False],
            "responses": [r"\boxed{5}", "Answer: 5", r"\boxed{6}", "no idea"],
            "response_length": [10, 20, 30, 40],
            "truncated": [False, False, False, True],
        },
        {
            "correct": [False, False, False, False],
            "answers": ["1", "2", "2", None],
            "response_length": [5, 5, 5, 5],
            "truncated": [True, True, False, False],
        },
    ]
    out = summarize(per_prompt, pass_ks=[1, 2, 4])
    assert out["eval/acc_avg@4"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["eval/acc"] == out["eval/acc_avg@4"]
    assert out["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0.0) / 2)  # 1 - C(2,2)/C(4,2)
    assert out["eval/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["eval/maj@4"] == pytest.approx((1.0 + 0.0) / 2)  # "5" wins prompt 1, "2" (wrong) prompt 2
    assert out["eval/response_length"] == pytest.approx(120 / 8)
    assert out["eval/truncated_frac"] == pytest.approx(3 / 8)
    assert out["eval/prompts"] == 2


def test_summarize_defaults_to_pass_at_k_and_rejects_ragged_groups():
    out = summarize([{"correct": [True, False]}, {"correct": [False, False]}])
    assert set(out) == {"eval/acc", "eval/acc_avg@2", "eval/pass@2", "eval/prompts"}
    assert out["eval/pass@2"] == 0.5
    with pytest.raises(ValueError, match="same number"):
        summarize([{"correct": [True, False]}, {"correct": [True]}])
    with pytest.raises(ValueError, match="pass_ks"):
        summarize([{"correct": [True, False]}], pass_ks=[3])


def test_eval_size_is_a_seeded_random_subset_not_the_first_rows():
    """eval.size=N once took the first N rows, the easy ones in files sorted by difficulty (data=chat_add: 75 % on
    the first 16 against 29 % on all). It draws N at random with eval.subset_seed, the same for every training seed."""
    from rlcli.loop.eval import eval_subset

    rows = [{"prompt": str(i), "answer": str(i)} for i in range(100)]
    picked, which = eval_subset(rows, SimpleNamespace(size=16, subset_seed=0))
    assert len(picked) == 16 and picked != rows[:16] and which == "16 of 100 eval prompts (random subset, eval.subset_seed=0)"
    assert [int(r["prompt"]) for r in picked] == sorted(int(r["prompt"]) for r in picked)  # kept in split order
    assert max(int(r["prompt"]) for r in picked) >= 50  # drawn from the whole split
    assert eval_subset(rows, SimpleNamespace(size=16, subset_seed=0))[0] == picked  # reproducible
    assert eval_subset(rows, SimpleNamespace(size=16, subset_seed=1))[0] != picked
    assert eval_subset(rows, SimpleNamespace(size=None, subset_seed=0)) == (rows, "all 100 eval prompts")
    assert eval_subset(rows, SimpleNamespace(size=500, subset_seed=0))[0] == rows


def test_no_majority_vote_where_answers_are_none():
    """Code tasks have no final answer to vote on: rlcli.loop.eval passes answers=None and maj@k is not reported."""
    from rlcli.loop.eval_metrics import summarize

    rows = [{"correct": [True, False], "answers": None, "responses": ["a", "b"]}]
    out = summarize(rows)
    assert "eval/maj@2" not in out and out["eval/pass@2"] == 1.0 and out["eval/acc"] == 0.5
    assert "eval/maj@2" in summarize([{"correct": [True, False], "responses": ["\\boxed{1}", "\\boxed{2}"]}])
