"""The gossip staleness model: each ingress sees each peer's cache and load as of the last gossip round it heard.

Every node publishes once per ``interval_s`` (each at its own random phase, like independent agents): the changes of
its real PrefixIndex since its previous round (``PrefixIndex.journal_since``; a full snapshot when the journal no
longer reaches back), and its load (running, waiting, KV usage, cached blocks). What a node publishes at time
t becomes visible to every other node at ``t + delay_s``. The default delay is the real agent's measured lag
(``agent_fitted_delay``: push-pull with fanout 3 spreads a round's news within about half a round at 30 nodes,
``gossip_view.DeliveryLag``). ``one_hop_push_delay`` -- ``interval * log2(N) / 2``, the lag of a push that reaches
one more hop per round, and this model's default until the results were redone with the measured lag -- is kept as
the pessimistic what-if (``--gossip-delay``): ~6x the agent's lag at 16 nodes.

Differences from the agent, on purpose and documented: the summary here is exact (every cached block, not the
agent's stride-sampled subset, unless ``stride`` > 1 rounds estimates down the way the agent's summary does), and
every receiver hears a round at the same moment. Gossip bytes are estimated
as ``SUMMARY_ADDED_BYTES`` per block added and ``SUMMARY_WITHDRAWN_BYTES`` per block withdrawn (the summary log's
batches and bitmaps, ``cache/summary_log.py``) plus ``LOAD_BYTES`` per round, delivered once to each of the N-1
other nodes.

Segment keys (``cache/segment_summary.py``): a node whose engine keeps a segment store (approximate runs) also
publishes, each round, the changes of its hot segment keys (the newest its store took, within the node's byte
budget, ``config.DEFAULT_SEGMENT_SUMMARY_BYTES``), heard with the same delay and counted in the same bytes
(``SEGMENT_ENTRY_BYTES`` each); ``segment_holders`` answers which of a request's segments each node holds.

KV tiers (``engine/simulated/tiers.py``): a node with tiers below its engine also publishes, each round, the changes
of each tier's blocks since its last round (``KvTier.changes_since``; a snapshot when the journal does not reach back),
heard with the same delay, counted in the same bytes per hash, and kept in one inverted index per medium.
``estimate_tier_matches`` answers, for each node, the cumulative depth of a chain in its visible engine summary and
tiers (the engine's or a tier's, every block contiguous): exact like the engine's estimate, where a node's
``ClusterView`` reads each tier's deepest published hash and the router takes the deeper of that and the engine's.

Data structure: one inverted index ``block hash -> bitmask of nodes whose visible summary holds it``, so
``estimate_matches`` walks the request's chain once for all nodes: O(blocks + matching nodes) per request.

One directory serves every ingress (everyone hears a round at the same moment); the router leaves out its own node.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Sequence

from p2pnode.block_loops import apply_journal, prefix_depths, prefix_depths_by
from p2pnode.cache.segment_summary import SEGMENT_ENTRY_BYTES, hot_keys
from p2pnode.cache.tiers import Medium
from p2pnode.config import DEFAULT_SEGMENT_SUMMARY_BYTES
from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S
from p2pnode.sim.views import MeshParts, PeerState

__all__ = ["StalenessGossip", "agent_fitted_delay", "check_settings", "default_delay", "one_hop_push_delay"]

#: Wire bytes per hash added to the cache summary (its 4-byte summary key in a batch, ``cache/summary_log.py``) and
#: per hash withdrawn (a bit of a batch's bitmap, or a share of a whole batch's deletion: ~1 B).
SUMMARY_ADDED_BYTES = 4
SUMMARY_WITHDRAWN_BYTES = 1
#: Wire bytes of one load value plus its key and version (p2pnode/load.py: ~10 B value).
LOAD_BYTES = 24


def one_hop_push_delay(interval_s: float, nodes: int) -> float:
    """Mean time for a round's news to reach a node if it spread one hop per round: half of the ~log2(N) rounds a
    full spread takes. ~5x the real agent's lag at 30 nodes (docs/simulator.md, "Gossip: model vs real agent");
    a pessimistic what-if, no longer the default."""
    return interval_s * math.log2(max(2, nodes)) / 2


#: Mean publish -> visible lag of the real agent (fanout 3, push-pull), in rounds per doubling of N / 4, fitted to
#: ``gossip_view.DeliveryLag`` on the aggregate at 150 QPS: 0.25 rounds at 10 nodes, 0.48 at 30, 0.62 at 60.
AGENT_LAG_ROUNDS_PER_DOUBLING = 0.16


def agent_fitted_delay(interval_s: float, nodes: int) -> float:
    """The real agent's mean publish -> visible lag (seconds), as measured: ~0.16 rounds per doubling of N / 4."""
    return interval_s * AGENT_LAG_ROUNDS_PER_DOUBLING * math.log2(max(1.0, nodes / 4))


def default_delay(interval_s: float, nodes: int) -> float:
    """The delay a run gets unless it names one: the real agent's measured lag (``agent_fitted_delay``)."""
    return agent_fitted_delay(interval_s, nodes)


def check_settings(interval_s: float, delay_s: float | None, stride: int) -> None:
    """ValueError naming a gossip setting the model cannot run with."""
    if not interval_s > 0:
        raise ValueError(f"gossip interval must be positive, got {interval_s}")
    if delay_s is not None and not delay_s >= 0:
        raise ValueError(f"gossip delay must be >= 0, got {delay_s}")
    if stride < 1:
        raise ValueError(f"summary stride must be >= 1, got {stride}")


class StalenessGossip:
    """Visible per-peer summaries and loads, refreshed by simulated gossip rounds (a ``SimView`` and the
    ``PeerDirectory`` every ingress shares)."""

    def __init__(
        self,
        interval_s: float = DEFAULT_GOSSIP_INTERVAL_S,
        delay_s: float | None = None,
        seed: int = 0,
        stride: int = 1,
    ):
        check_settings(interval_s, delay_s, stride)
        self.interval_s = interval_s
        self.delay_s = delay_s
        self.seed = seed
        #: Estimates are rounded down to a multiple of this many blocks, as the agent's stride-sampled summary does
        #: (1: the exact summary, the default; the agent's own default is 4).
        self.stride = stride
        self._inv: dict[int, int] = {}  # block hash -> bitmask of nodes whose visible summary has it
        self._segments: dict[int, int] = {}  # segment key -> bitmask of nodes whose visible keys have it
        self._seg_published: list[set[int]] = []  # per node, the segment keys its last round published
        self._states: list[PeerState] = []
        self._by_id: dict[str, PeerState] = {}
        self._heard: deque[str] = deque()
        self._ids: tuple[str, ...] = ()
        self._pub_version: list[int] = []  # per node, the index version its last round published
        #: Per tier medium: block hash -> bitmask of nodes whose visible tier summary has it; and per node, the tier
        #: journal versions its last round published.
        self._tier_inv: dict[Medium, dict[int, int]] = {}
        self._tier_pub: list[dict[Medium, int]] = []
        self._mesh: MeshParts | None = None
        self._bytes = 0
        self.rounds = 0
        #: Rounds heard so far: a router's ``version`` (every heard round changes a load or a summary).
        self.version = 0

    def start(self, mesh: MeshParts) -> None:
        self._mesh = mesh
        n = len(mesh.engines)
        if self.delay_s is None:
            self.delay_s = default_delay(self.interval_s, n)
        self._ids = mesh.node_ids
        loop = mesh.loop
        self._inv = {}
        self._states = [PeerState(nid, loop) for nid in mesh.node_ids]
        for st in self._states:
            st.kv_layout = mesh.kv_layout  # published with the summary's meta, known from the first round on
        self._by_id = {st.node_id: st for st in self._states}
        self._heard: deque[str] = deque(maxlen=max(64, 4 * n))  # node of each heard round, newest last
        self._pub_version = [0] * n
        self._tier_pub = [{} for _ in range(n)]
        self._tier_inv = {}
        for eng in mesh.engines:
            tiers = eng.cache.tiers
            for tier in tiers.tiers() if tiers is not None else ():
                self._tier_inv.setdefault(tier.medium, {})
        self._segments = {}
        self._seg_published = [set() for _ in range(n)]
        rng = random.Random(self.seed ^ 0x5EED)
        for j in range(n):
            loop.at(rng.uniform(0.0, self.interval_s), self._publish, j)

    def directory_for(self, ingress: int) -> StalenessGossip:
        return self

    def peers(self) -> Sequence[PeerState]:
        return self._states

    def peer(self, node_id: str) -> PeerState | None:
        return self._by_id.get(node_id)

    def changes_since(self, version: int) -> list[str] | None:
        """Rounds are heard one node at a time: the nodes of the rounds heard after ``version``."""
        behind = self.version - version
        if behind <= 0:
            return []
        heard = self._heard
        if behind > len(heard):
            return None
        return list(itertools.islice(reversed(heard), behind))[::-1]

    def gossip_bytes(self) -> int:
        return self._bytes

    # --- rounds ------------------------------------------------------------------------------------------------------

    def _publish(self, j: int) -> None:
        mesh = self._mesh
        assert mesh is not None
        if mesh.is_done():
            return
        loop = mesh.loop
        eng = mesh.engines[j]
        index = eng.cache.index
        changes = index.journal_since(self._pub_version[j])  # a hash added, ~hash removed
        full = None
        if changes is None:  # the journal does not reach back to the last round: a full snapshot
            full = [h for h, _ in index.iter_blocks()]
        self._pub_version[j] = index.version
        load = (eng.load(), len(index))
        if full is not None:
            summary_bytes = len(full) * SUMMARY_ADDED_BYTES
        else:
            added = len(list(filter((0).__le__, changes)))  # type: ignore[arg-type]
            summary_bytes = added * SUMMARY_ADDED_BYTES + (len(changes) - added) * SUMMARY_WITHDRAWN_BYTES  # type: ignore[arg-type]
        segment_changes: tuple[list[int], list[int]] = ([], [])
        if eng.segments is not None and eng.segments.store is not None:
            hot = set(hot_keys(eng.segments.keys(), DEFAULT_SEGMENT_SUMMARY_BYTES))
            published = self._seg_published[j]
            segment_changes = ([k for k in hot if k not in published], [k for k in published if k not in hot])
            self._seg_published[j] = hot
        seg_bytes = (len(segment_changes[0]) + len(segment_changes[1])) * SEGMENT_ENTRY_BYTES
        tier_changes, tier_bytes = self._tier_round(j, eng)
        self._bytes += (summary_bytes // self.stride + seg_bytes + LOAD_BYTES) * (
            len(mesh.engines) - 1
        )
        if tier_bytes:
            self._bytes += tier_bytes // self.stride * (len(mesh.engines) - 1)
        self.rounds += 1
        payload = (j, loop.now, changes, full, load, segment_changes)
        if tier_changes:
            payload = (*payload, tier_changes)
        if self.delay_s:
            loop.at(loop.now + self.delay_s, self._apply, payload)
        else:
            self._apply(payload)
        loop.at(loop.now + self.interval_s, self._publish, j)

    def _tier_round(self, j: int, eng: NodeEngine) -> tuple[dict[Medium, list[tuple[int, bool, int]] | list[int]], int]:
        """Node j's tiers' changes since its last round, by medium (a list of every held hash instead when a journal
        does not reach back), and their bytes on the wire."""
        tiers = eng.cache.tiers
        if tiers is None:
            return {}, 0
        published = self._tier_pub[j]
        out: dict[Medium, list[tuple[int, bool, int]] | list[int]] = {}
        wire = 0
        for tier in tiers.tiers():
            changes = tier.changes_since(published.get(tier.medium, 0))
            published[tier.medium] = tier.version
            if changes is None:
                snapshot = [h for h, _ in tier.iter_blocks()]
                out[tier.medium] = snapshot
                wire += len(snapshot) * SUMMARY_ADDED_BYTES
            elif changes:
                out[tier.medium] = changes
                added = sum(1 for _, is_added, _ in changes if is_added)
                wire += added * SUMMARY_ADDED_BYTES + (len(changes) - added) * SUMMARY_WITHDRAWN_BYTES
        return out, wire

    def _apply(self, payload: tuple) -> None:
        j, t_pub, changes, full, load, *rest = payload
        segment_changes = rest[:1]
        bit = 1 << j
        clear = ~bit
        if len(rest) > 1:
            self._apply_tiers(bit, rest[1])
        if segment_changes:
            added_keys, removed_keys = segment_changes[0]
            segments = self._segments
            for key in added_keys:
                segments[key] = segments.get(key, 0) | bit
            for key in removed_keys:
                m = segments.get(key, 0) & clear
                if m:
                    segments[key] = m
                else:
                    segments.pop(key, None)
        _apply_changes(self._inv, bit, changes, full)
        st = self._states[j]
        st.load, st.cached_blocks = load
        # Heard now: as in the node (``PeerView.load_at``), sends after this moment are the ones not in the load.
        st.report_time = self._mesh.loop.now if self._mesh is not None else t_pub
        self.version += 1
        self._heard.append(st.node_id)

    def _apply_tiers(self, bit: int, tier_changes: dict[Medium, list]) -> None:
        """A round's tier changes, heard: each medium's inverted index follows (a snapshot replaces what the node's
        summary of that medium showed)."""
        for medium, changes in tier_changes.items():
            snapshot = bool(changes) and not isinstance(changes[0], tuple)
            entries = [] if snapshot else [h if added else ~h for _, added, h in changes]
            _apply_changes(self._tier_inv.setdefault(medium, {}), bit, entries, changes if snapshot else None)

    # --- lookups -----------------------------------------------------------------------------------------------------

    def estimate_tier_matches(self, block_hashes: Sequence[int], medium: Medium) -> dict[str, int]:
        """``{node id: cumulative depth of the chain in its visible engine summary and tiers down to medium's}`` for
        the nodes with such a tier whose depth is not 0 (module docstring; stride-rounded like ``estimate_matches``)."""
        inv_tier = self._tier_inv.get(medium)
        if inv_tier is None:
            return {}
        invs = [self._inv, self._tier_inv.get(Medium.HOST, {})]
        if medium is Medium.DISK:
            invs.append(inv_tier)

        def mask_of(h: int, default: int) -> int:
            m = default
            for inv in invs:
                m |= inv.get(h, 0)
            return m

        return _stride_rounded(prefix_depths_by(block_hashes, mask_of, self._ids), self.stride)

    def estimate_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """``{node id: visible cached prefix in blocks}`` for the nodes whose estimate is not 0 (stride-rounded: the
        agent's estimate is the deepest published depth, a multiple of the stride)."""
        return _stride_rounded(prefix_depths(block_hashes, self._inv, self._ids), self.stride)

    def segment_holders(self, keys: Sequence[int]) -> dict[str, list[int]]:
        """``{node id: indices into keys of the segments its visible keys hold}`` (``PeerDirectory``)."""
        segments = self._segments
        if not segments:
            return {}
        ids = self._ids
        out: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            m = segments.get(key)
            while m:
                b = m & -m
                out.setdefault(ids[b.bit_length() - 1], []).append(i)
                m ^= b
        return out


def _stride_rounded(depths: dict[str, int], stride: int) -> dict[str, int]:
    """The depths as a summary of that stride shows them: rounded down to a multiple of it, 0s left out."""
    if stride > 1 and depths:
        return {node_id: d - d % stride for node_id, d in depths.items() if d >= stride}
    return depths


def _apply_changes(inv: dict[int, int], bit: int, changes: Sequence[int], full: Sequence[int] | None) -> None:
    """One node's summary changes (journal entries: a hash added, ``~hash`` removed) into an inverted index of node
    bitmasks (``block_loops.apply_journal``); ``full``, a snapshot, is diffed against what the index showed of that
    node first (rare)."""
    if full is not None:
        had = {h for h, m in inv.items() if m & bit}
        now_set = set(full)
        changes = [~h for h in had - now_set] + list(now_set - had)
    apply_journal(inv, bit, changes)
