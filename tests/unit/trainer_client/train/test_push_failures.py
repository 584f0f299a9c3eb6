"""A background weight push that fails (a vLLM server died mid-push, and the service aborted
the update) does not end training: vLLM keeps the version before it and the next push
re-joins. Failures in a row still end it."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from trainer_client.step_timing import PhaseClock
from trainer_client.train.step_callback import PUSH_ATTEMPTS, SyncAndAck
from trainer_client.weights.push import WeightPusher


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


class RecordingPusher:
    """Commits every push at once: a resend at the version vLLM serves, else the next one."""

    timeout_s = 1.0

    def __init__(self, version: int) -> None:
        self.version = version
        self.resends: list[bool] = []

    async def push_policy(self, model: object, resend: bool = False) -> int:
        self.resends.append(resend)
        self.version += 0 if resend else 1
        return self.version


def test_a_push_the_service_asks_for_resends_the_version_only_if_no_step_changed_the_weights() -> None:
    """A restarted server asks for the weights. If vLLM serves this step's weights already,
    they go again as a resend (the version stays); if the step's own push failed, vLLM
    serves older weights and the push is a new version."""
    callback, feed = callback_with_failed_push()
    pusher = RecordingPusher(version=4)
    state = SimpleNamespace(global_step=5)
    callback.trainer.__dict__.update(
        pusher=pusher, state=state, accelerator=SimpleNamespace(unwrap_model=lambda model: model), model=None
    )
    feed.call = lambda coroutine, timeout_s: asyncio.run(coroutine)
    done: Future[int] = Future()
    done.set_result(4)
    callback._push_in_flight, callback._in_flight_step = done, 5  # step 5's background push committed v4

    callback._push_on_request("s0 restarted")
    assert pusher.resends == [True] and feed.current_version == 4

    state.global_step = 6
    callback._push_in_flight, callback._in_flight_step = failed(RuntimeError("aborted: s0 died")), 6
    callback._push_on_request("s0 restarted")  # vLLM serves step 5's weights: step 6's are new
    assert pusher.resends == [True, False] and feed.current_version == 5 and feed.pushes_owed == 0
    callback._push_on_request("s0 restarted again")  # now vLLM serves step 6's
    assert pusher.resends == [True, False, True] and feed.current_version == 5
