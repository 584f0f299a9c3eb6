"""Server reflection answers under grpc.reflection.v1 (what grpcurl asks first) and v1alpha."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as messages

from rollout_service.config import SecuritySettings
from rollout_service.edge.server import start_grpc_server
from tests.unit.scripted import ScriptedEngine, make_service


async def ask(channel: grpc.aio.Channel, version: str, request: messages.ServerReflectionRequest):
    """One reflection request by raw method path: v1 and v1alpha messages are the same bytes."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=messages.ServerReflectionRequest.SerializeToString,
        response_deserializer=messages.ServerReflectionResponse.FromString,
    )
    stream = call(iter([request]), timeout=5)
    return await anext(aiter(stream))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_both_reflection_versions_list_and_describe_the_api(version: str) -> None:
    service = make_service(ScriptedEngine())
    server, port, _health = await start_grpc_server(service, "127.0.0.1", 0, SecuritySettings(reflection=True))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            listed = await ask(channel, version, messages.ServerReflectionRequest(list_services=""))
            names = {s.name for s in listed.list_services_response.service}
            assert {"rollout.v1.RolloutService", "grpc.health.v1.Health"} <= names
            assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
            for symbol, package in [
                ("rollout.v1.RolloutService", "rollout.v1"),
                (f"grpc.reflection.{version}.ServerReflection", f"grpc.reflection.{version}"),
            ]:
                described = await ask(channel, version, messages.ServerReflectionRequest(file_containing_symbol=symbol))
                files = [
                    descriptor_pb2.FileDescriptorProto.FromString(raw)
                    for raw in described.file_descriptor_response.file_descriptor_proto
                ]
                assert package in {f.package for f in files}, symbol
    finally:
        await server.stop(None)
        await service.close()
