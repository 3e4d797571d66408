"""ClusterView: what the router knows about every peer -- liveness, load, freshness, and its cache estimate.

The node's ``PeerDirectory`` (``directory.py``). It is a consumer of the gossip agent (``ClusterView.attach``): the
agent tells it every change of the replicated state (``on_node_added`` / ``on_node_removed`` / ``on_key_changed``)
and every liveness change (``on_transition``), and the view decodes what it knows the meaning of -- a node's address,
its load (``p2pnode/load.py``), its cache summary (``cache/summary.py``) -- into shapes that are cheap to query:

- per peer, the set of summary keys its cache summary publishes (``cache/summary.py``: the low 32 bits of the
  sampled blocks' hashes) and its summary stride;
- an inverted index ``summary key -> bitmask of peers`` publishing it (a ``MaskTable``: its key beside its bitmask's
  machine words, ``mask_table.py``), so that ``estimate_all`` answers for every peer at once with about two probes
  per sampled depth of the request (~2n/stride), whatever the peer count;
- the decoded load and address;
- per tier below peers' engines (a host tier, a disk tier), the same for that tier's summary (``tier_summaries.py``),
  so that ``estimate_tier_matches`` answers for every peer at once;
- per peer, the segment keys it gossips (``cache/segment_summary.py``: what its engine's segment store holds), and an
  inverted index ``segment key -> bitmask of peers``, so that ``segment_holders`` answers for every peer at once with
  one dict probe per segment of the request.

Estimate of a peer's cached prefix for a request chain h_1..h_n (``estimate_match_blocks``): the deepest depth d,
a multiple of that peer's stride s, whose key (h_d's) the peer publishes, with h_{d-s}'s past the first stride
(``tier_summaries.deepest_published``: a 32-bit collision then moves an estimate by one stride at most); 0 when
none. It is at most the truth minus 0..stride-1 blocks while the summary is fresh (see ``summary.py`` for when it
can be over).

Invariants: a peer that is not usable (dead, left, forgotten) gets estimate 0 and is absent from ``estimate_all``
-- its summary is kept (it may come back) but never consulted; a peer whose summary uses another block size than
this view's gets 0 (its hashes name other prefixes); ``inverted[h]`` has the bit of peer p iff p publishes h.
Not thread-safe: one event loop updates and queries it.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from p2pnode.cache.segment_summary import SEGMENT_PREFIX, key_segment
from p2pnode.cache.summary import SUMMARY_FAMILIES, SUMMARY_META_KEY, SummaryMeta, decode_meta
from p2pnode.cache.summary_log import BATCH_PREFIX, DEAD_PREFIX, SUMMARY_KEY_MASK, SummaryReader
from p2pnode.cache.tiers import Medium
from p2pnode.gossip.clock import Clock
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership, MemberState, Transition
from p2pnode.gossip.state import ClusterState, StateListener
from p2pnode.load import LOAD_KEY, NodeLoad, decode_load
from p2pnode.lora import ADAPTERS_KEY, NO_ADAPTERS, AdapterSet, decode_adapters
from p2pnode.node_info import INFO_KEY, NodeInfo, decode_info
from p2pnode.routing.estimates import LAZY_ESTIMATES_ABOVE, LevelEstimates, levels_dict
from p2pnode.routing.mask_table import MaskTable
from p2pnode.routing.tier_summaries import TierSummaries, deepest_published, ids_at_slots

__all__ = ["ClusterView", "PeerStatus", "PeerView"]

#: Peer bitmasks whose node ids ``estimate_matches`` remembers (~100 B each plus the ids' tuple).
MAX_CACHED_MASKS = 4096
#: Changes ``changes_since`` can name (~80 B each): a few gossip rounds of every peer's load at hundreds of peers.
MAX_CHANGE_LOG = 4096


def _clear_bit(inverted: dict[int, int], key: int, bit: int) -> None:
    """Take ``bit`` (one peer) out of ``inverted[key]``, dropping the key when no peer is left: the inverted maps
    hold only keys some peer has."""
    bits = inverted.get(key, 0) & ~bit
    if bits:
        inverted[key] = bits
    else:
        inverted.pop(key, None)


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """A snapshot of one peer (or this node) as the router sees it (``p2pnode status``)."""

    node_id: str
    address: str
    state: MemberState
    generation: int
    heartbeat: int
    #: Seconds since this node last knew its copy of the peer's state to be as new as the peer's own.
    info_age_s: float
    #: phi of the failure detector (0 for this node; None when not tracked, e.g. left).
    phi: float | None
    load: NodeLoad | None
    #: Its versions and served names (``node_info.py``; None until heard).
    info: NodeInfo | None
    #: Block hashes the peer publishes in its cache summary, and the depth stride they were sampled with.
    summary_hashes: int
    summary_stride: int | None
    is_self: bool
    #: The LoRA adapters it serves (``lora.py``).
    adapters: AdapterSet = NO_ADAPTERS
    #: Segment keys its gossip says its store holds (approximate reuse).
    summary_segments: int = 0


class Agent(Protocol):
    """The gossip agent a view attaches to (``GossipAgent``)."""

    state: ClusterState
    membership: Membership
    clock: Clock

    def subscribe(self, listener: StateListener) -> None: ...

    def watch_liveness(self, callback: Callable[[Transition], None]) -> None: ...


class PeerView:
    """One peer (or this node) as the router sees it now; a live handle (values change as gossip arrives)."""

    __slots__ = (
        "_view", "adapters", "address", "bit", "hashes", "info", "load", "load_at", "meta", "node_id", "segments",
        "slot", "summary",
    )

    def __init__(self, view: ClusterView, node_id: str, slot: int) -> None:
        self._view = view
        self.node_id = node_id
        self.slot = slot
        self.bit = 1 << slot
        self.address = ""
        self.load: NodeLoad | None = None
        self.info: NodeInfo | None = None
        #: This node's clock when the current load value arrived: requests sent to the peer after it cannot be in
        #: that load yet (the router counts them itself). Not the peer's freshness, which heartbeats move on.
        self.load_at = float("-inf")
        self.meta: SummaryMeta | None = None
        #: Its published summary, read from the gossiped log (``cache/summary_log.py``); ``hashes`` is its live set.
        self.summary = SummaryReader()
        self.hashes: dict[int, int] = self.summary.hashes
        self.adapters: AdapterSet = NO_ADAPTERS
        #: The segment keys it gossips (``cache/segment_summary.py``).
        self.segments: set[int] = set()

    @property
    def is_self(self) -> bool:
        return self.node_id == self._view.self_id

    @property
    def state(self) -> MemberState:
        return self._view._membership.state(self.node_id) or MemberState.DEAD

    @property
    def usable(self) -> bool:
        """Alive or suspect: the router may send requests there and use its estimates."""
        return self.state.usable

    @property
    def generation(self) -> int:
        node = self._view._state.node(self.node_id)
        return node.generation if node is not None else 0

    @property
    def heartbeat(self) -> int:
        node = self._view._state.node(self.node_id)
        return node.heartbeat if node is not None else 0

    @property
    def info_age_s(self) -> float:
        """Seconds since this node last knew its copy of the peer's state to be current (0 for itself)."""
        if self.is_self:
            return 0.0
        node = self._view._state.node(self.node_id)
        return max(0.0, self._view._clock.now() - node.fresh_at) if node is not None else float("inf")

    @property
    def load_age_s(self) -> float:
        """Seconds since the current load value arrived (inf before any)."""
        return max(0.0, self._view._clock.now() - self.load_at)

    @property
    def stride(self) -> int | None:
        meta = self.meta
        if meta is None or (self._view.block_size is not None and meta.block_size != self._view.block_size):
            return None
        return meta.stride

    @property
    def cached_blocks(self) -> int:
        """Blocks its cache holds, as far as its summary shows: every published depth stands for ``stride``."""
        return len(self.hashes) * (self.stride or 1)

    @property
    def kv_layout(self) -> str:
        """Its KV layout fingerprint as its summary says ("" when it moves no KV, or its blocks are not ours)."""
        meta = self.meta
        return meta.kv_layout if meta is not None and self.stride is not None else ""

    def estimate_match_blocks(self, block_hashes: Sequence[int]) -> int:
        """Estimated longest cached prefix of ``block_hashes`` on this peer, in blocks (0 when not usable)."""
        stride = self.stride
        if stride is None or not self.hashes or not self.usable:
            return 0
        keys = self.hashes
        depth = len(block_hashes) - len(block_hashes) % stride
        while depth >= stride:  # as deepest_published: the key of the depth, and of the one before it
            if block_hashes[depth - 1] & SUMMARY_KEY_MASK in keys and (
                depth == stride or block_hashes[depth - stride - 1] & SUMMARY_KEY_MASK in keys
            ):
                return depth
            depth -= stride
        return 0

    def snapshot(self) -> PeerStatus:
        view = self._view
        return PeerStatus(
            node_id=self.node_id,
            address=self.address,
            state=self.state,
            generation=self.generation,
            heartbeat=self.heartbeat,
            info_age_s=self.info_age_s,
            phi=view._membership.phi(self.node_id, view._clock.now()),
            load=self.load,
            info=self.info,
            summary_hashes=len(self.hashes),
            summary_stride=self.meta.stride if self.meta is not None else None,
            is_self=self.is_self,
            adapters=self.adapters,
            summary_segments=len(self.segments),
        )


class ClusterView:
    """Every known peer's routing-relevant information (see the module docstring)."""

    @classmethod
    def attach(cls, agent: Agent, block_size: int | None = None) -> ClusterView:
        """A view of ``agent``'s mesh, kept current by it from now on (its state replayed first)."""
        view = cls(agent.state, agent.membership, agent.clock, block_size)
        agent.subscribe(view)
        agent.watch_liveness(view.on_transition)
        return view

    def __init__(
        self, state: ClusterState, membership: Membership, clock: Clock, block_size: int | None = None
    ) -> None:
        self.self_id = state.self_id
        self._state = state
        self._membership = membership
        self._clock = clock
        #: Block size of this node's hashes; peers whose summary says otherwise are never matched. None: any.
        self.block_size = block_size
        self._peers: dict[str, PeerView] = {}
        self._by_slot: list[PeerView | None] = []
        self._slot_ids: list[str | None] = []  # each slot's node id (None: free): what a bitmask decodes to
        self._free_slots: list[int] = []
        # summary key -> bitmask of the peers publishing it: every decision's probes (``mask_table.py``)
        self._inverted = MaskTable()
        # segment key -> bitmask of peers publishing it (``segment_holders``)
        self._segment_inverted: dict[int, int] = {}
        # (version, bitmask of usable peers) for ``segment_holders``; recomputed when the version moves
        self._usable: tuple[int, int] = (-1, 0)
        #: Every tier's summaries below peers' engines (``tier_summaries.py``), by medium.
        self._tiers = {
            medium: TierSummaries(family, block_size)
            for medium, family in SUMMARY_FAMILIES.items()
            if medium is not Medium.GPU
        }
        #: Whether any peer publishes a summary of a tier (``estimate_tier_matches`` finds nothing otherwise: a router
        #: skips asking, on every decision).
        self.tiers_published = False
        # (version, bitmask of every usable peer) for ``estimate_tier_matches``
        self._usable_peers: tuple[int, int] = (-1, 0)
        # stride -> bitmask of usable peers with a summary of that stride; rebuilt lazily after a change.
        self._groups: list[tuple[int, int]] | None = None
        # peer bitmask -> node ids (``_ids_of``); cleared when slots change owners, bounded by MAX_CACHED_MASKS.
        self._mask_ids: dict[int, tuple[str, ...]] = {}
        #: Moves whenever a slot changes owner (``estimates.SlotOwners``: a LevelEstimates reads depths by slot).
        self.slot_epoch = 0
        # a zero depth per slot, copied for each request's LevelEstimates (``estimate_levels``)
        self._zero_depths: array[int] = array("I")
        #: Bumped whenever a peer is added or removed or its liveness, load, address or summary metadata changes
        #: (not on every summary hash): readers that cache per-peer facts rebuild them when it moves.
        self.version = 0
        # (version, node id) of the latest changes, for ``changes_since``.
        self._change_log: deque[tuple[int, str]] = deque(maxlen=MAX_CHANGE_LOG)

    # ------------------------------------------------------------------------------------------------- queries

    def peer(self, node_id: str) -> PeerView | None:
        return self._peers.get(node_id)

    def peers(self) -> list[PeerView]:
        """Every known peer, this node included, dead ones included (check ``usable``)."""
        return list(self._peers.values())

    def usable_peers(self) -> list[PeerView]:
        return [p for p in self._peers.values() if p.usable]

    def members(self) -> list[PeerStatus]:
        """Every known peer, this node included, sorted by node id."""
        return sorted((p.snapshot() for p in self._peers.values()), key=lambda m: m.node_id)

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._peers

    def adapters(self, node_id: str) -> AdapterSet | None:
        """The LoRA adapters ``node_id`` serves, as it published them (None when unknown)."""
        peer = self._peers.get(node_id)
        return None if peer is None else peer.adapters

    def estimate_match_blocks(self, node_id: str, block_hashes: Sequence[int]) -> int:
        """Estimated cached prefix of ``block_hashes`` on ``node_id`` (0 when unknown or not usable)."""
        peer = self._peers.get(node_id)
        return 0 if peer is None else peer.estimate_match_blocks(block_hashes)

    def estimate_all(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """``{node id: estimated cached prefix in blocks}`` for every usable peer (this node included).

        Equal to calling ``estimate_match_blocks`` on each usable peer, at the cost of one table probe per sampled
        depth of the request instead of one per peer and depth.
        """
        result = dict.fromkeys((p.node_id for p in self._peers.values() if p.usable), 0)
        result.update(self.estimate_matches(block_hashes))
        return result

    def estimate_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """``estimate_all`` without the zeros: only the usable peers whose estimate is not 0.

        The router's hot path: its cost is ~2n/stride table probes plus one entry per peer that matches, never a
        pass over every peer.
        """
        groups = self._groups if self._groups is not None else self._rebuild_groups()
        return deepest_published(block_hashes, groups, self._inverted, self._ids_of_cached, slot_ids=self._slot_ids)

    def estimate_levels(
        self, block_hashes: Sequence[int]
    ) -> tuple[dict[str, int] | LevelEstimates, list[tuple[int, tuple[str, ...]]]]:
        """``estimate_matches``, and the same estimates grouped by depth, deepest first (``(depth, node ids)``, one
        per depth): what the router reads the deepest holders and the common prefix from without sorting every
        peer's estimate. Where more than ``LAZY_ESTIMATES_ABOVE`` peers hold some (all at one stride, the default)
        the estimates are a ``LevelEstimates``: the same mapping, read by slot from an array the C fills from the
        levels' bitmasks, its dict built only when every item is read."""
        groups = self._groups if self._groups is not None else self._rebuild_groups()
        levels: list[tuple[int, tuple[str, ...]]] = []
        # one stride (the default: every peer samples alike): no dict, an array of depths by slot
        # (routing/estimates.py); several: their levels are merged below into new tuples, so every estimate goes into
        # the dict
        if len(groups) == 1 and len(self._peers) > LAZY_ESTIMATES_ABOVE:
            if len(self._zero_depths) != len(self._by_slot):
                self._zero_depths = array("I", [0]) * len(self._by_slot)
            depths = self._zero_depths[:]
            deepest_published(
                block_hashes, groups, self._inverted, self._ids_of, levels, self._mask_ids, depths, self._slot_ids
            )
            count = sum([len(ids) for _, ids in levels])
            if count > LAZY_ESTIMATES_ABOVE:
                return LevelEstimates(levels, depths, self, count), levels
            return levels_dict(levels), levels  # a few holders: a dict of them reads faster than the array does
        estimates = deepest_published(
            block_hashes, groups, self._inverted, self._ids_of, levels, self._mask_ids, slot_ids=self._slot_ids
        )
        if len(groups) > 1:  # each stride's levels are deepest first; merge them
            merged: dict[int, tuple[str, ...]] = {}
            for depth, ids in levels:
                merged[depth] = merged.get(depth, ()) + ids
            levels = sorted(merged.items(), reverse=True)
        return estimates, levels

    def slot_of(self, node_id: str) -> int | None:
        """The slot of a known peer (bit i of a peer bitmask: slot i)."""
        peer = self._peers.get(node_id)
        return None if peer is None else peer.slot

    def estimate_tier_matches(self, block_hashes: Sequence[int], medium: Medium) -> dict[str, int]:
        """``{node id: the deepest depth of block_hashes its summary of medium's tier publishes}`` for the usable peers
        whose estimate is not 0 (the engine's own medium is ``estimate_matches``)."""
        tier = self._tiers.get(medium)
        if tier is None:
            return {}
        version, usable = self._usable_peers
        if version != self.version:
            usable = 0
            for peer in self._peers.values():
                if peer.usable:
                    usable |= peer.bit
            self._usable_peers = (self.version, usable)
        return tier.estimate(block_hashes, usable, self._ids_of_cached)

    def tier_hashes(self, node_id: str, medium: Medium) -> int:
        """How many hashes ``node_id`` publishes in its summary of medium's tier (0: none, or no such tier)."""
        peer, tier = self._peers.get(node_id), self._tiers.get(medium)
        return 0 if peer is None or tier is None else tier.hashes(peer.bit)

    def _ids_of_cached(self, mask: int) -> tuple[str, ...]:
        ids = self._mask_ids.get(mask)
        return ids if ids is not None else self._ids_of(mask)

    def segment_holders(self, keys: Sequence[int]) -> dict[str, list[int]]:
        """``{node id: indices into keys of the segments it gossips holding}`` for the usable peers that gossip at
        least one of ``keys`` (this node included when its own keys are known). One dict probe per key."""
        inverted = self._segment_inverted
        if not inverted:
            return {}
        version, usable = self._usable
        if version != self.version:
            usable = 0
            for peer in self._peers.values():
                if peer.segments and peer.usable:
                    usable |= peer.bit
            self._usable = (self.version, usable)
        out: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            bits = inverted.get(key, 0) & usable
            if bits:
                ids = self._mask_ids.get(bits)
                for node_id in ids if ids is not None else self._ids_of(bits):
                    out.setdefault(node_id, []).append(i)
        return out

    def _ids_of(self, mask: int) -> tuple[str, ...]:
        """The node ids of a peer bitmask (``ids_at_slots``), remembered: the same masks recur (a prefix held by the
        same peers, or by all of them), and a mask of many peers costs a tuple of them to decode."""
        result = ids_at_slots(mask, self._slot_ids)
        if len(self._mask_ids) >= MAX_CACHED_MASKS:
            self._mask_ids.clear()
        self._mask_ids[mask] = result
        return result

    def _rebuild_groups(self) -> list[tuple[int, int]]:
        masks: dict[int, int] = {}
        for peer in self._peers.values():
            stride = peer.stride
            if stride is not None and peer.hashes and peer.usable:
                masks[stride] = masks.get(stride, 0) | peer.bit
        self._groups = sorted(masks.items())
        return self._groups

    # ------------------------------------------------------------------------------------------ state listener

    def on_node_added(self, node_id: str, generation: int) -> None:
        if node_id in self._peers:
            self.on_node_removed(node_id)
        slot = self._free_slots.pop() if self._free_slots else len(self._by_slot)
        peer = PeerView(self, node_id, slot)
        if slot == len(self._by_slot):
            self._by_slot.append(peer)
            self._slot_ids.append(node_id)
        else:
            self._by_slot[slot] = peer
            self._slot_ids[slot] = node_id
        self._peers[node_id] = peer
        self._groups = None
        self._mask_ids.clear()
        self.slot_epoch += 1
        self._changed(node_id)

    def on_node_removed(self, node_id: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is None:
            return
        self._inverted.clear_bits(peer.hashes, peer.slot)
        peer.summary = SummaryReader()
        peer.hashes = peer.summary.hashes
        for key in peer.segments:
            _clear_bit(self._segment_inverted, key, peer.bit)
        peer.segments = set()
        for tier in self._tiers.values():
            tier.drop(peer.bit)
        self.tiers_published = any(t.published for t in self._tiers.values())
        self._by_slot[peer.slot] = None
        self._slot_ids[peer.slot] = None
        self._free_slots.append(peer.slot)
        self._groups = None
        self._mask_ids.clear()
        self.slot_epoch += 1
        self._changed(node_id)

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        peer = self._peers.get(node_id)
        if peer is None:
            return
        if key.startswith((BATCH_PREFIX, DEAD_PREFIX)):
            had = bool(peer.hashes)
            change = peer.summary.apply(key, value)
            if change is None:
                return
            added, removed = change
            if removed:
                self._inverted.clear_bits(removed, peer.slot)
            if added:
                self._inverted.set_bits(added, peer.slot)
            if had != bool(peer.hashes):
                self._groups = None
        elif key.startswith(SEGMENT_PREFIX):
            self._segment_changed(peer, key, value)
        elif key == LOAD_KEY:
            peer.load = decode_load(value) if value is not None else None
            peer.load_at = self._clock.now()
            self._changed(node_id)
        elif key == SUMMARY_META_KEY:
            peer.meta = decode_meta(value) if value is not None else None
            self._groups = None
            self._changed(node_id)
        elif key == ADAPTERS_KEY:
            peer.adapters = (decode_adapters(value) if value is not None else None) or NO_ADAPTERS
            self._changed(node_id)
        elif key == INFO_KEY:
            peer.info = decode_info(value) if value is not None else None
        elif key == ADDRESS_KEY:
            peer.address = value.decode(errors="replace") if value is not None else ""
            self._changed(node_id)
        elif tier := next((t for t in self._tiers.values() if t.owns(key)), None):
            tier.apply(peer.bit, key, value)
            self.tiers_published = any(t.published for t in self._tiers.values())

    def _segment_changed(self, peer: PeerView, key: str, value: bytes | None) -> None:
        segment = key_segment(key)
        if segment is None:
            return
        inverted = self._segment_inverted
        had = bool(peer.segments)
        if value is None:
            if segment in peer.segments:
                peer.segments.discard(segment)
                _clear_bit(inverted, segment, peer.bit)
        elif segment not in peer.segments:
            peer.segments.add(segment)
            inverted[segment] = inverted.get(segment, 0) | peer.bit
        if had != bool(peer.segments):
            self._usable = (-1, 0)  # who gossips any segment changed

    def on_liveness(self, node_id: str, state: MemberState | None) -> None:
        """A peer's liveness changed (the estimate groups depend on it)."""
        self._groups = None
        self._changed(node_id)

    def on_transition(self, t: Transition) -> None:
        """``on_liveness`` for a membership transition (``GossipAgent.watch_liveness``)."""
        self.on_liveness(t.node_id, t.new)

    def _changed(self, node_id: str) -> None:
        self.version += 1
        self._change_log.append((self.version, node_id))

    def changes_since(self, version: int) -> set[str] | None:
        """The peers changed after ``version`` (``PeerDirectory``); None once the bounded log no longer reaches it."""
        log = self._change_log
        if version >= self.version:
            return set()
        if not log or log[0][0] > version + 1:
            return None
        changed: set[str] = set()
        for v, node_id in reversed(log):
            if v <= version:
                break
            changed.add(node_id)
        return changed
