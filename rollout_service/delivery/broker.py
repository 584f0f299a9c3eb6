"""Holds a run's scored groups until consumers take them, and tracks what they hold.

Invariant: a group is in exactly one place: ``buffered``, ``leased`` to one consumer, or
gone (acked); a consumer that leaves returns its leases to the front of the buffer. Acks are
idempotent by group id. With ``lease_timeout_s``, an expired lease returns to the buffer,
the first holder's late ack is refused, and that holder does not get it back while its
stream lasts (both copies would be trained). The scheduler ``reserve``s a place before it
starts a group, so at most ``max_buffered`` groups are ever reserved or buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from rollout_service.delivery.admission import RunAdmission
from rollout_service.delivery.audit import BiasAudit
from rollout_service.delivery.ledger import GoodputLedger, LedgerSnapshot
from rollout_service.delivery.state_store import ACKED_KEPT, MemoryStore, StateStore
from rollout_service.errors import AlreadyExists, FailedPrecondition, echo
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import ScoredGroup

logger = logging.getLogger(__name__)

ACK_TRAINED = "trained"
ACK_DROPPED_STALE = "dropped_stale"


class RunBroker:
    def __init__(
        self,
        run_id: str,
        max_buffered: int,
        metrics: ServiceMetrics,
        lease_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        admission: RunAdmission | None = None,
        store: StateStore | None = None,
    ) -> None:
        self.run_id = run_id
        self.store: StateStore = store if store is not None else MemoryStore()
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
        """Buffered group id -> the consumer its lease expired on, which may not take it back."""
        self.leases_expired = 0
        self.groups_returned = 0
        """Leased groups put back (the consumer left, or its lease expired)."""
        self.admission = admission if admission is not None else RunAdmission(run_id, metrics, free_clock=clock)
        self.admission.on_change(self._wake_soon)
        self._wakeups: set[asyncio.Task[None]] = set()
        self._reservers_waiting = 0
        """Reservations waiting for room: only then does an ack need to wake anyone."""
        self.acked: OrderedDict[str, str] = OrderedDict()
        self.ack_counts = {ACK_TRAINED: 0, ACK_DROPPED_STALE: 0}
        self.restored: set[str] = set()
        """Restored, unacked group ids: their pre-restart consumer may ack them without a lease."""
        self.deliveries: dict[str, int] = {}
        """Times each unacked group has been leased; a redelivery says so."""
        self.buffered_at: dict[str, float] = {}
        """group id -> when ``put`` buffered it (paced admission's slack)."""
        self.ledger = GoodputLedger()
        """Where the run's generated tokens went; the broker settles what consumers ack."""
        self.audit = BiasAudit(run_id)
        """Whether what the run trains looks like what it starts; the broker tells it what is trained."""
        self.reserved = 0
        self.closed = False
        self.draining = False
        """Set at shutdown: no group is started or handed out any more."""
        self.closed_event = asyncio.Event()
        self.finished_event = asyncio.Event()
        self.waits_for_acks = True
        """Once finished, whether streams end only when every group is acked (``exhausted``) or as
        soon as none is left for them (``handed_out_to``: a failed run, whose trainers stop)."""
        self._changed = asyncio.Condition()

    def has_room(self) -> bool:
        return self._buffer_has_room() and self.admission.allows(self.pending)

    def _buffer_has_room(self) -> bool:
        return len(self.buffered) + self.reserved < self.max_buffered

    @property
    def pending(self) -> int:
        return self.reserved + len(self.buffered) + self.num_leased

    async def reserve(self) -> bool:
        """Wait for room and reserve a place for one group; False once the run is closed."""
        async with self._changed:
            held_back = not self.has_room() and not self.closed
            if held_back:
                self.admission.hold_back(counts_as_staleness_wait=self._buffer_has_room())
            self._reservers_waiting += 1
            try:
                await self._changed.wait_for(lambda: self.has_room() or self.closed or self.draining)
            finally:
                self._reservers_waiting -= 1
                if held_back:
                    self.admission.admit()
            if self.closed or self.draining:
                return False
            self.reserved += 1
            return True

    def _wake_soon(self) -> None:
        """Wake waiters from synchronous code (notify needs the condition's lock)."""

        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        task = asyncio.get_running_loop().create_task(notify())
        self._wakeups.add(task)
        task.add_done_callback(self._wakeups.discard)

    def finish(self, *, wait_for_acks: bool = True) -> None:
        """No group will be added: streams end once the rest are acked (``exhausted``), or, without
        ``wait_for_acks``, each once none is left for it (``handed_out_to``)."""
        self.waits_for_acks = self.waits_for_acks and wait_for_acks
        self.finished_event.set()
        self._wake_soon()

    @property
    def exhausted(self) -> bool:
        return self.finished_event.is_set() and not self.buffered and not self.num_leased

    def handed_out_to(self, consumer_id: str) -> bool:
        """Whether a stream of a run finished without ``wait_for_acks`` ends: none of the buffered
        groups is left for it (one whose lease expired on it is another's)."""
        return self.finished_event.is_set() and not self.waits_for_acks and self._first_for(consumer_id) is None

    async def wait_handed_out_to(self, consumer_id: str) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.closed or self.handed_out_to(consumer_id))

    async def unreserve(self) -> None:
        async with self._changed:
            self.reserved -= 1
            self._changed.notify_all()

    async def put(self, group: ScoredGroup) -> None:
        """Buffer a group once it is durable, so a restart never forgets a group a consumer took."""
        try:
            await self.store.put_group(group)
        except Exception:
            logger.exception("group %s could not be stored; it is kept in memory only", group.group_id)
        async with self._changed:
            self.reserved -= 1
            self.buffered.append(group)
            if self.admission.lookahead is not None:
                self.buffered_at[group.group_id] = self.clock()
            self._update_gauges()
            self._changed.notify_all()

    def subscribe(self, consumer_id: str, credits: int = 0) -> None:
        if self.closed:
            raise FailedPrecondition(f"run {self.run_id} is stopped; create a new run")
        if consumer_id in self.leases:
            raise AlreadyExists(
                f"consumer {echo(consumer_id)} is already subscribed to run {self.run_id}; "
                "use a unique consumer_id per trainer process"
            )
        self.leases[consumer_id] = {}
        self.admission.credits[consumer_id] = credits

    async def take(self, consumer_id: str) -> ScoredGroup | None:
        """Wait for a group and lease it; None once closed. Cancellation-safe: no await after the lease."""
        async with self._changed:
            lookahead, starving = self.admission.lookahead, False
            try:
                while True:
                    self._expire_leases()
                    index = self._first_for(consumer_id)
                    if (
                        (index is not None and not self.draining)
                        or self.closed
                        or consumer_id not in self.leases
                        or self.exhausted
                        or self.handed_out_to(consumer_id)
                    ):
                        break
                    if lookahead is not None and not starving:
                        lookahead.consumer_waits()
                        starving = True
                    with contextlib.suppress(TimeoutError):  # a lease expired: loop to return it to the buffer
                        async with asyncio.timeout(self._seconds_to_next_expiry()):
                            await self._changed.wait()
            finally:
                if starving and lookahead is not None:
                    lookahead.consumer_served()
            if index is None or self.draining or consumer_id not in self.leases:
                return None
            group = self.buffered[index]
            del self.buffered[index]
            if self.finished_event.is_set() and not self.waits_for_acks:
                self._changed.notify_all()  # the other streams may have none left: they end
            if (buffered_at := self.buffered_at.pop(group.group_id, None)) is not None and lookahead is not None:
                lookahead.group_taken(self.clock() - buffered_at)
            self.expired_holder.pop(group.group_id, None)
            self.deliveries[group.group_id] = self.deliveries.get(group.group_id, 0) + 1
            self.leases[consumer_id][group.group_id] = group
            if self.lease_timeout_s is not None:
                self.lease_deadlines[group.group_id] = self.clock() + self.lease_timeout_s
            self._update_gauges()
            self._changed.notify_all()
            return group

    def _first_for(self, consumer_id: str) -> int | None:
        """Index of the oldest buffered group this consumer may take (not one that expired on it)."""
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

    def ack(
        self,
        consumer_id: str,
        group_ids: list[str],
        status: str,
        trained_at: int | None = None,
        mismatch_kl: float | None = None,
    ) -> int:
        """Remove acked groups; returns how many were newly acked (repeats are no-ops)."""
        leased = self.leases.get(consumer_id, {})
        newly = 0
        for group_id in group_ids:
            if group_id not in leased and self.expired_from.get(group_id) == consumer_id:
                raise FailedPrecondition(
                    f"the lease of group {echo(group_id)} expired (after {self.lease_timeout_s}s without an ack) "
                    "and it went back to the run for another consumer; do not count it as trained here"
                )
            if group_id in self.acked:
                continue
            # Unleased, only a restored group may be acked: its consumer held it before the restart.
            group = leased.pop(group_id, None) or self._take_restored(group_id)
            if group is None:
                raise FailedPrecondition(
                    f"group {echo(group_id)} is not leased to consumer {echo(consumer_id)}; "
                    "ack only groups this stream received"
                )
            self.restored.discard(group_id)
            self.lease_deadlines.pop(group_id, None)
            self.deliveries.pop(group_id, None)
            if self.expired_from.get(group_id) == consumer_id:
                del self.expired_from[group_id]  # it came back to this consumer, which acked it
            self._remember(self.acked, group_id, status)
            self.ack_counts[status] += 1
            self.ledger.acked(group, status)
            if status == ACK_TRAINED:
                version = self.admission.trained(trained_at, mismatch_kl)
                self.audit.trained(group, max(0, version - group.policy_version))
            self.metrics.groups_acked.labels(self.run_id, status).inc()
            self.store.ack(self.run_id, [group_id], status)
            newly += 1
        self._update_gauges()
        if newly and (self._reservers_waiting or self.draining or self.finished_event.is_set()):
            self._wake_soon()  # admission room, or the streams' end; nobody to wake is the common case
        return newly

    async def release(self, consumer_id: str) -> int:
        """The consumer left: its unacked groups go back to the front, oldest first."""
        async with self._changed:
            leased = self.leases.pop(consumer_id, {})
            self.admission.credits.pop(consumer_id, None)
            # Its stream is gone, so it holds no first copy: its expired groups may go to anyone.
            self.expired_holder = {g: holder for g, holder in self.expired_holder.items() if holder != consumer_id}
            for group_id in leased:
                self.lease_deadlines.pop(group_id, None)
            self.buffered.extendleft(reversed(list(leased.values())))
            self.groups_returned += len(leased)
            if leased:
                self.metrics.groups_returned.labels(self.run_id, "consumer_left").inc(len(leased))
            self._update_gauges()
            self._changed.notify_all()
        return len(leased)

    def restore(self, groups: list[ScoredGroup], acked: dict[str, str]) -> None:
        """A restarted service's unacked groups (buffered, as if their consumers had left) and acked ids."""
        self.buffered.extend(groups)
        self.ledger.restored_groups(groups)
        self.restored.update(group.group_id for group in groups)
        for group_id, status in acked.items():
            self._remember(self.acked, group_id, status)
        self._update_gauges()

    def _take_restored(self, group_id: str) -> ScoredGroup | None:
        """Take a restored group acked by its pre-restart consumer out of the buffer; None if not there."""
        if group_id not in self.restored:
            return None
        for index, group in enumerate(self.buffered):
            if group.group_id == group_id:
                del self.buffered[index]
                return group
        return None

    def discard_all(self) -> int:
        """After ``close`` of a deleted run: drop everything; returns how many groups were held."""
        freed = len(self.buffered) + self.num_leased
        self.ledger.cancel_all([*self.buffered, *self._leased_groups()])
        self.buffered.clear()
        self.buffered_at.clear()
        self.leases.clear()
        self.deliveries.clear()
        self.lease_deadlines.clear()
        self.acked.clear()
        self.expired_from.clear()
        self.expired_holder.clear()
        self.admission.forget()
        return freed

    async def drain(self) -> None:
        """Shutting down: start and hand out no group, so leases can only settle."""
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
        if len(memory) > ACKED_KEPT:
            memory.popitem(last=False)

    def goodput(self) -> LedgerSnapshot:
        """The ledger, with the groups this broker holds now."""
        return self.ledger.snapshot(self.buffered, self._leased_groups())

    def _leased_groups(self) -> list[ScoredGroup]:
        return [group for leased in self.leases.values() for group in leased.values()]

    @property
    def num_leased(self) -> int:
        return sum(len(v) for v in self.leases.values())

    def _update_gauges(self) -> None:
        if self.closed:
            return  # a deleted run's series are removed; a late release must not bring them back
        self.metrics.queue_depth.labels(self.run_id).set(len(self.buffered))
        self.metrics.groups_leased.labels(self.run_id).set(self.num_leased)
