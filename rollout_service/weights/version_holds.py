"""Holds on the servers' policy version, taken by evaluation runs.

An evaluation means something only at one policy version, so an evaluation run holds its version
while it generates, and a weight update waits for the holds before changing the weights: at
commit with ``pause_mode: none``, at begin for the pausing modes (a paused server would never
finish the evaluation). A hold is bounded: after ``timeout_s`` the update hands the holders to
``on_overrun`` (which stops them) and goes on, so a slow evaluation never stops training.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class VersionHolds:
    """Who holds which policy version; a weight update waits until nobody does."""

    def __init__(self, on_overrun: Callable[[list[str]], None] = lambda holders: None) -> None:
        self._holders: dict[str, int] = {}
        self._released = asyncio.Event()
        self._released.set()
        self.on_overrun = on_overrun
        """Told the holders an update stopped waiting for; it must release them."""

    def hold(self, holder: str, version: int) -> None:
        self._holders[holder] = version
        self._released.clear()

    def release(self, holder: str) -> None:
        if self._holders.pop(holder, None) is not None and not self._holders:
            self._released.set()

    @property
    def holders(self) -> dict[str, int]:
        return dict(self._holders)

    async def wait_released(self, timeout_s: float) -> float:
        """Wait until no version is held, or ``timeout_s`` (holders then go to ``on_overrun``); seconds waited."""
        if not self._holders:
            return 0.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        logger.info("weight update waits for evaluations holding version(s) %s", sorted(set(self._holders.values())))
        try:
            async with asyncio.timeout(timeout_s):
                await self._released.wait()
        except TimeoutError:
            overrun = list(self._holders)
            logger.warning(
                "evaluations %s held the policy version for more than %gs (weight_sync.eval_hold_timeout_s); "
                "they are stopped and the weight update goes on",
                overrun,
                timeout_s,
            )
            self._holders.clear()
            self._released.set()
            self.on_overrun(overrun)
        return loop.time() - started
