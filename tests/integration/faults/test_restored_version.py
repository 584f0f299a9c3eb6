"""A service restarted on its state store finds its vLLM server holding other weights than
the restored policy version (a managed server started anew, or one restarted behind its
back): it generates nothing under that version until the version is pushed again, asks the
run's trainer for that push, and every group it streams afterwards was sampled from the
restored policy, by log-prob agreement with that policy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_service.engine.control import VLLMControlClient
from tests.integration.conftest import restore_base_weights, service_settings, service_with_client
from tests.integration.test_weight_sync import perturbed, vllm_matches, vllm_weight_label
from tests.support import wait_until
from trainer_client.weights.push import WeightPusher

pytestmark = pytest.mark.integration

GROUPS_AT_RESTORED_VERSION = 4
LOGPROB_TOLERANCE = 1e-3
"""The session's server computes in float32, as the reference does."""


@torch.no_grad()
def logprob_gap(models: dict[int, Qwen2ForCausalLM], group: pb.Group) -> float:
    """The largest gap between a group's behaviour log-probs and those of the policy each
    sample's versions name, over its generated tokens. A sample that straddles a push (the
    default pause mode lets generation run through it) has no single policy: it is skipped."""
    gap = 0.0
    prompt = list(group.prompt_token_ids)
    for sample in group.samples:
        if sample.policy_version_first != sample.policy_version_last:
            continue
        model = models[sample.policy_version_first]
        completion = list(sample.completion_token_ids)
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        pairs = zip(sample.completion_logprobs, reference.tolist(), sample.completion_mask, strict=True)
        for mine, theirs, mask in pairs:
            if mask:
                gap = max(gap, abs(mine - theirs))
    return gap


async def push(client: RolloutClient, run_id: str, model: Qwen2ForCausalLM, resend: bool = False) -> int:
    pusher = WeightPusher(client, run_id, transfer_timeout_s=30)
    try:
        return await asyncio.wait_for(pusher.push(list(model.named_parameters()), resend), 60)
    finally:
        pusher.close()


async def set_label(url: str, label: str) -> None:
    control = VLLMControlClient(url)
    await control.start()
    try:
        await control.set_weight_version(label, 10)
    finally:
        await control.close()


@pytest.mark.timeout(300)
async def test_a_restarted_service_generates_nothing_until_its_server_holds_the_restored_version(
    vllm_server, tiny_model: Path, tmp_path: Path
) -> None:
    url = vllm_server.url
    base = Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    policy = perturbed(base)
    settings = service_settings(
        [url],
        tiny_model,
        scheduler={"max_inflight": 4},
        state_store=str(tmp_path / "state.db"),
        weight_sync={"transfer_timeout_s": 30, "control_timeout_s": 10},
    )
    spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8, max_buffered_groups=1)
    async with service_with_client(settings) as (_, client):
        run_id = (await client.create_run(spec)).run_id
        assert await push(client, run_id, policy) == 1
        await wait_until(lambda: vllm_weight_label(url) == "1", 30, "vLLM to label the pushed weights")

    # The server comes back with the checkpoint's weights and a fresh label, as a managed
    # server that a restarted service starts anew (the push needs a service of its own).
    async with service_with_client(service_settings([url], tiny_model)) as (_, other):
        scratch = (await other.create_run(spec)).run_id
        await restore_base_weights(other, scratch, tiny_model)
    await set_label(url, "default")
    assert await vllm_matches(url, base) <= 1e-4

    async with service_with_client(settings) as (running, client):
        try:
            service = running.service
            assert service.policy_version == 1
            assert "policy version 1 is pushed" in service.scheduler.engine.held[url]
            (engine,) = (await client.stats()).engines
            assert not engine.routable and "labelled 'default'" in engine.held_reason  # visible in GetStats
            assert service.runs.require(run_id).admission.weights_wanted  # the trainer is asked for its weights
            assert (await client.stats()).tokens_generated == 0  # nothing sampled under a version not held

            assert await push(client, run_id, policy, resend=True) == 1  # the trainer's resend
            assert not service.scheduler.engine.held
            # The groups buffered before the restart come first, some of version 0 (sampled from
            # the checkpoint); every sample must agree with the policy its version names.
            models = {0: base, 1: policy}
            stream = client.stream(run_id, "checker", credits=4)
            gaps: dict[int, list[float]] = {0: [], 1: []}
            async with asyncio.timeout(120):
                async for group in stream:
                    gap = await asyncio.to_thread(logprob_gap, models, group)
                    gaps[group.policy_version].append(gap)
                    stream.ack([group.group_id])
                    if len(gaps[1]) == GROUPS_AT_RESTORED_VERSION:
                        break
            stream.cancel()
            assert (await client.stats()).tokens_generated > 0
            assert max(gaps[0] + gaps[1]) <= LOGPROB_TOLERANCE, gaps
        finally:  # the tests after this one sample from the base weights
            await restore_base_weights(client, run_id, tiny_model)
