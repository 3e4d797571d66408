"""Gossip over real gRPC: the ``p2pnode.v1.Peer`` service on the node's server, and a client transport.

One gossip message is one unary ``Peer/Gossip`` call whose request is the sealed envelope and whose response is the
reply envelope (empty bytes when there is none), exactly the Transport contract of ``transport.py``. Both sides
exchange the serialized ``GossipEnvelope`` as raw bytes (no gRPC (de)serializer), so that a malformed request
reaches ``auth.Authenticator`` -- which counts it -- instead of failing inside gRPC.

Server side: ``add_peer_service(server, agent)`` registers the handler on the node's existing ``grpc.aio.Server``;
a refused message is answered with the status of its ``RejectReason`` (PERMISSION_DENIED for another cluster,
UNAUTHENTICATED for a bad MAC / replay / stale timestamp, INVALID_ARGUMENT, RESOURCE_EXHAUSTED) and the node carries
on. With mTLS the node builds its server port with ``server_credentials(tls)`` (client certificates required).
Before any of that, each connection spends one token of its budget (``ConnectionBudget``:
``max_peer_messages_per_s``, config.py says why that never holds back an honest peer): over it, the message is
answered RESOURCE_EXHAUSTED unopened and counted (``throttled``), so a connection flooding signed messages costs
this node no MAC and no decoding past its budget.

Client side: ``GrpcTransport`` keeps one channel per peer address (at most ``max_channels``, least recently used
closed first) with a short reconnect backoff (a restarted peer is reachable again within seconds), bounds the calls
in flight (``max_pending_sends``; beyond it sends are dropped and counted) and gives every call ``rpc_timeout_s``.
Failures are counted by status code in ``stats``; they never raise. A peer that refuses our messages for what we
are (another cluster secret or id, another envelope version, our own node id, a node id another live process holds,
a certificate that does not name our node id) is logged at WARNING, a few lines a minute at most: a misconfigured
node must not run alone in silence. With mTLS the server hands the agent the names of the caller's certificate, which
must name the sender's node id (``TlsConfig.bind_node_id``).

With per-node certificates (``GossipConfig.certified_ids``) the client checks the other direction too: a message
bound to node X goes on a channel whose TLS handshake requires the server's certificate to name X (its common name
or a subject alternative name: gRPC's ``ssl_target_name_override``), and a reply on it must be signed as X. Before,
peer channels checked only the host name, so whoever held any certificate of the mesh's CA at X's address (after X
moved, say) answered as X, and in a reply could even sign as any node id. A Hello, which names no receiver, goes on
a channel checked against the host name alone; it changes nothing, and the Syn that answers its HelloAck is bound to
the node named there, so it is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from p2pnode.gossip.auth import Rejected, RejectReason, tls_peer_names
from p2pnode.gossip.config import (
    DEFAULT_MAX_RECONNECT_BACKOFF_MS,
    DEFAULT_MIN_RECONNECT_BACKOFF_MS,
    MAX_BUDGETED_CONNECTIONS,
    GossipConfig,
    TlsConfig,
)
from p2pnode.gossip.transport import Handler
from p2pnode.log_limit import LogLimiter
from p2pnode.v1 import peer_pb2

if TYPE_CHECKING:
    from p2pnode.gossip.agent import GossipAgent

__all__ = [
    "GOSSIP_METHOD", "PEER_SERVICE", "ConnectionBudget", "GrpcTransport", "add_peer_service", "server_credentials",
]

log = logging.getLogger("p2pnode.gossip.grpc")

PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name
GOSSIP_METHOD = f"/{PEER_SERVICE}/Gossip"


class ConnectionBudget:
    """Messages each connection may still send (a token bucket per connection: ``rate`` a second, a burst of
    ``2 * rate``), for at most ``max_connections`` connections (the least recently used is forgotten)."""

    def __init__(self, rate: float, max_connections: int = MAX_BUDGETED_CONNECTIONS) -> None:
        self.rate = rate
        self.burst = 2.0 * rate
        self.max_connections = max_connections
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # connection -> (tokens, at)

    def spend(self, connection: str, now: float) -> bool:
        """Take one token of ``connection``; False (nothing taken) when it has none left."""
        tokens, at = self._buckets.get(connection, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            return False
        self._buckets[connection] = (tokens - 1.0, now)
        self._buckets.move_to_end(connection)
        while len(self._buckets) > self.max_connections:
            self._buckets.popitem(last=False)
        return True


class InjectedLoss:
    """Fault injection (``GossipConfig.injected_loss``): whether to drop a message, each independently, once
    ``injected_loss_after_s`` have passed since this was made."""

    def __init__(self, config: GossipConfig, what: str) -> None:
        self.what = what
        self.fraction = config.injected_loss
        self.begins = time.monotonic() + config.injected_loss_after_s
        self.began = False
        self._rng = random.Random()

    def drops(self) -> bool:
        if not self.fraction or time.monotonic() < self.begins:
            return False
        if not self.began:
            self.began = True
            log.warning("fault injection: %.0f%% of %s dropped from now on", 100 * self.fraction, self.what)
        return self._rng.random() < self.fraction


def add_peer_service(server: grpc.aio.Server, agent: GossipAgent) -> None:
    """Serve ``Peer/Gossip`` for ``agent`` on ``server`` (before ``server.start()``)."""

    loss = InjectedLoss(agent.config, "gossip replies")
    tls = agent.config.tls
    bind = tls is not None and tls.bind_node_id
    budget = ConnectionBudget(agent.config.max_peer_messages_per_s)

    async def gossip(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if not budget.spend(context.peer(), time.monotonic()):
            agent.stats.throttled += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "throttled: over max_peer_messages_per_s")
        try:
            names = (tls_peer_names(context.auth_context()) or frozenset()) if bind else None
            reply = agent.handle(request, peer_names=names)
        except Rejected as rejected:
            # an identity conflict says which life holds the id: the refused node learns it is superseded (agent.py)
            details = str(rejected) if rejected.reason is RejectReason.IDENTITY_CONFLICT else rejected.reason.value
            await context.abort(grpc.StatusCode[rejected.code], details[:512])
        if reply and loss.drops():  # fault injection: the reply is lost
            return b""
        return reply or b""

    handler = grpc.method_handlers_generic_handler(
        PEER_SERVICE, {"Gossip": grpc.unary_unary_rpc_method_handler(gossip)}
    )
    server.add_generic_rpc_handlers((handler,))


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Server credentials for mTLS: this node's certificate, and peers' certificates required and checked."""
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


class GrpcTransport:
    """Client half of the gossip transport (the server half is ``add_peer_service``)."""

    def __init__(self, config: GossipConfig) -> None:
        self.config = config
        self.secure = config.tls is not None
        self._credentials = None
        self._options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", config.max_receive_bytes),
            ("grpc.max_send_message_length", config.max_receive_bytes),
            ("grpc.min_reconnect_backoff_ms", DEFAULT_MIN_RECONNECT_BACKOFF_MS),
            ("grpc.initial_reconnect_backoff_ms", DEFAULT_MIN_RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", DEFAULT_MAX_RECONNECT_BACKOFF_MS),
        ]
        if config.tls is not None:
            cert, key, ca = config.tls.read()
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert
            )
            if config.tls.server_name:
                self._options.append(("grpc.ssl_target_name_override", config.tls.server_name))
        self._certified = config.certified_ids
        self._handler: Handler | None = None
        #: By (address, the node id its certificate must name: "" for the host name alone).
        self._channels: OrderedDict[tuple[str, str], tuple[grpc.aio.Channel, grpc.aio.UnaryUnaryMultiCallable]] = (
            OrderedDict()
        )
        self._pending: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Counters: calls, replies, failures by status code ("failed:UNAVAILABLE"...), dropped (too many pending).
        self.stats: Counter[str] = Counter()
        self._log = LogLimiter(log)
        self._loss = InjectedLoss(config, "gossip sends")
        #: Told ``(address, details)`` when a peer refuses a message of ours as an identity conflict (the agent:
        #: another process may hold this node's id).
        self.on_identity_conflict: Callable[[str, str], None] | None = None

    def bind(self, handler: Handler) -> None:
        self._handler = handler
        self._closed = False

    def _stub(self, address: str, peer_id: str) -> grpc.aio.UnaryUnaryMultiCallable:
        key = (address, peer_id)
        entry = self._channels.get(key)
        if entry is not None:
            self._channels.move_to_end(key)
            return entry[1]
        if self._credentials is not None:
            options = self._options
            if peer_id:  # the server's certificate must name the node dialled (module docstring)
                options = [*(o for o in options if o[0] != "grpc.ssl_target_name_override"),
                           ("grpc.ssl_target_name_override", peer_id)]
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        else:
            channel = grpc.aio.insecure_channel(address, options=self._options)
        stub = channel.unary_unary(GOSSIP_METHOD)  # raw bytes in and out
        self._channels[key] = (channel, stub)
        while len(self._channels) > self.config.max_channels:
            _, (old, _) = self._channels.popitem(last=False)
            task = asyncio.get_running_loop().create_task(old.close())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        return stub

    def send(self, address: str, data: bytes, peer_id: str = "") -> None:
        if self._closed:
            return
        if len(self._pending) >= self.config.max_pending_sends:
            self.stats["dropped"] += 1
            return
        if self._loss.drops():
            self.stats["injected_loss"] += 1  # fault injection (GossipConfig.injected_loss)
            return
        receiver = self._receiver_of(data) or (peer_id if self._certified else "")
        task = asyncio.get_running_loop().create_task(self._call(address, data, receiver))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _receiver_of(self, data: bytes) -> str:
        """The node a sealed envelope is bound to, whose certificate its channel checks ("": none, or no per-node
        certificates)."""
        if not self._certified:
            return ""
        try:
            return peer_pb2.GossipEnvelope.FromString(data).receiver_id
        except Exception:  # never ours to send, but a send never raises
            return ""

    async def _call(self, address: str, data: bytes, peer_id: str = "") -> None:
        self.stats["calls"] += 1
        try:
            reply = await self._stub(address, peer_id)(data, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.stats[f"failed:{exc.code().name}"] += 1
            details = exc.details() or ""
            reason = details.split(":", 1)[0]
            if reason == RejectReason.IDENTITY_CONFLICT.value and self.on_identity_conflict is not None:
                self.on_identity_conflict(address, details)
            hint = _REFUSAL_HINTS.get(reason)
            if hint is not None:
                self._log.warning(
                    f"refused:{details[:32]}", "gossip: %s refused our message (%s %s): %s",
                    address, exc.code().name, details[:200], hint,
                )
            else:
                log.debug("gossip to %s failed: %s %s", address, exc.code().name, details)
            return
        except Exception as exc:  # e.g. an unparsable address
            self.stats["failed:other"] += 1
            log.debug("gossip to %s failed: %r", address, exc)
            return
        if not reply or self._handler is None or self._closed:
            return
        self.stats["replies"] += 1
        try:
            # on a channel checked for peer_id, the reply must be signed as that node (auth.py's certificate check)
            out = self._handler(reply, address, frozenset((peer_id,))) if peer_id else self._handler(reply, address)
        except Rejected:
            return  # counted by the agent
        except Exception:
            log.exception("gossip: reply handler failed")
            return
        if out:
            self.send(address, out)

    async def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for calls in flight, cancel the rest, close every channel."""
        pending = set(self._pending)
        if pending and timeout > 0:
            await asyncio.wait(pending, timeout=timeout)
        self._closed = True
        leftover = list(self._pending)
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.gather(*leftover, return_exceptions=True)
        channels = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()


#: Refusals that say something is wrong with this node's own configuration, by the reason the peer answers with.
_REFUSAL_HINTS = {
    RejectReason.BAD_MAC.value: "its cluster secret differs from this node's (--cluster-secret-file)",
    RejectReason.WRONG_CLUSTER.value: "its --cluster-id differs from this node's",
    RejectReason.MALFORMED.value: "it speaks another envelope version (every node must run the same p2pnode)",
    RejectReason.OWN_SENDER.value: "it runs with this node's own --node-id",
    RejectReason.IDENTITY_CONFLICT.value: "another process is alive under this node's --node-id at another address; "
    "the mesh keeps that one (stop one of them: a node moved to a new address is admitted once its earlier life is "
    "seen dead or has left)",
    RejectReason.CERT_MISMATCH.value: "this node's certificate does not name its --node-id (--tls-cert: the common "
    "name or a subject alternative name must be the node id)",
}
