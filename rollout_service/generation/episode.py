"""One episode (one group member): a single completion, or a conversation with tools or an
environment.

Token-exact: the completion is the ids vLLM generated plus the ids the chat template puts
between turns; earlier turns are never re-tokenized (re-tokenizing can give other ids, and
the trainer must score exactly the sampled tokens). Generated tokens have mask 1 and their
behaviour logprob; template and tool tokens mask 0. ``messages`` keep special tokens (tool
parsers read them); ``reward_text`` / ``reward_messages`` are decoded without them, as TRL's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rollout_service.engine.protocol import Engine, GroupEngine
from rollout_service.generation.environments import EnvironmentFactory, call_environment
from rollout_service.generation.tools import ParsedCall, ToolCall, ToolResult, ToolSet
from rollout_service.types import Completion, EpisodeResult, FinishReason, PromptItem, SamplingParams

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


def salt(version: int) -> str:
    """vLLM's prefix-cache salt for requests made at a policy version."""
    return f"policy-v{version}"


def salted(params: SamplingParams, version: int) -> SamplingParams:
    """``params`` sharing vLLM's cached prompt blocks only with requests at the same policy version."""
    return replace(params, cache_salt=salt(version))


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
    """A whole single-turn group from one request (see ``GroupEngine``)."""
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

    def environment_call(self) -> dict[str, Any]:
        return {"executor": self.environment_executor, "timeout_s": self.environment_timeout_s}


class Transcript:
    """The growing completion: ids, behaviour logprobs, mask and the conversation as messages."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.messages: list[dict[str, str]] = []
        self.reward_messages: list[dict[str, Any]] = []

    def add_generated(self, ids: list[int], logprobs: list[float]) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)

    def add_template(self, ids: list[int], messages: Sequence[dict[str, str]]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.messages += messages
        self.reward_messages += [dict(m) for m in messages]


class _Episode:
    """One multi-turn episode while ``run_episode`` drives it."""

    def __init__(
        self,
        prompt: PromptItem,
        config: MultiTurnConfig,
        decode: Decode,
        on_tool_result: Callable[[ToolResult], None] | None,
    ) -> None:
        self.prompt, self.config, self.decode = prompt, config, decode
        self.on_tool_result = on_tool_result
        self.environment = config.environment() if config.environment is not None else None
        self.env_reward: float | None = 0.0 if self.environment is not None else None
        self.transcript = Transcript()
        self.turns = self.tool_calls = self.tool_failures = 0

    def room(self) -> tuple[float, FinishReason]:
        """Tokens the episode may still add, and the guard that bounds them."""
        used = len(self.transcript.ids)
        budget_left = (self.config.max_episode_tokens or math.inf) - used
        context_left = self.config.max_model_len - len(self.prompt.token_ids) - used
        if budget_left <= context_left:
            return budget_left, "max_episode_tokens"
        return context_left, "max_model_len"

    def record_turn(self, completion: Completion) -> dict[str, Any]:
        """Add the model's turn; returns its message as reward functions see it."""
        turn_ids, transcript, decode = completion.token_ids, self.transcript, self.decode
        self.turns += 1
        transcript.add_generated(turn_ids, completion.logprobs)
        transcript.messages.append({"role": "assistant", "content": decode(self.config.template.content(turn_ids))})
        turn_message: dict[str, Any] = {"role": "assistant", "content": decode(turn_ids, skip_special_tokens=True)}
        transcript.reward_messages.append(turn_message)
        return turn_message

    async def answer(self, turn_ids: list[int], turn_message: dict[str, Any]) -> list[dict[str, str]] | FinishReason:
        """Tool results or the environment's observation answering a turn, or the finish reason."""
        text = self.decode(turn_ids)
        tools = self.config.tools
        calls = tools.parse(text) if tools is not None else []
        if calls:
            assert tools is not None
            if readable := trl_tool_calls(calls):
                turn_message["tool_calls"] = readable
            if self.turns >= self.config.max_turns:
                return "max_turns"  # its results could never be shown to the model
            results = await tools.execute_all(calls)
            for result in results:
                self.tool_calls += 1
                self.tool_failures += not result.ok
                if self.on_tool_result is not None:
                    self.on_tool_result(result)
            return [r.message() for r in results]
        if self.environment is None:
            return "stop"
        step = await call_environment("step", self.environment.step, text, **self.config.environment_call())
        self.env_reward = (self.env_reward or 0.0) + float(step.reward)
        if step.done or step.observation is None:
            return "stop"
        if self.turns >= self.config.max_turns:
            return "max_turns"
        return [{"role": "user", "content": step.observation}]

    def append_answer(self, turn_ids: list[int], messages: list[dict[str, str]]) -> FinishReason | None:
        """Append the answer's template ids; a finish reason if they leave no room to generate."""
        bridge = self.config.template.bridge(turn_ids, messages)
        left, limit = self.room()
        if len(bridge) >= left:  # the appended messages must leave room for a generated token
            return limit
        self.transcript.add_template(bridge, messages)
        return None

    def result(self, finish: FinishReason, version_first: int, version_last: int) -> EpisodeResult:
        transcript, decode = self.transcript, self.decode
        return EpisodeResult(
            completion_ids=transcript.ids,
            logprobs=transcript.logprobs,
            mask=transcript.mask,
            finish_reason=finish,
            text=decode(transcript.ids),
            policy_version_first=version_first,
            policy_version_last=version_last,
            num_turns=self.turns,
            num_tool_calls=self.tool_calls,
            num_tool_failures=self.tool_failures,
            messages=tuple(transcript.messages),
            env_reward=self.env_reward,
            reward_text=decode(transcript.ids, skip_special_tokens=True),
            reward_messages=tuple(transcript.reward_messages),
        )


async def run_episode(
    engine: Engine,
    prompt: PromptItem,
    params: SamplingParams,
    config: MultiTurnConfig,
    policy_version: Callable[[], int],
    decode: Decode,
    affinity: str | None = None,
    on_tool_result: Callable[[ToolResult], None] | None = None,
) -> EpisodeResult:
    """Turns until the model stops, the environment is done or a guard ends the episode; a
    failed tool call is a message to the model, never an exception."""
    episode = _Episode(prompt, config, decode, on_tool_result)
    if episode.environment is not None:
        await call_environment("reset", episode.environment.reset, prompt, **config.environment_call())
    version_first = version_last = policy_version()
    while True:
        left, limit = episode.room()
        cap = int(min(params.max_tokens, left))
        if cap <= 0:
            return episode.result(limit, version_first, version_last)
        turn_params = salted(replace(params, max_tokens=cap), version_last)  # the version read last
        completion = await engine.generate(prompt.token_ids + episode.transcript.ids, turn_params, affinity=affinity)
        version_last = policy_version()
        turn_message = episode.record_turn(completion)
        if completion.finish_reason != "stop":
            lowered = completion.finish_reason == "length" and cap < params.max_tokens
            finish = limit if lowered else completion.finish_reason  # the budget, not max_tokens, cut the turn
            return episode.result(finish, version_first, version_last)
        answer = await episode.answer(completion.token_ids, turn_message)
        if isinstance(answer, str):
            return episode.result(answer, version_first, version_last)
        if (ended := episode.append_answer(completion.token_ids, answer)) is not None:
            return episode.result(ended, version_first, version_last)
