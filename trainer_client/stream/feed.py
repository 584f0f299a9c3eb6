"""Fresh groups for a synchronous training loop, from the service's async stream.

``GroupFeed`` runs the gRPC stream on its own event loop in a background thread and hands
groups to the training thread through a queue. Staleness is judged when a group is taken,
against ``training_version``: stale groups are acked as DROPPED_STALE, the rest as TRAINED
once their step ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollout_api import rollout_pb2 as pb
from rollout_api.client import GroupStream, RolloutClient, rpc_reason, unavailable
from rollout_common.staleness import within_staleness
from trainer_client.step_timing import PhaseClock

logger = logging.getLogger(__name__)
T = TypeVar("T")

_WAKE = object()
"""Put in the group queue to wake the training thread for a request of the weights."""

TIMEOUT_S = 30.0
"""Bound of the feed's RPCs, calls and shutdown."""
RECONNECT_S = 120.0
"""How long a trainer waits for a service that went away (a restart) before it fails."""
ID_MEMORY = 100_000
"""Group ids a feed remembers: duplicates arrive minutes apart, never this many groups later."""


class RecentIds(OrderedDict[str, None]):
    """A set of the last ``capacity`` ids added; the oldest is forgotten first."""

    def __init__(self, capacity: int = ID_MEMORY) -> None:
        super().__init__()
        self.capacity = capacity

    def add(self, group_id: str) -> None:
        self[group_id] = None
        if len(self) > self.capacity:
            self.popitem(last=False)


@dataclass
class FeedCounters:
    received: int = 0
    trained: int = 0
    dropped_stale: int = 0
    duplicates: int = 0
    """Deliveries of a group id this consumer already held or trained, skipped."""
    trained_group_ids: deque[str] = field(default_factory=lambda: deque(maxlen=ID_MEMORY))
    """The last ``ID_MEMORY`` trained, in ack order, for data-parallel checks."""


class RunStalled(RuntimeError):
    """The service reports that the run stopped generating (``RunStall``): training cannot go on."""


class StreamEnded(RuntimeError):
    """The service ended the run's sample stream with an answer (the run failed or was deleted, a
    lease expired), or the stream broke for good: training cannot go on, and the message says why."""


class GroupFeed:
    """One consumer of one run; use ``with GroupFeed(...) as feed``."""

    def __init__(self, target: str, run_id: str, consumer_id: str, max_staleness: int, credits: int = 16) -> None:
        self.target = target
        self.run_id = run_id
        self.consumer_id = consumer_id
        self.max_staleness = max_staleness
        self.credits = credits
        self.connected = True
        """False while the service is unreachable and the feed reconnects: pushes wait."""
        self.current_version = 0
        """The policy version of the last push that committed."""
        self.pushes_owed = 0
        """How many versions the trainer's weights are ahead of ``current_version`` (0 or 1),
        until a push commits them."""
        self.min_version = 0
        self.clock = PhaseClock()
        """Seconds per phase of the current step; the feed adds ``wait_groups``, the trainer the rest."""
        self.counters = FeedCounters()
        self._seen = RecentIds()
        """The group ids taken from the stream: none is trained twice, whatever the service sends."""
        self._acked: dict[pb.AckStatus.ValueType, RecentIds] = {
            pb.ACK_STATUS_TRAINED: RecentIds(),
            pb.ACK_STATUS_DROPPED_STALE: RecentIds(),
        }
        """Ids acked, by status: a duplicate of one is acked again (the first ack may be lost)."""
        self.on_weights_wanted: Callable[[str], None] | None = None
        """Set by a trainer that pushes: called on the training thread, between groups, when
        the service asks for the run's weights."""
        self._weights_wanted = ""
        self._stall_error: RunStalled | None = None
        self._groups: queue.Queue[pb.Group | BaseException | object] = queue.Queue()
        """What the stream delivered and the training thread has not taken. Unbounded on purpose:
        the credits bound it, and a blocked put after a reconnect would keep the process from exiting."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"feed-{consumer_id}", daemon=True)
        self._client: RolloutClient | None = None
        self._stream: GroupStream | None = None
        self._reader: Future[None] | None = None

    # -- lifetime ------------------------------------------------------------------------
    def __enter__(self) -> GroupFeed:
        self._thread.start()
        self.call(self._open())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=TIMEOUT_S)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.submit(coro).result(timeout_s or TIMEOUT_S)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run_alongside(self, coro: Coroutine[Any, Any, None], what: str) -> Future[None]:
        """Run ``coro`` on the feed's loop while training; if it fails, the next wait for a group raises."""

        async def guarded() -> None:
            try:
                await coro
            except Exception as exc:
                logger.error("%s failed: %s", what, exc)
                self._groups.put_nowait(RuntimeError(f"{what} failed: {exc}"))

        return self.submit(guarded())

    @property
    def training_version(self) -> int:
        """The version of the trainer's weights once the push they are owed commits."""
        return self.current_version + self.pushes_owed

    @property
    def client(self) -> RolloutClient:
        assert self._client is not None, "the feed is not open"
        return self._client

    async def _open(self) -> None:
        self._client = await RolloutClient(self.target, TIMEOUT_S).__aenter__()
        self._reader = asyncio.ensure_future(self._read(self._subscribe()))

    def _subscribe(self) -> GroupStream:
        stream = self.client.stream(self.run_id, self.consumer_id, credits=self.credits)
        stream.on_weights_wanted = self._weights_requested
        stream.on_stall = self._stalled
        self._stream = stream
        return stream

    async def _read(self, stream: GroupStream) -> None:
        try:
            while True:
                try:
                    async for group in stream:
                        self.counters.received += 1
                        self._groups.put_nowait(group)  # never blocks: see ``_groups``
                    return
                except Exception as exc:
                    if not unavailable(exc):
                        raise
                    # The call is over; end its request side, which would otherwise wait until exit.
                    await stream.aclose(timeout_s=1)
                    stream = await self._reconnect(exc)
        except BaseException as exc:  # the trainer thread must see why the stream ended
            self._groups.put_nowait(exc)
            raise

    async def _reconnect(self, lost: Exception) -> GroupStream:
        """The service went away: retry with backoff for ``RECONNECT_S``, then subscribe again; a
        service back at an older version than this trainer's gets a push."""
        self.connected = False
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + RECONNECT_S, 0.25
        logger.warning(
            "the service at %s is unreachable (%s); reconnecting for up to %gs",
            self.target,
            rpc_reason(lost),
            RECONNECT_S,
        )
        while True:
            await asyncio.sleep(delay)  # a retry backoff, not synchronisation
            try:
                run = await self.client.get_run(self.run_id)
                break
            except Exception as exc:
                if not unavailable(exc) or loop.time() > deadline:
                    raise
                delay = min(2 * delay, 4.0)
        stream = self._subscribe()
        self.connected = True
        logger.warning("reconnected to %s: run %s at policy version %d", self.target, self.run_id, run.policy_version)
        if run.policy_version < self.current_version:
            self._weights_requested(
                pb.WeightsWanted(
                    reason=f"the service came back at policy version {run.policy_version}, behind this trainer's "
                    f"{self.current_version}"
                )
            )
        return stream

    async def _close(self) -> None:
        assert self._stream is not None and self._reader is not None  # opened by __enter__
        await self._stream.aclose()
        self._reader.cancel()
        await self.client.__aexit__(None, None, None)

    def _stalled(self, stall: pb.RunStall) -> None:
        """On the feed's loop: a generation stall makes the next wait for a group raise; a consumer
        stall is only logged."""
        kind = pb.StallKind.Name(stall.kind)
        if stall.kind != pb.STALL_KIND_GENERATION:
            logger.warning("the service reports run %s stalled (%s): %s", self.run_id, kind, stall.reason)
            return
        self._stall_error = RunStalled(
            f"run {self.run_id} stopped generating; the service reports: {stall.reason} "
            "(it waits scheduler.stall_timeout_s before it says so)"
        )
        self._groups.put_nowait(_WAKE)

    def _weights_requested(self, wanted: pb.WeightsWanted) -> None:
        """On the feed's loop: note the request and wake a training thread waiting for groups."""
        if self.on_weights_wanted is None:
            logger.info("the service wants run %s's weights; another trainer pushes them", self.run_id)
            return
        self._weights_wanted = wanted.reason or "asked by the service"
        self._groups.put_nowait(_WAKE)

    # -- consumer side (the training thread) ---------------------------------------------
    def next_fresh_group(self, timeout_s: float = 300.0) -> pb.Group:
        """The next group within ``max_staleness`` of ``current_version``; stale ones are
        dropped and acked as such on the way. A request for the weights is answered first."""
        while True:
            if self._weights_wanted and self.on_weights_wanted is not None:
                reason, self._weights_wanted = self._weights_wanted, ""
                self.on_weights_wanted(reason)
            if self._stall_error is not None and self._groups.empty():
                raise self._stall_error
            with self.clock.measure("wait_groups"):
                item = self._groups.get(timeout=timeout_s)
            if item is _WAKE:
                continue
            if isinstance(item, BaseException):
                raise StreamEnded(f"the sample stream of run {self.run_id} ended: {rpc_reason(item)}") from item
            assert isinstance(item, pb.Group)
            if item.group_id in self._seen:
                self._skip_duplicate(item.group_id)
                continue
            self._seen.add(item.group_id)
            if not self.is_fresh(item.policy_version):
                self.ack_dropped_stale([item.group_id])
                continue
            return item

    def _skip_duplicate(self, group_id: str) -> None:
        """Not trained again: acked again if its first copy was acked, else its credit is granted back."""
        self.counters.duplicates += 1
        logger.warning("group %s was delivered again; skipped (it is trained once)", group_id)
        stream = self._stream
        assert stream is not None
        acked_as = next((status for status, ids in self._acked.items() if group_id in ids), None)
        if acked_as is None:
            self._loop.call_soon_threadsafe(stream.grant, 1)
        else:
            self._loop.call_soon_threadsafe(functools.partial(stream.ack, [group_id], acked_as))

    def is_fresh(self, policy_version: int) -> bool:
        """Within max_staleness of ``training_version`` and not older than the trainer's first push."""
        return policy_version >= self.min_version and within_staleness(
            policy_version, self.training_version, self.max_staleness
        )

    def ack_trained(self, group_ids: list[str], version: int | None = None, mismatch_kl: float | None = None) -> None:
        """``version``: the policy version they were trained at (default: the trainer's now);
        ``mismatch_kl``: the sampler-trainer mismatch measured training them (None: not measured)."""
        self.counters.trained += len(group_ids)
        self.counters.trained_group_ids.extend(group_ids)
        version = self.training_version if version is None else version
        self._ack(group_ids, pb.ACK_STATUS_TRAINED, version, mismatch_kl)

    def ack_dropped_stale(self, group_ids: list[str]) -> None:
        self.counters.dropped_stale += len(group_ids)
        self._ack(group_ids, pb.ACK_STATUS_DROPPED_STALE)

    def flush_acks(self, timeout_s: float = 10.0) -> None:
        """Wait until the acks sent so far are written to the stream, before the step is recorded."""
        stream = self._stream
        assert stream is not None
        flushed = self.submit(stream.flushed())
        try:
            with self.clock.measure("ack"):
                flushed.result(timeout_s)
        except TimeoutError:
            flushed.cancel()
            logger.warning("acks not written within %.0fs; the stream may be down", timeout_s)

    def _ack(
        self,
        group_ids: list[str],
        status: pb.AckStatus.ValueType,
        version: int | None = None,
        mismatch_kl: float | None = None,
    ) -> None:
        stream = self._stream
        assert stream is not None
        for group_id in group_ids:
            self._acked[status].add(group_id)
        with self.clock.measure("ack"):
            self._loop.call_soon_threadsafe(
                functools.partial(stream.ack, group_ids, status, policy_version=version, mismatch_kl=mismatch_kl)
            )
