"""A group is encoded to its wire message once and reused: the bytes a delivery sends parse
as the message the group converts to, with the delivery's attempt; a restored group decodes
to the group that was stored."""

from __future__ import annotations

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.edge import group_wire
from rollout_service.edge.group_wire import WireCodec, delivery_response, group_to_pb
from tests.unit.rollout_service.builders import scored_group


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
    assert restored.policy_version == 3
