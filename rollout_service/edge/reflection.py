"""gRPC server reflection as ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only v1alpha; the protos differ only in package name, so the same
servicer is registered under the v1 name with a copy of the descriptor in the v1 package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    with contextlib.suppress(KeyError):  # registered already
        pool.FindFileByName(V1_FILE)
        return
    file = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(file)
    file.name, file.package = V1_FILE, "grpc.reflection.v1"
    pool.Add(file)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) listing ``service_names`` and itself."""
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
