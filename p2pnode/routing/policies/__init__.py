"""Routing policies: pure functions ``(RouteRequest, peers, plan) -> Decision``, selectable by name.

The node's router (``--routing-policy``) and the simulator look policies up here, so both run the very same
code. ``p2p`` is the default; the others are the peers' published algorithms, each module citing its source
and naming its defaults. Policies with tunable defaults also take them as keyword-only overrides (bind them
with ``functools.partial``; the result is still a ``Policy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.routing.policies import cacheroute, chwbl, dualmap, dynamo, flat, p2p, preble, sglang, sticky
from p2pnode.routing.policies.types import Decision, NoAliveCandidate, PeerSnapshot, Policy, RouteRequest

__all__ = [
    "DEFAULT_POLICY",
    "HOMED_POLICIES",
    "POLICIES",
    "SPARSE_POLICIES",
    "Decision",
    "NoAliveCandidate",
    "PeerSnapshot",
    "Policy",
    "RouteRequest",
    "get_policy",
    "uses_home",
    "uses_routing_key",
]

#: The policy a node uses when none is named.
DEFAULT_POLICY = DEFAULT_ROUTING_POLICY

#: name -> policy, in the order the simulator reports them (cache-blind first, ours last).
POLICIES: Mapping[str, Policy] = MappingProxyType(
    {m.NAME: m.route for m in (flat, sticky, chwbl, sglang, dynamo, dualmap, preble, p2p, cacheroute)}
)


def get_policy(name: str) -> Policy:
    """The policy called ``name``; ValueError listing the valid names otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(POLICIES)}") from None


#: Policies whose target is always among the peers a request *touches* (an estimated match, sends in flight from
#: this ingress, the peers drawn for it in ``RouteRequest.sampled``, its key's plan destinations) plus the
#: least-loaded others, so the router may hand them only those (``router.py``: a decision then costs O(touched
#: peers), not O(mesh)). Why each qualifies: ``flat`` picks the least load, and every peer whose load differs from
#: its last report is touched; ``p2p``'s candidates are this node, the peers with a match and the sampled ones;
#: ``cacheroute`` is its plan's destinations or its fallback, when that fallback is one of these. The hash-ring and
#: cost-model baselines see every peer.
SPARSE_POLICIES: frozenset[str] = frozenset(
    {flat.NAME, p2p.NAME} | ({cacheroute.NAME} if cacheroute.DEFAULT_FALLBACK in (flat.NAME, p2p.NAME) else set())
)

#: Policies that read ``RouteRequest.routing_key`` (key pinning, the plan's warm keys): the router derives a key before
#: deciding only for these.
KEYED_POLICIES: frozenset[str] = frozenset({sticky.NAME, chwbl.NAME, dualmap.NAME, cacheroute.NAME})


#: Policies that read ``RouteRequest.homes`` (``p2p``, and ``cacheroute`` when ``p2p`` routes its cold keys): the
#: router names a request's homes and hands those peers only for these.
HOMED_POLICIES: frozenset[str] = frozenset(
    {p2p.NAME} | ({cacheroute.NAME} if cacheroute.DEFAULT_FALLBACK == p2p.NAME else set())
)


def uses_home(name: str) -> bool:
    """Whether the policy called ``name`` reads ``RouteRequest.homes``: ``p2p@w4`` is ``p2p``'s; the simulator's
    ``cacheroute-<fallback>`` reads them when its fallback does (``cacheroute-p2p`` as ``cacheroute``, not
    ``cacheroute-flat``)."""
    base, _, fallback = name.split("@")[0].partition("-")
    return uses_home(fallback) if base == cacheroute.NAME and fallback else base in HOMED_POLICIES


def uses_plan(name: str) -> bool:
    """Whether the policy called ``name`` routes warm keys by the rate plan (``cacheroute`` and its simulator
    variants); the other keyed policies read the key but not the plan."""
    return _base_name(name) == cacheroute.NAME


def uses_routing_key(name: str) -> bool:
    """Whether the policy called ``name`` reads routing keys; the simulator's variants (``cacheroute-p2p``,
    ``p2p@w4``) are their base policy's."""
    return _base_name(name) in KEYED_POLICIES


def _base_name(name: str) -> str:
    """The registered policy a simulator variant runs: ``cacheroute-p2p`` and ``p2p@w4`` are ``cacheroute`` and
    ``p2p``."""
    return name.split("@")[0].split("-")[0]
