"""Reward functions with TRL's signature, their registry, and the inputs they are called with.

A reward function is called exactly as TRL's ``GRPOTrainer`` calls it, with the same inputs
(README, "Reward functions"), so a TRL reward function scores here as it does there. One that
raises, times out or returns the wrong number of values fails its group with ``RewardError``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from rollout_common import reasoning_gym_tasks
from rollout_service.errors import InvalidArgument, RewardError, echo
from rollout_service.types import EpisodeResult, PromptItem

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., list[float | None] | Awaitable[list[float | None]]]

Message = dict[str, Any]
Completion = str | list[Message]

POSITIONAL = ("prompts", "completions", "completion_ids")
"""The three inputs every reward function gets; never taken from prompt metadata."""


@dataclass(frozen=True)
class RewardInputs:
    prompts: list[str | list[Message]]
    completions: list[Completion]
    completion_ids: list[list[int]]
    kwargs: dict[str, Any]


def _log_extra(column: str, values: list[Any]) -> None:
    logger.debug("reward log_extra %s: %.200r", column, values)


def _log_metric(name: str, value: float) -> None:
    logger.debug("reward log_metric %s: %r", name, value)


def reward_inputs(prompt: PromptItem, episodes: Sequence[EpisodeResult], multi_turn: bool = False) -> RewardInputs:
    """TRL's reward inputs for one group; ``multi_turn`` makes every completion a message list."""
    size = len(episodes)
    conversational = bool(prompt.messages)
    prompts: list[str | list[Message]] = [
        [dict(m) for m in prompt.messages] if conversational else prompt.text for _ in episodes
    ]
    completions: list[Completion] = [
        [dict(m) for m in e.reward_messages] if conversational or multi_turn else e.reward_text for e in episodes
    ]
    kwargs: dict[str, Any] = {key: [value] * size for key, value in prompt.metadata.items() if key not in POSITIONAL}
    kwargs.update(
        trainer_state=None,
        log_extra=_log_extra,
        log_metric=_log_metric,
        messages=[[*(dict(m) for m in prompt.messages), *(dict(m) for m in e.reward_messages)] for e in episodes],
        completion_messages=[[dict(m) for m in e.reward_messages] for e in episodes],
        env_reward=[e.env_reward for e in episodes],
        num_turns=[e.num_turns for e in episodes],
        num_tool_calls=[e.num_tool_calls for e in episodes],
        num_tool_failures=[e.num_tool_failures for e in episodes],
    )
    return RewardInputs(prompts, completions, [list(e.completion_ids) for e in episodes], kwargs)


def _text(content: Any) -> str:
    """A message's content as text (multimodal content blocks: their text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def assistant_texts(completion: Completion) -> list[str]:
    """The model's texts in a completion: the text itself, or each assistant message's content."""
    if isinstance(completion, str):
        return [completion]
    return [_text(m.get("content")) for m in completion if m.get("role") == "assistant"]


def char_fraction(prompts: list[Any], completions: list[Completion], completion_ids: list[list[int]], **kwargs: Any):
    """Fraction of the non-space characters the model wrote equal to the prompt's ``target_char``."""
    targets = kwargs.get("target_char") or ["a"] * len(completions)
    out: list[float | None] = []
    for completion, target in zip(completions, targets, strict=True):
        chars = [c for text in assistant_texts(completion) for c in text if not c.isspace()]
        out.append(sum(c == target for c in chars) / len(chars) if chars else 0.0)
    return out


def exact_answer(prompts: list[Any], completions: list[Completion], completion_ids: list[list[int]], **kwargs: Any):
    """1.0 when the first number in the model's last message is the prompt's ``answer``, else 0.0 (None without one)."""
    answers = kwargs.get("answer") or [None] * len(completions)
    out: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        if answer is None:
            out.append(None)
            continue
        texts = assistant_texts(completion)
        match = re.search(r"-?\d+", texts[-1] if texts else "")
        out.append(1.0 if match and match.group() == str(answer) else 0.0)
    return out


def completion_length(prompts: list[Any], completions: list[Completion], completion_ids: list[list[int]], **kwargs):
    """Number of completion tokens (a diagnostic reward; weight it negatively to prefer short)."""
    return [float(len(ids)) for ids in completion_ids]


def env_reward(prompts: list[Any], completions: list[Completion], completion_ids: list[list[int]], **kwargs: Any):
    """The environment's summed step rewards of each episode (None for runs without an environment)."""
    return list(kwargs.get("env_reward") or [None] * len(completions))


def reasoning_gym(prompts: list[Any], completions: list[Completion], completion_ids: list[list[int]], **kwargs: Any):
    """reasoning-gym's own score of the model's last message, for prompts made by ``reasoning_gym:...``."""
    entries = kwargs.get(reasoning_gym_tasks.ENTRY_COLUMN)
    if entries is None:
        raise ValueError(
            f"the prompt has no {reasoning_gym_tasks.ENTRY_COLUMN} column: this reward scores prompts generated "
            f"by {reasoning_gym_tasks.FORMAT}"
        )
    texts = [assistant_texts(completion) for completion in completions]
    return [reasoning_gym_tasks.score(t[-1] if t else "", e) for t, e in zip(texts, entries, strict=True)]


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "char_fraction": char_fraction,
    "exact_answer": exact_answer,
    "completion_length": completion_length,
    "env_reward": env_reward,
    "reasoning_gym": reasoning_gym,
}


class RewardRegistry:
    def __init__(self) -> None:
        self._functions: dict[str, RewardFunction] = dict(BUILTIN_REWARDS)

    def register(self, name: str, function: RewardFunction) -> None:
        if not callable(function):
            raise TypeError(f"reward {name!r} is not callable")
        self._functions[name] = function

    def load_module(self, module_path: str) -> None:
        """Add a user module's ``REWARD_FUNCTIONS`` dict, or for ``module:function`` that function under that name."""
        module_name, _, function_name = module_path.partition(":")
        module = importlib.import_module(module_name)
        if function_name:
            function = getattr(module, function_name, None)
            if function is None:
                raise ValueError(f"module {module_name} has no function {function_name!r}")
            self.register(module_path, function)
            return
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
            raise InvalidArgument(
                f"unknown reward function {echo(name)}; registered: {', '.join(self.names())}"
            ) from None


async def call_reward(
    name: str, function: RewardFunction, inputs: RewardInputs, timeout_s: float, executor: Executor | None = None
) -> list[float]:
    """One reward function over one group, called as TRL calls it; None becomes NaN."""
    arguments = dict(
        inputs.kwargs, prompts=inputs.prompts, completions=inputs.completions, completion_ids=inputs.completion_ids
    )
    expected = len(inputs.completions)
    try:
        # An instance of a class with ``async def __call__`` is async too (TRL's is_async_callable).
        if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(type(function).__call__):
            pending = function(**arguments)
        else:
            pending = asyncio.get_running_loop().run_in_executor(executor, functools.partial(function, **arguments))
        values = await asyncio.wait_for(pending, timeout_s)
    except TimeoutError:
        raise RewardError(f"reward {name!r} took longer than {timeout_s:.0f}s") from None
    except Exception as exc:
        raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(values, list | tuple) or len(values) != expected:
        raise RewardError(f"reward {name!r} returned {values!r:.80}; expected a list of {expected}")
    try:
        numbers = [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError, OverflowError) as exc:
        raise RewardError(f"reward {name!r} returned a non-number: {exc}") from None
    for index, (value, number) in enumerate(zip(values, numbers, strict=True)):
        if value is not None and not math.isfinite(number):
            # NaN stands for None from here on: a NaN or inf the function returned is a bug in it.
            raise RewardError(
                f"reward {name!r} returned {number} for completion {index}; return a finite number, "
                "or None to leave the sample unscored by it"
            )
    return numbers
