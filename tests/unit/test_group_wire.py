"""A group is encoded to its wire message once and reused: the bytes a delivery sends parse
as the message the group converts to, with the delivery's attempt; a restored group decodes
to the group that was stored."""

from __future__ import annotations

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.edge import group_wire
from rollout_service.edge.group_wire import WireCodec, delivery_response, group_to_pb
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup


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


@pytest.mark.parametrize("attempt", [1, 2, 300])
def test_a_delivery_is_the_groups_message_with_its_attempt(attempt: int) -> None:
    group = scored_group()
    expected = group_to_pb(group)
    expected.delivery_attempt = attempt
    assert pb.StreamSamplesResponse.FromString(delivery_response(group, attempt)).group == expected


def test_a_group_is_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    group, encodings = scored_group(), []
    original = group_wire.group_to_pb
    monkeypatch.setattr(group_wire, "group_to_pb", lambda g: encodings.append(g) or original(g))
    first = WireCodec.encode(group)
    delivery_response(group, 1), delivery_response(group, 2)
    assert len(encodings) == 1 and WireCodec.encode(group) is first


def test_a_stored_group_decodes_to_the_group_with_its_bytes() -> None:
    group = scored_group()
    body = WireCodec.encode(group)
    restored = WireCodec.decode(body)
    assert vars(restored) == vars(group)  # groups compare by identity; their fields match
    assert WireCodec.encode(restored) is body  # kept, not encoded again
    assert restored.policy_version == 3 and restored.num_generated_tokens == 4
