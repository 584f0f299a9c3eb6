"""How far ahead of the trainer a run generates: the least lookahead that keeps it busy.

Where training is the slower side, a lookahead of ``max_staleness`` only fills the buffer
and trains every group that many versions stale. ``Lookahead`` adapts it between 0 and
``max_staleness`` from what the broker sees per trainer version: *starved*, seconds a
consumer waited with nothing to take, and *slack*, the least time a group taken at this
version or the one before sat buffered (two versions, so a version whose trainer waited does
not cut the lookahead right back). Each version of ``step`` seconds moves it by
``GAIN * (TARGET_SLACK * step - slack + starved) / step``.

With ``max_mismatch_kl`` (which starts the lookahead at one version), the largest mismatch the
consumers report in a version (the k3 KL(pi_vllm || pi_trainer) of what they trained, which
grows with staleness) has the last word: over the bound the lookahead drops a version; within
half of it of the bound it may not grow.
Pacing keeps the trainer busy; the bound keeps what it trains near enough on-policy.
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

    def __init__(
        self, max_versions: int, clock: Callable[[], float] = time.monotonic, max_mismatch_kl: float = 0.0
    ) -> None:
        self.max_versions = max_versions
        self.max_mismatch_kl = max_mismatch_kl
        """0: no bound."""
        self.mismatch_kl = 0.0
        """The largest mismatch reported in the last version that reported one."""
        self.cuts = 0
        """Versions whose mismatch was over the bound."""
        self._version_mismatch: float | None = None
        self.clock = clock
        now = clock()
        # A bound starts one version ahead and lets pacing earn the rest: groups admitted at the
        # full lookahead before the first report would train that stale whatever it says.
        self.versions = float(min(1, max_versions) if max_mismatch_kl else max_versions)
        self._version_started = now
        self._starved = 0.0
        self.consumers_waiting = 0
        """Consumers waiting in ``take`` with nothing to take; starved time runs while > 0."""
        self._waiting_since = now
        self._slack: float | None = None
        self._previous_slack = 0.0
        """0 at the start, so the first version cannot lower the lookahead."""

    def consumer_waits(self) -> None:
        if self.consumers_waiting == 0:
            self._waiting_since = self.clock()
        self.consumers_waiting += 1

    def consumer_served(self) -> None:
        self.consumers_waiting -= 1
        if self.consumers_waiting == 0:
            self._starved += self.clock() - self._waiting_since

    def mismatch_reported(self, kl: float) -> None:
        """A consumer trained groups at this mismatch."""
        self._version_mismatch = kl if self._version_mismatch is None else max(self._version_mismatch, kl)

    def group_taken(self, seconds_buffered: float) -> None:
        self._slack = seconds_buffered if self._slack is None else min(self._slack, seconds_buffered)

    def restore(self, versions: float) -> None:
        """Set the lookahead, within 0 and ``max_versions``."""
        self.versions = min(float(self.max_versions), max(0.0, versions))

    def version_ended(self) -> None:
        """The trainer moved on a version: correct the lookahead by what this one showed."""
        now = self.clock()
        step = now - self._version_started
        starved = self._starved
        if self.consumers_waiting:
            starved += now - self._waiting_since
            self._waiting_since = now
        slack, mismatch = self._slack, self._version_mismatch
        self._version_started, self._starved, self._slack, self._version_mismatch = now, 0.0, None, None
        paced = self.versions
        if step > 0 and (slack is not None or starved > 0):  # else nothing was taken and nobody waited
            steady_slack = min(slack or 0.0, self._previous_slack)
            self._previous_slack = slack or 0.0
            paced += GAIN * (TARGET_SLACK * step - steady_slack + starved) / step
        self.restore(self._bounded(paced, mismatch))

    def _bounded(self, paced: float, mismatch: float | None) -> float:
        """Pacing's lookahead, held to the mismatch bound by this version's report."""
        if not self.max_mismatch_kl or mismatch is None:
            return paced
        self.mismatch_kl = mismatch
        if mismatch > self.max_mismatch_kl:
            self.cuts += 1
            return min(paced, self.versions - 1)
        if mismatch > self.max_mismatch_kl / 2:  # no headroom: hold
            return min(paced, self.versions)
        return paced
