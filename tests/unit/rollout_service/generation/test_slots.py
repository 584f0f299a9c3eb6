"""Weighted sharing of the service's slots between runs."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest

from rollout_service.generation.slots import WeightedSlots


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)  # slots are handed out one per loop turn (turns, not timing)


async def test_freed_slots_go_to_runs_in_proportion_to_their_weights() -> None:
    now = [0.0]
    slots = WeightedSlots(8, clock=lambda: now[0])
    for _ in range(8):
        await slots.acquire("filler")
    now[0] = 1.0  # slots are held 1 s on average: what a new slot will cost
    waiting = [asyncio.ensure_future(slots.acquire("a", 3)) for _ in range(8)]
    waiting += [asyncio.ensure_future(slots.acquire("b", 1)) for _ in range(8)]
    await settle()
    for _ in range(8):
        slots.release("filler")
    await settle()
    granted = [sum(task.done() for task in waiting[:8]), sum(task.done() for task in waiting[8:])]
    assert granted == [6, 2]  # no usage yet: split by weight at once
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert slots.busy == 8


async def test_shares_hold_under_churn() -> None:
    """Both runs always want a slot; random slots free up: run a holds 3/4 on average."""
    slots, rng = WeightedSlots(8), random.Random(0)
    held: list[str] = []

    async def feeder(key: str, weight: float) -> None:
        while True:
            await slots.acquire(key, weight)
            held.append(key)

    feeders = [asyncio.ensure_future(feeder("a", 3)), asyncio.ensure_future(feeder("b", 1))]
    await settle()
    shares = []
    for _ in range(2000):
        key = held.pop(rng.randrange(len(held)))
        slots.release(key)
        await settle()
        shares.append(held.count("a") / slots.total)
    for task in feeders:
        task.cancel()
    await asyncio.gather(*feeders, return_exceptions=True)
    assert sum(shares) / len(shares) == pytest.approx(0.75, abs=0.03)


async def test_a_run_that_does_not_wait_leaves_its_share_to_the_others() -> None:
    slots = WeightedSlots(4)
    for _ in range(4):
        await slots.acquire("a", 1)  # b (weight 9) has nothing to do: a may take everything
    assert slots.busy == 4
    waiting_b = asyncio.ensure_future(slots.acquire("b", 9))
    waiting_a = asyncio.ensure_future(slots.acquire("a", 1))
    await settle()
    slots.release("a")
    await settle()
    assert waiting_b.done() and not waiting_a.done()  # once b waits, it comes first
    waiting_a.cancel()
    await asyncio.gather(waiting_a, return_exceptions=True)


async def test_cancelled_waiters_leak_no_slot() -> None:
    slots = WeightedSlots(1)
    await slots.acquire("a")
    waiter = asyncio.ensure_future(slots.acquire("b"))
    await settle()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    slots.release("a")
    assert slots.busy == 0
    # Granted and cancelled before it could resume: the slot goes back.
    await slots.acquire("a")
    granted = asyncio.ensure_future(slots.acquire("b"))
    await settle()
    slots.release("a")  # grants b's future ...
    granted.cancel()  # ... whose task is cancelled before it runs
    await asyncio.gather(granted, return_exceptions=True)
    assert slots.busy == 0


async def test_slot_seconds_integrate_busy_slots_over_time() -> None:
    now = [0.0]
    slots = WeightedSlots(4, clock=lambda: now[0])
    await slots.acquire("a")
    await slots.acquire("a")
    now[0] = 10.0
    slots.release("a")
    now[0] = 15.0
    assert slots.slot_seconds("a") == pytest.approx(2 * 10 + 1 * 5)
    assert slots.slot_seconds("never") == 0.0


async def test_an_idle_spell_earns_no_burst() -> None:
    now = [0.0]
    slots = WeightedSlots(2, clock=lambda: now[0])
    await slots.acquire("a")
    await slots.acquire("a")
    now[0] = 100.0  # a used 200 slot-seconds while b was idle
    slots.release("a")
    await slots.acquire("b")  # b starts at a's virtual time, not at 0
    waiting = [asyncio.ensure_future(slots.acquire("a")), asyncio.ensure_future(slots.acquire("b"))]
    await settle()
    now[0] = 101.0
    slots.release("a")
    await settle()
    assert waiting[0].done() and not waiting[1].done()  # a is not starved for b's idle past
    waiting[1].cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_busy_time_average_and_free_seconds_integrate_over_time() -> None:
    now = [0.0]
    slots = WeightedSlots(2, clock=lambda: now[0])
    await slots.acquire("a")  # t 0-5: 1 busy, a slot free
    now[0] = 5.0
    await slots.acquire("b")  # t 5-8: 2 busy, none free
    waiting = asyncio.ensure_future(slots.acquire("a"))
    await settle()
    now[0] = 8.0
    slots.release("b")  # the waiter takes the freed slot at once: still none free
    await settle()
    assert waiting.done()
    now[0] = 9.0
    slots.release("a")  # t 9-10: 1 busy, a slot free
    now[0] = 10.0
    assert slots.busy_seconds() == pytest.approx(1 * 5 + 2 * 4 + 1 * 1)
    assert slots.busy_time_average() == pytest.approx(14 / 10)
    assert slots.free_seconds() == pytest.approx(5 + 1)
    slots.release("a")
    now[0] = 20.0  # idle: nothing busy, so the average falls
    assert slots.busy_time_average() == pytest.approx(14 / 20)
    assert slots.free_seconds() == pytest.approx(16)


async def test_runs_that_take_two_slots_at_a_time_still_share_by_weight() -> None:
    """A group request takes its G slots one at a time. Handed out in one go, every second
    slot of a release went to the other run whatever the weights (0.60 instead of 0.75)."""
    now = [0.0]
    slots = WeightedSlots(8, clock=lambda: now[0])
    started: collections.deque[str] = collections.deque()  # groups in start order

    async def feeder(key: str, weight: float) -> None:
        while True:
            await slots.acquire(key, weight)
            await slots.acquire(key, weight)
            started.append(key)

    feeders = [asyncio.ensure_future(feeder("heavy", 3)), asyncio.ensure_future(feeder("light", 1))]
    await settle()
    for _ in range(400):  # the oldest group finishes, every group takes the same time
        now[0] += 0.1
        key = started.popleft()
        slots.release(key)
        slots.release(key)
        await settle()
    heavy, light = slots.slot_seconds("heavy"), slots.slot_seconds("light")
    for task in feeders:
        task.cancel()
    await asyncio.gather(*feeders, return_exceptions=True)
    assert heavy / (heavy + light) == pytest.approx(0.75, abs=0.04)
