"""Candidate assembly: from what an ingress knows (its own exact state, the peer table, every peer's estimate, the
in-flight ledger, the plan) to the ``PeerSnapshot`` list a policy decides on.

This is the one place that decides what a policy sees, for the node and the simulator alike.

Sparse assembly (the policies in ``SPARSE_POLICIES``, the default among them): a policy is handed only the peers the
request *touches* (an estimated match, sends in flight from here), this node, the peers drawn at random for the
request (``RouteRequest.sampled``), the key's plan destinations and the ``LEAST_LOADED_CANDIDATES`` least-loaded
others -- enough for their choice (see ``policies/__init__.py``); ``CandidateSet.complete`` then appends every other
alive peer by load to the retry order. When more than ``PRUNE_ABOVE`` peers match, only the undominated ones are
kept (``undominated``). Full assembly hands every known peer (the hash-ring and cost-model policies need them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from p2pnode.routing.ledger import InFlightLedger
from p2pnode.routing.peer_table import PeerTable
from p2pnode.routing.policies.types import Decision, PeerSnapshot

__all__ = ["LEAST_LOADED_CANDIDATES", "PRUNE_ABOVE", "CandidateSet", "assemble", "undominated"]

#: Untouched peers handed to a sparse policy besides the touched ones: the least loaded, ties spread by the request's
#: tiebreak. The target needs one; the rest give the retry order (``max_attempts`` 3) real alternatives.
LEAST_LOADED_CANDIDATES = 4
#: Peers with an estimate beyond which a sparse policy is handed only the undominated ones: below it, pruning costs
#: about what it saves.
PRUNE_ABOVE = 16


@dataclass(frozen=True, slots=True)
class CandidateSet:
    """What a policy is handed for one request, and what the ingress keeps of it."""

    snapshots: list[PeerSnapshot]  # this node first
    #: Every peer's estimate in blocks, pruned or not (absent: 0); this node's too.
    estimates: dict[str, int]
    sparse: bool
    alive_ids: tuple[str, ...]  # every alive peer, least loaded first

    def complete(self, decision: Decision, self_id: str) -> Decision:
        """A sparse decision's retry order goes on with every other alive peer, by reported load."""
        if not self.sparse:
            return decision
        ranked = decision.ranked
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
        return Decision(ranked + tuple(rest), decision.policy, decision.est_match_blocks, decision.reason)


def undominated(
    table: PeerTable, estimates: dict[str, int], ledger: InFlightLedger, tiebreak: int
) -> dict[str, int]:
    """The estimates of the peers a sparse policy could still choose when many peers match (a prompt cached
    mesh-wide): the Pareto front of (longer estimate, lower load, shorter queue) -- up to
    ``LEAST_LOADED_CANDIDATES`` peers of a tie, entered at a tiebreak offset -- plus every peer with sends in
    flight from here (its load is not the table's).

    Why this loses no choice: ``p2p``'s guard admits more with a longer match, a lower load (the overload test)
    and fewer waiting requests (the backlog test; the router leaves ``prefill_backlog_tokens`` unset), and its
    order prefers a longer match, then a lower load; ``flat`` only looks at load. A peer beaten on all three is
    chosen only when the peer beating it would be chosen too.
    """
    in_flight = ledger.peers()
    kept = {node_id: estimates[node_id] for node_id in in_flight if node_id in estimates}
    if len(estimates) >= len(table.alive_by_load) and estimates.keys() >= set(table.alive_ids):
        # Every peer matches (a prompt cached mesh-wide): each one's estimate is at least the least of them,
        # so a peer at that floor is beaten on all three by whoever beats it on (load, waiting), and only the
        # table's precomputed front of those (ties capped) and the deeper peers need to stay.
        floor = min(estimates.values())
        kept.update({node_id: m for node_id, m in estimates.items() if m > floor})
        for tie in table.front:
            offset = tiebreak % len(tie)
            for i in range(min(len(tie), LEAST_LOADED_CANDIDATES)):
                node_id = tie[(offset + i) % len(tie)]
                kept[node_id] = estimates[node_id]
        if len(kept) <= PRUNE_ABOVE:
            return kept
        estimates, kept = kept, {node_id: m for node_id, m in kept.items() if node_id in in_flight}
    front: list[list[int]] = []  # [estimate, waiting, load, peers kept at this point], in load order
    for base in table.by_load(tiebreak):
        node_id = base.node_id
        m = estimates.get(node_id)
        if m is None or node_id in kept:
            continue
        waiting, load = base.waiting, base.load
        for point in front:
            if point[0] >= m and point[1] <= waiting:  # as good or better on all three (load: earlier)
                if point[:3] == [m, waiting, load] and point[3] < LEAST_LOADED_CANDIDATES:
                    point[3] += 1  # a tie: a few are kept, so that ties still spread
                    kept[node_id] = m
                break
        else:
            front.append([m, waiting, load, 1])
            kept[node_id] = m
    return kept


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
) -> CandidateSet:
    """The snapshots a policy decides on (module docstring). ``estimates`` holds the peers' positive estimates
    (gossip and speculative, merged); ``planned`` the request key's plan destinations."""
    every_estimate = estimates
    if sparse and len(estimates) > PRUNE_ABOVE:
        estimates = undominated(table, estimates, ledger, tiebreak)
    by_id, reported_at = table.by_id, table.reported_at
    touched: dict[str, PeerSnapshot] = {}
    for node_id, blocks in estimates.items():
        base = by_id.get(node_id)
        if base is not None and base.alive:
            in_flight = ledger.count_since(node_id, reported_at[node_id]) if node_id in ledger else 0
            touched[node_id] = table.variant(base, blocks, in_flight)
    for node_id in list(ledger.peers()):
        base = by_id.get(node_id)
        if base is not None and node_id not in touched:
            in_flight = ledger.count_since(node_id, reported_at[node_id])
            if in_flight:
                touched[node_id] = table.variant(base, 0, in_flight)
    all_estimates = dict(every_estimate)  # every peer's, pruned or not (a C-level copy)
    all_estimates[me.node_id] = me.est_match_blocks
    if not sparse:
        snapshots = [me, *(touched.get(b.node_id, b) for b in table.bases)]
        return CandidateSet(snapshots, all_estimates, False, table.alive_ids)
    chosen = dict(touched)
    for node_id in (*sampled, *planned):
        base = by_id.get(node_id)
        if base is not None and node_id not in chosen:  # with its estimate, even if pruning dropped it
            chosen[node_id] = table.variant(base, every_estimate.get(node_id, 0), 0) if base.alive else base
    snapshots = [me, *chosen.values(), *table.least_loaded(chosen, tiebreak, LEAST_LOADED_CANDIDATES)]
    return CandidateSet(snapshots, all_estimates, True, table.alive_ids)
