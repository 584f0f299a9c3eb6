"""The loop-lag watcher reports a blocked event loop as lag, and a free one as near zero."""

from __future__ import annotations

import asyncio
import contextlib
import time

from rollout_service.loop_lag import watch_loop_lag

BLOCK_S = 0.3


class Recorder:
    """Stands in for the Prometheus histogram; ``seen`` is set at each observation."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.seen = asyncio.Event()

    def observe(self, value: float) -> None:
        self.values.append(value)
        self.seen.set()


def block_the_loop() -> None:
    """The planted lag: nothing else runs on the loop meanwhile."""
    time.sleep(BLOCK_S)


async def test_a_blocked_loop_shows_as_lag() -> None:
    recorder = Recorder()
    watcher = asyncio.create_task(watch_loop_lag(recorder, interval_s=0.01))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(recorder.seen.wait(), 5)
        free = list(recorder.values)
        recorder.seen.clear()
        block_the_loop()
        await asyncio.wait_for(recorder.seen.wait(), 5)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert min(free) >= 0.0
    assert max(free) < BLOCK_S / 2
    assert max(recorder.values) >= BLOCK_S - 0.02
