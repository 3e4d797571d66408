"""GossipStats: the counters of one gossip agent; the node reports them in its status and metrics (``as_dict``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GossipStats"]


@dataclass
class GossipStats:
    """Counters of one agent (they only grow)."""

    rounds: int = 0
    messages_sent: Counter[str] = field(default_factory=Counter)  # by kind: syn, syn_ack, ack, push
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    #: Inbound messages refused, by reason (``auth.RejectReason``: oversized, malformed, wrong_cluster, bad_mac,
    #: stale, replayed).
    rejected: Counter[str] = field(default_factory=Counter)
    entries_applied: int = 0
    #: Node deltas dropped because applying them would have left a gap (reordered or duplicated messages).
    delta_gaps: int = 0
    #: Node deltas of an older generation, of a forgotten node, or about this node itself.
    stale_deltas: int = 0
    #: Messages signed by another process using this node's id (a misconfiguration worth a look).
    self_id_conflicts: int = 0
    internal_errors: int = 0
    #: New members refused at the member cap.
    members_refused: int = 0
    #: New members refused because their sender had vouched for its budget's worth already (admission.py).
    vouches_refused: int = 0
    #: New members past their sender's budget that said they introduced themselves (a mesh forming at once), left
    #: to reach this node through other peers; those that never do are counted refused a window later.
    vouches_deferred: int = 0
    #: Deferred members that answered this node's Hello at their address as themselves: let in when next brought.
    joins_confirmed: int = 0
    #: Members this node suspected and declared dead on a peer's verdict (verdicts.py), before its own threshold.
    deaths_confirmed: int = 0
    #: Messages answered RESOURCE_EXHAUSTED unopened: their connection was over its budget (grpc_transport.py).
    throttled: int = 0
    #: Relayed members refused because that life was refused at the cap, or forgotten never having answered us.
    shunned_refused: int = 0
    #: Messages and relayed lives refused because the node id is held by another live life (admission.py).
    identity_conflicts: int = 0
    #: Node deltas refused because they would take a peer's copy past ``max_node_keys`` or ``max_node_bytes``.
    oversized_nodes: int = 0
    #: With per-node certificates, new lives of a node id a relay announced: taken only from the node itself.
    lives_deferred: int = 0
    #: Times a later life of this node's own id was seen (another process runs under it), and the new lives this
    #: node started to reclaim its id (with per-node certificates).
    superseded: int = 0
    reclaims: int = 0
    #: Hellos sent to addresses of unknown node id (seeds), and the HelloAcks that answered one.
    probes_sent: int = 0
    probes_answered: int = 0
    #: Syns sent to members unheard here for ``stale_probe_phi`` to ask for their heartbeat (agent._probe_stale).
    stale_probes: int = 0
    #: How late the round timer fired (this node's event loop held up: its own stall, discounted from its peers'
    #: silences): in all, and the worst once, in ms.
    loop_lag_ms_total: int = 0
    loop_lag_ms_max: int = 0
    #: The highest phi (x1000) any established member (one that answered at its address) reached here: how near a
    #: real peer came to suspicion, whatever else arrived.
    established_phi_max_milli: int = 0

    def note_loop_lag(self, seconds: float) -> None:
        ms = int(seconds * 1000)
        self.loop_lag_ms_total += ms
        self.loop_lag_ms_max = max(self.loop_lag_ms_max, ms)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "messages_sent": dict(self.messages_sent),
            "messages_received": self.messages_received,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rejected": dict(self.rejected),
            "entries_applied": self.entries_applied,
            "delta_gaps": self.delta_gaps,
            "stale_deltas": self.stale_deltas,
            "self_id_conflicts": self.self_id_conflicts,
            "internal_errors": self.internal_errors,
            "members_refused": self.members_refused,
            "vouches_refused": self.vouches_refused,
            "vouches_deferred": self.vouches_deferred,
            "joins_confirmed": self.joins_confirmed,
            "deaths_confirmed": self.deaths_confirmed,
            "shunned_refused": self.shunned_refused,
            "throttled": self.throttled,
            "identity_conflicts": self.identity_conflicts,
            "oversized_nodes": self.oversized_nodes,
            "lives_deferred": self.lives_deferred,
            "superseded": self.superseded,
            "reclaims": self.reclaims,
            "probes_sent": self.probes_sent,
            "probes_answered": self.probes_answered,
            "stale_probes": self.stale_probes,
            "loop_lag_ms_total": self.loop_lag_ms_total,
            "loop_lag_ms_max": self.loop_lag_ms_max,
            "established_phi_max_milli": self.established_phi_max_milli,
        }
