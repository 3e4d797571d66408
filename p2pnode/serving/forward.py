"""Forwarding a request to the peer routing chose, and serving requests forwarded here.

Ingress side (``ForwardClient``): one signed Forward per attempt, relayed message by message -- opened on the link
this node keeps to the peer (``peer_link.py``: one stream carrying many requests), or as a call of its own (links
off, a peer without them, an envelope too large for a link); the caller's deadline travels with it and closing the
relay cancels it (which aborts the peer's engine request). Either way failures become ``TargetFailed``; whether to
retry is the ingress's decision (only before any output).

A forwarded call never waits on a peer that cannot answer: it is abandoned -- cancelled at the peer and
failed as retryable, so the ingress tries the next node -- when its first token does not come within
``first_token_timeout_s``, or when gossip says the peer turned suspect (nothing streamed yet) or dead (also
mid-stream: a dead peer sends nothing more, and the ingress then ends the call with the partial output it has).
Peer channels ping a peer that has a call in flight and went quiet (gRPC keepalive), so a frozen process or a
network that drops packets fails the call in seconds instead of TCP's minutes. No output is ever duplicated:
abandoning a call that has streamed is never retried (the ingress's rule).

Receiver side (``ForwarderService``): authenticate the envelope exactly like gossip -- bound to this node and this
life of it (its generation) as its receiver, never from this node's own id, from a sender that is not another
process under a live member's id, and with mTLS from a caller whose certificate names the sender -- check the
request against this node's model, and serve it locally: a forwarded request is never forwarded again (hop must be
1). The ingress seals each Forward for the generation gossip says its target runs; a node restarted since is
refused it (UNAUTHENTICATED ``wrong_generation``: a captured Forward is never served by the next life of its
receiver), which the ingress retries on the next node like any failure before the first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc
from google.protobuf.message import DecodeError

from p2pnode.cache.namespace import CacheNamespace
from p2pnode.cache.segments import SegmentSpans
from p2pnode.config import (
    DEFAULT_MAX_LINK_REQUESTS,
    DEFAULT_MAX_PEER_CHANNELS,
    DEFAULT_TENANT,
    LINK_MAX_OPEN_BYTES,
    ForwardingConfig,
)
from p2pnode.gossip.auth import tls_peer_names
from p2pnode.gossip.config import DEFAULT_MAX_RECONNECT_BACKOFF_MS, DEFAULT_MIN_RECONNECT_BACKOFF_MS
from p2pnode.log_limit import LogLimiter
from p2pnode.request import KvSource, Request, SamplingOptions
from p2pnode.serving import segments as segment_checks
from p2pnode.serving.admission import Admission
from p2pnode.serving.errors import RETRYABLE, ServeCode, ServeError, TargetFailed, Throttle
from p2pnode.serving.local import LocalServer
from p2pnode.serving.peer_link import LINK_METHOD_NAME, NO_LINK_RETRY_S, LinkedCall, LinkSession, PeerLink
from p2pnode.serving.retry_after import retry_after_of, trailing_metadata
from p2pnode.token_wire import serialize_with_tokens

if TYPE_CHECKING:
    from p2pnode.serving.pulls import KvPulls
from p2pnode.v1 import forward_pb2, node_pb2

log = logging.getLogger("p2pnode.forwarding")

__all__ = [
    "EXPORT_METHOD",
    "FORWARDER_SERVICE",
    "FORWARD_METHOD",
    "LINK_METHOD",
    "CallGone",
    "ForwardClient",
    "ForwarderService",
    "PeerChannels",
    "forward_payload",
    "peer_channel_options",
    "peer_server_keepalive_options",
    "request_of",
    "status_of",
    "to_forward",
    "write_or_gone",
]


FORWARDER_SERVICE = forward_pb2.DESCRIPTOR.services_by_name["Forwarder"].full_name
FORWARD_METHOD = f"/{FORWARDER_SERVICE}/Forward"
EXPORT_METHOD = f"/{FORWARDER_SERVICE}/Export"
LINK_METHOD = f"/{FORWARDER_SERVICE}/{LINK_METHOD_NAME}"
#: Seconds an evicted peer channel lets its calls run before closing cancels them (their requests then fail over:
#: retried before output, migrated after).
CHANNEL_CLOSE_GRACE_S = 5.0


def status_of(code: ServeCode) -> grpc.StatusCode:
    """The gRPC status of serving's ``code`` (the same name: ``errors.py``)."""
    return grpc.StatusCode[code.name]


class CallGone(Exception):
    """The caller went away (cancelled, deadline passed, connection lost) while a message was being written."""


async def write_or_gone(context: grpc.aio.ServicerContext, message: node_pb2.GenerateResponse) -> None:
    """``context.write``, with a write onto a call that has ended raised as ``CallGone``.

    gRPC raises ``asyncio.CancelledError`` when the call ends while the handler waits elsewhere, but its internal
    ``ExecuteBatchError`` when it ends during a write (e.g. one held back by flow control for a slow reader), and
    at that point ``context.cancelled()`` may not say so yet. A message that cannot be serialized fails before the
    write is attempted, so any other failure of the write means the call is over.
    """
    try:
        await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise CallGone(f"{type(e).__name__}: {e}") from e


# --- a request's wire form: one function each way ----------------------------------------------------------------
# ``to_forward`` writes a ``Request`` as the ``ForwardRequest`` its ingress seals for the serving peer; the peer's
# admission checks every field again (``Admission.forwarded``) and ``request_of`` rebuilds the same ``Request``.
# Sampling travels with every field set, so the peer's checks fill nothing from defaults: its engine sees exactly the
# options the ingress admitted.


def to_forward(request: Request, origin: str, prompt: bool = True) -> forward_pb2.ForwardRequest:
    """``request`` as ``origin`` forwards it (one hop: the peer serves it, never forwards it again); without its
    ``prompt`` (``forward_payload`` writes it)."""
    source = request.kv_source
    message = forward_pb2.ForwardRequest(
        request_id=request.request_id,
        prompt_token_ids=request.tokens if prompt else None,
        sampling=sampling_to_proto(request.sampling),
        origin=origin,
        hop=1,
        routing_key=request.routing_key,
        pull=(
            None if source is None
            else forward_pb2.KvPullHint(holder=source.holder, holder_address=source.address, blocks=source.blocks)
        ),
        adapter=request.namespace.adapter,
        cache_salt=request.namespace.salt,
        tenant=request.tenant,
    )
    segments = request.segments
    if segments is not None:
        message.segment_reuse = segment_checks.PROTO_MODES[segments.mode]
        message.segment_recompute_tokens = segments.recompute
        message.segment_spans.extend(node_pb2.TokenRange(start=s, end=e) for s, e in segments.spans)
    return message


def forward_payload(request: Request, origin: str) -> bytes:
    """``to_forward``'s message, serialized: the prompt written in one C pass (``token_wire``), not through protobuf's
    container one token at a time."""
    return serialize_with_tokens(to_forward(request, origin, prompt=False), "prompt_token_ids", request.tokens)


def request_of(
    message: forward_pb2.ForwardRequest,
    sampling: SamplingOptions,
    arrived: float,
    deadline: float | None = None,
    tokens: list[int] | None = None,
) -> Request:
    """The forwarded ``Request`` rebuilt from ``message``, whose fields admission checked, and the sampling it
    converted from the message's (``Admission.forwarded``); its segments are checked here. ``deadline``: the call's
    (its ingress's timeout), which bounds its wait in this node's queue; ``tokens``: the prompt admission read from
    the message (None: read here)."""
    pull = message.pull if message.HasField("pull") else None
    if tokens is None:
        tokens = message.prompt_token_ids[:]
    namespace = CacheNamespace(message.adapter, message.cache_salt)
    return Request(
        request_id=message.request_id,
        tokens=tokens,
        sampling=sampling,
        namespace=namespace,
        segments=_segments_of(message, tokens, namespace),
        routing_key=message.routing_key,
        arrived=arrived,
        deadline=deadline,
        origin=message.origin,
        kv_source=None if pull is None else KvSource(pull.holder, pull.holder_address, pull.blocks),
        tenant=message.tenant or DEFAULT_TENANT,
    )


def _segments_of(
    message: forward_pb2.ForwardRequest, tokens: list[int], namespace: CacheNamespace
) -> SegmentSpans | None:
    """A forwarded request's segments, checked again (a peer's bug must not reach the engine); keys recomputed."""
    recompute = message.segment_recompute_tokens
    mode = segment_checks.check_mode(message.segment_reuse, recompute, len(message.segment_spans))
    if mode is None:
        return None
    spans: list[tuple[int, int]] = []
    after = 0
    for i, span in enumerate(message.segment_spans):
        if not after <= span.start < span.end <= len(tokens):
            raise segment_checks.invalid(
                f"segment_spans[{i}]", f"[{span.start}, {span.end}) is not an ordered span of the prompt"
            )
        spans.append((span.start, span.end))
        after = span.end
    return segment_checks.spans_of(mode, tokens, spans, recompute, namespace)


def sampling_to_proto(options: SamplingOptions) -> node_pb2.SamplingParams:
    """Validated options on the wire, every field set (a peer's checks then fill nothing from defaults)."""
    sampling = node_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        stop=list(options.stop),
        ignore_eos=options.ignore_eos,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        min_tokens=options.min_tokens,
        min_p=options.min_p,
        stop_token_ids=options.stop_token_ids,
        include_stop_str_in_output=options.include_stop_str_in_output,
        logit_bias=dict(options.logit_bias),
        structured_outputs=options.structured_outputs,
        priority=options.priority,
    )
    if options.seed is not None:
        sampling.seed = options.seed
    if options.logprobs is not None:
        sampling.logprobs = options.logprobs
    if options.prompt_logprobs is not None:
        sampling.prompt_logprobs = options.prompt_logprobs
    return sampling


class OpenedEnvelope(Protocol):
    sender_id: str
    sender_address: str
    sender_generation: int
    payload: bytes


class EnvelopeAuth(Protocol):
    """Signs and checks peer envelopes: the gossip agent's ``Authenticator`` (p2pnode/gossip/auth.py)."""

    def seal(self, payload: bytes, receiver_id: str, receiver_generation: int) -> bytes: ...

    def open(
        self, data: bytes, max_bytes: int | None = None, *, peer_names: frozenset[str] | None = None
    ) -> OpenedEnvelope:
        """The verified envelope bound to this node, or raise an error whose ``code`` names the gRPC status."""
        ...


#: ``check_sender(sender_id, address, generation)``: raise (an error whose ``code`` names the gRPC status) when the
#: sender is another process under a live member's id (the gossip agent's ``check_sender``).
SenderCheck = Callable[[str, str, int], None]


def peer_channel_options(config: ForwardingConfig) -> list[tuple[str, int]]:
    """Keepalive of the channels an ingress forwards on: ping a quiet peer while a call is in flight.

    ``grpc.http2.ping_timeout_ms`` too: gRPC 1.85 merges a keepalive ping into a flow-control (BDP) ping already in
    flight, whose timeout is that argument's (60 s by default), not ``keepalive_timeout_ms`` -- measured through a
    proxy dropping every byte: with only the keepalive arguments the call was still waiting after 60 s; with both,
    it failed 5 s after the last byte (tests/unit/test_peer_keepalive.py).
    """
    timeout_ms = int(config.keepalive_timeout_s * 1000)
    return [
        # a peer back from a partition is dialled again within seconds (gRPC's own backoff grows to 120 s)
        ("grpc.min_reconnect_backoff_ms", DEFAULT_MIN_RECONNECT_BACKOFF_MS),
        ("grpc.initial_reconnect_backoff_ms", DEFAULT_MIN_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", DEFAULT_MAX_RECONNECT_BACKOFF_MS),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),  # a call waiting for its first token sends no data
    ]


def peer_server_keepalive_options(config: ForwardingConfig) -> list[tuple[str, int]]:
    """What a node's server accepts from peers' keepalive: pings as often as peers send them (gRPC's default
    refuses a ping within 5 minutes of the last one and closes the connection after two such "strikes")."""
    return [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(config.keepalive_s * 1000) // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


class PeerChannels:
    """A bounded pool of gRPC channels to peers, by address (and, with per-node certificates -- ``certified`` --
    by the node id the peer's certificate must name: the TLS handshake checks it, as the gossip transport's does),
    and the link (``peer_link.py``) forwarded requests share on each channel."""

    def __init__(
        self,
        options: list[tuple[str, int]],
        credentials: grpc.ChannelCredentials | None = None,
        max_channels: int = DEFAULT_MAX_PEER_CHANNELS,
        forwarding: ForwardingConfig | None = None,
        *,
        certified: bool = False,
    ) -> None:
        self.forwarding = forwarding or ForwardingConfig()
        self.options = [*options, *peer_channel_options(self.forwarding)]
        self.credentials = credentials
        self.max_channels = max_channels
        self.certified = certified and credentials is not None
        self._channels: OrderedDict[tuple[str, str], grpc.aio.Channel] = OrderedDict()
        self._closing: set[object] = set()
        self._links: dict[tuple[str, str], PeerLink] = {}
        #: Peers that answered a link UNIMPLEMENTED, and until when they get a call per request instead.
        self._no_link_until: dict[tuple[str, str], float] = {}
        #: Links opened since the start (one per peer forwarded to, again after an idle close or a failure).
        self.links_opened = 0

    def get(self, address: str, peer_id: str = "") -> grpc.aio.Channel:
        """The channel to ``address``, where the node ``peer_id`` is served (its certificate checked when
        ``certified``)."""
        key = (address, peer_id if self.certified else "")
        channel = self._channels.get(key)
        if channel is not None:
            self._channels.move_to_end(key)
            return channel
        if self.credentials is not None:
            options: list[tuple[str, int | str]] = list(self.options)
            if key[1]:
                options = [*(o for o in options if o[0] != "grpc.ssl_target_name_override"),
                           ("grpc.ssl_target_name_override", key[1])]
            channel = grpc.aio.secure_channel(address, self.credentials, options=options)
        else:
            channel = grpc.aio.insecure_channel(address, options=self.options)
        self._channels[key] = channel
        while len(self._channels) > self.max_channels:
            old_key, old = self._channels.popitem(last=False)
            link = self._links.pop(old_key, None)
            if link is not None:
                link.retire()  # its open requests finish within the channel's grace below
            # Closing waits for calls on it; let that happen in the background.
            task = asyncio.ensure_future(old.close(grace=CHANNEL_CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel

    @property
    def links_open(self) -> int:
        """Links this node holds open to peers now."""
        return len(self._links)

    def link(self, address: str, peer_id: str = "") -> PeerLink | None:
        """The link to ``address`` (opened now if none is open), or None: links are off, the peer serves none, or
        its link carries all it may."""
        if not self.forwarding.peer_links:
            return None
        key = (address, peer_id if self.certified else "")
        link = self._links.get(key)
        if link is not None and not link.closed:
            if key in self._channels:
                self._channels.move_to_end(key)  # in use: the channel a busy link rides on is the last evicted
            return link if link.has_room else None
        until = self._no_link_until.get(key)
        if until is not None:
            if time.monotonic() < until:
                return None
            del self._no_link_until[key]
        channel = self.get(address, peer_id)
        config = self.forwarding
        link = PeerLink(
            channel, LINK_METHOD, fallback_method=FORWARD_METHOD, window=config.link_window, idle_s=config.link_idle_s,
            max_requests=config.max_link_requests,
            on_close=lambda closed, served: self._link_closed(key, closed, served),
        )
        self._links[key] = link
        self.links_opened += 1
        return link

    def _link_closed(self, key: tuple[str, str], link: PeerLink, served: bool) -> None:
        if self._links.get(key) is link:
            del self._links[key]
        if not served:
            if len(self._no_link_until) >= self.max_channels:
                self._no_link_until.pop(next(iter(self._no_link_until)))
            self._no_link_until[key] = time.monotonic() + NO_LINK_RETRY_S
            log.info("peer at %s serves no Forward links: a call per request for %.0f s", key[0], NO_LINK_RETRY_S)

    async def close(self) -> None:
        for link in list(self._links.values()):
            link.cancel()
        self._links.clear()
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close(grace=1.0)
        self._channels.clear()


class _Attempt:
    """One forwarded call in flight, which the ingress may abandon (see the module docstring)."""

    __slots__ = ("call", "reason", "streamed", "target", "timer")

    def __init__(self, target: str, call: grpc.aio.UnaryStreamCall | LinkedCall) -> None:
        self.target = target
        self.call = call
        self.streamed = False
        #: Why it was abandoned (None while it is not): the failure the ingress reports for this attempt.
        self.reason: TargetFailed | None = None
        #: The first-token timeout, while it runs.
        self.timer: asyncio.TimerHandle | None = None

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abandon(self, code: ServeCode, message: str) -> None:
        if self.reason is None:
            self.reason = TargetFailed(self.target, code, message, retryable=True)
            self.call.cancel()


class ForwardClient:
    """Ingress side: stream a request from a peer (see the module docstring)."""

    def __init__(
        self,
        self_id: str,
        auth: EnvelopeAuth,
        channels: PeerChannels,
        forwarding: ForwardingConfig | None = None,
        *,
        generation_of: Callable[[str], int],
    ) -> None:
        """``generation_of(node_id)``: the life of a peer gossip knows (the gossip agent's), which every envelope
        to it is sealed for."""
        self.self_id = self_id
        self.auth = auth
        self.channels = channels
        self.config = forwarding or ForwardingConfig()
        self.generation_of = generation_of
        self._attempts: dict[str, set[_Attempt]] = {}
        #: Calls abandoned, by cause: first_token_timeout, peer_suspect, peer_dead.
        self.abandoned: dict[str, int] = {"first_token_timeout": 0, "peer_suspect": 0, "peer_dead": 0}

    def in_flight(self, target: str) -> int:
        return len(self._attempts.get(target, ()))

    def peer_down(self, node_id: str, dead: bool) -> int:
        """Gossip says ``node_id`` turned suspect (``dead`` False) or dead: abandon its calls that have not streamed
        (retried elsewhere), and when dead the streaming ones too (they fail). Returns how many."""
        cause = "peer_dead" if dead else "peer_suspect"
        n = 0
        for attempt in list(self._attempts.get(node_id, ())):
            if attempt.reason is None and (dead or not attempt.streamed):
                state = "dead" if dead else "suspect"
                attempt.abandon(ServeCode.UNAVAILABLE, f"peer turned {state} (gossip): call cancelled there")
                self.abandoned[cause] += 1
                n += 1
        return n

    async def export(
        self, holder: str, address: str, request: forward_pb2.ExportRequest, timeout: float,
        tokens: Sequence[int] = (),
    ) -> forward_pb2.ExportReply:
        """Ask ``holder`` to lease a prefix's KV blocks (``serving/pulls.py``), the prefix's ``tokens`` written into
        the request's ``prompt_token_ids`` (``token_wire``); raise TargetFailed."""
        payload = serialize_with_tokens(request, "prompt_token_ids", tokens)
        envelope = self.auth.seal(payload, holder, self.generation_of(holder))
        method = self.channels.get(address, holder).unary_unary(
            EXPORT_METHOD, response_deserializer=forward_pb2.ExportReply.FromString
        )
        try:
            return await method(envelope, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            code = ServeCode[e.code().name]
            raise TargetFailed(holder, code, e.details() or code.name, retryable=False) from e

    async def stream(self, target: str, address: str, request: Request) -> AsyncIterator[node_pb2.GenerateResponse]:
        """Stream ``request`` from ``target`` at ``address`` (one hop: it is served there, its prefix pulled first
        when its ``kv_source`` says so, its segments reused there); raise TargetFailed."""
        payload = forward_payload(request, self.self_id)
        envelope = self.auth.seal(payload, target, self.generation_of(target))
        timeout = request.remaining_s(time.monotonic())
        link = self.channels.link(address, target) if len(envelope) <= LINK_MAX_OPEN_BYTES else None
        if link is not None:
            call: grpc.aio.UnaryStreamCall | LinkedCall = link.open(envelope, timeout)
        else:
            method = self.channels.get(address, target).unary_stream(
                FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString
            )
            call = method(envelope, timeout=timeout)
        attempt = self._begin(target, call)
        try:
            async for message in call:
                if not attempt.streamed:
                    attempt.streamed = True
                    attempt.stop_timer()
                yield message
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request's own task is cancelled: its client went away
            if attempt.reason is not None:
                raise attempt.reason from None  # we cancelled the call, nobody cancelled us
            # Nobody cancelled us and we did not cancel it: the call was cancelled under us (its channel closed after
            # its grace, evicted from ``PeerChannels``). The peer failed for this request, as a broken link fails it.
            raise TargetFailed(
                target, ServeCode.UNAVAILABLE, "call to the peer cancelled locally (its channel closed)", retryable=True
            ) from None
        except grpc.aio.AioRpcError as e:
            if attempt.reason is not None:
                raise attempt.reason from e
            code = ServeCode[e.code().name]
            retry_after = retry_after_of(e)
            throttle = Throttle.OVERLOAD if code == ServeCode.RESOURCE_EXHAUSTED and retry_after is not None else None
            raise TargetFailed(
                target, code, e.details() or code.name, retryable=code in RETRYABLE, throttle=throttle,
                retry_after_s=retry_after,
            ) from e
        finally:
            self._end(attempt)
            call.cancel()  # no-op when the call already ended; cancels the peer's request otherwise

    def _begin(self, target: str, call: grpc.aio.UnaryStreamCall | LinkedCall) -> _Attempt:
        """Track a call in flight, with its first-token timer running."""
        attempt = _Attempt(target, call)
        self._attempts.setdefault(target, set()).add(attempt)
        limit = self.config.first_token_timeout_s
        if limit > 0:
            attempt.timer = asyncio.get_running_loop().call_later(limit, self._first_token_overdue, attempt, limit)
        return attempt

    def _end(self, attempt: _Attempt) -> None:
        attempt.stop_timer()
        attempts = self._attempts.get(attempt.target)
        if attempts is not None:
            attempts.discard(attempt)
            if not attempts:
                del self._attempts[attempt.target]

    def _first_token_overdue(self, attempt: _Attempt, limit: float) -> None:
        if not attempt.streamed and attempt.reason is None:
            self.abandoned["first_token_timeout"] += 1
            attempt.abandon(ServeCode.DEADLINE_EXCEEDED, f"no first token within {limit:g} s (first-token timeout)")


class ForwarderService:
    """Receiver side: serve requests forwarded by peers on the local engine.

    Registered as a generic handler taking the raw envelope bytes (like gossip), so that malformed input reaches
    p2pnode's own checks and counters instead of failing inside gRPC's deserializer.
    """

    def __init__(
        self,
        local: LocalServer,
        auth: EnvelopeAuth,
        admission: Admission,
        max_request_bytes: int,
        pulls: KvPulls | None = None,
        *,
        check_sender: SenderCheck | None = None,
        bind_tls: bool = False,
        max_link_requests: int = DEFAULT_MAX_LINK_REQUESTS,
    ) -> None:
        """``check_sender``: the gossip agent's identity check (None: none); ``bind_tls``: the caller's certificate
        must name the sender id (mTLS with ``TlsConfig.bind_node_id``); ``max_link_requests``: requests one peer's
        link may have open here (``peer_link.py``)."""
        self.local = local
        self.max_link_requests = max_link_requests
        self.auth = auth
        self.check_sender = check_sender
        self.bind_tls = bind_tls
        self.admission = admission
        #: This node's KV lending (``pulls.py``); None: Export is answered UNAVAILABLE.
        self.pulls = pulls
        #: A forwarded prompt may be as large as a client's (gossip's own envelope limit is far smaller).
        self.max_request_bytes = max_request_bytes
        self.received = 0
        self.rejected = 0
        #: Refusals are logged at most a few per minute (a flood of bad envelopes must not flood the log).
        self._log = LogLimiter(log)
        #: The links peers hold open here, closed when the node stops.
        self._links: set[LinkSession] = set()

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.method_handlers_generic_handler(
            FORWARDER_SERVICE,
            {
                "Forward": grpc.unary_stream_rpc_method_handler(
                    self.forward, response_serializer=node_pb2.GenerateResponse.SerializeToString
                ),
                "Export": grpc.unary_unary_rpc_method_handler(
                    self.export, response_serializer=forward_pb2.ExportReply.SerializeToString
                ),
                LINK_METHOD_NAME: grpc.stream_stream_rpc_method_handler(self.link),
            },
        )
        server.add_generic_rpc_handlers((handler,))

    def _refused(self, peer: str, code: ServeCode, message: str, kind: str = "") -> ServeError:
        """A refusal to raise; counted, and logged at WARNING a few lines a minute per ``kind`` (default: the code)."""
        self.rejected += 1
        self._log.warning(
            f"refused:{kind or code.name}", "refused a Forward call from %s: %s %s", peer, code.name, message
        )
        return ServeError(code, message)

    def _peer_names(self, context: grpc.aio.ServicerContext) -> frozenset[str] | None:
        """The names the caller's certificate binds it to (with ``bind_tls``; None: not checked)."""
        return (tls_peer_names(context.auth_context()) or frozenset()) if self.bind_tls else None

    def _opened(self, data: bytes, peer_names: frozenset[str] | None, peer: str) -> OpenedEnvelope:
        """The verified envelope, or raise the ``ServeError`` its refusal names."""
        try:
            envelope = self.auth.open(data, max_bytes=self.max_request_bytes, peer_names=peer_names)
            if self.check_sender is not None:
                self.check_sender(envelope.sender_id, envelope.sender_address, envelope.sender_generation)
        except Exception as e:  # gossip's Rejected: its ``code`` names the status to answer with
            code = ServeCode.__members__.get(str(getattr(e, "code", "")), ServeCode.UNAUTHENTICATED)
            raise self._refused(peer, code, f"envelope: {e}", str(getattr(e, "reason", ""))) from None
        return envelope

    async def forward(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        """A Forward call: one request, its messages written to the call, its refusal the call's status."""
        arrived = time.monotonic()
        remaining = context.time_remaining()
        deadline = arrived + remaining if remaining is not None else None
        try:
            messages = self.served(data, arrived, deadline, self._peer_names(context), context.peer())
            async with contextlib.aclosing(messages):
                async for message in messages:
                    await write_or_gone(context, message)
        except CallGone:
            pass  # the ingress gave up (cancelled, deadline): the stream is closed and the engine request aborted
        except ServeError as e:  # refused, or shed by the queue: its retry-after goes back to the ingress
            await context.abort(status_of(e.code), e.message, trailing_metadata(e.retry_after_s))

    async def link(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """A peer's link: many requests, each served as ``forward`` serves one (``peer_link.py``)."""
        session = LinkSession(self.served, context, self._peer_names(context), self.max_link_requests, self._log)
        self._links.add(session)
        try:
            await session.run(frames)
        finally:
            self._links.discard(session)

    def close_links(self) -> int:
        """End every peer's link here (a stopping node: what they carried has drained, or is aborted as a stopping
        server's calls are), so that the server's stop does not wait out its grace for them; returns how many."""
        links = list(self._links)
        for session in links:
            session.close()
        return len(links)

    async def served(
        self, data: bytes, arrived: float, deadline: float | None, peer_names: frozenset[str] | None, peer: str
    ) -> AsyncIterator[node_pb2.GenerateResponse]:
        """A forwarded request's messages from the local engine; raise ``ServeError`` when it is refused or ends
        with an error (INTERNAL for a bug: retryable, never a silent UNKNOWN). ``deadline``: the ingress's, which
        bounds its wait in this node's queue."""
        self.received += 1
        try:
            envelope = self._opened(data, peer_names, peer)
            try:
                request = forward_pb2.ForwardRequest.FromString(envelope.payload)
            except DecodeError:
                raise self._refused(peer, ServeCode.INVALID_ARGUMENT, "payload: not a ForwardRequest") from None
            try:
                sampling, tokens = self.admission.forwarded(request, envelope.sender_id, envelope.payload)
                admitted = request_of(request, sampling, arrived, deadline, tokens)
            except ServeError as e:
                raise self._refused(peer, e.code, e.message) from None
            try:
                async with contextlib.aclosing(self.local.stream(admitted)) as messages:
                    async for message in messages:
                        yield message
            except TargetFailed as e:  # refused or shed by the queue: its retry-after goes back to the ingress
                raise e.serve_error() from None
        except ServeError:
            raise
        except Exception as e:
            log.exception("Forward failed")
            raise ServeError(
                ServeCode.INTERNAL, f"internal error serving a forwarded request: {type(e).__name__}"
            ) from e

    async def _open(self, data: bytes, context: grpc.aio.ServicerContext) -> OpenedEnvelope:
        """The verified envelope, or abort the call with the status its refusal names."""
        try:
            return self._opened(data, self._peer_names(context), context.peer())
        except ServeError as e:
            await context.abort(status_of(e.code), e.message)
        raise AssertionError("unreachable")  # abort raises

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        """Refuse the call (counted and logged as ``_refused``)."""
        error = self._refused(context.peer(), ServeCode[code.name], message)
        await context.abort(code, error.message)

    async def export(self, data: bytes, context: grpc.aio.ServicerContext) -> forward_pb2.ExportReply:
        """Lease a prefix's blocks to the peer about to serve it (``pulls.KvPulls.export``)."""
        envelope = await self._open(data, context)
        try:
            request = forward_pb2.ExportRequest.FromString(envelope.payload)
        except DecodeError:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "payload: not an ExportRequest")
        if request.origin != envelope.sender_id:
            message = f"origin: {request.origin!r} is not the sender"
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, message)
        if self.pulls is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node lends no KV (--kv-link-gbps 0)")
        try:
            return await self.pulls.export(request, envelope.payload)  # type: ignore[union-attr]
        except ServeError as e:
            await context.abort(status_of(e.code), e.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # a bug: the puller computes the prefix instead (never a silent UNKNOWN)
            log.exception("Export failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error leasing KV: {type(e).__name__}")
        raise AssertionError("unreachable")  # every branch above returns or aborts
