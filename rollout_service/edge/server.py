"""The gRPC server: registers the servicer (``edge.servicer``) with health and reflection, over
TLS and tokens when configured, and refuses a request that does not parse as INVALID_ARGUMENT."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollout_api import rollout_pb2 as pb
from rollout_api import rollout_pb2_grpc as pb_grpc
from rollout_service.config import SecuritySettings
from rollout_service.edge.convert import undecodable
from rollout_service.edge.reflection import enable_reflection
from rollout_service.edge.security import AuthInterceptor, check_bind, load_token_table, server_credentials
from rollout_service.edge.servicer import RolloutServicer
from rollout_service.errors import InvalidArgument
from rollout_service.service import RolloutService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
RUNS_HEALTH_NAME = f"{SERVICE_NAME}/runs"
"""NOT_SERVING while any run is stalled; the service itself stays SERVING (other runs may be fine)."""


class _HandlerCollector:
    """Stands in for the server to catch the generated code's method handlers."""

    handlers: dict[str, grpc.RpcMethodHandler] | None = None

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers


def _stream_response_bytes(response: pb.StreamSamplesResponse | bytes) -> bytes:
    """A group delivery comes already encoded (``group_wire``); other responses are messages."""
    return response if isinstance(response, bytes) else response.SerializeToString()


@dataclasses.dataclass(frozen=True)
class _Undecodable:
    """A request that did not parse: its handler answers INVALID_ARGUMENT (grpc.aio would answer UNKNOWN)."""

    why: str


def _tolerant(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    message = pb.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name[method].input_type
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            return _Undecodable(undecodable(data, message))

    handler = handler._replace(request_deserializer=deserialize)
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def checked_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return await unary(request, context)

        return handler._replace(unary_unary=checked_unary)
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def checked_stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await stream_unary(_parsed(requests), context)

        return handler._replace(stream_unary=checked_stream_unary)
    stream_stream = handler.stream_stream

    async def checked_stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        async with contextlib.aclosing(stream_stream(_parsed(requests), context)) as responses:
            async for response in responses:
                yield response

    return handler._replace(stream_stream=checked_stream_stream)


async def _parsed(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A stream's requests; one that did not parse ends it with INVALID_ARGUMENT (``servicer._edge``)."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise InvalidArgument(request.why)
        yield request


def _add_rollout_servicer(servicer: RolloutServicer, server: grpc.aio.Server) -> None:
    """The generated registration, but StreamSamples may yield pre-encoded bytes and
    unparsable requests are INVALID_ARGUMENT."""
    collector = _HandlerCollector()
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, collector)
    if collector.handlers is None:
        raise RuntimeError("rollout_pb2_grpc registers no method handlers: regenerate it with `make proto`")
    handlers = {method: _tolerant(handler, method) for method, handler in collector.handlers.items()}
    handlers["StreamSamples"] = handlers["StreamSamples"]._replace(response_serializer=_stream_response_bytes)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def start_grpc_server(
    service: RolloutService, host: str, port: int, security: SecuritySettings | None = None
) -> tuple[grpc.aio.Server, int, Any]:
    """Start the gRPC server with health (and reflection); returns (server, bound port, health)."""
    security = security if security is not None else SecuritySettings()
    check_bind(host, security)
    tokens = load_token_table(security)
    credentials = server_credentials(security)
    # No SO_REUSEPORT: a second service on the same port must fail, not share it silently.
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),  # adapter chunks
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options, interceptors=[AuthInterceptor(tokens, security.reflection)])
    _add_rollout_servicer(RolloutServicer(service, tokens, security), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if security.reflection:
        enable_reflection(server, [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind gRPC to {host}:{port}; is the port in use?")
    await server.start()
    await set_serving(health_servicer, True)
    await set_runs_progressing(health_servicer, True)
    return server, bound, health_servicer


async def set_serving(health_servicer: Any, serving: bool, names: tuple[str, ...] = (SERVICE_NAME, "")) -> None:
    """The gRPC health status of ``names``, by default this service's own and the server's ("")."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in names:
        await health_servicer.set(name, status)


async def set_runs_progressing(health_servicer: Any, progressing: bool) -> None:
    await set_serving(health_servicer, progressing, (RUNS_HEALTH_NAME,))
