"""Evaluation metrics over k sampled responses per prompt: pure functions, no model.

Names follow the field's habits (docs/metrics.md, "Evaluation"):
  acc_avg@k  mean accuracy over the k samples of each prompt, averaged over prompts
             (DAPO / VAPO report AIME "avg@32" this way);
  pass@k     unbiased estimate of P(at least one of k samples is correct) from n >= k samples
             (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1);
  maj@k      the majority-voted final answer of the k samples is correct (self-consistency).

Answers come from the reward's own extractor, `rlcli.core.answers.extract_final_answer` (through
`extract_final_answer_or_none`: a response the reward rejects as malformed gives no answer), so
maj@k votes on exactly the answers the reward verified. `normalize_answer` is deliberately simple
(whitespace, `$`, spacing macros, `\\dfrac`, thousands separators); it decides only which answers
vote together, never correctness, which stays with the verifier's per-response verdicts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from rlcli.core.answers import extract_final_answer_or_none

_NUMBER_WITH_COMMAS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_DECIMAL = re.compile(r"-?\d+\.\d+")


def normalize_answer(answer: str) -> str:
    """A light canonical form for voting: `$5$`, ` 5 .` and `5.0` vote together; `1,000` = `1000`;
    `\\dfrac{1}{2}` = `\\frac{1}{2}`; `\\text{...}` is unwrapped; all whitespace is removed."""
    s = answer.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[!,;:]", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).strip("$").rstrip(".")
    if _NUMBER_WITH_COMMAS.fullmatch(s):
        s = s.replace(",", "")
    if _DECIMAL.fullmatch(s):
        s = s.rstrip("0").rstrip(".")
    return s


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i) (Chen et al. 2021), which never forms
    the huge binomials. If fewer than k samples are wrong, every k-subset holds a correct one: 1.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def acc_avg_at_k(correct: Sequence[bool | float]) -> float:
    """Mean accuracy over one prompt's k samples (truthy = verified correct)."""
    if not correct:
        raise ValueError("acc_avg_at_k needs at least one sample")
    return sum(1.0 for x in correct if x) / len(correct)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool | float]) -> float:
    """1.0 if the majority-voted final answer of one prompt's samples is correct, else 0.0.

    `answers[i]` is sample i's extracted final answer (None = no answer: it does not vote) and
    `correct[i]` its verifier verdict. Answers vote after `normalize_answer`. Ties between answers
    with equal votes go to the answer that appears first in sample order (deterministic, and
    independent of how answers sort as strings). The winning answer counts as correct iff more than
    half of the samples that gave it were verified correct (they normally all agree; an exact half
    counts as wrong). No answer at all scores 0.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} verdicts")
    votes: dict[str, list[bool]] = {}  # insertion order = first appearance in sample order
    for answer, ok in zip(answers, correct):
        if answer is None:
            continue
        votes.setdefault(normalize_answer(answer), []).append(bool(ok))
    if not votes:
        return 0.0
    winner = max(votes.values(), key=len)  # max keeps the first of equal lengths
    return 1.0 if 2 * sum(winner) > len(winner) else 0.0


def summarize(
    per_prompt: Sequence[Mapping[str, Sequence]], pass_ks: Sequence[int] | None = None
) -> dict[str, float]:
    """Evaluation metrics over prompts that each have the same number k of samples.

    Each item of `per_prompt` holds, per sample: `correct` (verifier verdicts, required), and
    optionally `answers` (extracted final answers; else extracted from `responses`; None: nothing to vote on, as
    code has, so no maj@k),
    `responses` (texts), `response_length` (tokens) and `truncated` (hit max_new_tokens).

    Returns `eval/acc`, `eval/acc_avg@{k}`, `eval/pass@{j}` for j in `pass_ks` (default: k),
    `eval/maj@{k}` (when answers or responses are given), `eval/response_length` and
    `eval/truncated_frac` (when given), and `eval/prompts`; k is the literal number, e.g. avg@32.
    """
    if not per_prompt:
        raise ValueError("summarize needs at least one prompt")
    k = len(per_prompt[0]["correct"])
    if k == 0 or any(len(p["correct"]) != k for p in per_prompt):
        sizes = sorted({len(p["correct"]) for p in per_prompt})
        raise ValueError(f"every prompt needs the same number k >= 1 of samples, got sizes {sizes}")
    ks = list(pass_ks) if pass_ks else [k]
    if any(not 1 <= j <= k for j in ks):
        raise ValueError(f"pass_ks={ks} must lie in [1, k={k}]")

    accs = [acc_avg_at_k(p["correct"]) for p in per_prompt]
    out: dict[str, float] = {"eval/acc": sum(accs) / len(accs), f"eval/acc_avg@{k}": sum(accs) / len(accs)}
    for j in ks:
        passes = [pass_at_k(k, sum(1 for x in p["correct"] if x), j) for p in per_prompt]
        out[f"eval/pass@{j}"] = sum(passes) / len(passes)
    if all(p.get("answers") is not None or ("answers" not in p and "responses" in p) for p in per_prompt):
        majs = []
        for p in per_prompt:
            if "answers" in p:
                answers = p["answers"]
            else:
                answers = [extract_final_answer_or_none(r) for r in p["responses"]]
            majs.append(maj_at_k(answers, p["correct"]))
        out[f"eval/maj@{k}"] = sum(majs) / len(majs)
    for key, name in (("response_length", "eval/response_length"), ("truncated", "eval/truncated_frac")):
        if all(key in p for p in per_prompt):
            values = [float(v) for p in per_prompt for v in p[key]]
            out[name] = sum(values) / len(values) if values else 0.0
    out["eval/prompts"] = float(len(per_prompt))
    return out
