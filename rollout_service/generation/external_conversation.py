"""One outside episode's conversation (``generation.external``): the endpoint's requests and replies,
what the service holds of the episode, and the checks that a request repeats it."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from rollout_service.errors import FailedPrecondition, InvalidArgument, echo
from rollout_service.generation.episode import Transcript, TurnTemplate
from rollout_service.types import CHAT_ROLES, Completion, FinishReason, PromptItem


@dataclass(frozen=True)
class EpisodeRequest:
    """The sampling fields a client left out (None, empty) are the run's."""

    episode_id: str
    task_id: str
    _: KW_ONLY
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class TurnRequest(EpisodeRequest):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class TextRequest(EpisodeRequest):
    """``prompt``: the episode's text so far plus what the client adds."""

    prompt: str


@dataclass(frozen=True)
class TurnReply:
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[float]


@dataclass
class OpenEpisode:
    episode_id: str
    task_id: str
    prompt: PromptItem
    template: TurnTemplate | None
    """The chat template's turn suffixes; None for a text episode (``/v1/completions``)."""
    version_first: int
    known: list[dict[str, Any]]
    """The conversation so far, as the client must repeat it."""
    text: str = ""
    """A text episode's text so far, as the client must repeat it."""
    transcript: Transcript = field(default_factory=Transcript)
    last_turn_ids: list[int] = field(default_factory=list)
    version_last: int = 0
    turns: int = 0
    finish: FinishReason = "stop"
    busy: bool = False
    started: float = field(default_factory=time.monotonic)


def reply(
    episode: OpenEpisode, completion: Completion, content: str | None, tool_calls: list[dict[str, Any]]
) -> TurnReply:
    finish = "tool_calls" if tool_calls else ("length" if completion.finish_reason == "length" else "stop")
    turn_ids = completion.token_ids
    return TurnReply(
        content=content,
        tool_calls=tool_calls,
        finish_reason=finish,
        prompt_tokens=len(episode.prompt.token_ids) + len(episode.transcript.ids) - len(turn_ids),
        completion_tokens=len(turn_ids),
        token_ids=list(turn_ids),
        logprobs=list(completion.logprobs),
    )


def not_busy(episode: OpenEpisode) -> None:
    if episode.busy:
        raise FailedPrecondition(
            f"a request of episode {echo(episode.episode_id)} is still running; send its turns one after another"
        )


def check_messages(messages: list[dict[str, Any]], first: bool) -> None:
    if first and not messages:
        raise InvalidArgument("messages is empty; send at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise InvalidArgument(f"message {index} needs a role, one of {', '.join(CHAT_ROLES)}")
        if first and message["role"] in ("assistant", "tool"):
            raise InvalidArgument(
                f"message {index} of a new episode is a {message['role']} message: an episode starts from system "
                "and user messages, and the model's turns are generated here"
            )


def same_message(sent: Any, held: dict[str, Any]) -> bool:
    """Whether ``sent`` is the client's copy of ``held``, tolerating how clients re-serialize
    assistant turns (None or "" content, text parts, tool call ids and JSON spacing)."""
    if not isinstance(sent, dict) or sent.get("role") != held.get("role"):
        return False
    if _text(sent.get("content")) != _text(held.get("content")):
        return False
    return held.get("role") != "assistant" or _calls(sent) == _calls(held)


def _text(content: Any) -> Any:
    """A message's text: a string, or OpenAI's list of text parts; None is ""."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content)
    return content or ""


def _calls(message: dict[str, Any]) -> list[Any]:
    """An assistant message's tool calls as (name, arguments), the arguments parsed when JSON."""
    calls: list[Any] = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            calls.append(call)
            continue
        arguments = function.get("arguments")
        with contextlib.suppress(TypeError, ValueError):
            arguments = json.loads(arguments)
        calls.append((function.get("name"), arguments))
    return calls


def chars(messages: list[Any]) -> int:
    """The characters a request's messages give the chat template."""
    return sum(len(str(_text(m.get("content")))) for m in messages if isinstance(m, dict))
