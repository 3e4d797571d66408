"""gRPC server reflection in both versions clients ask for: ``grpc.reflection.v1`` (grpcurl, Postman and grpcui try it
first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection ships only v1alpha, so v1's messages are generated from the standard proto
(``protos/p2pnode/v1/grpc_reflection_v1.proto``, which also puts v1's descriptors in the default pool for clients that
describe the reflection service itself). v1's messages are v1alpha's field for field, so the library's servicer
answers both: the v1 method decodes and encodes with v1alpha's classes, and the bytes are the same.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from p2pnode.v1 import grpc_reflection_v1_pb2

__all__ = ["V1ALPHA_SERVICE", "V1_SERVICE", "enable_reflection"]

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_SERVICE: str = grpc_reflection_v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
_METHOD = "ServerReflectionInfo"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both reflection services."""
    names = [*service_names, V1ALPHA_SERVICE, V1_SERVICE]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)  # v1alpha
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, {_METHOD: handler}),))
