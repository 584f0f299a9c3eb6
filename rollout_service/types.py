"""Typed carriers at each boundary: prompt -> completion -> episode -> scored group.

Data flows one way through these; nothing here does I/O.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "max_turns", "max_episode_tokens", "max_model_len"]
"""Why an episode ended; ``max_turns``: the model still wanted to go on after its last allowed turn."""
PauseModeName = Literal["keep", "abort", "wait", "none"]
"""What a server does with its in-flight requests while its weights change."""


CHAT_ROLES = ("system", "user", "assistant", "tool")


class AdvantageScaling(StrEnum):
    """Denominator of the advantage, as TRL's ``scale_rewards``."""

    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


MAX_STOP_STRINGS = 32
"""Stop strings a run may give; a managed vLLM server is started to take as many (vLLM's
``VLLM_MAX_STOP_STRINGS``, 4 by default)."""


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
    """A run's LoRA adapter to sample from; None: the engine's own model."""
    cache_salt: str | None = None
    """vLLM's prefix-cache salt, the policy version (``salted``): no request reuses blocks older weights computed."""


@dataclass(frozen=True)
class EpisodeSpec:
    """Tools, an environment and budgets of an episode; the default is a single turn."""

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
    """A prompt ready for generation: token ids plus what rewards may want to see."""

    index: int
    token_ids: list[int]
    text: str
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Completion:
    """One vLLM completion, ids and behaviour logprobs as returned; no text (the episode decodes the ids)."""

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
    """The completion as a conversation, special tokens kept."""
    env_reward: float | None = None
    """Sum of the environment's step rewards; None without an environment."""
    reward_text: str = ""
    """The completion without special tokens: TRL's completion text."""
    reward_messages: tuple[dict[str, Any], ...] = ()
    """The completion as TRL's reward functions see it (without special tokens, TRL's ``tool_calls``)."""

    @functools.cached_property
    def policy_tokens(self) -> int:
        """Tokens the policy generated (mask 1): counted once, though metrics, the ledger and the audit ask."""
        return sum(self.mask)


@dataclass(eq=False)
class ScoredGroup:
    """G episodes of one prompt with rewards and advantages: the unit the broker hands out.
    Hashed by identity, so the edge can keep its wire encoding beside it."""

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
    engine_seconds: float = 0.0
    """Slot seconds its members held (the goodput ledger's); 0 when generated elsewhere or restored."""

    @property
    def policy_version(self) -> int:
        """The oldest policy any member started under: what staleness is judged by."""
        return min(e.policy_version_first for e in self.episodes)

    def wire_bytes_upper_bound(self) -> int:
        """An upper bound of this group's encoded size, without building the message."""
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
    """Why it takes no requests now; empty when routable."""
    sequences_in_flight: int
    managed: bool
    partition_run_id: str = ""
    """With pool partitions: the run it serves (empty: none)."""


@dataclass(frozen=True)
class EngineRemoved:
    url: str
    drain_seconds: float
    sequences_drained: int
    """Sequences that finished on the server during the drain."""
    sequences_moved: int
    """Sequences abandoned at the drain timeout, started over elsewhere."""
