"""User reward functions for tests/test_rewards.py, imported by dotted path inside the reward workers."""

import contextlib
import os
import signal
import time


def count_sevens(response: str, ground_truth: str) -> float:
    """A well-behaved user reward: how many '7' characters the response has."""
    return float(response.count("7"))


def explodes(response: str, ground_truth: str) -> float:
    """A user reward that raises on some inputs."""
    if "boom" in response:
        raise RuntimeError("boom")
    return 1.0


def returns_nan(response: str, ground_truth: str) -> float:
    return float("nan")


def swallows_timeouts(response: str, ground_truth: str) -> float:
    """A badly written user reward that never returns on 'hang': its bare except eats the worker's
    soft timeout, like C code that never yields to Python, so only a kill stops it."""
    while "hang" in response:
        with contextlib.suppress(BaseException):
            time.sleep(60)
    return 0.5


def slow(response: str, ground_truth: str) -> float:
    """Takes 1 s on 'slow' (long enough to be killed from outside mid-item), then returns 1."""
    if "slow" in response:
        time.sleep(1.0)
    return 1.0


def kills_its_worker(response: str, ground_truth: str) -> float:
    """A poisonous input: the worker dies on it (as on a segfault), every time."""
    if "die" in response:
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def hogs_memory(response: str, ground_truth: str) -> float:
    """Allocates 1 GiB on 'hog': beyond a 512 MiB worker cap, so it must fail, not swap the host."""
    if "hog" in response:
        return float(len(bytearray(1 << 30)))
    return 1.0


def even_answer(response: str, ground_truth: str) -> float:
    """A scripted reward that ignores the response: every group has zero variance."""
    return float(int(ground_truth) % 2 == 0)


def answer_digits(response: str, ground_truth: str) -> float:
    """A scripted reward predictable from the prompt alone (a critic can learn it): answer length / 4."""
    return len(ground_truth) / 4.0


def slow_tail(response: str, ground_truth: str) -> float:
    """count_sevens, with a long tail: on prompts whose answer ends in 7 (one in ten) it takes 0.3 s per response,
    so a generation batch holding one takes several times longer than the others (tests/test_async.py)."""
    if ground_truth.strip().endswith("7"):
        time.sleep(0.3)
    return float(response.count("7"))


def sevens_audited(response: str, ground_truth: str) -> tuple[float, dict[str, float]]:
    """count_sevens, with the reward audit's flag (rlcli.rewards.code.AUDIT) on every response that holds a '7': a
    stand-in for a check that fails, to follow the flag from the worker to metrics.jsonl."""
    return float(response.count("7")), {"audit_flagged": float("7" in response)}
