"""An OpenEnv server for tests/test_openenv.py (`openenv_fixtures:app`, served by rlcli on 127.0.0.1).

Steps: each pays 0.25 and answers `t<k>` on its own line, until the third, which ends the episode. The reset shows
the row's prompt as it is (rlcli passes it as a keyword argument). At the second step a message names a fault instead:
`raise` makes the step raise, `hang` makes it sleep past any test's timeout, `die` ends the server's process.
"""

import os
import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class Say(Action):
    message: str = Field(..., description="what the policy wrote")


class Heard(Observation):
    text: str = Field(default="", description="what the policy reads")


class Countdown(Environment[Say, Heard, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, prompt: str = "", **kw: Any) -> Heard:
        self._state = State(step_count=0)
        return Heard(text=prompt, reward=0.0, done=False)

    def step(self, action: Say, timeout_s: float | None = None, **kw: Any) -> Heard:
        self._state.step_count += 1
        k = self._state.step_count
        if k == 2 and action.message == "raise":
            raise RuntimeError("the environment failed on purpose")
        if k == 2 and action.message == "hang":
            time.sleep(120)
        if k == 2 and action.message == "die":
            os._exit(3)
        return Heard(text=f"\nt{k}\n", reward=0.25, done=k == 3)

    @property
    def state(self) -> State:
        return self._state


app = create_app(Countdown, Say, Heard, env_name="countdown", max_concurrent_envs=64)
mortal = app  # the same app under a second name: a second server, for the test that kills one
narrow = create_app(Countdown, Say, Heard, env_name="countdown")  # openenv-core's default: one connection at once
