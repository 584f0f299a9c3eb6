"""How far ahead of the trainer a run generates: the least lookahead that keeps it busy.

Staleness-aware admission lets a group start while the run's pending groups fit in
``max_staleness + 1`` trainer versions. That much lookahead is what a generation-bound run
needs, but where training is the slower side it only fills the buffer: every group then
waits there about ``max_staleness`` steps and is trained that many versions stale, which
costs learning for no speed (on a training-bound model, staleness 1 reached the target
sooner than staleness 2 at the same step rate: ``benchmarks/SPEED_HISTORY.md``).

``Lookahead`` adapts the bound, in versions, between 0 and ``max_staleness``, from two
times the broker sees at each trainer version:
- *starved*: seconds some consumer waited for a group with nothing to take (its credits are
  one step's worth, so it was waiting to start its step);
- *slack*: the least time any group taken at this version or the one before sat in the
  buffer, i.e. how much later the latest of them could have started and still been on time.
  Over two versions, because a version whose trainer waited lets generation run ahead, so
  the next one's groups are ready early: read alone, that slack would cut the lookahead
  right back and the trainer would wait every other step (as it did with the first form of
  this controller: ``benchmarks/SPEED_HISTORY.md``).

At the end of each version of ``step`` seconds the lookahead moves by
``GAIN * (TARGET_SLACK * step - slack + starved) / step`` versions: up when the trainer
waited or the groups only just made it, down when every group waited longer than
``TARGET_SLACK`` of a step. A generation-bound run starves a little every step, so it stays
at ``max_staleness`` (staleness admission's bound); a training-bound one comes down until its last
group arrives just before it is needed. The error is in seconds and divided by the step, so
one gain fits any model size; the gain below one damps the one or two versions it takes a
change to show up (the groups in flight were admitted under the old bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable

GAIN = 0.5
"""Share of a version's error corrected at once."""
TARGET_SLACK = 0.1
"""Wanted margin, as a share of a step: the last group of a step ready this early."""


class Lookahead:
    """The lookahead of one run, in trainer versions, learned from its consumers' waits."""

    def __init__(self, max_versions: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_versions = max_versions
        self.clock = clock
        now = clock()
        self.versions = float(max_versions)
        """The current lookahead: admission uses it in place of max_staleness."""
        self._version_started = now
        self._starved = 0.0
        self._waiting = 0
        """Consumers waiting in ``take`` with nothing to take; starved time runs while > 0."""
        self._waiting_since = now
        self._slack: float | None = None
        self._previous_slack = 0.0
        """The slack of the version before; 0 at the start, so the first version cannot lower it."""
        self.updates = 0

    # -- what the broker reports -----------------------------------------------------------
    def consumer_waits(self) -> None:
        """A consumer found nothing to take and waits."""
        if self._waiting == 0:
            self._waiting_since = self.clock()
        self._waiting += 1

    def consumer_served(self) -> None:
        """A waiting consumer got a group, or stopped waiting."""
        self._waiting -= 1
        if self._waiting == 0:
            self._starved += self.clock() - self._waiting_since

    def group_taken(self, seconds_buffered: float) -> None:
        """A group was taken after sitting ``seconds_buffered`` in the buffer."""
        self._slack = seconds_buffered if self._slack is None else min(self._slack, seconds_buffered)

    def restore(self, versions: float) -> None:
        """A restarted service's stored lookahead."""
        self._set(versions)

    def _set(self, versions: float) -> None:
        """Within this run's bounds: 0 to max_staleness versions."""
        self.versions = min(float(self.max_versions), max(0.0, versions))

    @property
    def consumers_waiting(self) -> int:
        return self._waiting

    # -- the update ------------------------------------------------------------------------
    def version_ended(self) -> None:
        """The trainer moved on a version: correct the lookahead by what this one showed."""
        now = self.clock()
        step = now - self._version_started
        starved = self._starved
        if self._waiting:
            starved += now - self._waiting_since
            self._waiting_since = now
        slack = self._slack
        self._version_started, self._starved, self._slack = now, 0.0, None
        if step <= 0 or (slack is None and starved == 0):
            return  # nothing was taken and nobody waited: nothing to learn from
        slack = slack or 0.0
        steady_slack = min(slack, self._previous_slack)
        self._previous_slack = slack
        error = (TARGET_SLACK * step - steady_slack + starved) / step
        self._set(self.versions + GAIN * error)
        self.updates += 1
