"""Every message the agent sends: sealed for the life of its receiver (auth.py), counted, and handed to the transport.

A message to a member is sealed for the generation this node knows of it; a reply, for the life that sent the
message it answers. An address whose node id is not known yet (a seed), or a member that may run another life by
now, is first *probed*: a Hello, the one envelope bound to no receiver, asks which node runs there; its HelloAck
names the node and its life, and the agent answers it with a Syn bound to them on the same connection (a join
costs one round trip more, not a round). The nonces of the Hellos awaiting an answer are kept here, a few hundred
at most, so that only an answer to a probe of ours starts an exchange. A Hello may also ask a member deferred at
the vouching budget whether it runs where its delta says (admission.py, rule 1): its answer starts no exchange.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from p2pnode.gossip.auth import NONCE_BYTES, Authenticator, Envelope
from p2pnode.gossip.codec import PROTOCOL_VERSION, Ack, Hello, HelloAck, Message, Syn, SynAck, encode
from p2pnode.gossip.stats import GossipStats
from p2pnode.gossip.transport import Transport

__all__ = ["MAX_PENDING_PROBES", "Outbox"]

#: Hellos awaiting their HelloAck, at most (oldest forgotten first): a few seeds and a round or two of join probes.
MAX_PENDING_PROBES = 512

#: The counter each kind of reply is sent under (``GossipStats.messages_sent``).
_REPLY_KINDS: dict[type[Message], str] = {SynAck: "syn_ack", Ack: "ack", HelloAck: "hello_ack", Syn: "syn"}


class Outbox:
    """Seals, counts and sends (see the module docstring). ``generation_of(node_id)``: the life a message to that
    member is sealed for."""

    def __init__(
        self,
        transport: Transport,
        auth: Authenticator,
        stats: GossipStats,
        generation_of: Callable[[str], int],
        wire_version: int = PROTOCOL_VERSION,
    ) -> None:
        self.transport = transport
        self.wire_version = wire_version  # what a probe of ours is sent in (config.py)
        self.auth = auth
        self.stats = stats
        self.generation_of = generation_of
        #: Hello nonce -> the node id it asks to confirm ("" for a probe that starts an exchange)
        self._probes: OrderedDict[bytes, str] = OrderedDict()

    def send(self, address: str, data: bytes, kind: str, peer_id: str = "") -> None:
        """Send a sealed envelope, counted under ``kind`` (``peer_id``: ``Transport.send``'s)."""
        self.stats.messages_sent[kind] += 1
        self.stats.bytes_sent += len(data)
        self.transport.send(address, data, peer_id)

    def send_to(self, address: str, node_id: str, payload: bytes, kind: str) -> None:
        """Send ``payload`` to member ``node_id`` at ``address``, sealed for the life of it this node knows."""
        self.send(address, self.auth.seal(payload, node_id, self.generation_of(node_id)), kind)

    def reply(self, message: Message, to: Envelope) -> bytes:
        """``message`` sealed for the sender of ``to`` (the life that sent it), counted; the transport returns it."""
        out = self.auth.seal(encode(message), to.sender_id, to.sender_generation)
        self.stats.messages_sent[_REPLY_KINDS[type(message)]] += 1
        self.stats.bytes_sent += len(out)
        return out

    def probe(self, address: str, confirm: str = "") -> None:
        """Ask ``address`` which node it is (a Hello). Its HelloAck is answered with a bound Syn; with ``confirm`` (a
        node id), it only says whether that node runs there."""
        nonce = os.urandom(NONCE_BYTES)
        self._probes[nonce] = confirm
        while len(self._probes) > MAX_PENDING_PROBES:
            self._probes.popitem(last=False)
        self.stats.probes_sent += 1
        # A confirming probe goes on a channel checked for the node it asks after (with per-node certificates):
        # its answer then counts only if that node's certificate signed it, not any certificate holder's.
        self.send(address, self.auth.seal(encode(Hello(self.wire_version)), "", 0, nonce), "hello", confirm)

    def probe_answered(self, nonce: bytes) -> str | None:
        """For a HelloAck: None when it answers no probe of ours still awaiting its answer; else the node id the probe
        asked to confirm ("" for one that starts an exchange), and the probe awaits no more."""
        confirm = self._probes.pop(nonce, None)
        if confirm is not None:
            self.stats.probes_answered += 1
        return confirm
