"""A run's policy versions and the admission they decide: may one more group start now?

One object per run owns both, because admission is a function of the versions: weight sync
and adapter pushes move the versions here, the scheduler's reservations wait on the answer
(through the run's broker, which adds its buffer bound), and acks report what was trained.

Two versions matter, both read from the run's ``PolicyVersion`` (``rollout_service.versions``,
their one owner, shared by the runs on the base weights): V (``policy_version``), what the
servers hold for this run (a group admitted now samples from it), and T (``trainer_version``),
the trainer's, which runs one ahead of V while a push is in flight.

Staleness-aware admission: with ``max_staleness`` set, the groups started but not yet
consumed (reserved + buffered + leased: "pending", counted by the broker) stay within what
the consumers will train before those groups exceed max_staleness. A group admitted now,
behind P pending groups and with k groups already trained at T, trains at about
T + (k + P) / C, so it is admitted only while k + P < (max_staleness - (T - V) + 1) * C,
where C is the groups trained per trainer version. Acks say the version they were trained
at (an ack without one counts at T), so an ack that reaches the service after the next
push's begin still lands on the version it was trained at; C is learned as T moves on.
When T == V, a run whose pending groups are below one version's worth is always admitted,
so an estimate that is off never starves the trainer; while a push is in flight the commit
will come and re-open admission. Until C is measured, the consumers' credits stand in for
it (a trainer asks for one step's worth), once some trainer has pushed: a run whose policy
never changes has nothing to go stale, so before the first version bump no staleness bound
applies. ``await_version`` holds a run's generation until the servers hold at least that
version (the trainer's first push), so no group is generated from weights its trainer will
refuse, and ``doomed`` (with either admission) holds it while the servers' version is more
than max_staleness behind the trainer's, for the same reason.

Paced admission (``lookahead``, ``delivery/lookahead.py``): the same bound with the run's
learned lookahead in place of max_staleness, so a run whose trainer is the slower side
generates only as far ahead as keeps it busy, and trains fresher groups.

Admission wait: the seconds a reservation waited are measured on ``free_clock``, which the
service makes a clock that runs only while a slot is free: a run held back while every slot
was busy lost nothing to admission.
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
        """Paced admission: the lookahead that replaces max_staleness in the bound; None: staleness as given."""
        self.metrics = metrics
        self.max_staleness = max_staleness
        self.versions = versions if versions is not None else PolicyVersion()
        self._stop_watching = self.versions.watch(self._version_changed)
        self.await_version = await_version
        self.trained_by_version: dict[int, int] = {}
        """Groups acked as trained, by the trainer version they were trained at (recent ones)."""
        self.trained_per_version: float | None = None
        """C: moving average of groups trained per version; None until measured."""
        self.credits: dict[str, int] = {}
        """Credits each consumer subscribed with: C's stand-in until it is measured."""
        self.version_bumped = False
        self.admission_waits = 0
        """Times a reservation found room in the buffer but waited for the staleness bound."""
        self.weights_requests = 0
        """Pushes asked of the run's trainer (``request_weights``), in all."""
        self.weights_wanted = ""
        """Why a push is wanted, until the next version commits ("" : none is)."""
        self.free_clock = free_clock
        self._wait_seconds = 0.0
        self._held_back = 0
        """Reservations waiting because admission said no; the wait runs while this is > 0."""
        self._held_back_since = 0.0
        self._on_change: list[Callable[[], None]] = []
        self._watchers: set[Callable[[], None]] = set()

    # -- the answer ----------------------------------------------------------------------
    def allows(self, pending: int) -> bool:
        """May a group start, with ``pending`` groups started and not yet consumed?"""
        return self.policy_version >= self.await_version and not self.doomed and self._within_budget(pending)

    @property
    def doomed(self) -> bool:
        """A group started now, on the servers' version, would be more than max_staleness
        behind the trainer's: the trainer would drop it (a push is in flight with
        max_staleness 0, say). Wait for the commit instead of generating it."""
        return self.outdated(self.policy_version)

    def outdated(self, version: int) -> bool:
        """Samples started at ``version`` are more than max_staleness behind the trainer's
        version, so it can only drop them (always False without max_staleness: nothing trains). The
        scheduler aborts in-flight groups on the same rule."""
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
        """How many versions ahead of the trainer groups may start: max_staleness, or less
        under paced admission (0 without a staleness bound)."""
        if self.lookahead is not None:
            return self.lookahead.versions
        return float(self.max_staleness or 0)

    @property
    def groups_per_version(self) -> float | None:
        """C as admission uses it: measured, else (after a push) the consumers' credits, else unknown."""
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
        """Call ``callback`` (synchronously) whenever a version moves: waiters may now be admitted."""
        self._on_change.append(callback)

    # -- versions ------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """V: the version the servers hold for this run."""
        return self.versions.served

    @property
    def trainer_version(self) -> int:
        """T: the servers' version, plus one while a push is in flight."""
        return self.versions.trainer

    def set_policy_version(self, version: int) -> None:
        """The servers now hold this version (``PolicyVersion.commit``)."""
        self.versions.commit(version)

    def set_trainer_version(self, version: int) -> None:
        """The trainer's weights are at this version (``PolicyVersion.set_trainer``)."""
        self.versions.set_trainer(version)

    def _version_changed(self, change: VersionChange) -> None:
        """A commit (a resend commits the same version) brings the weights a restarted server
        wanted; a move of T closes the version that ended."""
        if change.committed:
            self.weights_wanted = ""
            if not change.served_moved:
                return
            self.version_bumped = True
        if self.trainer_version > change.previous_trainer:
            self._version_ended(change.previous_trainer)
        self._changed()

    def _version_ended(self, ended: int) -> None:
        """Learn C from the trainer version that just ended (one with nothing trained, like
        the one before a trainer's first push, teaches nothing)."""
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

    def _changed(self) -> None:
        for callback in self._on_change:
            callback()

    # -- what consumers report -----------------------------------------------------------
    def consumer_joined(self, consumer_id: str, credits: int) -> None:
        self.credits[consumer_id] = credits

    def consumer_left(self, consumer_id: str) -> None:
        self.credits.pop(consumer_id, None)

    def trained(self, trained_at: int | None) -> None:
        """One group was acked as trained at this trainer version (None: the current T)."""
        version = self.trainer_version if trained_at is None else trained_at
        self.trained_by_version[version] = self.trained_by_version.get(version, 0) + 1

    def forget(self) -> None:
        """The run was deleted: stop watching its versions, drop what consumers reported."""
        self._stop_watching()
        self.credits.clear()
        self.trained_by_version.clear()

    # -- asking the trainer for its weights ----------------------------------------------
    def request_weights(self, reason: str) -> None:
        """Ask the run's consumers for a push of its current weights now (a restarted server
        waits for them): every stream sends one WeightsWanted, also one that subscribes
        before the next push commits."""
        self.weights_requests += 1
        self.weights_wanted = reason
        self.wake_watchers()

    def wake_watchers(self) -> None:
        """Wake the run's consumer streams: they have a message to send (weights wanted, a stall)."""
        for wake in list(self._watchers):
            wake()

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` on every weights request (a consumer stream's wake-up)."""
        self._watchers.add(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._watchers.discard(wake)

    # -- how long admission held the run back --------------------------------------------
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
        """Seconds (on ``free_clock``) a reservation waited for admission; a wait in progress
        counts up to now."""
        running = self.free_clock() - self._held_back_since if self._held_back else 0.0
        return self._wait_seconds + running
