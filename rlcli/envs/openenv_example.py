"""An OpenEnv environment that ships with rlcli, to try env=openenv on the embedded task (docs/environments.md):

    rlcli train env=openenv env.openenv.app=rlcli.envs.openenv_example:app env.template=plain

The embedded arithmetic task as an OpenEnv server (openenv-core's create_app): the reset shows the data row's
question, the step reads the answer in the reply's last \\boxed{} and pays 1 when it is right; a wrong answer is
told so and may be tried again, up to MAX_TRIES. Imported only where it is named (it needs openenv-core).
"""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from rlcli.core.answers import extract_final_answer_or_none

MAX_TRIES = 2


class Reply(Action):
    message: str = Field(..., description="the policy's reply; its last \\boxed{} is the answer")


class Question(Observation):
    text: str = Field(default="", description="the question, or what was wrong with the reply")


class Arithmetic(Environment[Reply, Question, State]):
    """One question per episode: the row's (reset's prompt and answer), else a random 2-digit addition."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each connection gets an instance of its own; they share nothing

    def __init__(self) -> None:
        super().__init__()
        self._state, self.answer = State(step_count=0), ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, prompt: str | None = None,
              answer: str | None = None, **kw: Any) -> Question:
        self._state = State(episode_id=episode_id, step_count=0)
        if prompt is None or answer is None:
            rng = random.Random(seed)
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            prompt, answer = f"Q: {a}+{b}=?\nA:", str(a + b)
        self.answer = answer
        return Question(text=prompt, reward=0.0, done=False)

    def step(self, action: Reply, timeout_s: float | None = None, **kw: Any) -> Question:
        self._state.step_count += 1
        given = extract_final_answer_or_none(action.message)
        if given == self.answer:
            return Question(text="", reward=1.0, done=True)
        last = self._state.step_count >= MAX_TRIES
        told = "no answer in \\boxed{}" if given is None else f"{given} is wrong"
        return Question(text=f"\n{told}.{'' if last else ' Try again.'}\nA:", reward=0.0, done=last)

    @property
    def state(self) -> State:
        return self._state


app = create_app(Arithmetic, Reply, Question, env_name="rlcli_arithmetic", max_concurrent_envs=256)
"""The ASGI app rlcli serves (env.openenv.app=rlcli.envs.openenv_example:app): up to 256 connections at once."""
