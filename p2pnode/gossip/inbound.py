"""The anti-entropy exchange as the agent runs it: each inbound message opened, admitted, applied, and answered.

``exchange.step`` is the protocol without I/O (a Syn gets a SynAck: the responder's useful digest entries and the
delta the initiator is missing; a SynAck gets an Ack, the delta the responder is missing, unless that is empty; an
Ack gets nothing). Around it, here:

- every message is opened by ``auth.Authenticator`` first, then decoded, and its sender checked against the life
  this node knows of its node id (admission.py, rule 3). A refused one raises ``Rejected`` (counted in
  ``stats.rejected``, logged at WARNING a few lines a minute at most, with what it usually means) and changes
  nothing -- in particular its sender never enters the membership. Only a Hello may come unbound (no receiver);
- a Hello is answered with who this node is (a HelloAck bound to the prober); a HelloAck that answers a probe of
  ours (outbox.py) is answered with a Syn bound to the node it names, or, answering a join probe, confirms that
  member (admission.py, rule 1);
- the deltas a message brings pass the admission gate (rules 1 and 2), and what it refused is reported once the
  message is applied; the heartbeats the message advanced feed the failure detector (liveness.py); what the
  sender's digest says of its copy of this node is remembered for the pushes (push.py);
- a sender whose message is applied *spoke* to us; one that answered a message we sent to its address is
  *reachable* (membership.py).

Nothing here raises into the transport but ``Rejected``: an internal error is logged and counted.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from p2pnode.gossip.admission import Admission
from p2pnode.gossip.auth import Authenticator, Envelope, Rejected, RejectReason
from p2pnode.gossip.clock import Clock
from p2pnode.gossip.codec import Hello, HelloAck, MalformedMessage, Message, Syn, SynAck, decode
from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.exchange import make_syn, step
from p2pnode.gossip.keys import address_of, delta_address
from p2pnode.gossip.liveness import Liveness
from p2pnode.gossip.outbox import Outbox
from p2pnode.gossip.push import OwnPush
from p2pnode.gossip.state import ClusterState
from p2pnode.gossip.stats import GossipStats
from p2pnode.log_limit import LogLimiter

__all__ = ["Inbound"]

log = logging.getLogger("p2pnode.gossip")


class Inbound:
    """Opens and answers the messages peers send (see the module docstring)."""

    def __init__(
        self,
        *,
        config: GossipConfig,
        auth: Authenticator,
        state: ClusterState,
        rng: random.Random,
        clock: Clock,
        stats: GossipStats,
        log: LogLimiter,
        outbox: Outbox,
        push: OwnPush,
        admission: Admission,
        liveness: Liveness,
    ) -> None:
        self.config = config
        self.auth = auth
        self.state = state
        self.rng = rng
        self.clock = clock
        self.stats = stats
        self.log = log
        self.outbox = outbox
        self.push = push
        self.admission = admission
        self.liveness = liveness
        self.membership = liveness.membership
        #: Told ``(generation, address or None, sender)`` when a message names a later life of this node's own id.
        self.on_superseded: Callable[[int, str | None, str], None] | None = None
        #: Builds the Syn for a receiver (the agent's: a shard in turn, in a large mesh); the whole digest without.
        self.make_syn: Callable[[str], Syn] = lambda receiver: make_syn(self.state, version=config.wire_version)

    def open(self, data: bytes, peer_names: frozenset[str] | None) -> tuple[Envelope, Message]:
        """The envelope and message in ``data``; raises Rejected (counted and logged) when it is refused."""
        try:
            envelope = self.auth.open(data, allow_unbound=True, peer_names=peer_names)
            message = decode(envelope.payload, self.config.max_receive_bytes)
            if not envelope.receiver_id and not isinstance(message, Hello):
                raise Rejected(RejectReason.WRONG_RECEIVER, f"unbound {type(message).__name__} (only a Hello may be)")
            self.admission.check_sender(envelope.sender_id, envelope.sender_address, envelope.sender_generation)
        except Rejected as rejected:
            self._rejected(rejected)
            raise
        except MalformedMessage as exc:
            rejected = Rejected(RejectReason.MALFORMED, f"payload: {exc}")
            self._rejected(rejected)
            raise rejected from None
        return envelope, message

    def answer(self, envelope: Envelope, message: Message, reply_from: str | None) -> bytes | None:
        """Apply an opened message; the reply envelope, or None. ``reply_from``: see ``GossipAgent.handle``."""
        if isinstance(message, Hello):  # changes nothing: the answer is who we are, bound to the prober
            return self.outbox.reply(HelloAck(envelope.nonce, message.version), envelope)  # in the prober's version
        if isinstance(message, HelloAck):
            confirm = self.outbox.probe_answered(message.probe_nonce)
            if confirm is None:
                return None  # not an answer to a probe of ours (or a late one): nothing to do
            if confirm:  # a deferred member asked whether it runs there (admission.py, rule 1)
                self.admission.answered_join_probe(confirm, envelope.sender_id)
                return None
            return self.outbox.reply(self.make_syn(envelope.sender_id), envelope)
        try:
            reply = self._exchange(message, envelope.sender_id)
        except Exception:
            log.exception("gossip: failed to process a message from %s", envelope.sender_id)
            self.stats.internal_errors += 1
            return None
        self._heard_from(envelope, reply_from)
        if reply is None:
            return None
        return self.outbox.reply(reply, envelope)

    def _exchange(self, message: Message, sender: str) -> Message | None:
        """One step of the exchange for a Syn, SynAck or Ack from ``sender``; the reply, if any."""
        now = self.clock.now()
        if isinstance(message, (Syn, SynAck)):
            self.push.note_digest(sender, message.digest, isinstance(message, SynAck))
        gate = self.admission.gate(sender)
        result = step(self.state, message, now, self.config.max_message_bytes, self.rng, gate)
        applied = result.applied
        if applied is not None:
            self.stats.entries_applied += applied.entries
            self.stats.delta_gaps += applied.gaps
            self.stats.stale_deltas += applied.stale
            if applied.oversized:
                self.stats.oversized_nodes += len(applied.oversized)
                self.log.warning(
                    "oversized", "gossip: refused the state of %s from %s: it would hold more than %s keys or %s "
                    "bytes (max_node_keys, max_node_bytes: a node writing that much is broken or hostile)",
                    ", ".join(n[:64] for n in applied.oversized[:3]), sender[:64], self.state.max_node_keys,
                    self.state.max_node_bytes,
                )
        self.liveness.heartbeats(result.heartbeats, now)
        gate.report()
        self._check_own_life(message, sender)
        return result.reply

    def _check_own_life(self, message: Message, sender: str) -> None:
        """Whether ``message`` names a later life of this node's own id than the one running here: then another
        process runs under it (the state ignores it; the agent says so, and may reclaim the id)."""
        if self.on_superseded is None:
            return
        self_id, own = self.state.self_id, self.state.self_node.generation
        later: tuple[int, str | None] | None = None
        for entry in getattr(message, "digest", ()):
            if entry.node_id == self_id:
                if entry.generation > own:
                    later = (entry.generation, None)
                break
        for nd in getattr(message, "delta", ()):
            if nd.node_id == self_id and nd.generation > own:
                later = (nd.generation, delta_address(nd))
                break
        if later is not None:
            self.on_superseded(later[0], later[1], sender)

    def _heard_from(self, envelope: Envelope, reply_from: str | None) -> None:
        """The sender's current life spoke to us; answering at its own address, it is reachable there."""
        node = self.state.nodes.get(envelope.sender_id)
        if node is not None and node.generation == envelope.sender_generation:
            self.membership.mark_spoke(envelope.sender_id)
            if reply_from is not None and address_of(node) == reply_from:
                self.membership.mark_reachable(envelope.sender_id)

    def _rejected(self, rejected: Rejected) -> None:
        """Count a refused message and log it (a few lines a minute per reason: a flood is counted, not logged)."""
        reason = rejected.reason
        self.stats.rejected[reason.value] += 1
        if reason is RejectReason.OWN_SENDER:
            self.stats.self_id_conflicts += 1
        hint = _REJECTION_HINTS.get(reason, "")
        self.log.warning(f"rejected:{reason.value}", "gossip: refused a message: %s%s", rejected, hint)


#: What a refusal usually means, for the operator reading the log line.
_REJECTION_HINTS = {
    RejectReason.WRONG_CLUSTER: " -- a node of another --cluster-id",
    RejectReason.BAD_MAC: " -- a node with another cluster secret (or a forged message)",
    RejectReason.OWN_SENDER: " -- another process runs with this node's --node-id, or a replayed message",
    RejectReason.WRONG_RECEIVER: " -- a message for another node (a replay, or a stale address of a restarted peer)",
    RejectReason.WRONG_GENERATION: " -- sealed for an earlier life of this node: a replay, or a message in flight "
    "across this node's restart (its sender learns the new generation from gossip)",
    RejectReason.CERT_MISMATCH: " -- a certificate holder speaking as another node id (each node's certificate must "
    "name its --node-id)",
    RejectReason.IDENTITY_CONFLICT: " -- a second process runs under that node id; the mesh keeps the life it knows "
    "until that one is seen dead or leaves",
    RejectReason.STALE: " -- clocks of the two nodes differ by more than the replay window, or a replay",
    RejectReason.REPLAYED: " -- a message seen before (a replay)",
    RejectReason.MALFORMED: "",
    RejectReason.OVERSIZED: "",
}
