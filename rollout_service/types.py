"""Typed carriers at each boundary: prompt -> completion -> episode -> scored group.

Data flows one way through these; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "max_turns", "max_episode_tokens", "max_model_len"]
PauseModeName = Literal["keep", "abort", "wait", "none"]
"""What a server does with its in-flight requests while its weights change (the proto's PauseMode)."""
"""Why an episode ended. ``stop``: the model ended its turn with nothing left to do (no tool
call, or the environment said done); ``length``: a turn hit ``sampling.max_tokens``;
``abort``: the engine aborted a request; ``max_turns``: the model still wanted to go on
(a tool call, an unfinished environment) after its last allowed turn; ``max_episode_tokens``
/ ``max_model_len``: the episode's token budget or the model's context left no room for
the next tool result or turn."""


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have (rollout.v1.ChatMessage, the OpenAI endpoint)."""


class AdvantageScaling(StrEnum):
    """Denominator of the advantage, as TRL's ``scale_rewards``."""

    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


@dataclass(frozen=True)
class SamplingParams:
    """What vLLM samples with; validated when a run is created."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str | None = None
    """The served model to sample from when not the engine's own: a run's LoRA adapter."""
    cache_salt: str | None = None
    """vLLM's prefix-cache salt: requests share cached prompt blocks only under the same
    salt. Episodes set it to the policy version they start at (``salted``), so no request
    reuses blocks that older weights computed, also when an update did not pause vLLM
    and its prefix-cache reset was refused."""


@dataclass(frozen=True)
class EpisodeSpec:
    """How one episode unfolds beyond a single completion: tools, an environment, budgets.

    The default (no tools, no environment, no budgets) is the single-turn episode.
    """

    tools: tuple[str, ...] = ()
    tool_parser: str = ""
    tool_timeout_s: float = 0.0
    max_turns: int = 0
    max_episode_tokens: int = 0
    environment: str = ""

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools or self.environment or self.max_turns > 1 or self.max_episode_tokens)


@dataclass(frozen=True)
class PromptItem:
    """A prompt ready for generation: token ids plus what rewards may want to see
    (``messages`` when the prompt was given as a conversation)."""

    index: int
    token_ids: list[int]
    text: str
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Completion:
    """One vLLM completion, ids and behaviour logprobs exactly as vLLM returned them. No text:
    vLLM's incremental text holds back a partial UTF-8 tail; the episode decodes the ids."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    server: str


@dataclass(frozen=True)
class EpisodeResult:
    """One finished episode (a group member): the model's tokens and their versions."""

    completion_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finish_reason: FinishReason
    text: str
    policy_version_first: int
    policy_version_last: int
    num_turns: int = 1
    num_tool_calls: int = 0
    num_tool_failures: int = 0
    messages: tuple[dict[str, str], ...] = ()
    """The completion as a conversation (assistant turns, tool results, observations) as the
    chat template renders it: special tokens kept (``<tool_call>`` of tool turns)."""
    env_reward: float | None = None
    """Sum of the environment's step rewards; None without an environment."""
    reward_text: str = ""
    """The completion ids decoded with ``skip_special_tokens=True``: TRL's completion text."""
    reward_messages: tuple[dict[str, Any], ...] = ()
    """The completion as TRL's reward functions see it: assistant messages whose content is
    the turn's ids decoded with ``skip_special_tokens=True`` (plus ``tool_calls`` in TRL's
    form when the tool parser read calls), then tool results and observations."""


@dataclass(eq=False)
class ScoredGroup:
    """G episodes of one prompt with rewards and advantages: the unit the broker hands out.
    Compared and hashed by identity, so the edge can keep its wire encoding beside it
    (``edge.group_wire``); nothing changes a group's content."""

    group_id: str
    run_id: str
    prompt: PromptItem
    episodes: list[EpisodeResult]
    rewards: list[float]
    reward_components: dict[str, list[float]]
    reward_weights: dict[str, float]
    advantages: list[float]
    generation_seconds: float
    requested_size: int = 0
    """The run's group_size; more than ``len(episodes)`` for a partial group (0: as many as there are)."""

    @property
    def policy_version(self) -> int:
        """The oldest policy any member started under: what staleness is judged by."""
        return min(e.policy_version_first for e in self.episodes)

    @property
    def num_generated_tokens(self) -> int:
        return sum(sum(e.mask) for e in self.episodes)

    def wire_bytes_upper_bound(self) -> int:
        """An upper bound of this group's size as a ``rollout.v1.Group`` message, without
        building it: packed varints take at most 5 bytes (ids, mask), floats 4, and every
        field and sample gets generous room for its tag and length."""
        prompt = 5 * len(self.prompt.token_ids) + len(self.prompt.text.encode())
        metadata = sum(len(k.encode()) + len(v.encode()) + 16 for k, v in self.prompt.metadata.items())
        components = sum(len(name.encode()) + 32 for name in self.reward_components)
        samples = sum(
            5 * len(self.prompt.token_ids)  # every sample carries the prompt's ids
            + 5 * len(e.completion_ids)
            + 4 * len(e.logprobs)
            + 5 * len(e.mask)
            + len(e.text.encode())
            + components
            + 128
            for e in self.episodes
        )
        return prompt + metadata + samples + 256


@dataclass(frozen=True)
class RunStall:
    """Why a run stopped making progress (``delivery.watchdog``)."""

    kind: Literal["generation", "consumers"]
    reason: str
    seconds: float


@dataclass(frozen=True)
class EngineState:
    """One server as GetStats and the membership RPCs report it."""

    url: str
    routable: bool
    held_reason: str
    """Why it takes no requests now (joining, restarting, leaving); empty when routable."""
    sequences_in_flight: int
    managed: bool
    partition_run_id: str = ""
    """With pool partitions: the run it serves (empty: none)."""


@dataclass(frozen=True)
class EngineRemoved:
    url: str
    drain_seconds: float
    sequences_drained: int
    """Sequences in flight when the drain began that finished on the server."""
    sequences_moved: int
    """Sequences still running at the drain timeout: abandoned there, started over elsewhere."""
