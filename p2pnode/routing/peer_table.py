"""Every peer as of its last report, shared by the requests an ingress routes until something changes.

A request arrives far more often than any one peer reports (thousands per second against one per gossip round per
peer), so the ingress keeps one ``PeerSnapshot`` per peer (no estimate, nothing in flight) and derives the few
per-request variants from it (``variant``). When the directory's ``version`` moves, only the peers it names as
changed (``PeerDirectory.changes_since``) are re-read, so a mesh of N peers each reporting once per round costs
O(N) per round, not O(N log N) per report; a directory that cannot tell, or ``refresh_s`` without a full read (the
info ages and gossiped cache sizes drift meanwhile, and no policy decides on those), rebuilds everything.

Invariants: ``alive_by_load`` holds the alive bases ordered by (load, node id), ``alive_keys`` those pairs;
``variants`` only holds snapshots derived from the current bases.
The derived orders are recomputed lazily, at most once per change.

Routers that read one directory (the simulator's gossip model: every ingress hears a round at the same moment) may
share its bases (``SharedBases``): a round then costs one base snapshot and one re-sort for all of them, not one per
router, and each table copies the shared order, leaving its own node out. Only bases that hold nothing of one
router's can be shared: no served rate (its policy reads none, ``Reads.served_rates``) and no link figure (no pulls).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Collection, Container, Iterable, Iterator
from operator import attrgetter
from typing import Generic, TypeVar

from p2pnode.frozen import replace
from p2pnode.routing.directory import PeerDirectory, PeerInfo
from p2pnode.routing.policies.types import PeerSnapshot
from p2pnode.routing.served_rate import ServedRates

__all__ = ["PeerTable", "SharedBases", "least_in_order"]

_node_id = attrgetter("node_id")  # a snapshot's id, read at C speed over a load order

#: Most distinct (estimate, sends, tokens, segment tokens, tier depths) snapshots kept per peer between two of its
#: reports (a bound, rarely reached).
MAX_VARIANTS_PER_PEER = 256

#: Most levels whose sorted alive ids ``PeerTable.sorted_alive`` keeps (cleared when full, and when a peer's
#: liveness changes): ~8 KB per 1,000 ids, so ~1 MB at most.
MAX_SORTED_LEVELS = 128


def _load_order(b: PeerSnapshot) -> tuple[int, str]:
    return (b.requests, b.node_id)


def _load_ordered(bases: Iterable[PeerSnapshot]) -> tuple[list[PeerSnapshot], list[tuple[int, str]]]:
    """The alive ones of ``bases`` by (load, id), and those keys: a load order built whole."""
    alive = sorted((b for b in bases if b.alive), key=_load_order)
    return alive, [_load_order(b) for b in alive]


def _reorder(
    alive: list[PeerSnapshot], keys: list[tuple[int, str]], old: PeerSnapshot | None, new: PeerSnapshot | None
) -> None:
    """Move one peer in a load order: out at its ``old`` base, in at its ``new`` one (either None or not alive:
    nothing to take out, or to put in). (load, id) is unique, so bisection finds its place."""
    if old is not None and old.alive:
        i = bisect_left(keys, _load_order(old))
        del keys[i]
        del alive[i]
    if new is not None and new.alive:
        key = _load_order(new)
        i = bisect_left(keys, key)
        keys.insert(i, key)
        alive.insert(i, new)


def least_in_order(keys: list[tuple[int, str]], count: int, tiebreak: int, exclude: Container[str]) -> list[int]:
    """The positions in ``keys`` (``(load, node id)``, sorted) of up to ``count`` peers not in ``exclude``, least
    loaded first; each run of equal loads is entered at an offset set by ``tiebreak``, so ties spread over the run as
    a policy's own rotation would. A run's end is found by bisection: a caller that stops after a few peers pays for a
    few steps, however long the run (``PeerTable.least_loaded``, ``effective_load.EffectiveLoadOrder.least``)."""
    n = len(keys)
    out: list[int] = []
    start = 0
    while start < n and len(out) < count:
        end = bisect_left(keys, (keys[start][0] + 1, ""), start)
        size = end - start
        offset = tiebreak % size
        for i in range(size):
            at = start + (offset + i) % size
            if keys[at][1] not in exclude:
                out.append(at)
                if len(out) == count:
                    return out
        start = end
    return out


def _changed_peers(
    directory: PeerDirectory | None, seen: int, built_at: float, known: int, now: float, refresh_s: float
) -> Collection[str] | None:
    """The peers ``directory`` changed since version ``seen``, or None when a full re-read is due: nothing read yet,
    the directory cannot tell, ``refresh_s`` passed since ``built_at``, or re-reading each of them would cost more
    than a full pass over the ``known`` peers (~3x a peer of a full pass)."""
    if directory is None or now - built_at >= refresh_s or seen < 0:
        return None
    changed = directory.changes_since(seen)
    if changed is not None and 2 * len(changed) > known + 2:
        return None
    return changed


def _base_of(
    peer: PeerInfo, served_rates: ServedRates | None, link_of: Callable[[str], float] | None
) -> PeerSnapshot:
    """The peer as the directory reports it: no estimate, nothing in flight; its served rate (None without a sketch)
    and link figure (0 without ``link_of``) as this reader knows them."""
    node_id = peer.node_id
    load = peer.load
    if load is None:
        return PeerSnapshot(node_id=node_id, alive=False, info_age_s=peer.info_age_s, cached_blocks=peer.cached_blocks)
    # A peer is a candidate once the directory knows where it is and how loaded it is.
    layout = getattr(peer, "kv_layout", "")  # a directory written before KV moved has none: no pulls from it
    return PeerSnapshot(
        node_id=node_id,
        alive=peer.usable and bool(peer.address),
        load=load,
        served_rate=served_rates.observe(node_id, load) if served_rates is not None else None,
        info_age_s=peer.info_age_s,
        cached_blocks=peer.cached_blocks,
        kv_layout=layout,
        link_bytes_per_s=link_of(node_id) if link_of is not None and layout else 0.0,
    )


V = TypeVar("V")


class LevelMemo(Generic[V]):
    """A value made once per level's ids (a tuple the directory hands out again: it remembers the ids of each peer
    bitmask), so a read of a mesh-wide level costs a lookup, not a pass over its peers: its sorted alive peers here.
    Keyed by the tuple's identity, holding the tuple (so the key is never reused while remembered). Bounded by
    ``limit``: cleared when full."""

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int) -> None:
        self._held: dict[int, tuple[tuple[str, ...], V]] = {}
        self.limit = limit

    def get(self, ids: tuple[str, ...], make: Callable[[tuple[str, ...]], V]) -> V:
        """``make(ids)``, made once while remembered."""
        held = self._held.get(id(ids))
        if held is not None and held[0] is ids:
            return held[1]
        if len(self._held) >= self.limit:
            self._held.clear()
        made = make(ids)
        self._held[id(ids)] = (ids, made)
        return made

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


class SharedBases:
    """Every peer's base snapshot as of one version of one directory, for the tables of every router that reads it.

    Why: when N routers read one directory (the simulator's gossip model), each round the directory hears changes one
    peer, and N tables of their own would each re-read it and re-sort their load order: N base snapshots per round.
    Bases without a served rate or link figure are the same for every reader, so they are read once per directory
    version here and each table copies them (``PeerTable(shared=...)``), leaving out its own node.

    Invariant (what makes a stale base impossible): every entry reflects the directory at ``version``, which
    ``catch_up`` brings to the version its caller just read before anything is copied (the changed peers only,
    ``changes_since``, as a table does; everything when the directory cannot tell, or after ``refresh_s``), and
    ``generation`` moves with every change of any entry or of the order: a table copies whenever the generation it
    copied is not the current one. ``epoch`` moves with every full re-read (every base is then a new object).
    A base's ``info_age_s`` is as of the version's first read (no policy decides on it).
    """

    __slots__ = ("alive_by_load", "alive_keys", "built_at", "by_id", "epoch", "generation", "membership", "version")

    def __init__(self) -> None:
        self.version = -1
        self.built_at = float("-inf")
        self.generation = 0
        self.epoch = 0
        self.membership = 0  # moves whenever the set of alive peers may have changed
        self.by_id: dict[str, PeerSnapshot] = {}  # every known peer, the readers' own nodes included
        self.alive_by_load: list[PeerSnapshot] = []
        self.alive_keys: list[tuple[int, str]] = []

    def catch_up(self, directory: PeerDirectory | None, version: int, now: float, refresh_s: float) -> None:
        """Reflect ``directory`` at ``version`` (the one its reader just read: a directory may move it at every
        read)."""
        if version == self.version and now - self.built_at < refresh_s:
            return
        changed = _changed_peers(directory, self.version, self.built_at, len(self.by_id), now, refresh_s)
        if changed is None:
            peers = directory.peers() if directory is not None else ()
            self.by_id = {peer.node_id: _base_of(peer, None, None) for peer in peers}
            self.alive_by_load, self.alive_keys = _load_ordered(self.by_id.values())
            self.built_at = now
            self.epoch += 1
            self.membership += 1
        else:
            by_id, alive, keys = self.by_id, self.alive_by_load, self.alive_keys
            for node_id in changed:
                peer = directory.peer(node_id)  # type: ignore[union-attr]
                old = by_id.get(node_id)
                new = _base_of(peer, None, None) if peer is not None else None
                _reorder(alive, keys, old, new)
                if new is None:
                    by_id.pop(node_id, None)
                else:
                    by_id[node_id] = new
                if (old is not None and old.alive) != (new is not None and new.alive):
                    self.membership += 1
        self.version = version
        self.generation += 1


class PeerTable:
    """The shared per-peer snapshots of one ingress (see the module docstring)."""

    __slots__ = (
        "_addresses_lent",
        "_alive_ids",
        "_ids_by_id",
        "_mesh_ids",
        "_shared_epoch",
        "_shared_generation",
        "_shared_membership",
        "_sorted_levels",
        "addresses",
        "alive_by_load",
        "alive_keys",
        "built_at",
        "by_id",
        "link_of",
        "rebuilt",
        "reported_at",
        "rereads",
        "self_id",
        "served_rates",
        "shared",
        "variants",
        "version",
    )

    def __init__(
        self,
        self_id: str,
        self_address: str,
        link_of: Callable[[str], float] | None = None,
        *,
        served_rates: bool = True,
        shared: SharedBases | None = None,
    ) -> None:
        """``link_of(node_id)``: the bytes per second a KV pull from that peer moves (``routing/links.py``; None:
        no pulls). ``served_rates``: keep every peer's served rate (``served_rate.py``; False: every base's is None).
        ``shared``: the bases of the routers reading the same directory (``SharedBases``; only without a link figure
        or served rates, which are this reader's own)."""
        if shared is not None and (link_of is not None or served_rates):
            raise ValueError("shared bases carry no link figure and no served rate")
        self.self_id = self_id
        self.link_of = link_of
        self.shared = shared
        self._shared_generation = -1  # the shared bases' generation, epoch and membership this table copied
        self._shared_epoch = -1
        self._shared_membership = -1
        #: Every peer's recent served rate, this node's included (``served_rate.py``), fed by the loads read here;
        #: None when the policy reads none.
        self.served_rates = ServedRates() if served_rates else None
        self.built_at = float("-inf")
        self.version = -1  # the directory's version it reflects
        self.by_id: dict[str, PeerSnapshot] = {}  # every known peer but this node, no estimate, nothing in flight
        self.alive_by_load: list[PeerSnapshot] = []
        self.alive_keys: list[tuple[int, str]] = []  # (load, node id) of each, for bisection at C speed
        self.addresses: dict[str, str] = {self_id: self_address}
        self._addresses_lent = False  # ``addresses`` is a route's (``lend_addresses``): copied before a change
        self.reported_at: dict[str, float] = {}  # node id -> when its current load arrived (the ingress's clock)
        self.variants: dict[str, dict[tuple[int, int, int, int, int, int], PeerSnapshot]] = {}
        self._alive_ids: tuple[str, ...] | None = None
        self._ids_by_id: tuple[str, ...] | None = None
        self._mesh_ids: tuple[str, ...] | None = None
        self._sorted_levels: LevelMemo[list[str]] = LevelMemo(MAX_SORTED_LEVELS)
        #: The peers re-read since a reader last took them (``track_rereads``; None until one asks), and whether every
        #: peer was read anew meanwhile (a reader then reads the table whole and sets it back to False).
        self.rereads: set[str] | None = None
        self.rebuilt = True

    def track_rereads(self) -> set[str]:
        """The ids of the peers re-read since the caller last cleared this set (it starts empty, with ``rebuilt``
        True: read the table whole first). One reader: ``effective_load.EffectiveLoadOrder``."""
        if self.rereads is None:
            self.rereads = set()
            self.rebuilt = True
        return self.rereads

    # --- keeping up with the directory --------------------------------------------------------------------

    def refresh(self, directory: PeerDirectory | None, now: float, refresh_s: float) -> None:
        """Catch up with the directory: the changed peers only, or everything (module docstring)."""
        version = directory.version if directory is not None else -1
        if version == self.version and now - self.built_at < refresh_s:
            return
        changed = _changed_peers(directory, self.version, self.built_at, len(self.by_id), now, refresh_s)
        if self.shared is not None:
            self._follow(directory, version, changed, now, refresh_s)
        elif changed is None:
            self._rebuild(directory, now)
        else:
            for node_id in changed:
                self._update(node_id, directory.peer(node_id), now)  # type: ignore[union-attr]
        self.version = version

    def lend_addresses(self) -> dict[str, str]:
        """Every known node's address as of now, for a route to keep: the table copies them before it changes one,
        so a route's retries dial the addresses it was decided with (a peer forgotten since would be a KeyError)."""
        self._addresses_lent = True
        return self.addresses

    def _own_addresses(self) -> dict[str, str]:
        """``addresses``, to change: a copy of them once lent."""
        if self._addresses_lent:
            self.addresses = dict(self.addresses)
            self._addresses_lent = False
        return self.addresses

    def _read(self, peer: PeerInfo, now: float) -> None:
        """What this ingress keeps of a peer besides its base: its address, and when its current load arrived."""
        node_id = peer.node_id
        if self.addresses.get(node_id) != peer.address:
            self._own_addresses()[node_id] = peer.address
        # Sends since the peer's load arrived are not in it (the ledger counts them).
        self.reported_at[node_id] = now - peer.load_age_s

    def _base(self, peer: PeerInfo, now: float) -> PeerSnapshot:
        self._read(peer, now)
        return _base_of(peer, self.served_rates, self.link_of)

    def _rebuild(self, directory: PeerDirectory | None, now: float) -> None:
        self.by_id = {}
        self.addresses = {self.self_id: self.addresses[self.self_id]}
        self._addresses_lent = False
        self.reported_at = {}
        self.variants = {}
        for peer in directory.peers() if directory is not None else ():
            if peer.node_id != self.self_id:
                self.by_id[peer.node_id] = self._base(peer, now)
        if self.served_rates is not None:
            self.served_rates.retain({self.self_id, *self.by_id})
        self.alive_by_load, self.alive_keys = _load_ordered(self.by_id.values())
        self.built_at = now
        self.rebuilt = True
        self._dirty(membership=True)

    def _update(self, node_id: str, peer: PeerInfo | None, now: float) -> None:
        if node_id == self.self_id:
            return
        if self.rereads is not None:
            self.rereads.add(node_id)
        old = self.by_id.get(node_id)
        new = self._base(peer, now) if peer is not None else None
        self.variants.pop(node_id, None)
        _reorder(self.alive_by_load, self.alive_keys, old, new)
        if new is None:
            self.by_id.pop(node_id, None)
            if node_id in self.addresses:
                del self._own_addresses()[node_id]
            self.reported_at.pop(node_id, None)
            if self.served_rates is not None:
                self.served_rates.forget(node_id)
        else:
            self.by_id[node_id] = new
        self._dirty(membership=(old is not None and old.alive) != (new is not None and new.alive))

    def _follow(
        self, directory: PeerDirectory | None, version: int, changed: Collection[str] | None, now: float,
        refresh_s: float,
    ) -> None:
        """``refresh`` with shared bases, caught up with ``version`` first: the peers ``changed`` (None: every peer)
        read as ``_rebuild`` and ``_update`` read them -- their addresses and report times here, their bases the
        shared ones, in ``by_id``'s own order -- and the shared load order copied, this node left out."""
        shared = self.shared
        assert shared is not None
        shared.catch_up(directory, version, now, refresh_s)
        self_id = self.self_id
        bases = shared.by_id
        if shared.epoch != self._shared_epoch:  # every shared base is a new object: take them all
            self._shared_epoch = shared.epoch
            self.variants = {}
            self.rebuilt = True
            self.by_id = {node_id: bases[node_id] for node_id in self.by_id if node_id in bases}
        by_id = self.by_id
        if changed is None:
            by_id = self.by_id = {}
            self.addresses = {self_id: self.addresses[self_id]}
            self._addresses_lent = False
            self.reported_at = {}
            self.variants = {}
            for peer in directory.peers() if directory is not None else ():
                node_id = peer.node_id
                if node_id != self_id:
                    self._read(peer, now)
                    by_id[node_id] = bases.get(node_id) or _base_of(peer, None, None)
            self.built_at = now
            self.rebuilt = True
        else:
            rereads = self.rereads
            for node_id in changed:
                if node_id == self_id:
                    continue
                if rereads is not None:
                    rereads.add(node_id)
                self.variants.pop(node_id, None)
                peer = directory.peer(node_id)  # type: ignore[union-attr]
                if peer is not None:
                    self._read(peer, now)
                    by_id[node_id] = bases.get(node_id) or _base_of(peer, None, None)
                else:
                    by_id.pop(node_id, None)
                    if node_id in self.addresses:
                        del self._own_addresses()[node_id]
                    self.reported_at.pop(node_id, None)
        if shared.generation == self._shared_generation:
            return
        alive = shared.alive_by_load.copy()
        keys = shared.alive_keys.copy()
        _reorder(alive, keys, bases.get(self_id), None)  # this node is not its own peer
        self.alive_by_load, self.alive_keys = alive, keys
        self._dirty(membership=shared.membership != self._shared_membership)
        self._shared_membership = shared.membership
        self._shared_generation = shared.generation

    def _dirty(self, membership: bool) -> None:
        self._alive_ids = None
        if membership:
            self._ids_by_id = None
            self._mesh_ids = None
            self._sorted_levels.clear()

    # --- what requests read ---------------------------------------------------------------------------------

    @property
    def bases(self) -> Iterator[PeerSnapshot]:
        """Every known peer but this node."""
        return iter(self.by_id.values())

    @property
    def alive_ids(self) -> tuple[str, ...]:
        """The alive peers' ids, least loaded first."""
        if self._alive_ids is None:
            self._alive_ids = tuple(map(_node_id, self.alive_by_load))
        return self._alive_ids

    def alive_position(self, node_id: str) -> int:
        """The peer's position in ``alive_ids`` (-1: not an alive peer), by bisection of the load order: where a
        decision's retry order cuts it (``CandidateSet.complete``) without comparing every peer's id."""
        base = self.by_id.get(node_id)
        if base is None or not base.alive:
            return -1
        return bisect_left(self.alive_keys, _load_order(base))

    @property
    def ids_by_id(self) -> tuple[str, ...]:
        """The alive peers' ids sorted: the population ``sample_peers`` draws from."""
        if self._ids_by_id is None:
            self._ids_by_id = tuple(sorted(b.node_id for b in self.alive_by_load))
        return self._ids_by_id

    @property
    def mesh_ids(self) -> tuple[str, ...]:
        """Every alive node's id sorted, this one included: what every ingress hashes a request's home onto
        (``p2p.context_homes``)."""
        if self._mesh_ids is None:
            self._mesh_ids = tuple(sorted((*self.ids_by_id, self.self_id)))
        return self._mesh_ids

    def variant(
        self,
        base: PeerSnapshot,
        estimate: int,
        in_flight: int,
        in_flight_tokens: int,
        segment_tokens: int = 0,
        tiers: tuple[int, int] = (0, 0),
    ) -> PeerSnapshot:
        """``base`` with this estimate and this ingress's sends since its report (their count, and the prompt tokens
        they add to its backlog), a request's segment estimate (``est_segment_tokens``) and its tiers' cumulative
        depths (``est_host_blocks``, ``est_disk_blocks``). Snapshots are immutable, so they are reused."""
        per_peer = self.variants.get(base.node_id)
        if per_peer is None:
            per_peer = self.variants[base.node_id] = {}
        key = (estimate, in_flight, in_flight_tokens, segment_tokens, tiers)
        snap = per_peer.get(key)
        if snap is None:
            if len(per_peer) >= MAX_VARIANTS_PER_PEER:
                per_peer.clear()
            load = base.load
            if in_flight_tokens and load.prefill_backlog_tokens is not None:
                load = replace(load, prefill_backlog_tokens=load.prefill_backlog_tokens + in_flight_tokens)
            if in_flight_tokens and load.urgent_backlog_tokens is not None:  # this ingress does not tell sends apart
                load = replace(load, urgent_backlog_tokens=load.urgent_backlog_tokens + in_flight_tokens)
            snap = per_peer[key] = replace(
                base, est_match_blocks=estimate, load=load, in_flight=in_flight, est_segment_tokens=segment_tokens,
                est_host_blocks=tiers[0], est_disk_blocks=tiers[1],
            )
        return snap

    def sorted_alive(self, ids: tuple[str, ...]) -> list[str]:
        """The alive ones of ``ids`` (a level of a request's estimates: ``ClusterView.estimate_levels``), sorted;
        remembered per level (``LevelMemo``) until a peer's liveness changes (``types.draw_holders_by_depth``
        draws from it)."""
        return self._sorted_levels.get(ids, self._alive_sorted)

    def _alive_sorted(self, ids: tuple[str, ...]) -> list[str]:
        by_id = self.by_id
        return sorted(node_id for node_id in ids if (base := by_id.get(node_id)) is not None and base.alive)

    def is_alive(self, node_id: str) -> bool:
        base = self.by_id.get(node_id)
        return base is not None and base.alive

    def least_loaded(self, exclude: dict[str, PeerSnapshot], tiebreak: int, count: int) -> list[PeerSnapshot]:
        """Up to ``count`` alive peers not in ``exclude``, least loaded first; a run of equal loads is entered at
        an offset chosen by ``tiebreak``, so ties spread over the whole run as the policy's own rotation would."""
        alive = self.alive_by_load
        if count <= 0 or (len(exclude) >= len(alive) and sum(map(self.is_alive, exclude)) >= len(alive)):
            return []  # every alive peer excluded (``exclude`` may hold dead ones: a plan's destinations)
        return [alive[i] for i in least_in_order(self.alive_keys, count, tiebreak, exclude)]
