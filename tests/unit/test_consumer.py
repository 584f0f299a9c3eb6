"""The consumer session without gRPC: credits bound what it sends, acks reach the broker,
an invalid request ends it with its error. The engine behind it is scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rollout_service.delivery.broker import ACK_TRAINED
from rollout_service.delivery.consumer import Ack, ConsumerRequest, ConsumerSession, Credit
from rollout_service.errors import InvalidArgument
from rollout_service.types import ScoredGroup
from tests.unit.scripted import ScriptedEngine, make_service
from tests.unit.test_service_limits import spec


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
    assert isinstance(first, ScoredGroup)
    waiting = asyncio.ensure_future(session.next_message())
    done, _ = await asyncio.wait({waiting}, timeout=0.2)  # bounded: no credit, nothing is sent
    assert not done
    requests.queue.put_nowait(Credit(1))
    second = await asyncio.wait_for(waiting, 10)
    assert isinstance(second, ScoredGroup) and second.group_id != first.group_id
    requests.queue.put_nowait(Ack([first.group_id, second.group_id], ACK_TRAINED, 0))
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
