"""What GetServerInfo and GetStats report about the service, as plain types."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_service.evaluation import EvalResult
from rollout_service.types import EngineState
from rollout_service.weights.update_messages import UpdateTimes


@dataclass(frozen=True)
class ServerInfo:
    """What GetServerInfo reports: the service's fixed facts and the names a run may use now."""

    model: str
    engine_urls: list[str]
    max_inflight: int
    reward_functions: list[str]
    datasets: list[str]
    tools: list[str]
    tool_parsers: list[str]
    environments: list[str]
    model_signature: str


@dataclass(frozen=True)
class ServiceStats:
    """The service-wide part of GetStats (slots now, where the time went), so the edge reads no internals."""

    slots_busy: int
    max_inflight: int
    max_slots_busy_seen: int
    engine_request_failures: int
    uptime_seconds: float
    tokens_generated: int
    recent_tokens_per_second: float
    recent_window_seconds: float
    slot_seconds: float
    """Integral of the busy slots over the uptime."""
    slots_busy_time_average: float
    weight_updates_committed: int
    weight_updates_aborted: int
    weight_updates_resent: int
    """Commits of the current version's weights again, for a restarted server (no bump)."""
    weight_update_paused_seconds: float
    last_weight_update: UpdateTimes | None
    evals: list[EvalResult]
    """The latest evaluation runs' results, oldest first."""
    engines: list[EngineState]
    """The pool's servers now: routable or held, and why."""
