"""A background weight push that fails (a vLLM server died mid-push, and the service aborted
the update) does not end training: vLLM keeps the version before it and the next push
re-joins. Failures in a row still end it."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from trainer_client.step_callback import PUSH_ATTEMPTS, SyncAndAck
from trainer_client.step_timing import PhaseClock
from trainer_client.weight_push import WeightPusher


def callback_with_failed_push() -> tuple[SyncAndAck, SimpleNamespace]:
    feed = SimpleNamespace(current_version=4, pushes_owed=1)
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
    # vLLM keeps version 4; the trainer's weights are still one push ahead of it, so the
    # version its steps train at does not go back.
    assert feed.current_version == 4 and feed.pushes_owed == 1
    done: Future[int] = Future()
    done.set_result(5)
    callback._push_in_flight = done
    callback._wait_for_push()
    assert feed.current_version == 5 and feed.pushes_owed == 0 and callback._failed_pushes == 0


def test_failures_in_a_row_end_training() -> None:
    callback, _ = callback_with_failed_push()
    for _ in range(PUSH_ATTEMPTS - 1):
        callback._push_in_flight = failed(RuntimeError("aborted"))
        callback._wait_for_push()
    callback._push_in_flight = failed(RuntimeError("aborted"))
    with pytest.raises(RuntimeError, match="aborted"):
        callback._wait_for_push()


def test_a_step_that_ends_while_the_service_is_away_owes_its_push() -> None:
    """The push is skipped (the feed reconnects), and the steps after it train at the version
    that push will produce: the version in metrics.jsonl never goes back."""
    callback, feed = callback_with_failed_push()
    feed.pushes_owed, feed.connected = 0, False
    pusher = callback.trainer.pusher = WeightPusher.__new__(WeightPusher)  # never used: nothing is pushed
    pusher.timeout_s = 1.0
    callback._push_in_background()
    assert callback._push_in_flight is None and feed.current_version == 4 and feed.pushes_owed == 1
