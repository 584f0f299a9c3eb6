"""A background weight push that fails (a vLLM server died mid-push, and the service aborted
the update) does not end training: vLLM keeps the version before it and the next push
re-joins. Failures in a row still end it."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from trainer_client.step_callback import PUSH_ATTEMPTS, SyncAndAck
from trainer_client.step_timing import PhaseClock


def callback_with_failed_push() -> tuple[SyncAndAck, SimpleNamespace]:
    feed = SimpleNamespace(current_version=4, pushes_in_flight=1)
    trainer = SimpleNamespace(feed=feed, pusher=SimpleNamespace(timeout_s=1.0), clock=PhaseClock(), evaluator=None)
    return SyncAndAck(trainer), feed  # type: ignore[arg-type]


def failed(exc: Exception) -> Future[int]:
    future: Future[int] = Future()
    future.set_exception(exc)
    return future


def test_a_failed_push_leaves_the_version_and_training_goes_on() -> None:
    callback, feed = callback_with_failed_push()
    callback._push_in_flight = failed(RuntimeError("update aborted: server died"))
    callback._wait_for_push()
    assert feed.current_version == 4 and feed.pushes_in_flight == 0
    done: Future[int] = Future()
    done.set_result(5)
    callback._push_in_flight = done
    callback._wait_for_push()
    assert feed.current_version == 5 and callback._failed_pushes == 0


def test_failures_in_a_row_end_training() -> None:
    callback, _ = callback_with_failed_push()
    for _ in range(PUSH_ATTEMPTS - 1):
        callback._push_in_flight = failed(RuntimeError("aborted"))
        callback._wait_for_push()
    callback._push_in_flight = failed(RuntimeError("aborted"))
    with pytest.raises(RuntimeError, match="aborted"):
        callback._wait_for_push()
