"""Holds a run's scored groups until consumers take them, and tracks what they hold.

Invariant: a scored group is in exactly one place: ``buffered`` (waiting), ``leased`` to
one consumer (sent, not acked), or gone (acked). A consumer that leaves returns its
unacked leases to the front of the buffer, so no group is lost and none is handed to two
consumers at once. Acks are idempotent by group id.

Backpressure: the scheduler reserves a place (``reserve``) before it starts a group and
fills it with ``put`` or gives it back with ``unreserve`` (a dropped group); at most
``max_buffered`` groups are ever reserved or buffered, so a run without consumers stops
generating once that many groups wait, and memory stays bounded.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from rollout_service.errors import AlreadyExists, FailedPrecondition
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import ScoredGroup

ACK_TRAINED = "trained"
ACK_DROPPED_STALE = "dropped_stale"
_ACK_MEMORY = 100_000


class RunBroker:
    """The buffer and leases of one run."""

    def __init__(self, run_id: str, max_buffered: int, metrics: ServiceMetrics) -> None:
        self.run_id = run_id
        self.max_buffered = max_buffered
        self.metrics = metrics
        self.buffered: deque[ScoredGroup] = deque()
        self.leases: dict[str, dict[str, ScoredGroup]] = {}
        self.acked: OrderedDict[str, str] = OrderedDict()
        self.ack_counts = {ACK_TRAINED: 0, ACK_DROPPED_STALE: 0}
        self.reserved = 0
        self.closed = False
        self._changed = asyncio.Condition()

    # -- producer side -------------------------------------------------------------------
    def has_room(self) -> bool:
        return len(self.buffered) + self.reserved < self.max_buffered

    async def reserve(self) -> bool:
        """Wait for room and reserve a place for one group; False once the run is closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.has_room() or self.closed)
            if self.closed:
                return False
            self.reserved += 1
            return True

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

    # -- consumer side -------------------------------------------------------------------
    def subscribe(self, consumer_id: str) -> None:
        if self.closed:
            raise FailedPrecondition(f"run {self.run_id} is stopped; create a new run")
        if consumer_id in self.leases:
            raise AlreadyExists(
                f"consumer {consumer_id!r} is already subscribed to run {self.run_id}; "
                "use a unique consumer_id per trainer process"
            )
        self.leases[consumer_id] = {}

    async def take(self, consumer_id: str) -> ScoredGroup | None:
        """Wait for a group and lease it to the consumer; None once the run is closed.

        Cancellation-safe: the group is leased only on return, with no await in between.
        """
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self.buffered) or self.closed or consumer_id not in self.leases)
            if not self.buffered or consumer_id not in self.leases:
                return None
            group = self.buffered.popleft()
            self.leases[consumer_id][group.group_id] = group
            self._update_gauges()
            self._changed.notify_all()
            return group

    def ack(self, consumer_id: str, group_ids: list[str], status: str) -> int:
        """Remove acked groups; returns how many were newly acked. Repeats are no-ops."""
        leased = self.leases.get(consumer_id, {})
        newly = 0
        for group_id in group_ids:
            if group_id in self.acked:
                continue
            if group_id not in leased:
                raise FailedPrecondition(
                    f"group {group_id!r} is not leased to consumer {consumer_id!r}; "
                    "ack only groups this stream received"
                )
            del leased[group_id]
            self.acked[group_id] = status
            if len(self.acked) > _ACK_MEMORY:
                self.acked.popitem(last=False)
            self.ack_counts[status] += 1
            self.metrics.groups_acked.labels(self.run_id, status).inc()
            newly += 1
        self._update_gauges()
        return newly

    async def release(self, consumer_id: str) -> int:
        """The consumer left: its unacked groups go back to the front, oldest first."""
        async with self._changed:
            leased = self.leases.pop(consumer_id, {})
            self.buffered.extendleft(reversed(list(leased.values())))
            self._update_gauges()
            self._changed.notify_all()
        return len(leased)

    async def close(self) -> None:
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    @property
    def num_leased(self) -> int:
        return sum(len(v) for v in self.leases.values())

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.labels(self.run_id).set(len(self.buffered))
        self.metrics.groups_leased.labels(self.run_id).set(self.num_leased)
