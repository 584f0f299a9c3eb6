"""Holds a run's scored groups until consumers take them, and tracks what they hold.

Invariant: a scored group is in exactly one place: ``buffered`` (waiting), ``leased`` to
one consumer (sent, not acked), or gone (acked). A consumer that leaves returns its
unacked leases to the front of the buffer, so no group is lost and none is handed to two
consumers at once. Acks are idempotent by group id.

Staleness-aware admission: with ``max_staleness`` set, the broker also keeps the groups
started but not yet consumed (reserved + buffered + leased) within what the consumers will
train before those groups exceed max_staleness. Two versions matter: V, what the servers
hold (a group admitted now samples from it), and T, the trainer's, which runs one ahead of
V while a push is in flight (``set_trainer_version`` at its begin, and at an abort). A group
admitted now, behind P pending groups and with k groups already trained at T, trains at
about T + (k + P) / C, so it is admitted only while k + P < (max_staleness - (T - V) + 1) * C,
where C is the groups trained per trainer version. Acks say the version they were trained
at (an ack without one counts at T), so an ack that reaches the service after the next
push's begin still lands on the version it was trained at; C is learned as T moves on.
When T == V, a run whose pending groups are below one version's worth is always admitted,
so an estimate that is off never starves the trainer; while a push is in flight the
commit will come and re-open admission. Until C is measured, the consumers' credits
stand in for it (a trainer asks for one step's worth), once some trainer has pushed: a run
whose policy never changes has nothing to go stale, so before the first version bump only
max_buffered applies. ``await_version`` holds a run's generation until the servers hold at
least that version (the trainer's first push), so no group is generated from weights its
trainer will refuse.

Lease timeout: a consumer that stays connected but stops acking (a hung trainer) would hold
its groups for ever. With ``lease_timeout_s`` set, a lease older than that returns to the
front of the buffer for another consumer, and the late ack of the first holder is refused
with a message that says so; that consumer must not count the group as trained. The
consumer it expired on does not get it back while its stream lasts (both copies would be
trained and acked as one): another consumer takes it, or the same id after it reconnects.
Expiry is checked whenever a consumer waits for a group, so an expired group is handed out
as soon as anyone can take it.

Backpressure: the scheduler reserves a place (``reserve``) before it starts a group and
fills it with ``put`` or gives it back with ``unreserve`` (a dropped group); at most
``max_buffered`` groups are ever reserved or buffered, so a run without consumers stops
generating once that many groups wait, and memory stays bounded.

Admission wait: the seconds a reservation waited (full buffer, staleness bound, first
update) are measured on ``free_clock``, which the service makes a clock that runs only
while a slot is free: a run held back while every slot was busy lost nothing to admission.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from rollout_service.errors import AlreadyExists, FailedPrecondition
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import ScoredGroup

ACK_TRAINED = "trained"
ACK_DROPPED_STALE = "dropped_stale"
_ACK_MEMORY = 100_000


class RunBroker:
    """The buffer and leases of one run."""

    def __init__(
        self,
        run_id: str,
        max_buffered: int,
        metrics: ServiceMetrics,
        lease_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_staleness: int | None = None,
        policy_version: int = 0,
        await_version: int = 0,
        free_clock: Callable[[], float] | None = None,
    ) -> None:
        self.run_id = run_id
        self.max_buffered = max_buffered
        self.metrics = metrics
        self.lease_timeout_s = lease_timeout_s
        self.clock = clock
        self.buffered: deque[ScoredGroup] = deque()
        self.leases: dict[str, dict[str, ScoredGroup]] = {}
        self.lease_deadlines: dict[str, float] = {}
        """group id -> when its lease expires (only with a lease timeout), in lease order."""
        self.expired_from: OrderedDict[str, str] = OrderedDict()
        """group id -> the consumer whose lease on it expired, to explain a late ack."""
        self.expired_holder: dict[str, str] = {}
        """Buffered group id -> the consumer its lease expired on, which may not take it back
        while its stream lasts (it may still train its first copy)."""
        self.leases_expired = 0
        self.groups_returned = 0
        """Leased groups put back for another consumer (the consumer left, or its lease expired)."""
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self.await_version = await_version
        self.trainer_version = policy_version
        """T: the servers' version, plus one while a push is in flight."""
        self.trained_by_version: dict[int, int] = {}
        """Groups acked as trained, by the trainer version they were trained at (recent ones)."""
        self.trained_per_version: float | None = None
        """C: moving average of groups trained per version; None until measured."""
        self.credits: dict[str, int] = {}
        """Credits each consumer subscribed with: C's stand-in until it is measured."""
        self.version_bumped = False
        self.admission_waits = 0
        """Times a reservation found room in the buffer but waited for the staleness bound."""
        self.free_clock = free_clock if free_clock is not None else clock
        """Seconds on which admission waits are measured (default: every second counts)."""
        self._wait_seconds = 0.0
        self._held_back = 0
        """Reservations waiting because admission said no; the wait runs while this is > 0."""
        self._held_back_since = 0.0
        self._wakeups: set[asyncio.Task[None]] = set()
        self._reservers_waiting = 0
        """Reservations waiting for room: only then does an ack need to wake anyone."""
        self.acked: OrderedDict[str, str] = OrderedDict()
        self.ack_counts = {ACK_TRAINED: 0, ACK_DROPPED_STALE: 0}
        self.weights_requests = 0
        """Pushes asked of the run's trainer (``request_weights``), in all."""
        self.weights_wanted = ""
        """Why a push is wanted, until the next version commits ("" : none is)."""
        self._watchers: set[Callable[[], None]] = set()
        self.reserved = 0
        self.closed = False
        self.draining = False
        """Set at shutdown (``drain``): no group is started or handed out any more."""
        self.closed_event = asyncio.Event()
        """Set by ``close``: wakes a consumer stream that has no credits to take with."""
        self._changed = asyncio.Condition()

    # -- producer side -------------------------------------------------------------------
    def has_room(self) -> bool:
        return self._buffer_has_room() and self.policy_version >= self.await_version and self._within_staleness()

    def _buffer_has_room(self) -> bool:
        return len(self.buffered) + self.reserved < self.max_buffered

    @property
    def groups_per_version(self) -> float | None:
        """C as admission uses it: measured, else (after a push) the consumers' credits, else unknown."""
        if self.trained_per_version is not None:
            return self.trained_per_version
        if not self.version_bumped:
            return None
        return float(sum(self.credits.values())) or None

    def _within_staleness(self) -> bool:
        per_version = self.groups_per_version
        if self.max_staleness is None or per_version is None:
            return True
        pending = self.reserved + len(self.buffered) + self.num_leased
        lag = self.trainer_version - self.policy_version
        budget = (self.max_staleness - lag + 1) * per_version - self.trained_at_version
        return pending < budget or (lag == 0 and pending < per_version)

    @property
    def trained_at_version(self) -> int:
        """k: groups acked as trained at the trainer's current version."""
        return self.trained_by_version.get(self.trainer_version, 0)

    async def reserve(self) -> bool:
        """Wait for room and reserve a place for one group; False once the run is closed."""
        async with self._changed:
            held_back = not self.has_room() and not self.closed
            if held_back:
                self._hold_back()
                if self._buffer_has_room():
                    self.admission_waits += 1
                    self.metrics.admission_waits.labels(self.run_id).inc()
            self._reservers_waiting += 1
            try:
                await self._changed.wait_for(lambda: self.has_room() or self.closed or self.draining)
            finally:
                self._reservers_waiting -= 1
                if held_back:
                    self._admit()
            if self.closed or self.draining:
                return False
            self.reserved += 1
            return True

    @property
    def admission_wait_seconds(self) -> float:
        """Seconds (on ``free_clock``) a reservation waited for admission; a wait in progress
        counts up to now."""
        running = self.free_clock() - self._held_back_since if self._held_back else 0.0
        return self._wait_seconds + running

    def _hold_back(self) -> None:
        if self._held_back == 0:
            self._held_back_since = self.free_clock()
        self._held_back += 1

    def _admit(self) -> None:
        self._held_back -= 1
        if self._held_back == 0:
            waited = self.free_clock() - self._held_back_since
            self._wait_seconds += waited
            self.metrics.admission_wait_seconds.labels(self.run_id).inc(waited)

    def set_policy_version(self, version: int) -> None:
        """The servers now hold this version (a push committed)."""
        if version <= self.policy_version:
            return
        self.policy_version = version
        self.weights_wanted = ""
        self.version_bumped = True
        self._advance_trainer(max(version, self.trainer_version))
        self._wake_soon()

    def set_trainer_version(self, version: int) -> None:
        """The trainer's weights are at this version: one ahead of the servers' when a push
        begins, the servers' again when it is aborted."""
        if version > self.trainer_version:
            self._advance_trainer(version)
        elif version < self.trainer_version:
            self.trainer_version = max(version, self.policy_version)
        self._wake_soon()

    def _advance_trainer(self, version: int) -> None:
        """Move T forward and learn C from the version that just ended (one with nothing
        trained, like the one before a trainer's first push, teaches nothing)."""
        ended = self.trainer_version
        if version <= ended:
            return
        self.trainer_version = version
        trained = self.trained_by_version.pop(ended, 0)
        if trained:
            sample = trained / (version - ended)
            previous = self.trained_per_version
            self.trained_per_version = sample if previous is None else 0.5 * previous + 0.5 * sample
        for old in [v for v in self.trained_by_version if v < ended]:
            del self.trained_by_version[old]

    def _wake_soon(self) -> None:
        """Wake waiters from synchronous code (notify needs the condition's lock)."""

        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        task = asyncio.get_running_loop().create_task(notify())
        self._wakeups.add(task)
        task.add_done_callback(self._wakeups.discard)

    async def unreserve(self) -> None:
        async with self._changed:
            self.reserved -= 1
            self._changed.notify_all()

    async def put(self, group: ScoredGroup) -> None:
        async with self._changed:
            self.reserved -= 1
            self.buffered.append(group)
            self._update_gauges()
            self._changed.notify_all()

    # -- asking the trainer for its weights ---------------------------------------------
    def request_weights(self, reason: str) -> None:
        """Ask the run's consumers for a push of its current weights now (a restarted server
        waits for them): every stream sends one WeightsWanted, also one that subscribes
        before the next push commits."""
        self.weights_requests += 1
        self.weights_wanted = reason
        for wake in list(self._watchers):
            wake()

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` on every weights request (a consumer stream's wake-up)."""
        self._watchers.add(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._watchers.discard(wake)

    # -- consumer side -------------------------------------------------------------------
    def subscribe(self, consumer_id: str, credits: int = 0) -> None:
        if self.closed:
            raise FailedPrecondition(f"run {self.run_id} is stopped; create a new run")
        if consumer_id in self.leases:
            raise AlreadyExists(
                f"consumer {consumer_id!r} is already subscribed to run {self.run_id}; "
                "use a unique consumer_id per trainer process"
            )
        self.leases[consumer_id] = {}
        self.credits[consumer_id] = credits

    async def take(self, consumer_id: str) -> ScoredGroup | None:
        """Wait for a group and lease it to the consumer; None once the run is closed.

        Cancellation-safe: the group is leased only on return, with no await in between.
        """
        async with self._changed:
            while True:
                self._expire_leases()
                index = self._first_for(consumer_id)
                if (index is not None and not self.draining) or self.closed or consumer_id not in self.leases:
                    break
                try:
                    async with asyncio.timeout(self._seconds_to_next_expiry()):
                        await self._changed.wait()
                except TimeoutError:
                    pass  # a lease expired: loop to return it to the buffer
            if index is None or self.draining or consumer_id not in self.leases:
                return None
            group = self.buffered[index]
            del self.buffered[index]
            self.expired_holder.pop(group.group_id, None)
            self.leases[consumer_id][group.group_id] = group
            if self.lease_timeout_s is not None:
                self.lease_deadlines[group.group_id] = self.clock() + self.lease_timeout_s
            self._update_gauges()
            self._changed.notify_all()
            return group

    def _first_for(self, consumer_id: str) -> int | None:
        """Index of the oldest buffered group this consumer may take: any but those whose
        lease expired on it (it may still hold and train its first copy)."""
        for index, group in enumerate(self.buffered):
            if self.expired_holder.get(group.group_id) != consumer_id:
                return index
        return None

    def _seconds_to_next_expiry(self) -> float | None:
        if not self.lease_deadlines:
            return None
        return max(0.0, next(iter(self.lease_deadlines.values())) - self.clock())

    def _expire_leases(self) -> None:
        """Return leases past their deadline to the front of the buffer, oldest first."""
        now, expired = self.clock(), []
        for group_id, deadline in self.lease_deadlines.items():
            if deadline > now:
                break  # deadlines are in lease order, and every lease has the same timeout
            expired.append(group_id)
        returned = []
        for group_id in expired:
            del self.lease_deadlines[group_id]
            for consumer_id, leased in self.leases.items():
                if group_id in leased:
                    returned.append(leased.pop(group_id))
                    self._remember(self.expired_from, group_id, consumer_id)
                    self.expired_holder[group_id] = consumer_id
                    break
        if returned:
            self.buffered.extendleft(reversed(returned))
            self.leases_expired += len(returned)
            self.groups_returned += len(returned)
            self.metrics.groups_returned.labels(self.run_id, "lease_expired").inc(len(returned))
            self._update_gauges()

    def ack(self, consumer_id: str, group_ids: list[str], status: str, trained_at: int | None = None) -> int:
        """Remove acked groups; returns how many were newly acked. Repeats are no-ops.
        ``trained_at``: the trainer version they were trained at (None: the current T)."""
        leased = self.leases.get(consumer_id, {})
        newly = 0
        for group_id in group_ids:
            if group_id not in leased and self.expired_from.get(group_id) == consumer_id:
                raise FailedPrecondition(
                    f"the lease of group {group_id!r} expired (after {self.lease_timeout_s}s without an ack) "
                    "and it went back to the run for another consumer; do not count it as trained here"
                )
            if group_id in self.acked:
                continue
            if group_id not in leased:
                raise FailedPrecondition(
                    f"group {group_id!r} is not leased to consumer {consumer_id!r}; "
                    "ack only groups this stream received"
                )
            del leased[group_id]
            self.lease_deadlines.pop(group_id, None)
            if self.expired_from.get(group_id) == consumer_id:
                del self.expired_from[group_id]  # it came back to this consumer, which acked it
            self._remember(self.acked, group_id, status)
            self.ack_counts[status] += 1
            if status == ACK_TRAINED:
                version = self.trainer_version if trained_at is None else trained_at
                self.trained_by_version[version] = self.trained_by_version.get(version, 0) + 1
            self.metrics.groups_acked.labels(self.run_id, status).inc()
            newly += 1
        self._update_gauges()
        if newly and (self._reservers_waiting or self.draining):
            self._wake_soon()  # consumption frees admission room; nobody to wake is the common case
        return newly

    async def release(self, consumer_id: str) -> int:
        """The consumer left: its unacked groups go back to the front, oldest first."""
        async with self._changed:
            leased = self.leases.pop(consumer_id, {})
            self.credits.pop(consumer_id, None)
            # Its stream is gone, so it holds no first copy: its expired groups may go to anyone.
            for group_id in [g for g, holder in self.expired_holder.items() if holder == consumer_id]:
                del self.expired_holder[group_id]
            for group_id in leased:
                self.lease_deadlines.pop(group_id, None)
            self.buffered.extendleft(reversed(list(leased.values())))
            self.groups_returned += len(leased)
            if leased:
                self.metrics.groups_returned.labels(self.run_id, "consumer_left").inc(len(leased))
            self._update_gauges()
            self._changed.notify_all()
        return len(leased)

    def discard_all(self) -> int:
        """After ``close`` (the run was deleted): drop every group and the memories of acks,
        expiries and versions; returns how many groups were buffered or leased."""
        freed = len(self.buffered) + self.num_leased
        self.buffered.clear()
        self.leases.clear()
        self.credits.clear()
        self.lease_deadlines.clear()
        self.acked.clear()
        self.expired_from.clear()
        self.expired_holder.clear()
        self.trained_by_version.clear()
        return freed

    async def drain(self) -> None:
        """Shutting down: start no group and hand out none, so the groups leased now can only
        be acked or returned (``wait_leases_settled``)."""
        async with self._changed:
            self.draining = True
            self._changed.notify_all()

    async def wait_leases_settled(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.num_leased == 0 or self.closed)

    async def close(self) -> None:
        async with self._changed:
            self.closed = True
            self.closed_event.set()
            self._changed.notify_all()

    @staticmethod
    def _remember(memory: OrderedDict[str, str], key: str, value: str) -> None:
        """Bounded memory of group ids (acks, expiries), forgetting the oldest."""
        memory[key] = value
        if len(memory) > _ACK_MEMORY:
            memory.popitem(last=False)

    @property
    def num_leased(self) -> int:
        return sum(len(v) for v in self.leases.values())

    def _update_gauges(self) -> None:
        if self.closed:
            return  # a deleted run's series are removed; a late release must not bring them back
        self.metrics.queue_depth.labels(self.run_id).set(len(self.buffered))
        self.metrics.groups_leased.labels(self.run_id).set(self.num_leased)
