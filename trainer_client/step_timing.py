"""Where each second of a training run goes, per optimizer step: whether the run is
generation-bound (the trainer waits for groups) or training-bound.

A step's phases plus ``other`` (Trainer bookkeeping, logging, callbacks, gradient clipping) add
up to its wall time. A background push's ``push_*`` phases overlap the next step and count in
the step during which it finished. ``compute_cpu_seconds``, the training thread's CPU time in
forward, backward and optimizer, shows by its shortfall how much of the core others took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

ON_STEP_PATH = ("wait_groups", "collate", "forward", "backward", "optimizer", "push_snapshot", "push_wait", "ack")
"""Phases that run on the training thread: with ``other`` they add up to the step's wall time."""
PUSH_PHASES = ("push_begin", "push_transfer", "push_commit")
PHASES = ON_STEP_PATH + PUSH_PHASES
COMPUTE_PHASES = ("forward", "backward", "optimizer")
COMPUTE_CPU = "compute_cpu"
"""The clock's key for the training thread's CPU seconds in ``COMPUTE_PHASES`` (not a phase)."""


class PhaseClock:
    """Accumulates seconds per phase until ``take`` (thread-safe: a background push reports from the feed's)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def measure(self, phase: str, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
        """Seconds of ``clock`` in the block (``time.thread_time``: the calling thread's CPU seconds)."""
        start = clock()
        try:
            yield
        finally:
            self.add(phase, clock() - start)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The seconds gathered since the last ``take``, and start afresh."""
        with self._lock:
            seconds, self._seconds = self._seconds, {}
        return seconds


def step_seconds(phases: dict[str, float], wall_s: float, synchronous_push: bool) -> dict[str, float]:
    """A step's record: every phase (0 when absent), ``other`` and the step's wall time."""
    record = {phase: round(phases.get(phase, 0.0), 6) for phase in PHASES}
    on_path = sum(record[p] for p in ON_STEP_PATH)
    if synchronous_push:
        on_path += sum(record[p] for p in PUSH_PHASES)
    record["other"] = round(max(wall_s - on_path, 0.0), 6)
    record["step"] = round(wall_s, 6)
    return record


GENERATION_BOUND_WAIT = 0.10
"""A trainer that waits for groups more than this share of its wall time is generation-bound."""


def summarize_seconds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and fractions of wall time per phase over the steps, and which side bounds the run;
    the first step's one-off costs are left out."""
    timed = [r for r in records[1:] if "seconds" in r] or [r for r in records if "seconds" in r]
    if not timed:
        return {}
    steady = [r["seconds"] for r in timed]
    wall = sum(s["step"] for s in steady)
    totals = {phase: sum(s.get(phase, 0.0) for s in steady) for phase in (*PHASES, "other")}
    fractions = {phase: (seconds / wall if wall else 0.0) for phase, seconds in totals.items()}
    compute_wall = sum(totals[phase] for phase in COMPUTE_PHASES)
    compute_cpu = sum(r.get("compute_cpu_seconds", 0.0) for r in timed)
    return {
        "steps": len(steady),
        "wall_seconds": round(wall, 3),
        "steps_per_second": round(len(steady) / wall, 3) if wall else None,
        "seconds": {phase: round(value, 3) for phase, value in totals.items()},
        "fraction": {phase: round(value, 4) for phase, value in fractions.items()},
        "bound": "generation" if fractions["wait_groups"] > GENERATION_BOUND_WAIT else "training",
        "compute_cpu_share": round(min(compute_cpu / compute_wall, 1.0), 4) if compute_wall and compute_cpu else None,
    }


def with_lookahead(split: dict[str, Any], lookahead_versions: float | None, max_staleness: int) -> dict[str, Any]:
    """The split with the run's lookahead under paced admission. Below max_staleness the waits
    bought fresher groups, so the run is training-bound whatever it waited."""
    if not split or lookahead_versions is None:
        return split
    paced = {**split, "lookahead_versions": round(lookahead_versions, 3), "max_staleness": max_staleness}
    if lookahead_versions < max_staleness:
        paced["bound"] = "training"
    return paced


def format_split(split: dict[str, Any]) -> str:
    """One line a person reads: the big phases, as percentages of the steady-state wall time."""
    if not split:
        return "no steps timed"
    shown = sorted(
        ((phase, fraction) for phase, fraction in split["fraction"].items() if fraction >= 0.005),
        key=lambda item: -item[1],
    )
    parts = ", ".join(f"{phase} {100 * fraction:.0f}%" for phase, fraction in shown)
    line = (
        f"{split['steps']} steps at {split['steps_per_second']} steps/s, {split['bound']}-bound: {parts}"
        " (push_begin/transfer/commit overlap the next step when the push runs in the background)"
    )
    share = split.get("compute_cpu_share")
    if share is not None:
        line += f"; the training thread was on a CPU {100 * share:.0f}% of its forward/backward/optimizer time"
    lookahead, most = split.get("lookahead_versions"), split.get("max_staleness")
    if lookahead is not None and most is not None and lookahead < most:
        line += (
            f"; paced admission started groups {lookahead:.2f} of at most {most} versions ahead, "
            "so the waits bought fresher groups"
        )
    return line
