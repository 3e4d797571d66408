"""API keys on the client APIs: ``Authorization: Bearer <key>`` on HTTP, ``authorization`` metadata on gRPC.

A presented key is hashed (SHA-256) and compared with every configured key's digest by ``hmac.compare_digest``,
all of them every time, so the time taken says nothing about how close a guess was (vLLM's own middleware does
the same). No keys configured: no authentication. A key may name a tenant (``--tenant NAME=KEY``): it is accepted
like any other, and the match says whose it is (``ApiKeys.tenant_of``).

Only the client APIs are guarded: gRPC's ``p2pnode.v1.Node`` service and HTTP's ``/v1/*``. Peer RPCs (Gossip,
Forward) are authenticated by the cluster secret or mTLS instead; gRPC health and reflection and HTTP ``/health``,
``/ready`` and ``/metrics`` stay open for probes and scrapers, as in ``vllm serve``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable

import grpc

#: What a client without the right key is told (the same on both APIs).
UNAUTHENTICATED_MESSAGE = "authorization: missing or wrong API key (send 'Authorization: Bearer <key>')"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The accepted keys, kept only as digests, each with the tenant it names ("": none)."""

    def __init__(self, keys: Iterable[str] = (), tenants: Iterable[tuple[str, str]] = ()) -> None:
        """``tenants``: (key, tenant name) pairs, accepted like ``keys``."""
        self._digests = [(_digest(k), "") for k in keys if k] + [(_digest(k), name) for k, name in tenants if k]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: str | None) -> bool:
        """True when auth is off, or ``authorization`` is ``Bearer <one of the keys>``."""
        return not self._digests or self._match(authorization) is not None

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant the presented key names ("": none, or no accepted key)."""
        return self._match(authorization) or ""

    def _match(self, authorization: str | None) -> str | None:
        """The matching key's tenant ("" for a key that names none), None when no key matches."""
        if not self._digests or not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(token.strip())
        match: str | None = None
        for digest, tenant in self._digests:  # every one, whatever matched: the time says nothing
            if hmac.compare_digest(digest, presented):
                match = tenant
        return match


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codecs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(deny, **codecs)
    return grpc.unary_unary_rpc_method_handler(deny, **codecs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the guarded gRPC service without an accepted key; every other service passes."""

    def __init__(
        self, keys: ApiKeys, guarded_service: str, on_reject: Callable[[str], None] | None = None
    ) -> None:
        self.keys = keys
        self.prefix = f"/{guarded_service}/"
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.keys.enabled or not details.method.startswith(self.prefix):
            return handler
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        if self.keys.accepts(metadata.get("authorization")):
            return handler
        if self.on_reject is not None:
            self.on_reject(details.method)
        return _denied(handler)
