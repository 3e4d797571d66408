"""Flat-LB: the cache-blind baseline. Send each request to the least-loaded alive peer.

Source: the classic least-connections / round-robin balancer (SGLang router ``round_robin``, Dynamo
``--router-mode round-robin``), used as "Flat-LB" in CacheRoute's evaluation. It ignores the cache entirely, so
it bounds what affinity-blind balancing achieves.

Rule: order alive peers by ``load`` (running + waiting + in_flight); equal loads are rotated by the request's
``tiebreak`` (round robin when the caller passes a counter, uniform spread when it passes a request hash). The
ranked list is the same order: next-least-loaded first.

Defaults: none (no thresholds).
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.spec import PolicySpec, Reads, Role
from p2pnode.routing.policies.types import Decision, PeerSnapshot, RouteRequest, alive_peers, make_decision, rank

NAME = "flat"


def route(request: RouteRequest, peers: Sequence[PeerSnapshot], plan: Plan | None = None) -> Decision:
    """Least loaded; ties spread by tiebreak."""
    ranked = rank(alive_peers(peers), lambda p: p.requests, request.tiebreak)
    return make_decision(NAME, request, ranked, f"least loaded (load {ranked[0].requests})")


#: Sparse, by load alone: handed the least loaded with this ingress's sends counted (``Reads.load_only``).
SPEC = PolicySpec(NAME, route, role=Role.BASELINE, reads_of=lambda params: Reads(sparse=True, load_only=True))
