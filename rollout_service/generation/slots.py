"""The service's slots, shared between runs in proportion to their weights.

A freed slot goes to the waiting run that has used the least slot time per unit of weight
(its virtual time, as in weighted fair queuing). Usage, not current holdings, because a
run's feeder is not waiting at every instant and would lose the slots freed in its gaps.
Work-conserving: an idle run leaves its share to the others, and its virtual time is raised
to the active runs' least when it returns, so idling earns no burst.
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
    virtual: float = 0.0
    """slot-seconds / weight, floored at the active runs' least when the holder reactivates."""
    since: float = 0.0
    waiters: list[tuple[int, asyncio.Future[None], int]] = field(default_factory=list)
    """(arrival order, woken when granted, slots wanted at once)."""


class WeightedSlots:
    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.busy = 0
        self.clock = clock
        self._holders: dict[str, _Holder] = {}
        self._order = itertools.count()
        self._handout_scheduled = False
        self._releases = 0
        self._held_seconds = 0.0
        """Slot-seconds held by all keys ever, for the mean hold time."""
        self.started = clock()
        self._changed_at = self.started
        self._busy_seconds = 0.0
        """Integral of ``busy`` up to ``_changed_at`` (kept eagerly; the per-key accounting is lazy)."""
        self._free_seconds = 0.0
        """Seconds up to ``_changed_at`` during which at least one slot was free."""

    async def acquire(self, key: str, weight: float = 1.0, count: int = 1) -> None:
        """Wait for ``count`` slots, granted together: taken one at a time, two runs could deadlock."""
        if not 1 <= count <= self.total:
            raise ValueError(f"{count} slots asked for at once, of {self.total}")
        holder = self._holders.setdefault(key, _Holder(weight, since=self.clock()))
        holder.weight = weight
        if holder.busy == 0 and not holder.waiters:
            self._reactivate(holder)
        if self.busy + count <= self.total and not self._anyone_waiting():
            self._grant(holder, count)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._order), future, count)
        holder.waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if entry in holder.waiters:
                holder.waiters.remove(entry)
                if self.busy < self.total:  # it may have blocked others
                    self._schedule_hand_out()
            elif future.done() and not future.cancelled():
                for _ in range(count):
                    self.release(key)  # granted and cancelled in the same turn: give it back
            raise

    def release(self, key: str) -> None:
        holder = self._holders[key]
        self._account(holder)
        self._releases += 1
        holder.busy -= 1
        self._integrate()
        self.busy -= 1
        self._schedule_hand_out()

    def slot_seconds(self, key: str) -> float:
        """Slot-seconds the key has held so far, its current slots included."""
        holder = self._holders.get(key)
        if holder is None:
            return 0.0
        self._account(holder)
        return holder.slot_seconds

    def busy_seconds(self) -> float:
        """Integral of the busy slots over time since start, in slot-seconds."""
        return self._busy_seconds + self.busy * (self.clock() - self._changed_at)

    def busy_time_average(self) -> float:
        elapsed = self.clock() - self.started
        return self.busy_seconds() / elapsed if elapsed > 0 else float(self.busy)

    def free_seconds(self) -> float:
        """Seconds since start during which at least one slot was free."""
        running = self.clock() - self._changed_at if self.busy < self.total else 0.0
        return self._free_seconds + running

    def forget(self, key: str) -> None:
        """Drop a key's record once it holds and awaits nothing (its run ended)."""
        holder = self._holders.get(key)
        if holder is not None and holder.busy == 0 and not holder.waiters:
            del self._holders[key]

    def _anyone_waiting(self) -> bool:
        return any(holder.waiters for holder in self._holders.values())

    def _schedule_hand_out(self) -> None:
        if not self._handout_scheduled:
            self._handout_scheduled = True
            asyncio.get_running_loop().call_soon(self._hand_out)

    def _hand_out(self) -> None:
        self._handout_scheduled = False
        while self.busy < self.total:
            waiting = [h for h in self._holders.values() if h.waiters]
            if not waiting:
                return
            for h in waiting:
                self._account(h)
            # Finish tag: usage so far plus what the slots it would then hold will cost.
            tau = self._mean_slot_seconds()
            holder = min(waiting, key=lambda h: (h.virtual + (h.busy + 1) * tau / h.weight, h.waiters[0][0]))
            _, future, count = holder.waiters[0]
            if future.done():  # cancelled; its task is about to remove it
                holder.waiters.pop(0)
                continue
            if self.busy + count > self.total:
                return  # the fairest waiter needs more slots than are free: the next releases are its
            holder.waiters.pop(0)
            self._grant(holder, count)
            future.set_result(None)
            # One grant per loop turn: the task just woken must be waiting again before the next
            # slot is handed out, or the other runs get every second slot whatever the weights.
            if self.busy < self.total and self._anyone_waiting():
                self._schedule_hand_out()
            return

    def _grant(self, holder: _Holder, count: int) -> None:
        self._account(holder)
        holder.busy += count
        self._integrate()
        self.busy += count

    def _integrate(self) -> None:
        """Close the interval over which ``busy`` held its value; call before changing it."""
        now = self.clock()
        self._busy_seconds += self.busy * (now - self._changed_at)
        if self.busy < self.total:
            self._free_seconds += now - self._changed_at
        self._changed_at = now

    def _mean_slot_seconds(self) -> float:
        """How long a slot is held on average (in-progress slots count as partly done)."""
        return self._held_seconds / max(1, self._releases + self.busy)

    def _reactivate(self, holder: _Holder) -> None:
        active = [h for h in self._holders.values() if h is not holder and (h.busy or h.waiters)]
        for other in active:
            self._account(other)
        if active:
            holder.virtual = max(holder.virtual, min(h.virtual for h in active))

    def _account(self, holder: _Holder) -> None:
        now = self.clock()
        used = holder.busy * (now - holder.since)
        holder.slot_seconds += used
        holder.virtual += used / holder.weight
        self._held_seconds += used
        holder.since = now
