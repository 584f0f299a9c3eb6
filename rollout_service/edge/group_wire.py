"""A scored group on the wire (``rollout.v1.Group``), encoded once per group.

Encoding is the costliest step of a delivery, so the bytes are kept on the group (shared with
the state store) and each delivery appends its own ``delivery_attempt``: protobuf lets a
scalar field that appears again override the earlier value.
"""

from __future__ import annotations

import weakref
from typing import get_args

from rollout_api import rollout_pb2 as pb
from rollout_service.types import EpisodeResult, FinishReason, PromptItem, ScoredGroup

_FINISH_TO_PB = {name: getattr(pb, f"FINISH_REASON_{name.upper()}") for name in get_args(FinishReason)}
_FINISH_FROM_PB: dict[int, FinishReason] = {number: name for name, number in _FINISH_TO_PB.items()}

_LENGTH_DELIMITED, _VARINT = 2, 0
_GROUP_IN_RESPONSE = pb.StreamSamplesResponse.DESCRIPTOR.fields_by_name["group"].number
_ATTEMPT_IN_GROUP = pb.Group.DESCRIPTOR.fields_by_name["delivery_attempt"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_RESPONSE_GROUP_TAG = _varint(_GROUP_IN_RESPONSE << 3 | _LENGTH_DELIMITED)
_ATTEMPT_TAG = _varint(_ATTEMPT_IN_GROUP << 3 | _VARINT)


def group_to_pb(group: ScoredGroup) -> pb.Group:
    samples = [
        pb.Sample(
            completion_token_ids=episode.completion_ids,
            completion_logprobs=episode.logprobs,
            completion_mask=episode.mask,
            reward=group.rewards[i],
            reward_components=[
                pb.RewardComponent(name=name, value=values[i], weight=group.reward_weights[name])
                for name, values in group.reward_components.items()
            ],
            advantage=group.advantages[i],
            policy_version_first=episode.policy_version_first,
            policy_version_last=episode.policy_version_last,
            finish_reason=_FINISH_TO_PB[episode.finish_reason],
            completion_text=episode.text,
            num_turns=episode.num_turns,
            num_tool_calls=episode.num_tool_calls,
            num_tool_failures=episode.num_tool_failures,
        )
        for i, episode in enumerate(group.episodes)
    ]
    return pb.Group(
        group_id=group.group_id,
        run_id=group.run_id,
        prompt_index=group.prompt.index,
        prompt_text=group.prompt.text,
        prompt_token_ids=group.prompt.token_ids,
        requested_size=group.requested_size or len(group.episodes),
        samples=samples,
        policy_version=group.policy_version,
        generation_seconds=group.generation_seconds,
        metadata=group.prompt.metadata,
    )


def group_from_pb(message: pb.Group) -> ScoredGroup:
    """The group a message carries; what only scoring needed (messages, reward texts) stays empty."""
    samples = message.samples
    components = samples[0].reward_components if samples else []  # every sample names the same ones
    return ScoredGroup(
        group_id=message.group_id,
        run_id=message.run_id,
        prompt=PromptItem(
            message.prompt_index, list(message.prompt_token_ids), message.prompt_text, dict(message.metadata)
        ),
        episodes=[
            EpisodeResult(
                completion_ids=list(sample.completion_token_ids),
                logprobs=list(sample.completion_logprobs),
                mask=list(sample.completion_mask),
                finish_reason=_FINISH_FROM_PB[sample.finish_reason],
                text=sample.completion_text,
                policy_version_first=sample.policy_version_first,
                policy_version_last=sample.policy_version_last,
                num_turns=sample.num_turns,
                num_tool_calls=sample.num_tool_calls,
                num_tool_failures=sample.num_tool_failures,
            )
            for sample in samples
        ],
        rewards=[sample.reward for sample in samples],
        reward_components={
            component.name: [sample.reward_components[k].value for sample in samples]
            for k, component in enumerate(components)
        },
        reward_weights={component.name: component.weight for component in components},
        advantages=[sample.advantage for sample in samples],
        generation_seconds=message.generation_seconds,
        requested_size=message.requested_size,
    )


_ENCODED: weakref.WeakKeyDictionary[ScoredGroup, bytes] = weakref.WeakKeyDictionary()


class WireCodec:
    """Groups as ``rollout.v1.Group`` bytes, encoded once: the state store's and the stream's codec."""

    @staticmethod
    def encode(group: ScoredGroup) -> bytes:
        body = _ENCODED.get(group)
        if body is None:
            body = _ENCODED[group] = group_to_pb(group).SerializeToString()
        return body

    @staticmethod
    def decode(body: bytes) -> ScoredGroup:
        group = group_from_pb(pb.Group.FromString(body))
        _ENCODED[group] = body
        return group


def delivery_response(group: ScoredGroup, attempt: int) -> bytes:
    """The encoded ``StreamSamplesResponse`` delivering ``group`` for the ``attempt``-th time."""
    body = WireCodec.encode(group) + _ATTEMPT_TAG + _varint(attempt)
    return _RESPONSE_GROUP_TAG + _varint(len(body)) + body
