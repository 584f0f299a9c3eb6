"""Values the service's tests build in several folders: run specs and a fully populated
scored group."""

from __future__ import annotations

from rollout_service.generation.prompts import PromptSpec
from rollout_service.runs import RunSpec
from rollout_service.types import EpisodeResult, PromptItem, SamplingParams, ScoredGroup


def one_prompt_spec() -> RunSpec:
    """One prompt of one token, groups of 2, 2 tokens each."""
    return RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(token_ids=[1]),),
        sampling=SamplingParams(max_tokens=2),
        group_size=2,
        rewards=(("completion_length", 1.0),),
    )


def spec(prompts: list[list[int]], group_size: int = 3, rewards=(("completion_length", 1.0),), **kw) -> RunSpec:
    return RunSpec(
        source_kind="prompts",
        prompts=tuple(PromptSpec(token_ids=p) for p in prompts),
        sampling=SamplingParams(max_tokens=4),
        group_size=group_size,
        rewards=rewards,
        **kw,
    )


def scored_group() -> ScoredGroup:
    episodes = [
        EpisodeResult(
            completion_ids=[5, 6, 7 + i],
            logprobs=[-0.25, -1.5, -0.125 * i],
            mask=[1, 0, 1],
            finish_reason=("stop", "max_turns")[i],
            text=f"answer {i}",
            policy_version_first=3 + i,
            policy_version_last=4 + i,
            num_turns=2,
            num_tool_calls=1,
            num_tool_failures=i,
        )
        for i in range(2)
    ]
    return ScoredGroup(
        group_id="run-1/7",
        run_id="run-1",
        prompt=PromptItem(7, [1, 2, 3], "a prompt", {"answer": "42"}),
        episodes=episodes,
        rewards=[0.5, 1.5],
        reward_components={"accuracy": [0.0, 1.0], "format": [1.0, 1.0]},
        reward_weights={"accuracy": 1.0, "format": 0.5},
        advantages=[-1.0, 1.0],
        generation_seconds=2.5,
        requested_size=4,
    )
