"""Tools and an environment for tests/test_envs.py, importable by the tool workers (tests/ is on their path)."""

import time

from rlcli.envs import StepResult, tool


@tool
def boom(x: str) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("tool failed on purpose")


@tool
def sleepy(x: str) -> str:
    """Never answers in time.

    Args:
        x: ignored
    """
    time.sleep(60)
    return "late"


class Countdown:
    """Answers every turn with an observation until its third turn, then ends; a step reward of 0.25 per turn."""

    def __init__(self, cfg, toolbox):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        return StepResult([{"role": "tool", "content": f"t{self.turns}"}], reward=0.25, done=self.turns == 3)
