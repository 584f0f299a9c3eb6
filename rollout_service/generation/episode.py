"""One episode (one group member): a single completion, or a conversation with tools or an
environment.

Token-exact: the completion is the ids vLLM generated plus the ids the chat template puts
between turns; earlier turns are never re-tokenized (re-tokenizing can give other ids, and
the trainer must score exactly the sampled tokens). Generated tokens have mask 1 and their
behaviour logprob; template and tool tokens mask 0. ``messages`` keep special tokens (tool
parsers read them); ``reward_text`` / ``reward_messages`` are decoded without them, as TRL's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rollout_service.engine.protocol import Engine, GroupEngine
from rollout_service.errors import EnvironmentFailure
from rollout_service.generation.environments import Environment, EnvironmentFactory, close_environment
from rollout_service.generation.tools import ParsedCall, ToolCall, ToolResult, ToolSet
from rollout_service.generation.user_code import call_user_function
from rollout_service.types import Completion, EpisodeResult, FinishReason, PromptItem, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_TURNS = 8
"""Model turns of a tool or environment episode when the run does not say."""

_MARKER = "ASSISTANT_TURN_MARKER"


class Decode(Protocol):
    def __call__(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


def trl_tool_calls(calls: Sequence[ParsedCall]) -> list[dict[str, Any]]:
    """The calls the parser could read, in TRL's (and the chat template's) message form."""
    return [
        {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
        for c in calls
        if isinstance(c, ToolCall)
    ]


def salted(params: SamplingParams, version: int) -> SamplingParams:
    """``params`` sharing vLLM's cached prompt blocks only with requests at the same policy version."""
    return replace(params, cache_salt=f"policy-v{version}")


async def run_single_turn(
    engine: Engine,
    prompt: PromptItem,
    params: SamplingParams,
    policy_version: Callable[[], int],
    decode: Decode,
    affinity: str | None = None,
) -> EpisodeResult:
    version_first = policy_version()
    completion = await engine.generate(prompt.token_ids, salted(params, version_first), affinity=affinity)
    return _single_turn_result(completion, version_first, policy_version(), decode)


async def run_single_turn_group(
    engine: GroupEngine,
    prompt: PromptItem,
    params: SamplingParams,
    size: int,
    policy_version: Callable[[], int],
    decode: Decode,
    affinity: str | None = None,
) -> list[EpisodeResult]:
    version_first = policy_version()
    completions = await engine.generate_many(prompt.token_ids, salted(params, version_first), size, affinity=affinity)
    version_last = policy_version()
    return [_single_turn_result(c, version_first, version_last, decode) for c in completions]


def _single_turn_result(completion: Completion, version_first: int, version_last: int, decode: Decode) -> EpisodeResult:
    # Decoded from the ids, not vLLM's incremental text (which holds back a partial UTF-8 tail).
    text = decode(completion.token_ids)
    reward_text = decode(completion.token_ids, skip_special_tokens=True)
    return EpisodeResult(
        completion_ids=completion.token_ids,
        logprobs=completion.logprobs,
        mask=[1] * len(completion.token_ids),
        finish_reason=completion.finish_reason,
        text=text,
        policy_version_first=version_first,
        policy_version_last=version_last,
        messages=({"role": "assistant", "content": text},),
        reward_text=reward_text,
        reward_messages=({"role": "assistant", "content": reward_text},),
    )


def _suffix(full: list[int], head: list[int], what: str) -> list[int]:
    if full[: len(head)] != head:
        raise ValueError(
            f"the chat template does not render {what} as an extension of the conversation before it "
            "(token prefix differs), so turns cannot be appended without re-tokenizing"
        )
    return full[len(head) :]


class TurnTemplate:
    """The ids a tokenizer's chat template puts after an assistant turn: the suffix of a stand-in
    conversation rendered with and without the new messages (the prefix must match)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        self._tools = tools or None
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
        self._head = self._render(self._base, continue_final_message=True)
        self.close_ids = _suffix(self._render(self._base), self._head, "a closed assistant turn")
        """What closes an assistant turn, e.g. ``<|im_end|>\\n``."""
        if not self.close_ids:
            raise ValueError("the chat template renders nothing after an assistant turn")

    def _render(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        ids = self._tokenizer.apply_chat_template(
            list(messages), tools=self._tools, tokenize=True, return_dict=False, **kwargs
        )
        return list(ids)

    def closed_by_model(self, turn_ids: Sequence[int]) -> int:
        """How many ids of the turn's closing the model generated itself (its EOS, say)."""
        for k in range(min(len(self.close_ids), len(turn_ids)), 0, -1):
            if list(turn_ids[-k:]) == self.close_ids[:k]:
                return k
        return 0

    def bridge(self, turn_ids: Sequence[int], messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids to append after a model turn: the rest of its closing, ``messages`` and the next header."""
        rendered = self._render([*self._base, *messages], add_generation_prompt=True)
        after = _suffix(rendered, self._head, "new messages")
        if after[: len(self.close_ids)] != self.close_ids:
            raise ValueError("the chat template closes an assistant turn differently when messages follow it")
        return after[self.closed_by_model(turn_ids) :]

    def content(self, turn_ids: Sequence[int]) -> list[int]:
        """The turn without the closing ids the model generated: its message content."""
        return list(turn_ids[: len(turn_ids) - self.closed_by_model(turn_ids)])


@dataclass(frozen=True)
class MultiTurnConfig:
    template: TurnTemplate
    max_model_len: int
    max_turns: int = DEFAULT_MAX_TURNS
    max_episode_tokens: int = 0
    """Completion tokens (generated and template) per episode; 0: only the context bounds it."""
    tools: ToolSet | None = None
    environment: EnvironmentFactory | None = None
    environment_timeout_s: float = 60.0
    environment_executor: Executor | None = None
    """Threads for sync environment methods; None: asyncio's default pool."""

    async def call_environment(self, what: str, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` bounded by ``environment_timeout_s``; any failure is an ``EnvironmentFailure``."""
        timeout_s = self.environment_timeout_s
        try:
            return await asyncio.wait_for(call_user_function(method, self.environment_executor, *args), timeout_s)
        except TimeoutError:
            raise EnvironmentFailure(
                f"environment {what} took longer than {timeout_s:g}s (scheduler.environment_timeout_s)"
            ) from None
        except Exception as exc:
            raise EnvironmentFailure(f"environment {what} raised {type(exc).__name__}: {exc}") from exc


class Transcript:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.messages: list[dict[str, str]] = []
        self.reward_messages: list[dict[str, Any]] = []

    def add_turn(self, completion: Completion, content: str, decode: Decode) -> dict[str, Any]:
        """Add a model turn whose message has ``content``; returns its message as reward functions see it."""
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.token_ids)
        self.messages.append({"role": "assistant", "content": content})
        reward_message = {"role": "assistant", "content": decode(completion.token_ids, skip_special_tokens=True)}
        self.reward_messages.append(reward_message)
        return reward_message

    def add_template(self, ids: list[int], messages: Sequence[dict[str, str]]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.messages += messages
        self.reward_messages += [dict(m) for m in messages]

    def result(self, decode: Decode, finish: FinishReason, first: int, last: int, **counts: Any) -> EpisodeResult:
        """``counts``: the turn, tool and environment tallies of ``EpisodeResult``."""
        return EpisodeResult(
            completion_ids=self.ids,
            logprobs=self.logprobs,
            mask=self.mask,
            finish_reason=finish,
            text=decode(self.ids),
            policy_version_first=first,
            policy_version_last=last,
            messages=tuple(self.messages),
            reward_text=decode(self.ids, skip_special_tokens=True),
            reward_messages=tuple(self.reward_messages),
            **counts,
        )


async def run_episode(
    engine: Engine,
    prompt: PromptItem,
    params: SamplingParams,
    config: MultiTurnConfig,
    policy_version: Callable[[], int],
    decode: Decode,
    affinity: str | None = None,
    on_tool_result: Callable[[ToolResult], None] = lambda _: None,
) -> EpisodeResult:
    """Turns until the model stops, the environment is done or a guard ends the episode; a
    failed tool call is a message to the model, never an exception."""
    environment = config.environment() if config.environment is not None else None
    try:
        turns = _turns(engine, prompt, params, config, environment, policy_version, decode, affinity, on_tool_result)
        return await turns
    finally:
        if environment is not None:
            try:
                await config.call_environment("close", close_environment, environment)
            except EnvironmentFailure as exc:  # the episode's result stands
                logger.warning("%s", exc)


async def _turns(
    engine: Engine,
    prompt: PromptItem,
    params: SamplingParams,
    config: MultiTurnConfig,
    environment: Environment | None,
    policy_version: Callable[[], int],
    decode: Decode,
    affinity: str | None,
    on_tool_result: Callable[[ToolResult], None],
) -> EpisodeResult:
    tools, transcript = config.tools, Transcript()
    env_reward: float | None = 0.0 if environment is not None else None
    if environment is not None:
        await config.call_environment("reset", environment.reset, prompt)
    turns = tool_calls = tool_failures = 0
    version_first = version_last = policy_version()

    def room() -> tuple[float, FinishReason]:
        """Tokens the episode may still add, and the guard that bounds them."""
        used = len(transcript.ids)
        budget_left = (config.max_episode_tokens or math.inf) - used
        context_left = config.max_model_len - len(prompt.token_ids) - used
        if budget_left <= context_left:
            return budget_left, "max_episode_tokens"
        return context_left, "max_model_len"

    def result(finish: FinishReason) -> EpisodeResult:
        return transcript.result(
            decode,
            finish,
            version_first,
            version_last,
            num_turns=turns,
            num_tool_calls=tool_calls,
            num_tool_failures=tool_failures,
            env_reward=env_reward,
        )

    while True:
        left, limit = room()
        cap = int(min(params.max_tokens, left))
        if cap <= 0:
            return result(limit)
        turn_params = salted(replace(params, max_tokens=cap), version_last)  # the version read last
        completion = await engine.generate(prompt.token_ids + transcript.ids, turn_params, affinity=affinity)
        version_last = policy_version()
        turns += 1
        turn_ids = completion.token_ids
        turn_message = transcript.add_turn(completion, decode(config.template.content(turn_ids)), decode)
        if completion.finish_reason != "stop":
            lowered = completion.finish_reason == "length" and cap < params.max_tokens
            return result(limit if lowered else completion.finish_reason)  # the budget, not max_tokens, cut the turn
        text = decode(turn_ids)
        if tools is not None and (calls := tools.parser(text)):
            if readable := trl_tool_calls(calls):
                turn_message["tool_calls"] = readable
            if turns >= config.max_turns:
                return result("max_turns")  # its results could never be shown to the model
            results = await tools.execute_all(calls)
            for tool_result in results:
                tool_calls += 1
                tool_failures += tool_result.error_kind is not None
                on_tool_result(tool_result)
            messages = [r.message() for r in results]
        elif environment is None:
            return result("stop")
        else:
            step = await config.call_environment("step", environment.step, text)
            env_reward = (env_reward or 0.0) + float(step.reward)
            if step.done or step.observation is None:
                return result("stop")
            if turns >= config.max_turns:
                return result("max_turns")
            messages = [{"role": "user", "content": step.observation}]
        bridge = config.template.bridge(turn_ids, messages)
        left, limit = room()
        if len(bridge) >= left:  # the appended messages must leave room for a generated token
            return result(limit)
        transcript.add_template(bridge, messages)
