"""The consumer session without gRPC: credits bound what it sends, acks reach the broker,
an invalid request ends it with its error, a failed run's streams end with its reason. The
engine behind it is scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.delivery.broker import ACK_TRAINED
from rollout_service.delivery.consumer import Ack, ConsumerRequest, ConsumerSession, Credit, Delivery
from rollout_service.edge.convert import consumer_message_to_wire
from rollout_service.errors import FailedPrecondition, InvalidArgument
from rollout_service.generation.prompts import CyclingPromptSource
from rollout_service.types import PromptItem
from tests.support import wait_until
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.scripted import ScriptedEngine, make_service


class Requests:
    """The client's side: requests the test sends, one at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ConsumerRequest | None] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[ConsumerRequest]:
        while (request := await self.queue.get()) is not None:
            yield request


async def open_session(credits: int):  # type: ignore[no-untyped-def]
    service = make_service(ScriptedEngine())
    run = await service.create_run(spec())
    run.broker.subscribe("c", credits)
    session = ConsumerSession(service, run.run_id, "c", credits)
    requests = Requests()
    reader = asyncio.ensure_future(session.read(aiter(requests)))
    return service, run, session, requests, reader


async def test_credits_bound_what_is_sent_and_acks_reach_the_broker() -> None:
    service, run, session, requests, reader = await open_session(credits=1)
    first = await asyncio.wait_for(session.next_message(), 10)
    assert isinstance(first, Delivery) and first.attempt == 1
    waiting = asyncio.ensure_future(session.next_message())
    done, _ = await asyncio.wait({waiting}, timeout=0.2)  # bounded: no credit, nothing is sent
    assert not done
    requests.queue.put_nowait(Credit(1))
    second = await asyncio.wait_for(waiting, 10)
    assert isinstance(second, Delivery) and second.group.group_id != first.group.group_id
    requests.queue.put_nowait(Ack([first.group.group_id, second.group.group_id], ACK_TRAINED, 0))
    requests.queue.put_nowait(None)  # the client closes its side
    assert await asyncio.wait_for(session.next_message(), 10) is None
    await reader
    assert run.broker.ack_counts[ACK_TRAINED] == 2
    await service.delete_run(run.run_id)


async def test_an_invalid_request_ends_the_stream_with_its_error() -> None:
    service, run, session, requests, reader = await open_session(credits=0)
    requests.queue.put_nowait(Credit(0))
    with pytest.raises(InvalidArgument, match=r"credit\.groups must be > 0"):
        await asyncio.wait_for(session.next_message(), 10)
    await reader
    await service.delete_run(run.run_id)


async def test_a_group_handed_out_again_says_it_is_a_redelivery() -> None:
    """A consumer that left without acking returns its groups; the next consumer is told the
    group has been delivered before (its first holder may have trained it)."""
    service, run, session, requests, reader = await open_session(credits=1)
    first = await asyncio.wait_for(session.next_message(), 10)
    assert isinstance(first, Delivery) and first.attempt == 1
    requests.queue.put_nowait(None)
    await reader
    assert await run.broker.release("c") == 1  # the stream ended without an ack
    run.broker.subscribe("d", 1)
    again = ConsumerSession(service, run.run_id, "d", 1)
    redelivered = await asyncio.wait_for(again.next_message(), 10)
    assert isinstance(redelivered, Delivery)
    assert (redelivered.group.group_id, redelivered.attempt) == (first.group.group_id, 2)
    assert pb.StreamSamplesResponse.FromString(consumer_message_to_wire(redelivered)).group.delivery_attempt == 2
    run.broker.ack("d", [first.group.group_id], ACK_TRAINED)
    assert first.group.group_id not in run.broker.deliveries  # acked: forgotten
    await service.delete_run(run.run_id)


async def take_until_it_ends(session: ConsumerSession) -> tuple[list[str], FailedPrecondition]:
    """The group ids a stream hands out (none acked) before it ends, and how it ends."""
    taken: list[str] = []
    while True:
        try:
            message = await asyncio.wait_for(session.next_message(), 10)
        except FailedPrecondition as ended:
            return taken, ended
        assert isinstance(message, Delivery)
        taken.append(message.group.group_id)


async def test_a_failed_runs_streams_hand_out_its_groups_then_end_with_why_though_they_hold_leases() -> None:
    """A trainer waiting for a step's worth of groups holds its last ones unacked: the streams
    of a failed run end once nothing is left to hand out, not once everything is acked."""
    service = make_service(ScriptedEngine(), max_buffered=4)
    run = await service.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 4, 10, "a full buffer")
    sessions = []
    for consumer in ("c", "d"):
        run.broker.subscribe(consumer, 8)
        sessions.append(ConsumerSession(service, run.run_id, consumer, 8))
    first = await asyncio.wait_for(sessions[0].next_message(), 10)  # leased before the failure
    service.scheduler.fail_run(run, "the servers refuse it")
    buffered = {group.group_id for group in run.broker.buffered}
    (c_took, c_ended), (d_took, d_ended) = await asyncio.gather(*(take_until_it_ends(s) for s in sessions))
    assert sorted(c_took + d_took) == sorted(buffered) and len(buffered) >= 3  # each once, then the end
    assert str(c_ended) == str(d_ended) == f"run {run.run_id} failed: the servers refuse it"
    assert isinstance(first, Delivery) and first.group.group_id in run.broker.leases["c"]  # still leased
    with pytest.raises(FailedPrecondition, match="failed: the servers refuse it"):
        ConsumerSession(service, run.run_id, "e", 1).check_limits()  # a new stream is refused at once
    await service.delete_run(run.run_id)


async def test_a_failed_runs_stream_without_credits_ends_when_another_takes_the_last_group() -> None:
    """A trainer holding its step (no credit left) is told, though it asks for nothing."""
    service = make_service(ScriptedEngine(), max_buffered=2)
    run = await service.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 2, 10, "a full buffer")
    run.broker.subscribe("c", 8)
    run.broker.subscribe("d", 0)
    taker, holder = ConsumerSession(service, run.run_id, "c", 8), ConsumerSession(service, run.run_id, "d", 0)
    holding = asyncio.ensure_future(holder.next_message())
    service.scheduler.fail_run(run, "the servers refuse it")
    took, _ = await take_until_it_ends(taker)
    assert len(took) == 2
    with pytest.raises(FailedPrecondition, match="failed: the servers refuse it"):
        await asyncio.wait_for(holding, 10)
    await service.delete_run(run.run_id)


async def test_a_failed_runs_stream_ends_when_only_a_group_whose_lease_expired_on_it_is_left() -> None:
    """A group whose lease expired on a consumer goes to another one, never back to it: with none
    left but such a group, that consumer's stream ends rather than waits."""
    service = make_service(ScriptedEngine(), max_buffered=2)
    run = await service.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 2, 10, "a full buffer")
    service.scheduler.fail_run(run, "the servers refuse it")
    run.broker.subscribe("c", 8)
    expired, kept = run.broker.buffered
    run.broker.expired_holder[expired.group_id] = "c"  # as _expire_leases leaves it
    took, ended = await take_until_it_ends(ConsumerSession(service, run.run_id, "c", 8))
    assert took == [kept.group_id] and "failed: the servers refuse it" in str(ended)
    run.broker.subscribe("d", 8)
    took, _ = await take_until_it_ends(ConsumerSession(service, run.run_id, "d", 8))
    assert took == [expired.group_id]  # another consumer still gets it
    await service.delete_run(run.run_id)


async def test_a_feeder_that_dies_fails_its_run_and_its_streams_end_after_its_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    real_next = CyclingPromptSource.next

    async def next_until_the_source_breaks(source: CyclingPromptSource) -> PromptItem:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise OSError("the dataset's shard is gone")
        return await real_next(source)

    monkeypatch.setattr(CyclingPromptSource, "next", next_until_the_source_breaks)
    service = make_service(ScriptedEngine(), max_buffered=3)
    run = await service.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 3, 10, "a full buffer")
    run.broker.subscribe("c", 8)
    took, ended = await take_until_it_ends(ConsumerSession(service, run.run_id, "c", 8))
    assert len(took) == 3 and run.state == "failed"  # the first take made room: the feeder asked for more
    assert str(ended).startswith(f"run {run.run_id} failed: starting its groups failed: OSError: the dataset's shard")
    await service.delete_run(run.run_id)
