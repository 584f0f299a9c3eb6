"""A run: what to generate (validated spec) and its live state (prompts, broker, counters)."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_common.staleness import DEFAULT_MAX_STALENESS
from rollout_service.delivery.admission import RunAdmission
from rollout_service.delivery.audit import BiasAudit
from rollout_service.delivery.broker import RunBroker
from rollout_service.delivery.ledger import GoodputLedger
from rollout_service.errors import InvalidArgument, NotFound, echo
from rollout_service.eval_tally import EvalSpec, EvalTally
from rollout_service.generation.episode import MultiTurnConfig
from rollout_service.generation.prompts import PromptSource, PromptSpec
from rollout_service.scoring.advantages import AdvantageComputer
from rollout_service.types import MAX_STOP_STRINGS, AdvantageScaling, EpisodeSpec, RunStall, SamplingParams

# Bounds against a typo (group_size 100000) or a hostile client; raise them if a real workload needs it.
MAX_GROUP_SIZE = 1024
MAX_BUFFERED_GROUPS = 10_000
MAX_RUN_WEIGHT = 1000.0
MAX_REWARD_WEIGHT = 1e6
MAX_TOKENS = 1 << 20
MAX_STOP_CHARS = 1024
MAX_DISPLAY_NAME_CHARS = 256
MAX_TEMPERATURE = 2.0
"""vLLM refuses a higher temperature, so a run with one could never sample."""
MAX_SEED = 1 << 62
"""Member seeds count up from the base seed and must stay within vLLM's int64."""
MAX_SECONDS = 7 * 86_400
"""Timeouts and deadlines: a week is beyond any real one, and keeps timers finite."""
DELETED_RUNS_KEPT = 256

PromptSourceKind = Literal["dataset", "prompts", "submitted", "external"]
RunState = Literal["running", "stopped", "failed", "completed"]
AdmissionMode = Literal["staleness", "paced"]


@dataclass(frozen=True)
class RunSpec:
    """A run as the client asked for it, defaults filled in; ``validate`` names bad fields."""

    source_kind: PromptSourceKind
    dataset: str = ""
    prompts: tuple[PromptSpec, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group_size: int = 8
    rewards: tuple[tuple[str, float], ...] = ()
    max_staleness: int = DEFAULT_MAX_STALENESS
    max_inflight: int = 0
    max_buffered_groups: int = 0
    scale_rewards: AdvantageScaling = AdvantageScaling.GROUP
    display_name: str = ""
    episode: EpisodeSpec = field(default_factory=EpisodeSpec)
    weight: float = 1.0
    """Share of the slots relative to other runs while both have work."""
    admission: AdmissionMode = "paced"
    lease_timeout_s: float = 0.0
    """0: the service's default."""
    await_first_update: bool = False
    serve_adapter: bool = False
    group_deadline_s: float = 0.0
    """Seconds a group waits for its slowest members; 0: for all of them."""
    min_group_size: int = 0
    """Fewest finished members a group past its deadline is scored from; 0: group_size (drop it)."""
    eval: EvalSpec | None = None
    """An evaluation run: each prompt once, at one policy version, never trained (``evaluation``)."""
    max_mismatch_kl: float = 0.0
    """Paced admission's bound on the mismatch its consumers report (``delivery.lookahead``); 0: none."""

    @property
    def scores_partial_groups(self) -> bool:
        """A group past its deadline may be scored from the members that finished."""
        return self.group_deadline_s > 0 and 0 < self.min_group_size < self.group_size

    @property
    def fewest_members(self) -> int:
        """The fewest finished members a group is scored from."""
        return self.min_group_size if self.scores_partial_groups else self.group_size

    def validate(self) -> None:
        if self.group_size < 2:
            raise InvalidArgument(
                f"group_size is {self.group_size}; it must be >= 2 so that advantages can be "
                "normalised within the group"
            )
        if self.group_size > MAX_GROUP_SIZE:
            raise InvalidArgument(f"group_size is {self.group_size}; it must be <= {MAX_GROUP_SIZE}")
        if self.max_staleness < 0:
            raise InvalidArgument(f"max_staleness is {self.max_staleness}; it must be >= 0")
        _check_range("max_mismatch_kl", self.max_mismatch_kl, 0, 100, "nats per token; 0: no bound")
        if self.max_mismatch_kl and (self.admission != "paced" or self.max_staleness == 0):
            raise InvalidArgument(
                "max_mismatch_kl bounds paced admission's lookahead; set admission ADMISSION_MODE_PACED and "
                "max_staleness > 0, or leave max_mismatch_kl 0"
            )
        if self.max_buffered_groups > MAX_BUFFERED_GROUPS:
            raise InvalidArgument(
                f"max_buffered_groups is {self.max_buffered_groups}; it must be <= {MAX_BUFFERED_GROUPS} "
                "(0: the service's default)"
            )
        if len(self.display_name) > MAX_DISPLAY_NAME_CHARS:
            raise InvalidArgument(
                f"display_name has {len(self.display_name)} characters; give at most {MAX_DISPLAY_NAME_CHARS}"
            )
        self._validate_rewards()
        s = self.sampling
        if s.max_tokens <= 0:
            raise InvalidArgument("sampling.max_tokens must be > 0")
        if s.max_tokens > MAX_TOKENS:
            raise InvalidArgument(f"sampling.max_tokens is {s.max_tokens}; it must be <= {MAX_TOKENS}")
        if len(s.stop) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in s.stop):
            raise InvalidArgument(
                f"sampling.stop has {len(s.stop)} strings of up to {max(map(len, s.stop))} characters; "
                f"give at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters each"
            )
        if not all(s.stop):
            raise InvalidArgument("sampling.stop has an empty string; every stop string needs a character")
        _check_range("sampling.temperature", s.temperature, 0, MAX_TEMPERATURE, "0 is greedy")
        if not 0 < s.top_p <= 1:  # chained comparisons are False for NaN, so NaN is refused too
            raise InvalidArgument(f"sampling.top_p is {s.top_p}; it must be in (0, 1]")
        if s.top_k < 0:
            raise InvalidArgument(f"sampling.top_k is {s.top_k}; it must be >= 0 (0 disables)")
        if s.seed is not None and abs(s.seed) > MAX_SEED:
            raise InvalidArgument(f"sampling.seed is {s.seed}; it must be within +-2^62 (member seeds add to it)")
        if not math.isfinite(self.weight) or not 0 < self.weight <= MAX_RUN_WEIGHT:
            raise InvalidArgument(
                f"weight is {self.weight}; it must be a number in (0, {MAX_RUN_WEIGHT:g}] (0 on the wire means 1)"
            )
        _check_range("lease_timeout_seconds", self.lease_timeout_s, 0, MAX_SECONDS, "0: the default")
        _check_range("group_deadline_seconds", self.group_deadline_s, 0, MAX_SECONDS, "0: no deadline")
        if self.min_group_size and not 2 <= self.min_group_size <= self.group_size:
            raise InvalidArgument(
                f"min_group_size is {self.min_group_size}; it must be between 2 and group_size "
                f"({self.group_size}), or 0 to drop groups that miss their deadline"
            )
        if self.min_group_size and not self.group_deadline_s:
            raise InvalidArgument(
                f"min_group_size is {self.min_group_size} but group_deadline_seconds is 0; "
                "set a deadline for partial groups, or leave min_group_size at 0"
            )
        if self.source_kind == "prompts" and not self.prompts:
            raise InvalidArgument("prompt_source.prompts is empty; give at least one prompt")
        self._validate_episode()
        self._validate_eval()
        if self.source_kind == "external" and self.episode.multi_turn:
            raise InvalidArgument(
                "episode settings do not apply to a run with prompt_source.external: its client runs the "
                "conversation and its tools, and sends them with each request; leave episode unset"
            )

    def _validate_eval(self) -> None:
        if self.eval is None:
            return
        if self.source_kind in ("submitted", "external"):
            raise InvalidArgument(
                "an evaluation run needs a finite prompt set: give prompt_source.dataset or prompt_source.prompts, "
                f"not {self.source_kind} prompts"
            )
        if self.serve_adapter:
            raise InvalidArgument(
                "an evaluation run evaluates the servers' base weights; serve_adapter runs cannot be evaluated "
                "this way yet (evaluate the merged weights, or leave eval unset)"
            )
        if self.eval.policy_version is not None and self.eval.policy_version < 0:
            raise InvalidArgument(f"eval.policy_version is {self.eval.policy_version}; it must be >= 0")

    def _validate_rewards(self) -> None:
        if not self.rewards:
            raise InvalidArgument("reward_functions is empty; name at least one reward function")
        names = [name for name, _ in self.rewards]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"reward_functions names a function twice: {names}")
        for name, weight in self.rewards:
            if not math.isfinite(weight) or abs(weight) > MAX_REWARD_WEIGHT:
                raise InvalidArgument(
                    f"reward function {echo(name)} has weight {weight}; it must be a finite number "
                    f"within +-{MAX_REWARD_WEIGHT:g}"
                )

    def _validate_episode(self) -> None:
        """Names are checked against the registries by the service; here only the values."""
        e = self.episode
        if len(set(e.tools)) != len(e.tools):
            raise InvalidArgument(f"episode.tools names a tool twice: {list(e.tools)}")
        if any(not name for name in e.tools):
            raise InvalidArgument("episode.tools has an empty name")
        if e.max_turns < 0:
            raise InvalidArgument(f"episode.max_turns is {e.max_turns}; it must be >= 0 (0: the default)")
        if e.max_episode_tokens < 0:
            raise InvalidArgument(
                f"episode.max_episode_tokens is {e.max_episode_tokens}; it must be >= 0 (0: bounded by the context)"
            )
        _check_range("episode.tool_timeout_seconds", e.tool_timeout_s, 0, MAX_SECONDS, "0: the default")
        if e.tool_timeout_s and not e.tools:
            raise InvalidArgument("episode.tool_timeout_seconds is set but episode.tools is empty; name the tools")
        if e.tool_parser and not e.tools:
            raise InvalidArgument("episode.tool_parser is set but episode.tools is empty; name the tools")
        if e.max_turns > 1 and not (e.tools or e.environment):
            raise InvalidArgument(
                f"episode.max_turns is {e.max_turns} but the run has neither tools nor an environment, "
                "so every episode ends after one turn; set episode.tools or episode.environment"
            )


def _check_range(name: str, value: float, low: float, high: float, note: str) -> None:
    """Refuse a number outside [low, high]: NaN and infinities too (``x < 0`` lets NaN through)."""
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgument(f"{name} is {value}; it must be a finite number in [{low:g}, {high:g}] ({note})")


@dataclass
class RunCounters:
    groups_started: int = 0
    groups_scored: int = 0
    groups_dropped: int = 0
    groups_refused: int = 0
    """Of those dropped: vLLM refused a member's request itself (HTTP 4xx)."""
    slots_busy: int = 0
    groups_partial: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    slot_seconds: float = 0.0
    """Integral of this run's busy slots over time (its share of the slots)."""


@dataclass
class Run:
    """Live state of one run; the scheduler and the servicer share it."""

    run_id: str
    spec: RunSpec
    source: PromptSource
    broker: RunBroker
    max_inflight: int
    advantages: AdvantageComputer
    state: RunState = "running"
    error: str = ""
    counters: RunCounters = field(default_factory=RunCounters)
    episode: MultiTurnConfig | None = None
    """Multi-turn settings resolved against the registries; None: single-turn episodes."""
    adapter: str | None = None
    """The LoRA adapter this run's requests name (serve_adapter runs); None: the base model."""
    owner: str = ""
    """The principal that created the run (``security.principals``); "" when authentication is off."""
    stall: RunStall | None = None
    """Set by the watchdog while the run makes no progress."""
    stalls: int = 0
    """Stalls so far: each consumer stream sends each one once."""
    eval: EvalTally | None = None
    """An evaluation run's version and scores (``spec.eval`` set); None for training runs."""
    slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.max_inflight)

    @property
    def admission(self) -> RunAdmission:
        """The run's versions and staleness bound (its broker consults them)."""
        return self.broker.admission

    @property
    def audit(self) -> BiasAudit:
        """Whether what the run trains looks like what it starts (its broker reports the trained)."""
        return self.broker.audit

    @property
    def ledger(self) -> GoodputLedger:
        """Where the run's generated tokens went (its broker settles the acks)."""
        return self.broker.ledger

    @property
    def policy_version(self) -> int:
        """The version this run samples from: the base weights', or its own adapter pushes'."""
        return self.broker.admission.policy_version

    @staticmethod
    def new_id() -> str:
        return f"run-{uuid.uuid4().hex[:12]}"

    def reward_weights(self) -> dict[str, float]:
        return dict(self.spec.rewards)

    def stored_state(self) -> dict[str, Any]:
        """The run's changing parts as the state store keeps them (a plain dict: the store needs no ``Run``)."""
        admission = self.admission
        return {
            "state": self.state,
            "error": self.error,
            "await_version": admission.await_version,
            "trained_per_version": admission.trained_per_version,  # staleness admission's estimate
            "version_bumped": admission.version_bumped,
            "lookahead_versions": admission.lookahead.versions if admission.lookahead is not None else None,
        }


class RunTable(dict[str, Run]):
    """The live runs by id (running or failed), shared by the service and the weight plane, and
    the last ``DELETED_RUNS_KEPT`` deleted ones, so GetRun and a late subscriber can still be told
    what happened."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted: OrderedDict[str, Run] = OrderedDict()

    def find(self, run_id: str) -> Run | None:
        return self.get(run_id) or self.deleted.get(run_id)

    def require(self, run_id: str) -> Run:
        run = self.find(run_id)
        if run is None:
            raise NotFound(f"no run {echo(run_id)}; existing runs: {', '.join(self) or 'none'}")
        return run

    def retire(self, run_id: str) -> None:
        """Move a deleted run among the kept records."""
        self.deleted[run_id] = self.pop(run_id)
        while len(self.deleted) > DELETED_RUNS_KEPT:
            self.deleted.popitem(last=False)

    def request_weights(self, run_id: str, reason: str) -> None:
        """Ask a live run's trainer to push its weights now (WeightsWanted)."""
        if (run := self.get(run_id)) is not None:
            run.admission.request_weights(reason)
