"""The trainer's feed never trains a group id twice, whatever the stream delivers, and
reconnects when the service goes away."""

from __future__ import annotations

import threading

import grpc
import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import GRPC_CORE_WRITE_FAILED, unavailable
from trainer_client.stream.feed import ID_MEMORY, GroupFeed, RecentIds


class RecordingStream:
    """Stands in for the gRPC stream: records the credits the feed grants back."""

    def __init__(self) -> None:
        self.granted: list[int] = []
        self.granted_event = threading.Event()

    def grant(self, groups: int) -> None:
        self.granted.append(groups)
        self.granted_event.set()


def test_a_group_delivered_twice_is_taken_once_and_its_credit_is_given_back() -> None:
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=1, credits=4)
    stream = RecordingStream()
    feed._stream = stream  # type: ignore[assignment]
    feed._thread.start()
    try:
        for group_id in ("g1", "g1", "g2"):
            feed._groups.put(pb.Group(group_id=group_id, policy_version=0))
        assert feed.next_fresh_group(timeout_s=5).group_id == "g1"
        assert feed.next_fresh_group(timeout_s=5).group_id == "g2"
        assert feed.counters.duplicates == 1
        assert stream.granted_event.wait(5)
        assert stream.granted == [1]
    finally:
        feed._loop.call_soon_threadsafe(feed._loop.stop)
        feed._thread.join(5)


def test_recent_ids_forget_the_oldest_beyond_capacity() -> None:
    ids = RecentIds(capacity=3)
    for group_id in ("a", "b", "c", "d"):
        ids.add(group_id)
    assert len(ids) == 3
    assert "a" not in ids
    assert all(group_id in ids for group_id in ("b", "c", "d"))


def test_the_feed_remembers_a_bounded_number_of_ids() -> None:
    """A long run must not keep every id it ever trained: the duplicate memory and the trained
    list stop at ID_MEMORY, the newest kept."""
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=1, credits=4)
    feed._stream = RecordingStream()  # type: ignore[assignment]
    for index in range(ID_MEMORY + 10):
        feed._seen.add(f"g{index}")
        feed.counters.trained_group_ids.append(f"g{index}")
    assert len(feed._seen) == ID_MEMORY
    assert len(feed.counters.trained_group_ids) == ID_MEMORY
    assert f"g{ID_MEMORY + 9}" in feed._seen and "g0" not in feed._seen
    assert feed.counters.trained_group_ids[0] == "g10"


def test_a_request_for_weights_wakes_the_waiting_trainer_which_pushes_before_its_next_group() -> None:
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=1, credits=4)
    feed._stream = RecordingStream()  # type: ignore[assignment]
    pushed = threading.Event()
    calls: list[str] = []

    def push(reason: str) -> None:
        calls.append(reason)
        pushed.set()

    feed.on_weights_wanted = push
    taken: list[str] = []
    waiting = threading.Thread(target=lambda: taken.append(feed.next_fresh_group(timeout_s=10).group_id))
    waiting.start()  # no group yet: the training thread waits in the queue
    feed._weights_requested(pb.WeightsWanted(policy_version=3, reason="s0 restarted"))
    assert pushed.wait(5), "the waiting trainer was not woken to push"
    assert calls == ["s0 restarted"]
    feed._groups.put(pb.Group(group_id="g1", policy_version=3))
    waiting.join(5)
    assert taken == ["g1"] and calls == ["s0 restarted"]  # one push per request


def test_a_follower_ignores_a_request_for_weights() -> None:
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=1, credits=4)
    feed._weights_requested(pb.WeightsWanted(policy_version=3, reason="s0 restarted"))
    feed._groups.put(pb.Group(group_id="g1", policy_version=3))
    assert feed.next_fresh_group(timeout_s=5).group_id == "g1"


class DeliveredStream:
    """Stands in for a gRPC stream that delivers these groups, then ends."""

    def __init__(self, groups: list[pb.Group]) -> None:
        self.groups = groups

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._deliver()

    async def _deliver(self):  # type: ignore[no-untyped-def]
        for group in self.groups:
            yield group


def test_the_reader_takes_more_groups_than_credits_without_waiting_for_the_trainer() -> None:
    """After a reconnect the new stream's credits come on top of the groups the old one left
    queued. The reader must still never wait on the training thread: it used to block in a
    put on an executor thread that Python joins at exit, and a trainer that ended with a full
    queue never exited (a CI timeout of test_service_restart)."""
    credits = 4
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=1, credits=credits)
    feed._thread.start()
    try:
        delivered = [pb.Group(group_id=f"g{index}", policy_version=0) for index in range(3 * credits)]
        feed.call(feed._read(DeliveredStream(delivered)), timeout_s=10)  # type: ignore[arg-type]
        assert feed.counters.received == 3 * credits
        assert feed._groups.qsize() == 3 * credits
    finally:
        feed._loop.call_soon_threadsafe(feed._loop.stop)
        feed._thread.join(5)


class BrokenStream(DeliveredStream):
    """Delivers its groups, then fails as a gRPC stream does whose call just ended."""

    def __init__(self, groups: list[pb.Group], error: grpc.aio.AioRpcError) -> None:
        super().__init__(groups)
        self.error = error
        self.closed = False

    async def _deliver(self):  # type: ignore[no-untyped-def]
        for group in self.groups:
            yield group
        raise self.error

    async def aclose(self, timeout_s: float) -> None:
        self.closed = True


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    "lost",
    [
        rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
        # grpc's asyncio client, for an ack written as the service died (grpc/grpc#36066)
        rpc_error(grpc.StatusCode.INTERNAL, GRPC_CORE_WRITE_FAILED),
    ],
)
def test_a_stream_lost_with_the_service_reconnects_and_goes_on(lost: grpc.aio.AioRpcError) -> None:
    feed = GroupFeed("127.0.0.1:1", "run", "c", max_staleness=1, credits=4)
    broken = BrokenStream([pb.Group(group_id="g1", policy_version=0)], lost)
    reconnected_after: list[Exception] = []

    async def reconnect(error: Exception) -> DeliveredStream:
        reconnected_after.append(error)
        return DeliveredStream([pb.Group(group_id="g2", policy_version=0)])

    feed._reconnect = reconnect  # type: ignore[method-assign]
    feed._thread.start()
    try:
        feed.call(feed._read(broken), timeout_s=10)  # type: ignore[arg-type]
        assert reconnected_after == [lost] and broken.closed
        assert [feed.next_fresh_group(timeout_s=5).group_id for _ in range(2)] == ["g1", "g2"]
    finally:
        feed._loop.call_soon_threadsafe(feed._loop.stop)
        feed._thread.join(5)


def test_an_answer_of_the_service_ends_the_stream() -> None:
    """A real INTERNAL from the service (any other details) is an answer, not a lost connection."""
    assert not unavailable(rpc_error(grpc.StatusCode.INTERNAL, "scoring failed: boom"))
    assert not unavailable(rpc_error(grpc.StatusCode.NOT_FOUND, "run r not found"))
    assert not unavailable(RuntimeError("Internal error from Core"))
