"""Signed envelopes: every peer message carries the cluster id, its sender and receiver -- the receiver's node id
and generation -- and an HMAC over everything, and is accepted once, by that life of its receiver only.

Sealing wraps a payload in a ``p2pnode.v1.GossipEnvelope`` (protos/p2pnode/v1/peer.proto, which also defines the
canonical bytes the MAC covers), addressed to one receiver: its node id and its generation (the start time of the
receiver's current process, which the sender knows from gossip or from the message it answers). Gossip and
forwarded requests (Forward, Export) all use it. Opening checks, in this order, and stops at the first failure:

1. size <= ``max_receive_bytes``                                      else OVERSIZED        (RESOURCE_EXHAUSTED)
2. it parses as an envelope of version 3 with sane fields             else MALFORMED        (INVALID_ARGUMENT)
3. ``cluster_id`` is ours                                              else WRONG_CLUSTER    (PERMISSION_DENIED)
4. the MAC verifies (constant-time), when a cluster secret is set     else BAD_MAC          (UNAUTHENTICATED)
5. with mTLS, the caller's certificate names ``sender_id``            else CERT_MISMATCH    (UNAUTHENTICATED)
6. ``receiver_id`` is this node (empty only where the caller allows   else WRONG_RECEIVER   (UNAUTHENTICATED)
   it: a gossip Hello)
7. ``receiver_generation`` is this node's generation (this life)      else WRONG_GENERATION (UNAUTHENTICATED)
8. ``sender_id`` is not this node's own id                            else OWN_SENDER       (UNAUTHENTICATED)
9. |timestamp - our wall clock| <= ``replay_window_s``                else STALE            (UNAUTHENTICATED)
10. the nonce was not seen before (and is newer than any nonce the    else REPLAYED         (UNAUTHENTICATED)
    bounded cache had to forget)

A rejection raises ``Rejected`` (its ``code`` is the gRPC status name); callers count it and carry on. Nonces are
recorded only after the MAC verified, so an outsider cannot fill the cache.

Why per-process nonce caches in memory are enough: the MAC covers the receiver's node id *and generation*, and a
node accepts only envelopes naming both (6, 7). So a captured envelope can be accepted by one process only -- the
life of its receiver it was sealed for -- which refuses it a second time for as long as its timestamp is inside the
window (10); after the window every node refuses it as stale (9). A restart under the same id starts a new
generation with an empty nonce cache, and refuses everything sealed for the earlier life (7): before the
generation was bound, a Forward captured on its way to B was served again by B restarted within the window. The
alternative -- persisting the nonce cache across restarts -- costs a disk write per message and still fails a node
rescheduled onto another host; binding the generation needs no state at all. A message in flight across the
receiver's restart is refused the same way (the sender retries: UNAUTHENTICATED is retryable for a forward, and
gossip repeats every round with the generation the restarted node announces). Version 2 envelopes (no receiver
generation) are refused as malformed with a message naming both versions: a v3 node accepting them would accept
exactly the replays version 3 exists to refuse, so a mesh moves to version 3 all at once. The one envelope without
a receiver (id "" and generation 0) is the gossip Hello, the probe a node sends to a seed whose node id it does not
know yet: it changes nothing anywhere and is answered only with the responder's identity (a HelloAck bound to the
prober's id and generation), so replaying it learns nothing that asking would not. OWN_SENDER (8) closes the hole
where a node served an envelope claiming to come from itself.

The key is HKDF-SHA256(cluster secret, salt "p2pnode-gossip", info "p2pnode gossip mac v1|<cluster id>"): one
secret file can serve several clusters without their MACs being interchangeable (the MAC's own tag names the
envelope version). With mTLS and no secret the MAC is empty and step 4 is skipped (the transport authenticated the
peer, and only certificate holders can reach a node at all); the other checks stay, and step 5 binds the sender id
to the certificate the caller presented (its common name or one of its subject alternative names), so a node
holding a certificate for "b" cannot speak as "a". The caller passes the names (``peer_names``) it read from the
TLS session; None means the transport did not authenticate the caller (no mTLS, or binding turned off).
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import hmac
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from p2pnode.v1 import peer_pb2

__all__ = ["Authenticator", "Envelope", "NonceCache", "RejectReason", "Rejected", "derive_key", "tls_peer_names"]

ENVELOPE_VERSION = 3
NONCE_BYTES = 16
MAC_TAG = b"p2pnode.gossip.v3"
HKDF_SALT = b"p2pnode-gossip"
HKDF_INFO = b"p2pnode gossip mac v1|"
#: Bytes the envelope adds around a payload (ids, address, nonce, MAC, proto tags), as an upper bound for budgets.
ENVELOPE_OVERHEAD = 1024


class RejectReason(enum.StrEnum):
    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    WRONG_CLUSTER = "wrong_cluster"
    BAD_MAC = "bad_mac"
    CERT_MISMATCH = "cert_mismatch"
    WRONG_RECEIVER = "wrong_receiver"
    WRONG_GENERATION = "wrong_generation"
    OWN_SENDER = "own_sender"
    STALE = "stale"
    REPLAYED = "replayed"
    #: Refused by the gossip agent, not here: the sender's node id is held by another live process (admission.py).
    IDENTITY_CONFLICT = "identity_conflict"

    @property
    def grpc_code(self) -> str:
        """Name of the gRPC status code a server answers with."""
        return _GRPC_CODES[self]


_GRPC_CODES = {
    RejectReason.OVERSIZED: "RESOURCE_EXHAUSTED",
    RejectReason.MALFORMED: "INVALID_ARGUMENT",
    RejectReason.WRONG_CLUSTER: "PERMISSION_DENIED",
    RejectReason.BAD_MAC: "UNAUTHENTICATED",
    RejectReason.CERT_MISMATCH: "UNAUTHENTICATED",
    RejectReason.WRONG_RECEIVER: "UNAUTHENTICATED",
    RejectReason.WRONG_GENERATION: "UNAUTHENTICATED",
    RejectReason.OWN_SENDER: "UNAUTHENTICATED",
    RejectReason.STALE: "UNAUTHENTICATED",
    RejectReason.REPLAYED: "UNAUTHENTICATED",
    RejectReason.IDENTITY_CONFLICT: "ALREADY_EXISTS",
}


class Rejected(Exception):
    """An inbound message was refused; ``reason`` says why, ``code`` is the gRPC status to answer with."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail

    @property
    def code(self) -> str:
        return self.reason.grpc_code


@dataclass(frozen=True, slots=True)
class Envelope:
    """An opened (verified) envelope."""

    sender_id: str
    sender_address: str
    sender_generation: int
    timestamp_ms: int
    payload: bytes
    #: This node's id, or "" for an unbound envelope (only where ``open(allow_unbound=True)``).
    receiver_id: str = ""
    nonce: bytes = b""
    #: This node's generation (0 for an unbound envelope).
    receiver_generation: int = 0


def derive_key(secret: bytes, cluster_id: str) -> bytes:
    """HKDF-SHA256 (RFC 5869) with one output block: the MAC key of ``cluster_id``."""
    prk = hmac.new(HKDF_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, HKDF_INFO + cluster_id.encode() + b"\x01", hashlib.sha256).digest()


def _lp(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def _mac(key: bytes, env: peer_pb2.GossipEnvelope) -> bytes:
    m = hmac.new(key, MAC_TAG, hashlib.sha256)
    m.update(struct.pack(">I", env.version))
    m.update(_lp(env.cluster_id.encode()))
    m.update(_lp(env.sender_id.encode()))
    m.update(_lp(env.receiver_id.encode()))
    m.update(struct.pack(">Q", env.receiver_generation))
    m.update(_lp(env.sender_address.encode()))
    m.update(struct.pack(">Qq", env.sender_generation, env.timestamp_ms))
    m.update(_lp(env.nonce))
    m.update(struct.pack(">I", len(env.payload)))
    m.update(env.payload)
    return m.digest()


class NonceCache:
    """Nonces seen within the replay window, at most ``max_entries`` (see the module docstring, step 10).

    Entries leave oldest timestamp first -- when they fall out of the window or for room -- and each one that leaves
    raises ``floor_ms`` to its timestamp: an envelope not newer than the floor is refused, since its nonce may have
    been forgotten. By timestamp, not by arrival: evicted by arrival, one envelope dated near the window's future
    edge set the floor there when it left, and the node refused every honest envelope for a minute; and an entry
    expired without raising the floor let its envelope be replayed once the receiver's clock stepped back.
    """

    def __init__(self, max_entries: int, window_ms: int) -> None:
        self.max_entries = max_entries
        self.window_ms = window_ms
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[int, bytes]] = []  # heap of (timestamp_ms, nonce), one per nonce in ``_seen``
        #: Envelopes not newer than this are refused: a nonce that old may have been forgotten.
        self.floor_ms = -(1 << 63)

    def __len__(self) -> int:
        return len(self._seen)

    def check_and_add(self, nonce: bytes, timestamp_ms: int, now_ms: int) -> bool:
        """Record ``nonce``; False when it is (or may be) a replay."""
        by_time = self._by_time
        horizon = now_ms - self.window_ms
        while by_time and by_time[0][0] < horizon:
            self._forget_oldest()  # older than the window: the timestamp check refuses its replays too
        if timestamp_ms <= self.floor_ms or nonce in self._seen:
            return False
        if len(self._seen) >= self.max_entries:
            self._forget_oldest()  # another nonce than this one (it was not seen): the floor is for later ones
        self._seen.add(nonce)
        heapq.heappush(by_time, (timestamp_ms, nonce))
        return True

    def _forget_oldest(self) -> None:
        timestamp_ms, nonce = heapq.heappop(self._by_time)
        self._seen.discard(nonce)
        if timestamp_ms > self.floor_ms:
            self.floor_ms = timestamp_ms


class Authenticator:
    """Seals outgoing payloads as this node and opens incoming envelopes (see the module docstring)."""

    def __init__(
        self,
        *,
        cluster_id: str,
        secret: bytes | None,
        sender_id: str,
        sender_address: str,
        sender_generation: int,
        wall_ms: Callable[[], int],
        replay_window_s: float,
        max_seen_nonces: int,
        max_receive_bytes: int,
        nonce_source: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.cluster_id = cluster_id
        self._key = derive_key(secret, cluster_id) if secret is not None else None
        self.sender_id = sender_id
        self.sender_address = sender_address
        self.sender_generation = sender_generation
        self._wall_ms = wall_ms
        self.window_ms = int(replay_window_s * 1000)
        self.max_receive_bytes = max_receive_bytes
        self.nonces = NonceCache(max_seen_nonces, self.window_ms)
        self._nonce = nonce_source

    def seal(self, payload: bytes, receiver_id: str, receiver_generation: int, nonce: bytes | None = None) -> bytes:
        """``payload`` signed as this node, for the life ``receiver_generation`` of ``receiver_id`` only (both ""
        and 0 only for a gossip Hello)."""
        env = peer_pb2.GossipEnvelope(
            version=ENVELOPE_VERSION,
            cluster_id=self.cluster_id,
            sender_id=self.sender_id,
            receiver_id=receiver_id,
            receiver_generation=receiver_generation,
            sender_address=self.sender_address,
            sender_generation=self.sender_generation,
            timestamp_ms=self._wall_ms(),
            nonce=nonce if nonce is not None else self._nonce(NONCE_BYTES),
            payload=payload,
        )
        if self._key is not None:
            env.mac = _mac(self._key, env)
        return env.SerializeToString()

    def open(
        self,
        data: bytes,
        max_bytes: int | None = None,
        *,
        allow_unbound: bool = False,
        peer_names: frozenset[str] | None = None,
    ) -> Envelope:
        """Verify ``data``; raises Rejected (see the module docstring for the order of checks).

        ``max_bytes`` overrides ``max_receive_bytes`` for envelopes of another kind than gossip (a forwarded request
        carries a whole prompt, far above the gossip limit). ``allow_unbound`` accepts an empty receiver (the
        caller then accepts only a Hello in it). ``peer_names``: the names in the certificate the caller presented
        over mTLS (``tls_peer_names``), which must include the sender id; None skips that check.
        """
        env = self._parse(data, self.max_receive_bytes if max_bytes is None else max_bytes)
        self._check_origin(env, peer_names)
        self._check_addressing(env, allow_unbound)
        self._check_fresh(env)
        return Envelope(
            env.sender_id,
            env.sender_address,
            env.sender_generation,
            env.timestamp_ms,
            env.payload,
            env.receiver_id,
            env.nonce,
            env.receiver_generation,
        )

    @staticmethod
    def _parse(data: bytes, limit: int) -> peer_pb2.GossipEnvelope:
        """Steps 1-2: a whole envelope of our version, within ``limit`` bytes, with a sender and a sane nonce."""
        if len(data) > limit:
            raise Rejected(RejectReason.OVERSIZED, f"{len(data)} bytes > {limit}")
        try:
            env = peer_pb2.GossipEnvelope.FromString(data)
        except (DecodeError, ValueError, TypeError) as exc:
            raise Rejected(RejectReason.MALFORMED, f"not an envelope ({type(exc).__name__})") from None
        if env.version != ENVELOPE_VERSION:
            raise Rejected(
                RejectReason.MALFORMED,
                f"envelope version {env.version} from {env.sender_id[:64]!r} at {env.sender_address[:64]!r}: this "
                f"node speaks {ENVELOPE_VERSION} (versions do not mix: upgrade every node of the mesh at once)",
            )
        if not env.sender_id or not env.nonce or len(env.nonce) > 64:
            raise Rejected(RejectReason.MALFORMED, "bad envelope header")
        return env

    def _check_origin(self, env: peer_pb2.GossipEnvelope, peer_names: frozenset[str] | None) -> None:
        """Steps 3-5: sent by a member of our cluster (the MAC), under a name its certificate bears (mTLS)."""
        if env.cluster_id != self.cluster_id:
            raise Rejected(
                RejectReason.WRONG_CLUSTER,
                f"cluster {env.cluster_id[:64]!r} from {env.sender_id[:64]!r} at {env.sender_address[:64]!r}",
            )
        if self._key is not None and not hmac.compare_digest(env.mac, _mac(self._key, env)):
            raise Rejected(RejectReason.BAD_MAC, f"from {env.sender_id[:64]!r} at {env.sender_address[:64]!r}")
        if peer_names is not None and env.sender_id not in peer_names:
            raise Rejected(
                RejectReason.CERT_MISMATCH,
                f"{env.sender_id[:64]!r} at {env.sender_address[:64]!r} presented a certificate for "
                f"{', '.join(sorted(n[:64] for n in peer_names)[:4]) or 'no name'}",
            )

    def _check_addressing(self, env: peer_pb2.GossipEnvelope, allow_unbound: bool) -> None:
        """Steps 6-8: addressed to this life of this node (or to no one, where allowed), by another node."""
        unbound = allow_unbound and not env.receiver_id and not env.receiver_generation
        if env.receiver_id != self.sender_id and not unbound:
            raise Rejected(
                RejectReason.WRONG_RECEIVER, f"addressed to {env.receiver_id[:64]!r} by {env.sender_id[:64]!r}"
            )
        if env.receiver_generation != self.sender_generation and not unbound:
            raise Rejected(
                RejectReason.WRONG_GENERATION,
                f"from {env.sender_id[:64]!r}, sealed for generation {env.receiver_generation} of this node, which "
                f"runs generation {self.sender_generation}",
            )
        if env.sender_id == self.sender_id:
            raise Rejected(
                RejectReason.OWN_SENDER, f"signed as this node's own id from {env.sender_address[:64]!r}"
            )

    def _check_fresh(self, env: peer_pb2.GossipEnvelope) -> None:
        """Steps 9-10: inside the replay window, and never seen before (the nonce is recorded now)."""
        now_ms = self._wall_ms()
        if abs(env.timestamp_ms - now_ms) > self.window_ms:
            raise Rejected(RejectReason.STALE, f"timestamp off by {env.timestamp_ms - now_ms} ms")
        if not self.nonces.check_and_add(env.nonce, env.timestamp_ms, now_ms):
            raise Rejected(RejectReason.REPLAYED, f"from {env.sender_id[:64]!r}")


def tls_peer_names(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[str] | None:
    """The names the certificate of a gRPC caller carries (its common name and subject alternative names), from
    ``ServicerContext.auth_context()``; None when the call is not over TLS with a client certificate."""
    names = [
        value.decode(errors="replace")
        for key in ("x509_common_name", "x509_subject_alternative_name")
        for value in auth_context.get(key, ())
    ]
    if not names and not auth_context.get("x509_pem_cert"):
        return None
    return frozenset(names)
