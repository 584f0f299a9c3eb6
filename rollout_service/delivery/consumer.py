"""One consumer's stream of a run, without gRPC: credits and acks in, groups, weight requests
and stalls out.

Invariant: a group is taken from the broker only while credits are positive, and a taken
group is either sent or released back by ``broker.release``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_service.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceError
from rollout_service.types import RunStall, ScoredGroup

if TYPE_CHECKING:
    from rollout_service.service import RolloutService

MAX_CREDITS = 4096
"""Groups one stream may hold unacked, far above what a trainer step asks for."""


@dataclass(frozen=True)
class Credit:
    groups: int


@dataclass(frozen=True)
class Ack:
    """``status``: a ``broker.ACK_*``; ``policy_version``: the version trained at (None: the current one)."""

    group_ids: list[str]
    status: str
    policy_version: int | None = None
    mismatch_kl: float | None = None
    """The sampler-trainer mismatch the consumer measured training them (None: not measured)."""


@dataclass(frozen=True)
class WeightsWanted:
    policy_version: int
    reason: str


@dataclass(frozen=True)
class Delivery:
    """A group handed to this consumer, and how many times it has been handed out (1: the first)."""

    group: ScoredGroup
    attempt: int


ConsumerRequest = Credit | Ack
ConsumerMessage = Delivery | WeightsWanted | RunStall


class ConsumerSession:
    """One stream: ``read`` (its own task) consumes requests while the caller sends ``next_message``."""

    def __init__(self, service: RolloutService, run_id: str, consumer_id: str, credits: int) -> None:
        self.service = service
        self.run = service.runs.require(run_id)
        self.broker = self.run.broker
        self.consumer_id = consumer_id
        self.credits = credits
        self.error: ServiceError | None = None
        self.client_done = False
        self._changed = asyncio.Event()
        self.weights_requests_sent = 0
        self.stalls_sent = 0

    def check_limits(self) -> None:
        if self.broker.closed or self.broker.handed_out_to(self.consumer_id):
            raise self._ended()
        limits = self.service.settings
        if len(self.broker.leases) >= limits.max_consumers_per_run and self.consumer_id not in self.broker.leases:
            raise ResourceExhausted(
                f"run {self.run.run_id} has {len(self.broker.leases)} consumers, the limit "
                "(scheduler.max_consumers_per_run); close idle streams"
            )
        self._check_credits(self.credits)

    def _ended(self) -> FailedPrecondition:
        """Why the run's streams end, and new ones are refused: it failed, or it was stopped."""
        run = self.run
        if run.state == "failed":
            return FailedPrecondition(f"run {run.run_id} failed: {run.error}")
        why = f": {run.error}" if run.error else ""
        return FailedPrecondition(
            f"run {run.run_id} is {run.state}{why} (deleted, or the service is stopping); "
            "its unacked groups are gone; create a new run"
        )

    def _check_credits(self, credits: int) -> None:
        if credits > MAX_CREDITS:
            raise InvalidArgument(f"a stream may hold at most {MAX_CREDITS} credits; this one would hold {credits}")

    async def read(self, requests: AsyncIterator[ConsumerRequest]) -> None:
        """Apply requests until the client stops; an invalid one ends the stream (``next_message`` raises it)."""
        try:
            async for request in requests:
                self._handle(request)
                self._changed.set()
        except ServiceError as exc:
            self.error = exc
        finally:
            self.client_done = True
            self._changed.set()

    def _handle(self, request: ConsumerRequest) -> None:
        if isinstance(request, Credit):
            if request.groups <= 0:
                raise InvalidArgument("credit.groups must be > 0")
            self._check_credits(self.credits + request.groups)
            self.credits += request.groups
        else:
            self.broker.ack(
                self.consumer_id, request.group_ids, request.status, request.policy_version, request.mismatch_kl
            )

    def wake(self) -> None:
        self._changed.set()

    async def next_message(self) -> ConsumerMessage | None:
        """The next message to send, or None when the stream should end."""
        while True:
            if self.error is not None:
                raise self.error
            if self.client_done:
                return None
            if (wanted := self._weights_wanted()) is not None:
                return wanted
            if (stall := self._stall()) is not None:
                return stall
            if self.broker.closed or self.broker.handed_out_to(self.consumer_id):
                raise self._ended()
            if self.broker.exhausted:  # an evaluation run's every group is delivered and acked
                return None
            self._changed.clear()
            # Wait for a group (with a credit), a request, or the run's end (or the end of its set).
            broker = self.broker
            ends = [end.wait() for end in (broker.closed_event, broker.finished_event) if not end.is_set()]
            if broker.finished_event.is_set() and not broker.waits_for_acks:  # also while it has no credit
                ends.append(broker.wait_handed_out_to(self.consumer_id))
            waits = {asyncio.ensure_future(self._changed.wait()), *(asyncio.ensure_future(end) for end in ends)}
            take = asyncio.ensure_future(self.broker.take(self.consumer_id)) if self.credits > 0 else None
            try:
                await asyncio.wait({*waits, *([take] if take else [])}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
                # Also on cancellation: no take may outlive the stream (its release returns a leased group).
                if take is not None and not take.done():
                    take.cancel()
                    await asyncio.gather(take, return_exceptions=True)
            if take is None or take.cancelled():
                continue
            if (group := take.result()) is None:
                if self.broker.closed or self.broker.exhausted or self.broker.handed_out_to(self.consumer_id):
                    continue  # said at the top of the loop
                raise FailedPrecondition(
                    f"consumer {self.consumer_id!r} is no longer subscribed to run {self.run.run_id}; subscribe again"
                )
            self.credits -= 1
            return Delivery(group, self.broker.deliveries[group.group_id])

    def _stall(self) -> RunStall | None:
        """The run's stall, once per stall."""
        run = self.run
        if run.stall is None or self.stalls_sent == run.stalls:
            return None
        self.stalls_sent = run.stalls
        return run.stall

    def _weights_wanted(self) -> WeightsWanted | None:
        """A request for weights this stream has not passed on yet."""
        admission = self.broker.admission
        if not admission.weights_wanted or self.weights_requests_sent == admission.weights_requests:
            return None
        self.weights_requests_sent = admission.weights_requests
        return WeightsWanted(admission.policy_version, admission.weights_wanted)
