"""Environments: multi-turn tasks that are not tool calls (games, graders, simulated users).

An environment answers each model turn with an observation (appended to the conversation
as a user message), a reward and whether the episode is done. One environment instance
lives for one episode, made by the run's factory, so environments may keep state without
locks. ``reset`` and ``step`` may be sync or async; sync ones run in the environments' own
threads (``scheduler.user_code_threads``), one call of an instance at a time. Either kind
is bounded by ``scheduler.environment_timeout_s``; one that raises or times out drops its
group (reason ``environment``), and the run goes on.

Rewards the environment gives are summed per episode and reach reward functions as the
``env_reward`` keyword (the built-in ``env_reward`` reward function passes it through), so
a run weighs them like any other reward.
"""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_service.errors import EnvironmentFailure, InvalidArgument, echo
from rollout_service.generation.user_code import call_user_function
from rollout_service.types import PromptItem


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn; ``observation`` None with ``done`` False
    is allowed only as the last turn (nothing new for the model to see)."""

    observation: str | None
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    """One episode's environment."""

    def reset(self, prompt: PromptItem) -> Awaitable[None] | None:
        """Start an episode from its prompt and metadata (a secret, a game seed).

        The prompt is the first observation: it is rendered once per group and every
        member's sample carries the same prompt ids, so the environment cannot add its own
        opening message; put what the model must see first into the prompt (dataset)."""
        ...

    def step(self, model_text: str) -> StepResult | Awaitable[StepResult]:
        """React to the model's turn (decoded text, special tokens kept)."""
        ...


EnvironmentFactory = Callable[[], Environment]


async def call_environment(
    what: str, method: Callable[..., Any], *args: Any, executor: Executor | None, timeout_s: float
) -> Any:
    """``method(*args)`` of an environment: a sync one in ``executor``, either bounded by
    ``timeout_s``; any failure is an ``EnvironmentFailure`` naming ``what``."""
    try:
        return await asyncio.wait_for(call_user_function(method, executor, *args), timeout_s)
    except TimeoutError:
        raise EnvironmentFailure(
            f"environment {what} took longer than {timeout_s:g}s (scheduler.environment_timeout_s)"
        ) from None
    except Exception as exc:
        raise EnvironmentFailure(f"environment {what} raised {type(exc).__name__}: {exc}") from exc


class GuessNumber:
    """The model guesses the prompt's ``secret`` integer; each wrong guess is answered
    "Higher." or "Lower."; reward 1 for the right guess, which ends the episode."""

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
    """Named environment factories a run may ask for."""

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
