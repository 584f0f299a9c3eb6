"""The size bound that keeps an unsendable group out of the buffer is an upper bound."""

from __future__ import annotations

import random

import pytest

from rollout_service.edge.group_wire import group_to_pb
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup


def group(prompt_len: int, completion_len: int, size: int, text: str, metadata: dict[str, str]) -> ScoredGroup:
    rng = random.Random(0)
    episodes = [
        EpisodeResult(
            completion_ids=[rng.randrange(2**31) for _ in range(completion_len)],  # 5-byte varints: the worst case
            logprobs=[-rng.random() for _ in range(completion_len)],
            mask=[1] * completion_len,
            finish_reason="length",
            text=text * completion_len,
            policy_version_first=3,
            policy_version_last=4,
        )
        for _ in range(size)
    ]
    prompt = PromptItem(index=7, token_ids=list(range(prompt_len)), text=text * prompt_len, metadata=metadata)
    rewards = [rng.random() for _ in range(size)]
    return ScoredGroup(
        group_id="run-x/7/abcdef12",
        run_id="run-x",
        prompt=prompt,
        episodes=episodes,
        rewards=rewards,
        reward_components={"char_fraction": rewards, "completion_length": rewards},
        reward_weights={"char_fraction": 1.0, "completion_length": -0.5},
        advantages=rewards,
        generation_seconds=1.5,
    )


@pytest.mark.parametrize(
    ("prompt_len", "completion_len", "size", "text", "metadata"),
    [
        (0, 0, 2, "", {}),
        (12, 32, 8, "ab", {}),
        (500, 2000, 16, "é🙂", {"answer": "42" * 100, "source": "gsm8k"}),
    ],
)
def test_the_bound_is_never_below_the_message_size_and_not_far_above(
    prompt_len: int, completion_len: int, size: int, text: str, metadata: dict[str, str]
) -> None:
    scored = group(prompt_len, completion_len, size, text, metadata)
    actual = group_to_pb(scored).ByteSize()
    bound = scored.wire_bytes_upper_bound()
    assert actual <= bound <= 2 * actual + 1024
