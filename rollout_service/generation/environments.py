"""Environments: multi-turn tasks that are not tool calls (games, graders, simulated users).

An environment answers each model turn with an observation (a user message), a reward and
whether the episode is done. One instance lives for one episode, so it may keep state
without locks. A failing or slow ``reset``/``step`` drops its group, and the run goes on.
Step rewards are summed per episode and reach reward functions as ``env_reward``. An optional
``close()`` runs when the episode ends, however it ends.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from rollout_service.errors import InvalidArgument, echo
from rollout_service.types import PromptItem


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn; ``observation`` None ends the episode."""

    observation: str | None
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    def reset(self, prompt: PromptItem) -> Awaitable[None] | None:
        """Start an episode from its prompt and metadata; the prompt (shared by the group) is
        the first observation, so put what the model must see first into it."""
        ...

    def step(self, model_text: str) -> StepResult | Awaitable[StepResult]:
        """React to the model's turn (decoded text, special tokens kept)."""
        ...


async def close_environment(environment: Environment) -> None:
    """An environment's optional ``close()``, at the end of its episode however it ended."""
    close = getattr(environment, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


EnvironmentFactory = Callable[[], Environment]


class GuessNumber:
    """The model guesses the prompt's ``secret``, told "Higher." or "Lower."; reward 1 when right."""

    def __init__(self) -> None:
        self.secret = 0

    def reset(self, prompt: PromptItem) -> None:
        try:
            self.secret = int(prompt.metadata["secret"])
        except (KeyError, ValueError):
            raise ValueError("guess_number needs prompts whose metadata has an integer 'secret'") from None

    def step(self, model_text: str) -> StepResult:
        match = re.search(r"-?\d+", model_text)
        if match is None:
            return StepResult("Answer with a number.")
        guess = int(match.group())
        if guess == self.secret:
            return StepResult("Correct.", reward=1.0, done=True)
        return StepResult("Higher." if guess < self.secret else "Lower.")


BUILTIN_ENVIRONMENTS: dict[str, EnvironmentFactory] = {"guess_number": GuessNumber}


class EnvironmentRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, EnvironmentFactory] = dict(BUILTIN_ENVIRONMENTS)

    def register(self, name: str, factory: EnvironmentFactory) -> None:
        if not callable(factory):
            raise TypeError(f"environment {name!r} is not callable (pass a class or a factory)")
        self._factories[name] = factory

    def load_module(self, module_path: str) -> None:
        """Add a user module's ``ENVIRONMENTS = {name: factory}``."""
        factories = getattr(importlib.import_module(module_path), "ENVIRONMENTS", None)
        if not isinstance(factories, dict):
            raise ValueError(f"module {module_path} has no ENVIRONMENTS dict of name -> factory")
        for name, factory in factories.items():
            self.register(name, factory)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str) -> EnvironmentFactory:
        try:
            return self._factories[name]
        except KeyError:
            raise InvalidArgument(f"unknown environment {echo(name)}; registered: {', '.join(self.names())}") from None
