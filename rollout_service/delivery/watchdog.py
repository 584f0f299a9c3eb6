"""Liveness of each run: a run that stopped making progress is reported, not left silent.

A **generation** stall: no group scored for ``stall_timeout_s`` while none was buffered or
leased; a **consumers** stall: groups wait or are leased and none was acked for that long.
It clears as soon as the run progresses. Progress is read from counters the run keeps anyway,
so no hot path carries a hook.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import Run
from rollout_service.types import RunStall

logger = logging.getLogger(__name__)


@dataclass
class _Progress:
    """The counters last seen for a run, and when each last moved."""

    scored: int
    acked: int
    scored_at: float
    acked_at: float
    dropped_at_last_score: int
    pending: bool = False
    """Groups were buffered or leased at the last look."""
    pending_changed_at: float = 0.0
    """When ``pending`` last flipped: a side's idle time starts no earlier than its turn."""


class RunWatchdog:
    def __init__(self, stall_timeout_s: float, metrics: ServiceMetrics, clock: Callable[[], float]) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics
        self.clock = clock
        self.on_stalled: Callable[[bool], None] = lambda any_stalled: None
        """Told when the service goes from no stalled run to some, and back (gRPC health)."""
        self.any_stalled = False
        self._progress: dict[str, _Progress] = {}

    @property
    def interval_s(self) -> float:
        return min(5.0, max(0.05, self.stall_timeout_s / 4))

    def check(self, runs: Iterable[Run], engines_usable: bool) -> None:
        now = self.clock()
        running = [run for run in runs if run.state == "running"]
        for run in running:
            self._report(run, self._find_stall(run, self._seen(run, now), now, engines_usable))
        for run_id in set(self._progress) - {run.run_id for run in running}:
            del self._progress[run_id]
        any_stalled = any(run.stall is not None for run in running)
        if any_stalled != self.any_stalled:
            self.any_stalled = any_stalled
            self.on_stalled(any_stalled)

    def _seen(self, run: Run, now: float) -> _Progress:
        scored, dropped = run.counters.groups_scored, run.counters.groups_dropped
        acked = sum(run.broker.ack_counts.values())
        pending = bool(run.broker.buffered or run.broker.num_leased)
        progress = self._progress.setdefault(run.run_id, _Progress(
            scored, acked, scored_at=now, acked_at=now, dropped_at_last_score=dropped,
            pending=pending, pending_changed_at=now,
        ))  # fmt: skip
        if pending != progress.pending:
            progress.pending, progress.pending_changed_at = pending, now
        if scored != progress.scored:
            progress.scored, progress.scored_at = scored, now
            progress.dropped_at_last_score = dropped
        if acked != progress.acked:
            progress.acked, progress.acked_at = acked, now
        return progress

    def _find_stall(self, run: Run, progress: _Progress, now: float, engines_usable: bool) -> RunStall | None:
        broker, limit = run.broker, self.stall_timeout_s
        waiting, leased = len(broker.buffered), broker.num_leased
        if progress.pending:
            idle = now - max(progress.acked_at, progress.pending_changed_at)
            if idle < limit:
                return None
            consumers = len(broker.leases)
            who = f"{consumers} consumers are subscribed" if consumers else "no consumer is subscribed"
            return RunStall(
                "consumers",
                f"{waiting} groups wait and {leased} are leased, and no consumer acked a group for {idle:.0f}s "
                f"({who}); check the trainers",
                idle,
            )
        idle = now - max(progress.scored_at, progress.pending_changed_at)
        if idle < limit:
            return None
        why = self._why_not(run, progress, engines_usable)
        return RunStall("generation", f"no group scored for {idle:.0f}s: {why}", idle)

    @staticmethod
    def _why_not(run: Run, progress: _Progress, engines_usable: bool) -> str:
        if not engines_usable:
            return "no vLLM server is answering (see the service's health and the servers' logs)"
        dropped = run.counters.groups_dropped - progress.dropped_at_last_score
        if dropped:
            return f"{dropped} groups were dropped since the last one scored (the service's log says why)"
        if run.counters.slots_busy:
            return "groups are generating but none finished (a hung reward, tool or environment, or a stuck server)"
        admission = run.admission
        if admission.policy_version < admission.await_version:
            return (
                f"the run waits for its first weight update (await_first_update; the servers hold version "
                f"{admission.policy_version}); is its trainer pushing?"
            )
        if run.spec.source_kind == "submitted":
            return "no group started: it has no prompts to start (its prompts come from SubmitPrompts)"
        if run.spec.source_kind == "external":
            return (
                "no group completed: its episodes come from the OpenAI-compatible endpoint, and no task has had "
                f"{run.spec.group_size} episodes closed (is the agent code running?)"
            )
        return "no group started: admission holds the run back (its buffer and staleness bound, see GetRun's stats)"

    def _report(self, run: Run, stall: RunStall | None) -> None:
        previous = run.stall
        run.stall = stall
        if stall is not None and previous is None:
            run.stalls += 1
            logger.warning("run %s stalled (%s): %s", run.run_id, stall.kind, stall.reason)
            self.metrics.run_stalled.labels(run.run_id, stall.kind).set(1)
            run.admission.wake_watchers()  # its consumer streams send the stall
        elif stall is None and previous is not None:
            logger.info("run %s progresses again after a %s stall", run.run_id, previous.kind)
            self.metrics.run_stalled.labels(run.run_id, previous.kind).set(0)
        elif stall is not None and previous is not None and stall.kind != previous.kind:
            self.metrics.run_stalled.labels(run.run_id, previous.kind).set(0)
            self.metrics.run_stalled.labels(run.run_id, stall.kind).set(1)
