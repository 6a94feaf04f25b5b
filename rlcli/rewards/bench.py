"""Reward throughput and adversarial-input timings (the numbers quoted in docs/rewards.md).

    python -m rlcli.rewards.bench --n 256 --workers 2 --timeout 2

Normal responses are ~1.5k-character worked solutions ending in a boxed or an ``Answer:`` line, half
right, half wrong, with fractions, decimals and thousands separators. Adversarial inputs are scored
one per call after the pool is ready, so each time is the cost of that input alone.
"""

from __future__ import annotations

import argparse
import random
import time

import torch  # noqa: F401 -- imported first, as in the trainer, so it is not timed below

from rlcli.rewards import RewardConfig, RewardManager

ADVERSARIAL = {
    "9^9^9^9 boxed": ("\\boxed{9^9^9^9}", "2"),
    "9^{9^{9^{9}}} boxed": ("\\boxed{9^{9^{9^{9}}}}", "2"),
    "(10^{10})! boxed": ("\\boxed{(10^{10})!}", "2"),
    "\\boxed{ nested 10k deep": ("\\boxed{" * 10_000 + "1" + "}" * 10_000, "1"),
    "200k-char response": ("\\boxed{" + "1+" * 100_000 + "1}", "2"),
    "60k-char boxed sum": ("\\boxed{" + "1+" * 30_000 + "1}", "2"),
    "NUL bytes": ("Answer: 5\x00\x00", "5"),
    "lone surrogate": ("\\boxed{5}\udc80", "5"),
    "invalid UTF-8 bytes": (b"\\boxed{5}\xff\xfe", "5"),
}


def normal_batch(n: int, seed: int = 0) -> tuple[list[str], list[str], list[float]]:
    """Responses, ground truths and the expected acc of each."""
    rng = random.Random(seed)
    responses, truths, expected = [], [], []
    for i in range(n):
        a, b = rng.randint(100, 99_999), rng.randint(2, 9)
        steps = "\n".join(f"Step {k}: we add {rng.randint(1, 999)} and carry {k % 2}." for k in range(40))
        kind = i % 4
        if kind == 0:
            truth, answer = f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}"
        elif kind == 1:
            truth, answer = f"{a / 4}", f"\\frac{{{a}}}{{4}}"
        elif kind == 2:
            truth, answer = f"{a * 1000}", f"{a * 1000:,}"
        else:
            truth, answer = f"{a}", f"{a}"
        right = rng.random() < 0.5
        if not right:
            answer = f"{a + 1}"
        expected.append(float(right))
        end = f"So the result is \\boxed{{{answer}}}." if i % 2 else f"Answer: {answer}"
        responses.append(f"{steps}\n{end}")
        truths.append(truth)
    return responses, truths, expected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    cfg = RewardConfig(
        weights={"math_verify": 1.0, "format": 0.1}, num_workers=args.workers, timeout_s=args.timeout
    )
    t0 = time.perf_counter()
    with RewardManager(cfg) as manager:
        manager.pool.wait_ready()
        print(f"start-up: {time.perf_counter() - t0:.2f} s for {args.workers} workers")
        responses, truths, expected = normal_batch(args.n)
        for rnd in range(2):  # round 0 fills the workers' parse caches of gold answers
            t = time.perf_counter()
            out = manager(responses, truths)
            dt = time.perf_counter() - t
            print(
                f"round {rnd}: {args.n} normal responses in {dt:.2f} s = {args.n / dt:.0f} responses/s, "
                f"acc {out.acc.mean().item():.3f} (expected {sum(expected) / len(expected):.3f}, "
                f"{sum(float(a) == e for a, e in zip(out.acc.tolist(), expected))} agree), timeouts+errors "
                f"{out.metrics['reward/timeouts'] + out.metrics['reward/errors']:.0f}"
            )
        for name, (response, truth) in ADVERSARIAL.items():
            manager.pool.wait_ready()
            t = time.perf_counter()
            out = manager([response], [truth])
            m = out.metrics
            print(
                f"{name:28s} {time.perf_counter() - t:5.2f} s  score {out.score[0].item():.1f}  "
                f"timeouts {m['reward/timeouts']:.0f} errors {m['reward/errors']:.0f} "
                f"restarts {m['reward/restarts']:.0f}"
            )


if __name__ == "__main__":
    main()
