"""The prompt feeder keeps a SUBMITTED run's queue topped up, a window at a time, and goes
round the prompt set again at its end (a real gRPC server over a scripted engine)."""

from __future__ import annotations

import asyncio

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from rollout_service.config import SecuritySettings
from rollout_service.edge.server import start_grpc_server
from tests.unit.scripted import ScriptedEngine, make_service
from trainer_client.stream import prompt_feeder

PROMPTS = [pb.Prompt(token_ids=pb.TokenIds(ids=[i + 1]), metadata={"i": str(i)}) for i in range(3)]


async def test_the_feeder_cycles_the_prompts_and_stays_within_its_window(monkeypatch) -> None:
    monkeypatch.setattr(prompt_feeder, "POLL_S", 0.02)
    submitted_sizes: list[int] = []
    service = make_service(ScriptedEngine())
    server, port, _health = await start_grpc_server(service, "127.0.0.1", 0, SecuritySettings())
    try:
        async with RolloutClient(f"127.0.0.1:{port}", timeout_s=5) as client:
            original = client.submit_prompts

            async def counting_submit(run_id: str, prompts: list[pb.Prompt]) -> pb.SubmitPromptsResponse:
                reply = await original(run_id, prompts)
                submitted_sizes.append(reply.accepted)
                assert reply.queued <= 4  # the window: never more queued than ``ahead``
                return reply

            client.submit_prompts = counting_submit  # type: ignore[method-assign]
            spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="completion_length")])
            spec.prompt_source.submitted.SetInParent()
            spec.sampling.max_tokens = 2
            spec.max_buffered_groups = 2
            run = await client.create_run(spec)
            feeder = asyncio.create_task(prompt_feeder.feed_prompts(client, run.run_id, PROMPTS, ahead=4, batch_size=2))
            stream = client.stream(run.run_id, "trainer", credits=1)
            seen: list[str] = []
            async with asyncio.timeout(20):
                async for group in stream:
                    seen.append(group.metadata["i"])
                    stream.ack([group.group_id])
                    stream.grant(1)
                    if len(seen) == 8:
                        break
            await stream.aclose()
            assert not feeder.done()  # it feeds for as long as the trainer trains
            feeder.cancel()
    finally:
        await server.stop(None)
        await service.close()
    assert sorted(seen[:3]) == ["0", "1", "2"] and sorted(seen[3:6]) == ["0", "1", "2"]  # round and round
    assert set(submitted_sizes) <= {1, 2} and sum(submitted_sizes) >= 8


def test_small_sets_go_inline_and_large_ones_stream() -> None:
    assert prompt_feeder.fits_inline(10_000, 1 << 20)
    assert not prompt_feeder.fits_inline(10_001, 1 << 20)
    assert not prompt_feeder.fits_inline(10, 17 << 20)
