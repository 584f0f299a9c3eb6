"""gRPC-side helpers of the edge and client tests: a minimal wire RunSpec, and the status
code a call ends with."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc

from rollout_api import rollout_pb2 as pb


def run_spec() -> pb.RunSpec:
    spec = pb.RunSpec(group_size=2, reward_functions=[pb.RewardFunctionSpec(name="completion_length")])
    spec.prompt_source.prompts.prompts.add().token_ids.ids.append(1)
    spec.sampling.max_tokens = 2
    return spec


async def status_of(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
