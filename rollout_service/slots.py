"""The service's slots, shared between runs in proportion to their weights.

An ``asyncio.Semaphore`` wakes waiters first come, first served; every run's feeder waits
for one slot at a time, so runs would share the slots equally whatever their weights.
Here a freed slot goes to the waiting run that holds the fewest slots per unit of weight,
counting the slot it would get: ``(busy + 1) / weight``, ties to the longest waiting. Two
runs of weights 3 and 1 that both have work settle at 3/4 and 1/4 of the slots. The
sharing is work-conserving: a run that does not wait (its consumers stopped, so its
buffer is full) leaves its share to the others until it waits again.

Slot time is also accounted per run (slot-seconds), which is what a run's share means
over a window.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Holder:
    weight: float
    busy: int = 0
    slot_seconds: float = 0.0
    since: float = 0.0
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)


class WeightedSlots:
    """``total`` slots; ``acquire(key, weight)`` / ``release(key)``."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        if total < 1:
            raise ValueError(f"total slots must be >= 1, got {total}")
        self.total = total
        self.busy = 0
        self.clock = clock
        self._holders: dict[str, _Holder] = {}
        self._order = itertools.count()

    async def acquire(self, key: str, weight: float = 1.0) -> None:
        holder = self._holders.setdefault(key, _Holder(weight))
        holder.weight = weight
        if self.busy < self.total and not self._anyone_waiting():
            self._grant(holder)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._order), future)
        holder.waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if entry in holder.waiters:
                holder.waiters.remove(entry)
            elif future.done() and not future.cancelled():
                self.release(key)  # granted and cancelled in the same turn: give it back
            raise

    def release(self, key: str) -> None:
        holder = self._holders[key]
        self._account(holder)
        holder.busy -= 1
        self.busy -= 1
        self._hand_out()

    def busy_of(self, key: str) -> int:
        holder = self._holders.get(key)
        return holder.busy if holder is not None else 0

    def slot_seconds(self, key: str) -> float:
        """Slot-seconds the key has held so far, its current slots included."""
        holder = self._holders.get(key)
        if holder is None:
            return 0.0
        self._account(holder)
        return holder.slot_seconds

    def forget(self, key: str) -> None:
        """Drop a key's record once it holds and awaits nothing (its run ended)."""
        holder = self._holders.get(key)
        if holder is not None and holder.busy == 0 and not holder.waiters:
            del self._holders[key]

    def _anyone_waiting(self) -> bool:
        return any(holder.waiters for holder in self._holders.values())

    def _hand_out(self) -> None:
        while self.busy < self.total:
            waiting = [h for h in self._holders.values() if h.waiters]
            if not waiting:
                return
            holder = min(waiting, key=lambda h: ((h.busy + 1) / h.weight, h.waiters[0][0]))
            _, future = holder.waiters.pop(0)
            self._grant(holder)
            future.set_result(None)

    def _grant(self, holder: _Holder) -> None:
        self._account(holder)
        holder.busy += 1
        self.busy += 1

    def _account(self, holder: _Holder) -> None:
        now = self.clock()
        holder.slot_seconds += holder.busy * (now - holder.since)
        holder.since = now
