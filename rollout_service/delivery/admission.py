"""A run's policy versions and the admission they decide: may one more group start now?

V (``policy_version``) is what the servers hold for the run; T (``trainer_version``) runs one
ahead of V while a push is in flight. With ``max_staleness`` set, a group behind P pending
groups (reserved + buffered + leased) with k already trained at T trains at about
T + (k + P) / C, so it is admitted only while k + P < (max_staleness - (T - V) + 1) * C,
C being groups trained per version (learned as T moves; the consumers' credits until then).
When T == V, less than one version's worth pending is always admitted, so a wrong estimate
never starves the trainer; before the first version bump no bound applies. Paced admission
uses the learned ``Lookahead`` in place of max_staleness. Waits are timed on ``free_clock``,
which runs only while a slot is free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout_common.staleness import within_staleness
from rollout_service.delivery.lookahead import Lookahead
from rollout_service.metrics import ServiceMetrics
from rollout_service.versions import PolicyVersion, VersionChange


class RunAdmission:
    """The versions of one run, and whether they let one more group start."""

    def __init__(
        self,
        run_id: str,
        metrics: ServiceMetrics,
        max_staleness: int | None = None,
        versions: PolicyVersion | None = None,
        await_version: int = 0,
        free_clock: Callable[[], float] = time.monotonic,
        lookahead: Lookahead | None = None,
    ) -> None:
        self.run_id = run_id
        self.lookahead = lookahead
        """Paced admission's bound in place of max_staleness; None: staleness admission."""
        self.metrics = metrics
        self.max_staleness = max_staleness
        self.versions = versions if versions is not None else PolicyVersion()
        self._stop_watching = self.versions.watch(self._version_changed)
        self.await_version = await_version
        self.trained_by_version: dict[int, int] = {}
        """Groups acked as trained, by the trainer version they were trained at."""
        self.trained_per_version: float | None = None
        """C: moving average of groups trained per version; None until measured."""
        self.credits: dict[str, int] = {}
        """Credits each consumer subscribed with: C's stand-in until it is measured."""
        self.version_bumped = False
        self.admission_waits = 0
        """Reservations that had buffer room but waited for the staleness bound."""
        self.weights_requests = 0
        self.weights_wanted = ""
        """Why a push is wanted until the next commit ("": none is)."""
        self.free_clock = free_clock
        self._wait_seconds = 0.0
        self._held_back = 0
        """Reservations waiting because admission said no; the wait runs while this is > 0."""
        self._held_back_since = 0.0
        self._on_change: list[Callable[[], None]] = []
        self._watchers: set[Callable[[], None]] = set()

    def allows(self, pending: int) -> bool:
        """May a group start, with ``pending`` groups started and not yet consumed?"""
        return self.policy_version >= self.await_version and not self.doomed and self._within_budget(pending)

    @property
    def doomed(self) -> bool:
        """A group started now would be too stale for the trainer: wait for the commit instead."""
        return self.outdated(self.policy_version)

    def outdated(self, version: int) -> bool:
        """Samples started at ``version`` are beyond max_staleness: the trainer can only drop them."""
        return self.max_staleness is not None and not within_staleness(
            version, self.trainer_version, self.max_staleness
        )

    def _within_budget(self, pending: int) -> bool:
        per_version = self.groups_per_version
        if self.max_staleness is None or per_version is None:
            return True
        lag = self.trainer_version - self.policy_version
        budget = (self.lookahead_versions - lag + 1) * per_version - self.trained_at_version
        return pending < budget or (lag == 0 and pending < per_version)

    @property
    def lookahead_versions(self) -> float:
        """Versions ahead of the trainer groups may start: max_staleness, or less when paced."""
        if self.lookahead is not None:
            return self.lookahead.versions
        return float(self.max_staleness or 0)

    @property
    def groups_per_version(self) -> float | None:
        """C: measured, else (after a push) the consumers' credits, else unknown."""
        if self.trained_per_version is not None:
            return self.trained_per_version
        if not self.version_bumped:
            return None
        return float(sum(self.credits.values())) or None

    @property
    def trained_at_version(self) -> int:
        """k: groups acked as trained at the trainer's current version."""
        return self.trained_by_version.get(self.trainer_version, 0)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` synchronously whenever a version moves."""
        self._on_change.append(callback)

    @property
    def policy_version(self) -> int:
        return self.versions.served

    @property
    def trainer_version(self) -> int:
        return self.versions.trainer

    def set_policy_version(self, version: int) -> None:
        self.versions.commit(version)

    def set_trainer_version(self, version: int) -> None:
        self.versions.set_trainer(version)

    def _version_changed(self, change: VersionChange) -> None:
        """A commit satisfies a weights request; a move of T closes the version that ended."""
        if change.committed:
            self.weights_wanted = ""
            if not change.served_moved:
                return
            self.version_bumped = True
        if self.trainer_version > change.previous_trainer:
            self._version_ended(change.previous_trainer)
        for callback in self._on_change:
            callback()

    def _version_ended(self, ended: int) -> None:
        """Learn C from the trainer version that just ended (one with nothing trained teaches nothing)."""
        version = self.trainer_version
        if self.lookahead is not None:
            self.lookahead.version_ended()
            self.metrics.lookahead_versions.labels(self.run_id).set(self.lookahead.versions)
        trained = self.trained_by_version.pop(ended, 0)
        if trained:
            sample = trained / (version - ended)
            previous = self.trained_per_version
            self.trained_per_version = sample if previous is None else 0.5 * previous + 0.5 * sample
        for old in [v for v in self.trained_by_version if v < ended]:
            del self.trained_by_version[old]

    def trained(self, trained_at: int | None, mismatch_kl: float | None = None) -> int:
        """One group was acked as trained at this version (None: the current T), at this
        sampler-trainer mismatch (None: not measured); returns the version it is counted at."""
        version = self.trainer_version if trained_at is None else trained_at
        self.trained_by_version[version] = self.trained_by_version.get(version, 0) + 1
        if mismatch_kl is not None and self.lookahead is not None:
            self.lookahead.mismatch_reported(mismatch_kl)
        return version

    def forget(self) -> None:
        self._stop_watching()
        self.credits.clear()
        self.trained_by_version.clear()

    def request_weights(self, reason: str) -> None:
        """Ask the consumers for a push of the current weights (a restarted server waits for them)."""
        self.weights_requests += 1
        self.weights_wanted = reason
        self.wake_watchers()

    def wake_watchers(self) -> None:
        """Wake the run's consumer streams: they have a message to send."""
        for wake in list(self._watchers):
            wake()

    def watch(self, wake: Callable[[], None]) -> None:
        self._watchers.add(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._watchers.discard(wake)

    def hold_back(self, counts_as_staleness_wait: bool) -> None:
        """A reservation starts waiting; ``counts_as_staleness_wait``: the buffer had room."""
        if self._held_back == 0:
            self._held_back_since = self.free_clock()
        self._held_back += 1
        if counts_as_staleness_wait:
            self.admission_waits += 1
            self.metrics.admission_waits.labels(self.run_id).inc()

    def admit(self) -> None:
        """A reservation that waited stops waiting (admitted, or the run closed)."""
        self._held_back -= 1
        if self._held_back == 0:
            waited = self.free_clock() - self._held_back_since
            self._wait_seconds += waited
            self.metrics.admission_wait_seconds.labels(self.run_id).inc(waited)

    @property
    def admission_wait_seconds(self) -> float:
        """Seconds (on ``free_clock``) reservations waited, including one in progress."""
        running = self.free_clock() - self._held_back_since if self._held_back else 0.0
        return self._wait_seconds + running
