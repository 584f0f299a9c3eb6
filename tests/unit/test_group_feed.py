"""The trainer's feed never trains a group id twice, whatever the stream delivers."""

from __future__ import annotations

import threading

from rollout_service.api import rollout_pb2 as pb
from trainer_client.stream import GroupFeed


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
