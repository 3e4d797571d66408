"""Forwarding a request to the peer routing chose, and serving requests forwarded here.

Ingress side (``ForwardClient``): one signed Forward call per attempt, relayed message by message; the caller's
deadline travels as the call's timeout and closing the relay cancels the call (which aborts the peer's engine
request). Failures become ``TargetFailed``; whether to retry is the ingress's decision (only before any output).

Receiver side (``ForwarderService``): authenticate the envelope exactly like gossip, check the request against this
node's model, and serve it locally — a forwarded request is never forwarded again (hop must be 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from p2pnode.api import validation
from p2pnode.api.local_serving import CallGone, LocalServer, TargetFailed, write_or_gone
from p2pnode.config import DEFAULT_MAX_PEER_CHANNELS, SamplingDefaults
from p2pnode.v1 import forward_pb2, node_pb2

#: Status codes after which another node may serve the request (when nothing was streamed yet).
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
})


FORWARDER_SERVICE = forward_pb2.DESCRIPTOR.services_by_name["Forwarder"].full_name
FORWARD_METHOD = f"/{FORWARDER_SERVICE}/Forward"


class OpenedEnvelope(Protocol):
    sender_id: str
    payload: bytes


class EnvelopeAuth(Protocol):
    """Signs and checks peer envelopes: the gossip agent's ``Authenticator`` (p2pnode/gossip/auth.py)."""

    def seal(self, payload: bytes) -> bytes: ...

    def open(self, data: bytes, max_bytes: int | None = None) -> OpenedEnvelope:
        """The verified envelope, or raise an error whose ``code`` names the gRPC status to answer with."""
        ...


class PeerChannels:
    """A bounded pool of gRPC channels to peers, by address."""

    def __init__(
        self,
        options: list[tuple[str, int]],
        credentials: grpc.ChannelCredentials | None = None,
        max_channels: int = DEFAULT_MAX_PEER_CHANNELS,
    ) -> None:
        self.options = options
        self.credentials = credentials
        self.max_channels = max_channels
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._closing: set[object] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        if self.credentials is not None:
            channel = grpc.aio.secure_channel(address, self.credentials, options=self.options)
        else:
            channel = grpc.aio.insecure_channel(address, options=self.options)
        self._channels[address] = channel
        while len(self._channels) > self.max_channels:
            _, old = self._channels.popitem(last=False)
            # Closing waits for calls on it; let that happen in the background.
            task = asyncio.ensure_future(old.close(grace=5.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close(grace=1.0)
        self._channels.clear()


class ForwardClient:
    """Ingress side: stream a request from a peer."""

    def __init__(self, self_id: str, auth: EnvelopeAuth, channels: PeerChannels) -> None:
        self.self_id = self_id
        self.auth = auth
        self.channels = channels

    async def stream(
        self, target: str, address: str, request: forward_pb2.ForwardRequest, timeout: float | None
    ) -> AsyncIterator[node_pb2.GenerateResponse]:
        envelope = self.auth.seal(request.SerializeToString())
        method = self.channels.get(address).unary_stream(
            FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString
        )
        call = method(envelope, timeout=timeout)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as e:
            code = e.code()
            raise TargetFailed(target, code, e.details() or code.name, retryable=code in RETRYABLE_CODES) from e
        finally:
            call.cancel()  # no-op when the call already ended; cancels the peer's request otherwise


class ForwarderService:
    """Receiver side: serve requests forwarded by peers on the local engine.

    Registered as a generic handler taking the raw envelope bytes (like gossip), so that malformed input reaches
    p2pnode's own checks and counters instead of failing inside gRPC's deserializer.
    """

    def __init__(
        self, local: LocalServer, auth: EnvelopeAuth, sampling: SamplingDefaults, max_request_bytes: int
    ) -> None:
        self.local = local
        self.auth = auth
        self.sampling = sampling
        #: A forwarded prompt may be as large as a client's (gossip's own envelope limit is far smaller).
        self.max_request_bytes = max_request_bytes
        self.received = 0
        self.rejected = 0

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.method_handlers_generic_handler(
            FORWARDER_SERVICE,
            {
                "Forward": grpc.unary_stream_rpc_method_handler(
                    self.forward, response_serializer=node_pb2.GenerateResponse.SerializeToString
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.rejected += 1
        await context.abort(code, message)

    async def forward(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        arrived = time.monotonic()
        self.received += 1
        try:
            envelope = self.auth.open(data, max_bytes=self.max_request_bytes)
        except Exception as e:  # gossip's Rejected: its ``code`` names the status to answer with
            code = getattr(grpc.StatusCode, str(getattr(e, "code", "")), grpc.StatusCode.UNAUTHENTICATED)
            await self._reject(context, code, f"envelope: {e}")
        try:
            request = forward_pb2.ForwardRequest.FromString(envelope.payload)
        except DecodeError:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "payload: not a ForwardRequest")
        info = self.local.engine.info
        try:
            if request.hop != 1:
                raise validation.InvalidRequest(
                    "hop", f"must be 1 (forwarded requests are never re-forwarded), got {request.hop}"
                )
            if request.origin != envelope.sender_id:
                raise validation.InvalidRequest("origin", f"{request.origin!r} is not the sender")
            if not request.request_id:
                raise validation.InvalidRequest("request_id", "must not be empty")
            tokens = list(request.prompt_token_ids)
            validation.check_token_ids(tokens, info.vocab_size, "prompt_token_ids")
            validation.check_prompt_length(len(tokens), info, "prompt_token_ids")
            options = validation.check_sampling(request.sampling, self.sampling, info, len(tokens))
            validation.check_engine_limits(self.local.engine, options)
        except validation.InvalidRequest as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        engine_request_id = f"{request.origin}/{request.request_id}"
        try:
            stream = self.local.stream(engine_request_id, tokens, options, arrived, request.request_id)
            async with contextlib.aclosing(stream) as messages:
                async for message in messages:
                    await write_or_gone(context, message)
        except CallGone:
            pass  # the ingress gave up (cancelled, deadline): the stream is closed and the engine request aborted
        except TargetFailed as e:
            await context.abort(e.code, e.message)
