"""A lease that expires goes to another consumer and never back to the stream that still
holds it, end to end over gRPC against a real vLLM server. Before the fix, a consumer with
credits to spare received each of its expired groups again, every lease period, and
trained them twice."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from tests.support import wait_until

pytestmark = pytest.mark.integration

LEASE_S = 2.0


async def test_an_expired_lease_goes_to_another_consumer_and_never_back_to_its_holder(client: RolloutClient) -> None:
    # Four groups in all, as in the report: the holder takes them and keeps waiting for more.
    spec = pb.RunSpec(group_size=2, lease_timeout_seconds=LEASE_S)
    spec.reward_functions.add(name="char_fraction", weight=1.0)
    spec.prompt_source.submitted.SetInParent()
    spec.sampling.max_tokens = 8
    run = await client.create_run(spec)
    await client.submit_prompts(run.run_id, [pb.Prompt(text=f"spell {word}") for word in ("a", "be", "sea", "dee")])
    holder = client.stream(run.run_id, "holder", credits=16)  # takes groups, never acks, has credits to spare
    held: list[str] = []

    async def hold() -> None:
        async for group in holder:
            held.append(group.group_id)

    holding = asyncio.ensure_future(hold())
    try:
        await wait_until(lambda: len(held) >= 4, 60, "the holder's first groups")
        await wait_until(lambda: _expired(client, run.run_id, 4), 60, "its leases to expire")
        other = client.stream(run.run_id, "other", credits=4)
        taken: list[str] = []
        async with asyncio.timeout(60):
            async for group in other:
                taken.append(group.group_id)
                other.ack([group.group_id])
                if len(taken) == 4:
                    break
        assert sorted(taken) == sorted(held)  # the expired groups went to the other consumer ...
        assert len(held) == 4, "an expired group came back to the stream that still holds it"  # ... only

        holder.ack([taken[0]])  # the late ack of the first holder is refused: it must not count it
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(holding, 30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "expired" in info.value.details() and "do not count it as trained" in info.value.details()
        stats = (await client.get_run(run.run_id)).stats
        assert stats.groups_trained == 4  # each once, by the consumer that holds it now
        await other.aclose()
    finally:
        holding.cancel()
        with contextlib.suppress(BaseException):
            await holding
        await client.delete_run(run.run_id)


async def _expired(client: RolloutClient, run_id: str, leases: int) -> bool:
    return (await client.get_run(run_id)).stats.leases_expired >= leases
