"""Every knob of the gossip agent, with its default named and explained (hashicorp/memberlist's config.go is the
model). Nothing else in ``p2pnode.gossip`` keeps a literal default of its own.

The defaults target a LAN mesh of up to a few hundred nodes gossiping once a second; ``docs/gossip.md`` gives the
measured bandwidth, dissemination speed and detection time they lead to (``scripts/bench_gossip.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- rounds ----------------------------------------------------------------------------------------------------

#: Seconds between two gossip rounds of one node. Every round the node bumps its heartbeat, publishes its load and
#: cache-summary changes, and starts ``fanout`` exchanges. Dissemination takes ~log2(N) rounds and failure
#: detection ~8 intervals, so this is the knob that trades bandwidth for freshness.
DEFAULT_GOSSIP_INTERVAL_S = 1.0
#: Live peers a node starts an exchange with per round (memberlist's GossipNodes and chitchat's GOSSIP_COUNT are
#: 3 too). Push-pull with 3 peers reaches every node in about log2(N) + 2 rounds; more peers mostly add bytes.
DEFAULT_FANOUT = 3
#: Spread a round's exchanges over the round (the first at its start, the next every interval / fanout) instead of
#: starting them together. Together, the fanout's replies all answer the same digest and bring the same news up to
#: fanout times (measured: 1.7 entries received per entry applied at 100 nodes under churn); spread, each exchange
#: asks with what the previous ones brought, and news moves on every third of a round. False only for comparisons.
DEFAULT_STAGGER_EXCHANGES = True
#: Peers a node pushes its newest entries to, ahead of the round, when a consumer asks (``GossipAgent.push_own``:
#: the cache summary does when it publishes new prefixes, at most every ``summary_poll_s``). Those peers spread the
#: news with their own exchanges, so a new prefix is known to most of a 20-node mesh within a second instead of two
#: rounds. Costs one small message per peer and push, whatever the mesh size; 0 turns pushes off.
DEFAULT_PUSH_FANOUT = 6
#: Largest push (bytes of payload): a push carries a few fresh batches; a peer that lacks more than this (it fell
#: behind, or a stride change republished thousands of hashes) catches up through the exchanges instead, so pushes
#: never repeat bulk the exchanges send anyway (at most push_fanout x this per publish).
DEFAULT_PUSH_MAX_BYTES = 4096
#: Most members one Syn's digest names (0: no limit). A larger mesh is cut into ceil(members / this) shards by a
#: hash of the node id and each Syn carries the next shard (digest.py), so a node's digests cost at most fanout x
#: this x ~15-25 B a round whatever the mesh size (whole digests of 1,000 members: ~75 KB/s per node; quiet bytes at
#: 1,000: 105 -> 57 KB/s). Meshes up to 400 members never notice. Shards alone cost failure detection (a member's
#: heartbeat moves on from each node once every shards / fanout rounds: the highest phi a node saw of a live member
#: rose from 3.6 to 4.8 at 500 members and reached 7.9 at 1,000); with the stale probes and the detector's floor
#: (``FD_MIN_INTERVAL_ROUNDS``) 500 members in 2 shards do as well as whole digests (phi 3.2 against 3.6, the last
#: survivor 8.4 s both), 1,000 start within a minute as they should, and 1,000 keep phi at 3.7 (whole digests: 4.2),
#: the last survivor 8.7 s (8.6): docs/gossip.md, "Stale probes".
DEFAULT_DIGEST_MAX_MEMBERS = 400
#: Members a Syn of a shard also names whatever their shard: those alive or suspect whose heartbeat this node heard
#: advance longest ago (the responder's reply digest then brings any newer heartbeat of theirs). A shard relays each
#: heartbeat from a node only every shards / fanout rounds, and by chance a far observer went 4 rounds without
#: hearing a live member (suspect: 30 members in 3 shards, 4 of 3,480 pairs over a minute; the whole digest: none);
#: asking for the stalest each exchange keeps every member's silence here short. ~15-25 B each per Syn.
DEFAULT_DIGEST_STALEST_MEMBERS = 32
#: Each round, a node also asks up to ``max_stale_probes`` alive members it has not heard for ``stale_probe_phi``
#: (0: never) directly, with a Syn that names little but them (a digest shard of a member or two, ~150 B): the reply
#: brings their newest heartbeat. Gossip relays a heartbeat at random, and now and then a member goes unheard here for
#: rounds while most of the mesh hears it (measured: 78-94% of 300 members holding a newer heartbeat than a node
#: silent on it 3 s, whose Syns named it): more so with digest shards, where a member's heartbeat moves on only in
#: the exchanges of its shard. SWIM's direct probe, in Scuttlebutt's own messages. Members that answered this node
#: before are asked first, then at most 2 whose heartbeat it saw advance (docs/gossip.md, "Stale probes").
DEFAULT_STALE_PROBE_PHI = 1.5
DEFAULT_MAX_STALE_PROBES = 8
#: Stale probes a round sends at most to members that never answered this node (``Membership.stale_members``): as
#: the one such member a round's targets include anyway (targets.py), a bound on what made-up members can draw.
MAX_UNANSWERED_PROBES = 2
#: Members new to a node lately (a join, or a new life) that its Syns of a shard name whatever their shard, for
#: this many rounds, the newest this many at most: a join wave then spreads at the pace of whole digests, not of a
#: shard (a member is learned from the exchanges whose shard it falls in, a third of them at 1,000 members).
NEWCOMER_ROUNDS = 10
MAX_NEWCOMERS = 64
#: The gossip wire version a node starts exchanges in (codec.py). It reads versions 1 and 2 and answers each in its
#: own, so a mesh of the releases that speak only version 1 is upgraded in two rolls: every node to this release with
#: 1 (``--gossip-wire-version 1``), then to 2 (the default: generations as offsets from the sender's, ~40% fewer
#: digest bytes). A node of version 1 refuses version 2: set 2 only once none is left. ``WIRE_VERSIONS``: the versions
#: a node may start in, those ``codec.PROTOCOL_VERSIONS`` reads (this module imports none of the gossip package).
WIRE_VERSIONS = (1, 2)
DEFAULT_WIRE_VERSION = 2
#: Budget of one gossip message's payload (bytes): the digest plus as many delta entries as fit. chitchat's UDP
#: MTU is the same 64 KiB. A node that is far behind catches up over several exchanges, oldest versions first.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024
#: Largest envelope a node accepts (bytes); larger ones are rejected and counted as "oversized". Four budgets, so
#: that a peer configured with a larger budget (or a large digest) still gets through, while a flood cannot make a
#: node parse megabytes.
DEFAULT_MAX_RECEIVE_BYTES = 4 * DEFAULT_MAX_MESSAGE_BYTES
#: Peers a leaving node pushes its "left" state to before it stops (the rest learn it by gossip, or by phi).
DEFAULT_LEAVE_FANOUT = 8
#: How long ``stop()`` waits for in-flight sends (the leave push included) before closing the transport.
DEFAULT_LEAVE_TIMEOUT_S = 1.0

# --- failure detection (phi accrual; the defaults are chitchat's and Cassandra's where they apply) -------------

#: phi above which a node is dead. phi = (seconds since the node's heartbeat last advanced) / (mean interval
#: between advances), as in chitchat; 8 is chitchat's and Cassandra's threshold: at a 1 s interval a silent node
#: is declared dead after ~8-9 s, while 50% message loss stays far below it (tests/unit/test_gossip_cluster.py).
DEFAULT_PHI_THRESHOLD = 8.0
#: phi above which a live node is reported "suspect" (an early warning the router may use; a suspect node is
#: still gossiped with and its estimates still used). Half-way to dead.
DEFAULT_SUSPECT_PHI = 4.0
#: Rounds a peer's verdict counts here: a member this node suspects is declared dead while it holds a peer's own
#: detector's verdict on that life (the peer's ``down`` key names it, ``verdicts.py``), instead of when this node's
#: phi crosses the threshold too. A far observer hears a node's last heartbeat up to ~2 rounds after its near ones at
#: 1,000 members, and judged alone declared the death that much later (the last survivor at 10.2 s, the first at
#: 7.6); a verdict reaches it in the same ~2 rounds from the first. Only a suspect member is confirmed (phi > 4: this
#: node has not heard it for half the threshold either), never one heard here beyond the declarer's last heartbeat of
#: it, and its next heartbeat brings it back, as after any death. A node publishes only its own detector's verdicts,
#: each for this many rounds; 0: verdicts neither published nor heeded (each node judges alone, as chitchat does).
DEFAULT_DEAD_VERDICT_ROUNDS = 10
#: Most verdicts one node's ``down`` key names (the newest; a node whose detector declares more deaths than this
#: within ``DEFAULT_DEAD_VERDICT_ROUNDS`` rounds publishes only the newest, the rest are judged by each node alone).
MAX_DEAD_VERDICTS = 32
#: Heartbeat inter-arrival samples kept per node (chitchat and Cassandra keep 1000): a bounded window whose mean
#: follows the network's recent behaviour.
DEFAULT_FD_WINDOW = 1000
#: Inter-arrival samples longer than this are dropped, so that one long pause (a partition, a GC stall) does not
#: inflate the mean and slow every later detection (chitchat: 10 s).
DEFAULT_FD_MAX_INTERVAL_S = 10.0
#: Sample the window starts with when a node is first heard of, before any real inter-arrival is known. Twice the
#: default interval: a node heard of once and never again is dead after ~16 s; real samples soon dominate.
DEFAULT_FD_INITIAL_INTERVAL_S = 2.0
#: The least mean inter-arrival, in rounds, a silence is judged against (failure_detector.py, "A catch-up is not a
#: rhythm"): below it the window measures a backlog arriving, not the member's beat.
FD_MIN_INTERVAL_ROUNDS = 0.75
#: How long a dead or left node's state is kept before it is forgotten (its digest entry stops costing bytes).
#: Until then a node that comes back with the same generation simply becomes alive again. After it, the node id
#: is remembered (generation and heartbeat only) for as long again, so that a peer still gossiping the old state
#: cannot resurrect it.
DEFAULT_DEAD_NODE_GRACE_S = 300.0
#: How long a deleted key's tombstone is kept (seconds) before it is garbage-collected. It must outlive the time a
#: deletion takes to reach every node (~log2(N) + 3 rounds); a peer that is behind a collected tombstone gets a full
#: reset of that owner's state instead. Tombstones cost ~100 B each in memory while they live: at the benchmark's
#: cache churn (25 published hashes removed per node per second) 30 s means ~750 per owner.
DEFAULT_TOMBSTONE_GRACE_S = 30.0

# --- security -------------------------------------------------------------------------------------------------

#: Cluster id carried by every envelope; an envelope of another cluster gets PERMISSION_DENIED.
DEFAULT_CLUSTER_ID = "p2pnode"
#: Envelopes whose timestamp differs from the receiver's wall clock by more than this are rejected ("stale"). It
#: bounds how long a nonce must be remembered, and must exceed clock skew plus network delay.
DEFAULT_REPLAY_WINDOW_S = 60.0
#: Nonces remembered for replay detection. When full, the oldest is forgotten and envelopes not newer than it are
#: refused (counted as "replayed"), so the bound never opens a replay hole. A node receives ~2 x fanout x 2
#: envelopes per interval (~1.5k per window at the defaults), far below it.
DEFAULT_MAX_SEEN_NONCES = 65_536

# --- bounds and warnings against floods and misconfiguration ---------------------------------------------------

#: Most members (this node included) a node keeps. A node that holds the cluster secret could otherwise make every
#: node keep any number of fake members (10,000 were accepted, and gossiping with fakes delayed real heartbeats
#: until real peers were declared dead). At the cap a new member is taken only in place of the member dead or left
#: longest, else refused (counted, logged at most a few lines a minute). A digest entry costs up to ~18 B plus the
#: node id (generations as offsets, codec.py; ~22 B in version 1, when a whole digest of 1,000 members measured 26 KB
#: with 5-character ids, 49 KB with 27-character ones); past ``digest_max_members`` (when set) a Syn carries a shard of
#: the membership instead, so a Syn stays near ``(digest_max_members + digest_stalest_members) x (18 + id length)``
#: whatever the mesh size (~25 KB with 40-character ids at 400). Whole digests: keep ``max_members x (18 + id
#: length)`` under half of ``max_message_bytes`` (1024 members with ids up to ~10 characters, ~500 with 40), or raise
#: the budget, since the SynAck's delta gets what its reply digest leaves. Every member's load and summary changes
#: reach every node: 500 and 1,000 members are measured in docs/gossip.md.
DEFAULT_MAX_MEMBERS = 1024
#: Most keys (tombstones included) and bytes of keys and values one member's state may hold here: a delta that would
#: take a member past either is refused (counted, ``oversized_nodes``; logged). An honest node holds a few thousand
#: keys and well under a MiB (its engine's and tiers' summaries, at most 8,192 summary keys each in batches, its
#: segment keys, at most 4,096, its load, info and plan); without a bound a cluster-secret holder could write keys
#: under a member without end, copied by every node. The state is then at most ``max_members`` times this.
DEFAULT_MAX_NODE_KEYS = 65_536
DEFAULT_MAX_NODE_BYTES = 16 * 1024 * 1024
#: New members (node ids never known here) one sender may bring into this node's membership per
#: ``DEFAULT_VOUCH_WINDOW_S`` (a token bucket: a burst of this many, then this many a window); the rest are refused,
#: counted and logged (admission.py). A member introducing itself and one that returns spend nothing. A secret holder
#: announcing 5,000 members that keep heartbeating filled every node's table (1,024) and got every honest peer
#: suspected in ~6 s; with the budget it gets 64 in, then ~1 a second. An honest seed of a mesh forming all at once
#: vouches for more than this: a joining node then learns the rest through its other peers over a few rounds. Past
#: the budget, a member its delta says introduced itself (an honest member of a forming mesh) is deferred, not
#: logged as a flood, and judged a window later: logged as made up only if no other peer brought it by then
#: (admission.py, ``Deferred``; 1,000 members started within a minute: measured in docs/gossip.md).
DEFAULT_MAX_VOUCHED_MEMBERS = 64
#: The window of DEFAULT_MAX_VOUCHED_MEMBERS (seconds), and how long a deferred member has to reach this node
#: through another peer before it counts as made up.
DEFAULT_VOUCH_WINDOW_S = 60.0
#: Deferred members (introduced themselves, past their sender's budget) this node asks itself, per round: a Hello
#: to the address their delta names; one that answers as that node id runs there, and gets in as soon as a peer brings
#: it again (admission.py, rule 1). A member nobody can reach -- the flood the budget is for -- never answers. A node
#: joining a formed mesh defers most of it (a sender vouches for 64): at 128 a round it asks a 1,000-member mesh in
#: ~7 rounds (a Hello and its answer, ~0.3 KB each). Measured (300 members started within 20 s, bench_gossip.py
#: --cold-start): every member held every other alive 5 s after the last start with none, 4 s at 32, 2 s at 128 -- as
#: with no budget at all; bytes +0.9%. 0 turns it off. What it lets a secret holder do: make each node send up to
#: this many Hellos a round to addresses it names (each deferred member is asked once; at most max_members wait).
DEFAULT_MAX_JOIN_PROBES = 128
#: How long a member's life refused at the cap, or forgotten without ever having answered this node at its address,
#: stays refused when a relay brings it back (admission.py, ``Shunned``): as long as a dead member is remembered
#: (``dead_node_grace_s``), so an honest peer still gossiping a made-up member's heartbeats cannot bring it back as a
#: "returning" member, which spends no budget and may take the place of others. The member itself, speaking to this
#: node, is never refused by it.
DEFAULT_SHUN_S = 300.0
#: Lives remembered so, per allowed member (the bound is this times ``max_members``; the oldest is dropped first).
SHUNNED_PER_MEMBER = 16
#: A node that has seeds and no live peer for this long warns that it runs alone (then again every minute): a
#: wrong --seeds, a wrong secret or cluster id otherwise leave a node serving alone in silence.
DEFAULT_ALONE_WARNING_S = 10.0
#: Membership changes (alive, suspect, dead, left, forgotten) logged per minute at INFO; more are counted and the
#: count is logged. A mesh of a few dozen nodes starting at once is still logged line by line.
DEFAULT_MEMBERSHIP_LOG_BURST = 32

#: Fault injection for the chaos driver (scripts/chaos.py, ``--chaos-gossip-loss``): the fraction of this node's
#: gossip messages (sends and replies) dropped on purpose, each independently, like the in-memory network's loss.
#: 0 everywhere but in fault tests.
DEFAULT_INJECTED_LOSS = 0.0
#: Seconds after the node starts before the injected loss begins (``--chaos-gossip-loss-after``): a mesh that must
#: stay whole under loss joins first, at gossip's own pace, instead of spending most of a test joining through it.
DEFAULT_INJECTED_LOSS_AFTER_S = 0.0

#: With mTLS, whether a peer's certificate must name the node id it speaks as (TlsConfig.bind_node_id). Before, any
#: certificate the CA signed could speak as any node id.
DEFAULT_TLS_BIND_NODE_ID = True

# --- transport ---------------------------------------------------------------------------------------------------

#: Deadline of one gossip RPC (seconds); a peer slower than this is treated as lost for that message.
DEFAULT_RPC_TIMEOUT_S = 2.0
#: Gossip messages one connection may send this node per second: a token bucket per connection (its peer address
#: and port), refilled continuously, a burst of twice as many; beyond it a message is answered RESOURCE_EXHAUSTED
#: before anything of it is opened (no MAC computed, nothing decoded) and counted (``throttled``). An honest peer
#: sends one receiver, per exchange it starts with it, a Syn and an Ack (the SynAck rides back on the Syn's call),
#: plus at most one push per summary publish (every 0.25 s at most) and a probe: under 8 a second at the default 1 s
#: interval, under 20 at the fastest profile's 0.2 s. 100 is 5x that and more; a single connection carrying an
#: insider's flood is held to it (it opens and verifies at most 100 a second here).
DEFAULT_MAX_PEER_MESSAGES_PER_S = 100.0
#: Connections whose budget is remembered (the least recently used is forgotten: it starts over with a full burst).
MAX_BUDGETED_CONNECTIONS = 4096
#: gRPC sends in flight at once; beyond it new sends are dropped and counted (a dead peer's timeouts cannot pile up).
DEFAULT_MAX_PENDING_SENDS = 256
#: gRPC channels kept open (one per peer address, least recently used closed first).
DEFAULT_MAX_CHANNELS = 1024
#: Reconnect backoff bounds of a gRPC channel (ms). gRPC's own maximum is 120 s, which would keep a restarted peer
#: unreachable for minutes; gossip retries every interval anyway.
DEFAULT_MIN_RECONNECT_BACKOFF_MS = 100
DEFAULT_MAX_RECONNECT_BACKOFF_MS = 2_000

# --- what a node publishes -----------------------------------------------------------------------------------------

#: Cache summary: a block hash is published when its depth (1-based, in blocks) is a multiple of the stride. The
#: estimate of a prefix match is then below the true one by less than the stride (in blocks); bytes shrink by it.
DEFAULT_SUMMARY_STRIDE = 4
#: Most hashes one node publishes. When the sampled set would exceed it, the stride doubles (then halves back with
#: hysteresis): every cached prefix stays represented, with a coarser error, and a summary is at most ~16 B x this
#: on the wire (~130 KB) and in every peer's memory.
DEFAULT_SUMMARY_MAX_HASHES = 8192
#: The most a node may be configured to publish: half of what a peer's reader holds of one summary
#: (``summary_log.MAX_READER_KEYS``, 65,536), room for a compaction's moves.
MAX_SUMMARY_HASHES = 32_768
#: Most load updates a node should receive a second from the whole mesh. Every member publishes its load at most
#: every max(1, members / (this x interval_s)) rounds (``LoadPublisher``): every round up to 400 members at the
#: defaults, every 3rd round at 1,000 (a load in a peer's view is then up to ~3 s old). A load update costs ~60 B
#: in a delta, so at most ~24 KB/s of loads reach a node, where one per member a second is 60 KB/s at 1,000. 0: every
#: round, whatever the mesh size.
DEFAULT_LOAD_UPDATES_PER_S = 400.0
#: Least seconds between two cache-summary publishes. The node publishes its summary's changes soon after its
#: engine's cache events (and at each round's start), at most this often: a prefix cached now is published within
#: ~20 ms on a quiet node and pushed to ``push_fanout`` peers, instead of waiting up to a round; under constant
#: churn this caps the publishes (and pushes) at 4 a second, each one batch of hashes.
DEFAULT_SUMMARY_MIN_GAP_S = 0.25


# --- named profiles ------------------------------------------------------------------------------------------------

#: The settings that follow the network's delay, named for where a mesh runs (memberlist ships its LAN, WAN and local
#: configs the same way); everything not named keeps its default above. Detection and replay bounds scale with the
#: round: a node is dead after ~8 silent rounds (phi 8), the failure detector starts from 2 rounds and drops pauses
#: longer than 10 rounds.
#:
#: - ``lan``: one data centre, a few hundred nodes: the defaults above (1 s rounds; dead after ~8-10 s).
#: - ``wan``: nodes across regions (tens of ms between them, lossier links): 2 s rounds, RPCs given 5 s, tombstones
#:   and dead nodes kept twice as long (a deletion takes longer to reach everyone).
#: - ``local``: every node on one host (loopback: tests, demos, benchmarks): 0.2 s rounds, so a mesh converges and
#:   notices a death in a couple of seconds.
PROFILES: dict[str, dict[str, Any]] = {
    "lan": {},
    "wan": {
        "interval_s": 2.0,
        "fd_initial_interval_s": 4.0,
        "fd_max_interval_s": 20.0,
        "rpc_timeout_s": 5.0,
        "leave_timeout_s": 3.0,
        "tombstone_grace_s": 2 * DEFAULT_TOMBSTONE_GRACE_S,
        "dead_node_grace_s": 2 * DEFAULT_DEAD_NODE_GRACE_S,
    },
    "local": {
        "interval_s": 0.2,
        "fd_initial_interval_s": 0.4,
        "fd_max_interval_s": 2.0,
        "rpc_timeout_s": 1.0,
        "leave_timeout_s": 0.5,
    },
}
#: The profile a node runs when none is named.
DEFAULT_PROFILE = "lan"


@dataclass(frozen=True)
class TlsConfig:
    """mTLS for the gossip transport: this node's certificate and key, and the CA that signs every peer's.

    With TLS a peer without a certificate signed by ``ca_file`` cannot even connect; the cluster secret (HMAC) may
    then be omitted. ``server_name`` overrides the name checked in the server certificate (useful when peers are
    dialled by IP and certificates name hosts). Each node's certificate names its node id (``bind_node_id``).
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    server_name: str | None = None
    #: Bind node ids to certificates: the sender id of every peer message a node receives must be named by the
    #: certificate its caller presented (its common name or one of its subject alternative names), so a node
    #: holding a certificate cannot speak as another node id (refused as ``cert_mismatch``). False lets every
    #: node present one shared certificate (any holder may then speak as any id: ``--tls-shared-cert``).
    bind_node_id: bool = DEFAULT_TLS_BIND_NODE_ID

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA certificates) as PEM bytes."""
        return self.cert_file.read_bytes(), self.key_file.read_bytes(), self.ca_file.read_bytes()


@dataclass(frozen=True)
class GossipConfig:
    """One gossip agent's settings; see the module constants for what each default means and why."""

    cluster_id: str = DEFAULT_CLUSTER_ID
    #: Shared cluster secret (bytes of the secret file). None is only allowed with mTLS.
    cluster_secret: bytes | None = field(default=None, repr=False)
    tls: TlsConfig | None = None

    interval_s: float = DEFAULT_GOSSIP_INTERVAL_S
    fanout: int = DEFAULT_FANOUT
    stagger_exchanges: bool = DEFAULT_STAGGER_EXCHANGES
    digest_max_members: int = DEFAULT_DIGEST_MAX_MEMBERS
    digest_stalest_members: int = DEFAULT_DIGEST_STALEST_MEMBERS
    stale_probe_phi: float = DEFAULT_STALE_PROBE_PHI
    max_stale_probes: int = DEFAULT_MAX_STALE_PROBES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    wire_version: int = DEFAULT_WIRE_VERSION
    max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES
    leave_fanout: int = DEFAULT_LEAVE_FANOUT
    push_fanout: int = DEFAULT_PUSH_FANOUT
    push_max_bytes: int = DEFAULT_PUSH_MAX_BYTES
    leave_timeout_s: float = DEFAULT_LEAVE_TIMEOUT_S

    phi_threshold: float = DEFAULT_PHI_THRESHOLD
    suspect_phi: float = DEFAULT_SUSPECT_PHI
    dead_verdict_rounds: int = DEFAULT_DEAD_VERDICT_ROUNDS
    fd_window: int = DEFAULT_FD_WINDOW
    fd_max_interval_s: float = DEFAULT_FD_MAX_INTERVAL_S
    fd_initial_interval_s: float = DEFAULT_FD_INITIAL_INTERVAL_S
    dead_node_grace_s: float = DEFAULT_DEAD_NODE_GRACE_S
    tombstone_grace_s: float = DEFAULT_TOMBSTONE_GRACE_S

    replay_window_s: float = DEFAULT_REPLAY_WINDOW_S
    max_seen_nonces: int = DEFAULT_MAX_SEEN_NONCES

    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    max_pending_sends: int = DEFAULT_MAX_PENDING_SENDS
    max_channels: int = DEFAULT_MAX_CHANNELS
    max_peer_messages_per_s: float = DEFAULT_MAX_PEER_MESSAGES_PER_S

    summary_stride: int = DEFAULT_SUMMARY_STRIDE
    summary_max_hashes: int = DEFAULT_SUMMARY_MAX_HASHES
    summary_min_gap_s: float = DEFAULT_SUMMARY_MIN_GAP_S
    load_updates_per_s: float = DEFAULT_LOAD_UPDATES_PER_S

    max_members: int = DEFAULT_MAX_MEMBERS
    max_node_keys: int = DEFAULT_MAX_NODE_KEYS
    max_node_bytes: int = DEFAULT_MAX_NODE_BYTES
    max_vouched_members: int = DEFAULT_MAX_VOUCHED_MEMBERS
    vouch_window_s: float = DEFAULT_VOUCH_WINDOW_S
    max_join_probes: int = DEFAULT_MAX_JOIN_PROBES
    shun_s: float = DEFAULT_SHUN_S
    alone_warning_s: float = DEFAULT_ALONE_WARNING_S
    injected_loss: float = DEFAULT_INJECTED_LOSS
    injected_loss_after_s: float = DEFAULT_INJECTED_LOSS_AFTER_S

    @property
    def certified_ids(self) -> bool:
        """Whether each node has a certificate of its own naming its node id (mTLS with ``bind_node_id``): then a
        node id is its certificate's end to end -- a peer channel checks that the certificate names the node it
        dials, and a new life of a node id is taken only from that node itself, never on a relay's word
        (admission.py)."""
        return self.tls is not None and self.tls.bind_node_id

    @classmethod
    def profile(cls, name: str = DEFAULT_PROFILE, **settings: Any) -> GossipConfig:
        """A config of the named profile (``PROFILES``), with ``settings`` (the secret, TLS, overrides) on top."""
        try:
            base = PROFILES[name]
        except KeyError:
            raise ValueError(f"unknown gossip profile {name!r}; valid: {', '.join(PROFILES)}") from None
        return cls(**{**base, **settings})

    def __post_init__(self) -> None:
        if not self.cluster_id:
            raise ValueError("cluster_id must not be empty")
        if self.cluster_secret is not None and len(self.cluster_secret) < 16:
            raise ValueError("cluster_secret must be at least 16 bytes")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {self.fanout}")
        if self.wire_version not in WIRE_VERSIONS:
            raise ValueError(f"wire_version must be one of {WIRE_VERSIONS}, got {self.wire_version}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_receive_bytes < self.max_message_bytes:
            raise ValueError("max_receive_bytes must be >= max_message_bytes")
        if not 0 < self.suspect_phi <= self.phi_threshold:
            raise ValueError("need 0 < suspect_phi <= phi_threshold")
        if self.dead_verdict_rounds < 0:
            raise ValueError(f"dead_verdict_rounds must be >= 0, got {self.dead_verdict_rounds}")
        if self.fd_window < 1 or self.fd_initial_interval_s <= 0 or self.fd_max_interval_s <= 0:
            raise ValueError("fd_window, fd_initial_interval_s and fd_max_interval_s must be positive")
        if self.summary_stride < 1 or not 1 <= self.summary_max_hashes <= MAX_SUMMARY_HASHES:
            raise ValueError(
                f"summary_stride must be >= 1 and summary_max_hashes in [1, {MAX_SUMMARY_HASHES}] (what a peer reads "
                "of one summary is bounded: cache/summary_log.py)"
            )
        if self.summary_min_gap_s < 0:
            raise ValueError(f"summary_min_gap_s must be >= 0, got {self.summary_min_gap_s}")
        if self.stale_probe_phi < 0 or self.max_stale_probes < 0:
            raise ValueError("stale_probe_phi (0: never) and max_stale_probes must be >= 0")
        if self.digest_max_members < 0 or self.digest_stalest_members < 0:
            raise ValueError("digest_max_members (0: never cut) and digest_stalest_members must be >= 0")
        if not (math.isfinite(self.load_updates_per_s) and self.load_updates_per_s >= 0):
            raise ValueError(f"load_updates_per_s must be a finite number >= 0, got {self.load_updates_per_s}")
        if self.max_seen_nonces < 1 or self.replay_window_s <= 0:
            raise ValueError("max_seen_nonces and replay_window_s must be positive")
        if not 0 <= self.injected_loss < 1:
            raise ValueError(f"injected_loss must be in [0, 1), got {self.injected_loss}")
        if not (math.isfinite(self.injected_loss_after_s) and self.injected_loss_after_s >= 0):
            raise ValueError(f"injected_loss_after_s must be a finite number >= 0, got {self.injected_loss_after_s}")
        if self.max_members < 2:
            raise ValueError(f"max_members must be >= 2 (this node and a peer), got {self.max_members}")
        if self.max_node_keys < 64 or self.max_node_bytes < 65_536:
            raise ValueError(
                f"max_node_keys must be >= 64 and max_node_bytes >= 65536 (a node's core keys and summaries), got "
                f"{self.max_node_keys} and {self.max_node_bytes}"
            )
        if self.max_peer_messages_per_s <= 0:
            raise ValueError("max_peer_messages_per_s must be positive")
        if self.max_vouched_members < 1 or self.vouch_window_s <= 0:
            raise ValueError("max_vouched_members and vouch_window_s must be positive")
        if self.max_join_probes < 0:
            raise ValueError(f"max_join_probes must be >= 0, got {self.max_join_probes}")
