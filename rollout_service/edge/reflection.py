"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` (grpcurl,
Postman and recent grpc libraries try it first) and ``grpc.reflection.v1alpha``.

grpcio-reflection ships only the v1alpha service. The two protos differ in their package
name alone, so their messages are the same bytes on the wire: the v1 service here is the
same servicer registered under the v1 name, and a copy of the v1alpha file descriptor under
the v1 package lets clients describe the v1 service too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(file)
    file.name, file.package = V1_FILE, "grpc.reflection.v1"
    pool.Add(file)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> list[str]:
    """Serve reflection (v1 and v1alpha) listing ``service_names`` and itself; returns the list."""
    _register_v1_descriptor(descriptor_pool.Default())
    names = [*service_names, V1_SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)  # v1alpha
    servicer = reflection.aio.ReflectionServicer(names)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=v1alpha.ServerReflectionRequest.FromString,
                response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
    return names
