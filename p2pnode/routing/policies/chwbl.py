"""CHWBL: consistent hashing with bounded loads. Sticky, but no node takes more than c x the mean load.

Sources: Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018); Vimeo's
HAProxy implementation (``hash-balance-factor``, chash_server_is_eligible in src/lb_chash.c), the same rule in
Envoy ring_hash ``hash_balance_factor``, brpc ``c_murmurhash_bl`` and llm-d's prefix-affinity routing.

Rule: with n alive peers whose loads sum to L, the cap for this request is ``ceil(c * (L + 1) / n)`` (the +1 is
the request being placed). Walk the ring clockwise from ``routing_key``'s point and take the first alive node
whose ``load + 1 <= cap``. Since the cap is at least the mean, some node always qualifies. The ranked list is
the eligible nodes in ring order (the next one clockwise is where the key overflows to), then the ineligible
ones in ring order.

Defaults: ``BALANCE_FACTOR`` c = 1.25, ring of ``VNODES`` virtual nodes per node with seed ``SEED`` (the same
ring as ``sticky``, so with no overload CHWBL and sticky agree).
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.hashring import DEFAULT_VNODES, key_point, ring_for
from p2pnode.routing.policies.spec import PolicySpec, Reads, Role
from p2pnode.routing.policies.types import Decision, PeerSnapshot, RouteRequest, alive_peers, make_decision

NAME = "chwbl"
#: c: no node above 1.25x the mean load (Vimeo's production value, the paper's c = 1 + epsilon with eps 0.25):
#: lower moves more keys off their cached node, higher lets hot keys pile up.
BALANCE_FACTOR = 1.25
#: Virtual nodes per node (ketama's 160).
VNODES = DEFAULT_VNODES
#: Ring and key hash seed; the same as sticky's so both share one cached ring.
SEED = 0


def load_cap(total_load: int, n_alive: int, balance_factor: float = BALANCE_FACTOR) -> int:
    """``ceil(c * (total_load + 1) / n)`` in integer arithmetic (c as a percentage, like HAProxy)."""
    pct = round(balance_factor * 100)
    return -(-pct * (total_load + 1) // (100 * n_alive))


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    balance_factor: float = BALANCE_FACTOR,
) -> Decision:
    """First node clockwise from the key whose load stays within the cap."""
    alive = {p.node_id: p for p in alive_peers(peers)}
    cap = load_cap(sum(p.requests for p in alive.values()), len(alive), balance_factor)
    ring = ring_for((p.node_id for p in peers), VNODES, SEED)
    in_order = [alive[n] for n in ring.walk(key_point(request.routing_key, SEED)) if n in alive]
    eligible = [p for p in in_order if p.requests + 1 <= cap]
    ranked = eligible + [p for p in in_order if p.requests + 1 > cap]
    skipped = in_order.index(ranked[0])
    reason = f"ring owner within cap {cap}" if skipped == 0 else f"cap {cap}: skipped {skipped} on the ring"
    return make_decision(NAME, request, ranked, reason)


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.BASELINE,
    defaults={"balance_factor": BALANCE_FACTOR},
    reads_of=lambda params: Reads(keyed=True),
    variants={"b": ("balance_factor", float)},
)
