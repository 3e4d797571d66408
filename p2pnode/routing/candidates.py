"""Candidate assembly: from what an ingress knows (its own exact state, the peer table, every peer's estimate, the
in-flight ledger, the plan) to the ``PeerSnapshot`` list a policy decides on.

This is the one place that decides what a policy sees, for the node and the simulator alike.

Sparse assembly (the policies whose spec says ``sparse``, the default among them): a policy is handed only the peers the
request *touches* (an estimated match; sends in flight from here, for a policy that reads them elsewhere than at its
candidates: ``Reads.sends_elsewhere``, not ``p2p`` with a sample), this node, the peers drawn at random for the request
(``RouteRequest.sampled``), its homes (``RouteRequest.homes``, for the policies that read them), the key's plan
destinations and the ``LEAST_LOADED_CANDIDATES`` least-loaded others -- enough for their choice (see
``policies/__init__.py``); ``CandidateSet.complete`` then appends every other alive peer by load to the retry order. A
policy that chooses by load alone (``Reads.load_only``: ``flat``) is handed no touched peer but its sample and plan: the
least loaded come from an order that counts this ingress's sends (``effective_load.py``), so neither the sends in flight
nor a prompt cached mesh-wide make its decision O(peers). Full assembly hands every known peer (the hash-ring and
cost-model policies need them). Both hand a policy every peer with a match (``flat`` aside), so that what a policy does
with many holders (``p2p`` keeps the deepest few, at random among equals) is its own rule, the same in both -- with one
exception for speed: when more than ``DRAW_HOLDERS_ABOVE`` peers hold part of the prompt, the router draws ``p2p``'s
holders itself with the policy's own rule (``p2p.draw_holders``, one sort of the estimates) and hands only those, so a
prompt cached mesh-wide costs a snapshot for a few peers, not for every one. The decisions are the same
(tests/unit/test_policies.py).

KV tiers: a peer whose tiers hold the request's prefix past its engine's estimate (``tier_estimates``: its cumulative
host and disk depths) touches the request like a peer with an estimate, and its snapshot carries those depths
(``PeerSnapshot.est_host_blocks``, ``est_disk_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass

from p2pnode.frozen import fast_init
from p2pnode.routing.effective_load import EffectiveLoadOrder
from p2pnode.routing.ledger import InFlightLedger
from p2pnode.routing.peer_table import PeerTable
from p2pnode.routing.policies.spec import LEAST_LOADED_CANDIDATES
from p2pnode.routing.policies.types import Decision, PeerSnapshot

__all__ = ["DRAW_HOLDERS_ABOVE", "CandidateSet", "assemble"]

try:  # the retry order's completion in C (routing/native/p2p_rank.c); ``complete`` below defines it
    from p2pnode.routing._p2p import complete as _native_complete
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_complete = None

#: Peers with an estimate above which the router draws ``p2p``'s holders itself (module docstring): below it, handing
#: every holder costs less than the draw's sort.
DRAW_HOLDERS_ABOVE = 8


@fast_init
@dataclass(frozen=True, slots=True)
class CandidateSet:
    """What a policy is handed for one request, and what the ingress keeps of it."""

    snapshots: list[PeerSnapshot]  # this node first
    #: Every peer's estimate in blocks, candidate or not (absent: 0); this node's too.
    estimates: MutableMapping[str, int]  # a dict, or a LevelEstimates (routing/estimates.py)
    sparse: bool
    alive_ids: tuple[str, ...]  # every alive peer, least loaded first
    #: An alive peer's position in ``alive_ids``, -1 for any other (``PeerTable.alive_position``; None: not known).
    position_of: Callable[[str], int] | None = None

    def complete(self, decision: Decision, self_id: str) -> Decision:
        """A sparse decision's retry order goes on with every other alive peer, by reported load."""
        if not self.sparse:
            return decision
        ranked = decision.ranked
        if _native_complete is not None and type(ranked) is tuple and type(self.alive_ids) is tuple:
            out = _native_complete(ranked, self.alive_ids, self_id)  # None: off its path (p2p_rank.c): the Python
            if out is ranked:
                return decision
            if out is not None:
                return Decision(out, decision.policy, decision.est_match_blocks, decision.reason, decision.pull)
        position_of = self.position_of
        if len(ranked) <= 16 and position_of is not None:
            alive = self.alive_ids
            cuts: list[int] = []
            for node_id in ranked:
                if node_id != self_id:
                    cut = position_of(node_id)
                    if not 0 <= cut < len(alive) or alive[cut] != node_id:
                        break  # not an alive peer: the scan below raises as it always did
                    cuts.append(cut)
            else:
                cuts.sort()
                if len(set(cuts)) == len(cuts):  # (a peer ranked twice: the scan below raises too)
                    if len(cuts) == len(alive):
                        return decision
                    out, start = ranked, 0
                    for cut in cuts:  # the alive peers between two ranked ones, as slices: no pass per peer
                        out += alive[start:cut]
                        start = cut + 1
                    out += alive[start:]
                    return Decision(out, decision.policy, decision.est_match_blocks, decision.reason, decision.pull)
        if len(ranked) <= 16:
            rest = list(self.alive_ids)
            for node_id in ranked:
                if node_id != self_id:
                    rest.remove(node_id)  # a C-speed scan per candidate: cheaper than a Python pass per peer
        else:
            seen = set(ranked)
            rest = [node_id for node_id in self.alive_ids if node_id not in seen]
        if not rest:
            return decision
        return Decision(
            ranked + tuple(rest), decision.policy, decision.est_match_blocks, decision.reason, decision.pull
        )


def assemble(
    me: PeerSnapshot,
    table: PeerTable,
    estimates: dict[str, int],
    ledger: InFlightLedger,
    *,
    tiebreak: int,
    sampled: Sequence[str],
    planned: Sequence[str],
    sparse: bool,
    least_loaded: int = LEAST_LOADED_CANDIDATES,
    sends_elsewhere: bool = True,
    holders: Sequence[str] | None = None,
    homes: Sequence[str] = (),
    segment_estimates: dict[str, int] | None = None,
    tier_estimates: dict[str, tuple[int, int]] | None = None,
    by_load: EffectiveLoadOrder | None = None,
) -> CandidateSet:
    """The snapshots a policy decides on (module docstring). ``estimates`` holds the peers' positive estimates
    (gossip and speculative, merged); ``planned`` the request key's plan destinations. ``holders`` (sparse only):
    the holders the caller drew for the policy (``RouteRequest.holders``); other peers with an estimate are then
    handed only when something else touches them (sends in flight, the sample, the plan), so a prompt cached
    mesh-wide costs a snapshot for a few peers, not every one. ``homes``: the request's homes. ``segment_estimates``:
    the peers' estimates of a request's segment tokens (``routing/segments.py``; None: it names none), which touch a
    peer like a prefix estimate. ``tier_estimates``: the peers whose tiers reach past their estimate, with their
    cumulative (host, disk) depths (module docstring; None: none). ``sends_elsewhere`` (sparse only;
    ``Reads.sends_elsewhere``): every peer with sends in flight from here is handed, its sends counted; False: only
    the peers something else touches (their sends counted still). At an idle ingress a sparse request without segment
    or tier estimates -- the common case -- takes ``_assemble_idle``, the same answer in one pass. ``by_load`` (sparse
    only; ``Reads.load_only``): the order of every alive peer by load with its sends counted; the policy is then
    handed this node, its sample, plan and homes, and the ``least_loaded`` first of that order (``_assemble_by_load``).
    """
    if by_load is not None and sparse:
        return _assemble_by_load(
            me, table, estimates, ledger, by_load, tiebreak, (*sampled, *planned, *homes), least_loaded,
            segment_estimates or {}, tier_estimates or {},
        )
    pending = ledger.peers()  # a live view of the peers with sends in flight: ``in`` at C speed
    if sparse and not pending and not segment_estimates and not tier_estimates:
        return _assemble_idle(me, table, estimates, tiebreak, (*sampled, *planned, *homes), holders, least_loaded)
    by_id, reported_at = table.by_id, table.reported_at
    handed: Iterable[tuple[str, int]]
    seg = segment_estimates or {}
    tiers = tier_estimates or {}
    if holders is not None and sparse:  # only the drawn holders, the sample, the plan and sends in flight
        sent_to = pending if sends_elsewhere else ()
        wanted = dict.fromkeys((*holders, *sampled, *planned, *sent_to, *homes))  # ordered: decisions reproduce
        handed = [
            (k, m) for k in wanted if (m := estimates.get(k, 0)) > 0 or seg.get(k, 0) > 0 or (tiers and k in tiers)
        ]
    else:
        handed = estimates.items()  # every estimate (a LevelEstimates builds its dict: routing/estimates.py)
        if seg:
            handed = [*handed, *((k, 0) for k in seg if k not in estimates)]
        if tiers:
            handed = [*handed, *((k, 0) for k in tiers if k not in estimates and k not in seg)]
    touched: dict[str, PeerSnapshot] = {}
    variants = table.variants
    for node_id, blocks in handed:
        base = by_id.get(node_id)
        if base is not None and base.alive:
            sends, tokens = ledger.since(node_id, reported_at[node_id]) if node_id in pending else (0, 0)
            depths = tiers.get(node_id, (0, 0)) if tiers else (0, 0)
            segment = seg.get(node_id, 0) if seg else 0
            if not sends and not tokens and not segment and depths == (0, 0):  # ``_assemble_idle``'s read
                snap = per_peer.get((blocks, 0, 0, 0, (0, 0))) if (per_peer := variants.get(node_id)) else None
                touched[node_id] = snap if snap is not None else table.variant(base, blocks, 0, 0)
            else:
                touched[node_id] = table.variant(base, blocks, sends, tokens, segment, depths)
    if not pending:  # an idle ingress
        in_flight = []
    elif sends_elsewhere or not sparse:
        in_flight = list(pending)
    else:  # only the candidates' sends: the sample's, the plan's and the homes' (a holder's are read above)
        in_flight = [node_id for node_id in dict.fromkeys((*sampled, *planned, *homes)) if node_id in pending]
    for node_id in in_flight:
        base = by_id.get(node_id)
        if base is not None and node_id not in touched:
            sends, tokens = ledger.since(node_id, reported_at[node_id])
            if sends:
                touched[node_id] = table.variant(base, 0, sends, tokens)
    all_estimates = estimates  # the router's own dict: it keeps it in the Route, with this node's estimate too
    all_estimates[me.node_id] = me.est_match_blocks
    if not sparse:
        snapshots = [me, *(touched.get(b.node_id, b) for b in table.bases)]
        return CandidateSet(snapshots, all_estimates, False, table.alive_ids)
    chosen = dict(touched)
    for node_id in (*sampled, *planned, *homes):
        base = by_id.get(node_id)
        if base is not None and node_id not in chosen:  # untouched: no estimate, nothing in flight
            chosen[node_id] = base
    snapshots = [me, *chosen.values(), *table.least_loaded(chosen, tiebreak, least_loaded)]
    return CandidateSet(snapshots, all_estimates, True, table.alive_ids, table.alive_position)


def _assemble_by_load(
    me: PeerSnapshot,
    table: PeerTable,
    estimates: MutableMapping[str, int],
    ledger: InFlightLedger,
    by_load: EffectiveLoadOrder,
    tiebreak: int,
    others: tuple[str, ...],
    least_loaded: int,
    segment_estimates: dict[str, int],
    tier_estimates: dict[str, tuple[int, int]],
) -> CandidateSet:
    """``assemble``'s answer for a policy that chooses by load alone (``Reads.load_only``): this node, the alive
    ``others`` (the sample, the plan's destinations, the homes) and the ``least_loaded`` least loaded of the rest with
    this ingress's sends counted (``by_load``, synced here), each snapshot with its estimate, sends, segment estimate
    and tier depths as ``assemble`` writes them -- O(candidates), whatever the peers with sends or estimates."""
    by_load.sync(table, ledger)
    by_id, reported_at = table.by_id, table.reported_at
    chosen: dict[str, PeerSnapshot] = {}

    def snapshot(node_id: str, base: PeerSnapshot) -> PeerSnapshot:
        sends, tokens = ledger.since(node_id, reported_at[node_id]) if node_id in ledger else (0, 0)
        return table.variant(
            base, estimates.get(node_id, 0), sends, tokens, segment_estimates.get(node_id, 0),
            tier_estimates.get(node_id, (0, 0)),
        )

    for node_id in others:
        base = by_id.get(node_id)
        if base is not None and base.alive and node_id not in chosen:
            chosen[node_id] = snapshot(node_id, base)
    for node_id in by_load.least(least_loaded, tiebreak, chosen):
        chosen[node_id] = snapshot(node_id, by_id[node_id])
    estimates[me.node_id] = me.est_match_blocks  # the router's own dict: it keeps it in the Route
    return CandidateSet([me, *chosen.values()], estimates, True, table.alive_ids, table.alive_position)


def _assemble_idle(
    me: PeerSnapshot,
    table: PeerTable,
    estimates: MutableMapping[str, int],
    tiebreak: int,
    others: tuple[str, ...],
    holders: Sequence[str] | None,
    least_loaded: int,
) -> CandidateSet:
    """``assemble``'s sparse answer at an idle ingress (no send in flight) for a request without segment or tier
    estimates -- the common case, in one pass: the same snapshots in the same order (the drawn ``holders`` and
    ``others`` -- the sample, plan destinations and homes -- each handed once, first those with an estimate; every
    peer with an estimate where no holders were drawn; then the rest of ``others``), each peer's variant read
    straight from the table's cache (``PeerTable.variant``'s key for nothing in flight, no segment estimate and no
    tier past the estimate)."""
    by_id, variants = table.by_id, table.variants
    chosen: dict[str, PeerSnapshot] = {}
    if holders is None:  # every estimate touches the request
        for node_id, blocks in estimates.items():
            base = by_id.get(node_id)
            if base is not None and base.alive:
                snap = per_peer.get((blocks, 0, 0, 0, (0, 0))) if (per_peer := variants.get(node_id)) else None
                chosen[node_id] = snap if snap is not None else table.variant(base, blocks, 0, 0)
    else:
        for node_id in (*holders, *others):
            if node_id not in chosen and (blocks := estimates.get(node_id, 0)) > 0:
                base = by_id.get(node_id)
                if base is not None and base.alive:
                    snap = per_peer.get((blocks, 0, 0, 0, (0, 0))) if (per_peer := variants.get(node_id)) else None
                    chosen[node_id] = snap if snap is not None else table.variant(base, blocks, 0, 0)
    for node_id in others:
        if node_id not in chosen and (base := by_id.get(node_id)) is not None:  # untouched: no estimate
            chosen[node_id] = base
    estimates[me.node_id] = me.est_match_blocks  # the router's own mapping: it keeps it in the Route
    snapshots = [me, *chosen.values()]
    if least_loaded > 0:
        snapshots += table.least_loaded(chosen, tiebreak, least_loaded)
    return CandidateSet(snapshots, estimates, True, table.alive_ids, table.alive_position)
