"""An OpenEnv environment server for the tests, served by openenv-core in its own venv: the model
writes a message each step and earns the share of the letter ``a`` in it; the episode ends
after ``max_steps``. Every step is logged (JSON lines, ``LETTERS_LOG``) for the test to check."""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, ConcurrencyConfig, Observation, State


class LetterAction(Action):
    message: str


class LetterObservation(Observation):
    feedback: str = ""
    steps_left: int = 0


class LettersEnvironment(Environment[LetterAction, LetterObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.max_steps = 2

    def reset(self, seed: int | None = None, episode_id: str | None = None, max_steps: int = 2, **_: Any):
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self.max_steps = max_steps
        return LetterObservation(feedback="Write the letter a.", steps_left=max_steps, done=False, reward=0.0)

    def step(self, action: LetterAction, timeout_s: float | None = None, **_: Any) -> LetterObservation:
        self._state.step_count += 1
        chars = [c for c in action.message if not c.isspace()]
        reward = sum(c == "a" for c in chars) / len(chars) if chars else 0.0
        done = self._state.step_count >= self.max_steps
        with open(os.environ["LETTERS_LOG"], "a") as log:
            log.write(
                json.dumps({"episode": self._state.episode_id, "step": self._state.step_count, "reward": reward}) + "\n"
            )
        feedback = f"That scored {reward:.2f}. Write more of the letter a."
        return LetterObservation(
            feedback=feedback, steps_left=self.max_steps - self._state.step_count, done=done, reward=reward
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    LettersEnvironment, LetterAction, LetterObservation, env_name="letters",
    concurrency_config=ConcurrencyConfig(max_concurrent_envs=64),
)  # fmt: skip

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
