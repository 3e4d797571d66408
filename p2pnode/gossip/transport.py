"""How gossip messages move: a small Transport protocol, and an in-memory network for tests and the simulator.

The contract (both transports): ``send(address, data)`` is fire-and-forget -- it never blocks and never raises for a
lost or refused message. The receiver's handler gets the bytes and may return reply bytes; a reply travels back and
is given to the *sender's* handler, and if that handler returns bytes again they are sent to the same address as a
new message. That is the whole Scuttlebutt exchange: Syn -> (reply) SynAck -> (new message) Ack -> no reply. Over
gRPC a send is one unary call whose response is the reply; in memory it is two scheduled deliveries.

The handler raises ``auth.Rejected`` for a refused message (the gRPC server turns it into a status code); every
other outcome is bytes or None.

``InMemoryNetwork`` delivers through a ``SimClock`` (so 30 simulated seconds of a 50-node mesh run in well under a
second) with injectable loss (each message independently, replies included), delay (uniform in a range, so
messages reorder), partitions (groups of addresses that cannot reach each other) and directional blocks. Messages
already on their way when the sender closes are still delivered, like datagrams on a wire; messages to a closed or
unknown address are dropped. All randomness comes from one seeded ``random.Random``: a run is reproducible.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from p2pnode.gossip.auth import Rejected, RejectReason
from p2pnode.gossip.clock import SimClock

__all__ = ["Handler", "InMemoryNetwork", "InMemoryTransport", "Transport"]

#: ``handler(data, reply_from[, peer_names])``: ``reply_from`` is the address a reply comes from (the address this node
#: sent the message it answers to), None for a message a peer started; ``peer_names``, where the transport checked
#: who answered (a certificate), the names its sender must be among.
Handler = Callable[..., "bytes | None"]


class Transport(Protocol):
    """What the gossip agent needs to talk to peers."""

    #: True when the transport itself authenticates peers (mTLS); the cluster secret may then be omitted.
    secure: bool

    def bind(self, handler: Handler) -> None:
        """Deliver inbound messages (and replies to our sends) to ``handler`` from now on."""
        ...

    def send(self, address: str, data: bytes, peer_id: str = "") -> None:
        """Send ``data`` to ``address``; fire-and-forget (see the module docstring). ``peer_id``: the node whose
        certificate the peer must present when ``data`` names no receiver (a join probe asking whether that node
        runs there); with per-node certificates its answer must then be signed as that node."""
        ...

    async def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for sends in flight, then stop receiving and release resources."""
        ...


class InMemoryTransport:
    """One address on an ``InMemoryNetwork``."""

    secure = False

    def __init__(self, network: InMemoryNetwork, address: str) -> None:
        self.network = network
        self.address = address
        self.handler: Handler | None = None
        self.closed = False
        #: Told ``(address, details)`` when a message of ours is refused as an identity conflict, as the gRPC
        #: transport is by the refusing peer's status (``grpc_transport.py``).
        self.on_identity_conflict: Callable[[str, str], None] | None = None

    def bind(self, handler: Handler) -> None:
        self.handler = handler
        self.closed = False
        self.network._endpoints[self.address] = self

    def send(self, address: str, data: bytes, peer_id: str = "") -> None:
        if not self.closed:  # (no certificates here: every sender signs as its own id, as a certificate forces)
            self.network._send(self.address, address, data, is_reply=False)

    def close_now(self) -> None:
        """Stop receiving at once (the in-memory equivalent of the process dying)."""
        self.closed = True
        if self.network._endpoints.get(self.address) is self:
            del self.network._endpoints[self.address]

    async def close(self, timeout: float) -> None:
        self.close_now()


class InMemoryNetwork:
    """A simulated network of ``InMemoryTransport`` endpoints (see the module docstring)."""

    def __init__(
        self,
        clock: SimClock,
        *,
        seed: int = 0,
        loss: float = 0.0,
        delay_s: tuple[float, float] = (0.001, 0.010),
    ) -> None:
        self.clock = clock
        self.rng = random.Random(seed)
        self.loss = loss
        self.delay_s = delay_s
        self._endpoints: dict[str, InMemoryTransport] = {}
        self._group_of: dict[str, int] = {}
        self._blocked: set[tuple[str, str]] = set()
        #: Counters: sent, delivered, lost, partitioned, unreachable, rejected, handler_errors.
        self.stats: Counter[str] = Counter()
        #: Bytes sent per source address (replies count for the node that sends them).
        self.bytes_sent: Counter[str] = Counter()
        #: Optional hook called as ``tap(src, dst, data)`` on every send (benchmarks, tests).
        self.tap: Callable[[str, str, bytes], None] | None = None

    def transport(self, address: str) -> InMemoryTransport:
        """A transport for ``address`` (it receives once bound)."""
        return InMemoryTransport(self, address)

    # -------------------------------------------------------------------------------------------- fault injection

    def partition(self, *groups: Iterable[str]) -> None:
        """Only addresses in the same group can reach each other; addresses in no group reach everyone not
        partitioned away (i.e. they form one more group with the unlisted)."""
        self._group_of = {addr: i + 1 for i, group in enumerate(groups) for addr in group}

    def heal(self) -> None:
        """Remove partitions and blocks."""
        self._group_of.clear()
        self._blocked.clear()

    def block(self, src: str, dst: str) -> None:
        """Drop every message from ``src`` to ``dst`` (one direction)."""
        self._blocked.add((src, dst))

    def reachable(self, src: str, dst: str) -> bool:
        return (src, dst) not in self._blocked and self._group_of.get(src, 0) == self._group_of.get(dst, 0)

    # ------------------------------------------------------------------------------------------------- delivery

    def _send(self, src: str, dst: str, data: bytes, *, is_reply: bool) -> None:
        self.stats["sent"] += 1
        self.bytes_sent[src] += len(data)
        if self.tap is not None:
            self.tap(src, dst, data)
        if self.loss and self.rng.random() < self.loss:
            self.stats["lost"] += 1
            return
        lo, hi = self.delay_s
        delay = lo if hi <= lo else self.rng.uniform(lo, hi)
        self.clock.call_later(delay, lambda: self._deliver(src, dst, data, is_reply))

    def _deliver(self, src: str, dst: str, data: bytes, is_reply: bool) -> None:
        if not self.reachable(src, dst):
            self.stats["partitioned"] += 1
            return
        endpoint = self._endpoints.get(dst)
        if endpoint is None or endpoint.closed or endpoint.handler is None:
            self.stats["unreachable"] += 1
            return
        try:
            out = endpoint.handler(data, src if is_reply else None)
        except Rejected as e:
            self.stats["rejected"] += 1
            sender = self._endpoints.get(src)
            told = sender.on_identity_conflict if sender is not None and not is_reply else None  # a call's status
            if e.reason is RejectReason.IDENTITY_CONFLICT and told is not None:  # reaches its caller; a reply's not
                told(dst, str(e))
            return
        except Exception:
            self.stats["handler_errors"] += 1
            return
        self.stats["delivered"] += 1
        if out:
            # A reply to a request goes back as a reply; what a handler returns for a reply is a new request.
            self._send(dst, src, out, is_reply=not is_reply)
