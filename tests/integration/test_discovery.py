"""grpcurl-style discovery through server reflection, health checks and /metrics."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

pytestmark = pytest.mark.integration
SERVICE = "rollout.v1.RolloutService"


def fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


async def test_reflection_lists_and_describes_the_service_and_a_call_works_from_it(service) -> None:
    # The reflection client is synchronous, as grpcurl is: run it off the service's loop.
    def discover_and_call() -> tuple[list[str], list[str], str]:
        with grpc.insecure_channel(service.grpc_target) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = database.get_services()
            pool = descriptor_pool.DescriptorPool(database)
            described = pool.FindServiceByName(SERVICE)
            methods = [m.name for m in described.methods]
            # Like `grpcurl -d '{}' host rollout.v1.RolloutService/GetServerInfo`: message
            # classes built from the reflected descriptors only, no generated code.
            method = described.methods_by_name["GetServerInfo"]
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            call = channel.unary_unary(
                f"/{SERVICE}/GetServerInfo",
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            response = call(request_cls(), timeout=10)
            return services, methods, response.model

    services, methods, model = await asyncio.to_thread(discover_and_call)
    assert SERVICE in services and "grpc.health.v1.Health" in services
    assert {"CreateRun", "StreamSamples", "GetStats", "SubmitPrompts"} <= set(methods)
    assert model == "tiny"


async def test_health_is_serving(service) -> None:
    async with grpc.aio.insecure_channel(service.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            response = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_metrics_endpoint_exports_service_metrics(service, client) -> None:
    from rollout_api.client import dataset_run_spec
    from tests.integration.test_stream import take_groups

    run = await client.create_run(dataset_run_spec("letters", {"char_fraction": 1.0}, group_size=2, max_tokens=8))
    await take_groups(client, run.run_id, 2)
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    text = await asyncio.to_thread(fetch_text, url)  # the endpoint runs on this loop
    for name in (
        "rollout_slots_busy",
        "rollout_slots_total 8.0",
        f'rollout_tokens_generated_total{{run="{run.run_id}"}}',
        f'rollout_groups_scored_total{{run="{run.run_id}"}}',
        f'rollout_broker_groups_buffered{{run="{run.run_id}"}}',
        "rollout_engine_request_seconds_bucket",
    ):
        assert name in text, name
