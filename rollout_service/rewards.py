"""Reward functions with TRL's signature and their registry.

A reward function is ``f(prompts, completions, completion_ids, **kwargs) -> list[float | None]``,
sync or async. kwargs carry each prompt's metadata as lists (one entry per completion), as
TRL passes dataset columns. Sync functions run in a worker thread so a slow one does not
stall generation; every call has a timeout. A function that raises, times out or returns
the wrong number of values fails its group with ``RewardError``; the service goes on.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_service.errors import InvalidArgument, RewardError

RewardFunction = Callable[..., list[float | None] | Awaitable[list[float | None]]]


def char_fraction(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any):
    """Fraction of the completion's non-space characters equal to the prompt's ``target_char``."""
    targets = kwargs.get("target_char") or ["a"] * len(completions)
    out: list[float | None] = []
    for text, target in zip(completions, targets, strict=True):
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c == target for c in chars) / len(chars) if chars else 0.0)
    return out


def exact_answer(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any):
    """1.0 when the first number in the completion equals the prompt's ``answer``, else 0.0;
    None for prompts without an answer. In a multi-turn episode the completion is the model's
    last message (earlier turns hold tool calls and their arguments)."""
    answers = kwargs.get("answer") or [None] * len(completions)
    finals = [_last_assistant(m) for m in kwargs.get("completion_messages") or [[]] * len(completions)]
    out: list[float | None] = []
    for text, final, answer in zip(completions, finals, answers, strict=True):
        text = text if final is None else final
        if answer is None:
            out.append(None)
            continue
        match = re.search(r"-?\d+", text)
        out.append(1.0 if match and match.group() == str(answer) else 0.0)
    return out


def _last_assistant(messages: list[dict[str, str]]) -> str | None:
    contents = [m.get("content", "") for m in messages if m.get("role") == "assistant"]
    return contents[-1] if contents else None


def completion_length(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs):
    """Number of completion tokens (a diagnostic reward; weight it negatively to prefer short)."""
    return [float(len(ids)) for ids in completion_ids]


def env_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any):
    """The environment's summed step rewards of each episode (None for runs without an environment)."""
    return list(kwargs.get("env_reward") or [None] * len(completions))


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "char_fraction": char_fraction,
    "exact_answer": exact_answer,
    "completion_length": completion_length,
    "env_reward": env_reward,
}


class RewardRegistry:
    """Named reward functions a run may ask for."""

    def __init__(self) -> None:
        self._functions: dict[str, RewardFunction] = dict(BUILTIN_REWARDS)

    def register(self, name: str, function: RewardFunction) -> None:
        if not callable(function):
            raise TypeError(f"reward {name!r} is not callable")
        self._functions[name] = function

    def load_module(self, module_path: str) -> None:
        """Add the ``REWARD_FUNCTIONS`` dict of a user module (``reward_modules`` setting)."""
        module = importlib.import_module(module_path)
        functions = getattr(module, "REWARD_FUNCTIONS", None)
        if not isinstance(functions, dict):
            raise ValueError(f"module {module_path} has no REWARD_FUNCTIONS dict of name -> function")
        for name, function in functions.items():
            self.register(name, function)

    def names(self) -> list[str]:
        return sorted(self._functions)

    def get(self, name: str) -> RewardFunction:
        try:
            return self._functions[name]
        except KeyError:
            raise InvalidArgument(f"unknown reward function {name!r}; registered: {', '.join(self.names())}") from None


async def call_reward(
    name: str,
    function: RewardFunction,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    kwargs: dict[str, list[Any]],
    timeout_s: float,
) -> list[float]:
    """One reward function over one group; None becomes NaN."""
    try:
        if inspect.iscoroutinefunction(function):
            pending = function(prompts, completions, completion_ids, **kwargs)
        else:
            pending = asyncio.to_thread(function, prompts, completions, completion_ids, **kwargs)
        values = await asyncio.wait_for(pending, timeout_s)
    except TimeoutError:
        raise RewardError(f"reward {name!r} took longer than {timeout_s:.0f}s") from None
    except Exception as exc:
        raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(values, list | tuple) or len(values) != len(completions):
        raise RewardError(f"reward {name!r} returned {values!r:.80}; expected a list of {len(completions)}")
    try:
        return [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward {name!r} returned a non-number: {exc}") from None
