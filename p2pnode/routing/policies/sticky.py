"""Sticky: consistent hash of the routing key, no load bound.

Source: consistent hashing (Karger et al., STOC 1997) with ketama-style virtual nodes, as in SGLang router's
``consistent_hashing`` policy and session-affinity load balancers. Every request with one key goes to one node,
so that node keeps the key's prefix hot; a hot key overloads its node (no load bound: see ``chwbl``).

Rule: hash ``routing_key`` onto the ring of all known peers (alive or not, so a dead node's keys move to its
successors and every other key stays put); the target is the first alive node clockwise. The ranked list is the
alive nodes in ring order from the key (the successor that inherits the key if the target dies comes first).

Defaults: ``VNODES`` virtual nodes per node, ring seed ``SEED``.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.hashring import DEFAULT_VNODES, key_point, ring_for
from p2pnode.routing.policies.spec import PolicySpec, Reads, Role
from p2pnode.routing.policies.types import Decision, PeerSnapshot, RouteRequest, alive_peers, make_decision

NAME = "sticky"
#: Virtual nodes per node (ketama's 160): smooth key shares without a large ring.
VNODES = DEFAULT_VNODES
#: Hash seed of the ring and of keys; any fixed value works, it only has to be the same on every node.
SEED = 0


def route(request: RouteRequest, peers: Sequence[PeerSnapshot], plan: Plan | None = None) -> Decision:
    """First alive node clockwise from the key's point."""
    alive = {p.node_id: p for p in alive_peers(peers)}
    ring = ring_for((p.node_id for p in peers), VNODES, SEED)
    ranked = [alive[n] for n in ring.walk(key_point(request.routing_key, SEED)) if n in alive]
    return make_decision(NAME, request, ranked, f"consistent hash of key -> {ranked[0].node_id}")


SPEC = PolicySpec(NAME, route, role=Role.BASELINE, reads_of=lambda params: Reads(keyed=True))
