"""Routing policies: pure functions ``(RouteRequest, peers, plan) -> Decision``, each described by a ``PolicySpec``.

The node's router (``--routing-policy``) and the simulator (``--policies``) look specs up here, so both run the very
same code with the very same parameters. ``p2p`` is the default; the others are the peers' published algorithms, each
module citing its source and naming its defaults. A policy is added by writing its module (with its ``SPEC``) and one
line in ``SPECS`` below. Names may carry what-if parameters (``p2p@w8``, ``cacheroute-chwbl@k512``): ``get_spec``
resolves them through the spec's own ``variants`` (``spec.py``). Whoever compares policies reads them from here --
the baselines, ours (``names_of``), the cache-blind floor -- never from a list of names of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.routing.policies import cacheroute, chwbl, dualmap, dynamo, flat, p2p, preble, sglang, sticky
from p2pnode.routing.policies.spec import PolicySpec, Reads, Role
from p2pnode.routing.policies.types import Decision, NoAliveCandidate, PeerSnapshot, Policy, RouteRequest

__all__ = [
    "CACHE_BLIND_POLICY",
    "DEFAULT_POLICY",
    "PLAN_POLICY",
    "SPECS",
    "Decision",
    "NoAliveCandidate",
    "PeerSnapshot",
    "Policy",
    "PolicySpec",
    "Reads",
    "Role",
    "RouteRequest",
    "get_spec",
    "names_of",
]

#: The policy a node uses when none is named.
DEFAULT_POLICY = DEFAULT_ROUTING_POLICY
#: The policy that routes by the rate plan (the shadow gate replays it to decide whether the plan's affinity pays).
PLAN_POLICY = cacheroute.NAME
#: Cache-blind balancing: what affinity must beat (the shadow gate's other replay).
CACHE_BLIND_POLICY = flat.NAME

#: name -> spec, in the order the simulator reports them (cache-blind first, ours last).
SPECS: Mapping[str, PolicySpec] = MappingProxyType(
    {
        s.name: s
        for s in (
            flat.SPEC,
            sticky.SPEC,
            chwbl.SPEC,
            sglang.SPEC,
            dynamo.SPEC,
            dualmap.SPEC,
            preble.SPEC,
            p2p.SPEC,
            cacheroute.SPEC,
        )
    }
)


def names_of(role: Role) -> tuple[str, ...]:
    """The registered policies of ``role``, in ``SPECS`` order."""
    return tuple(name for name, spec in SPECS.items() if spec.role is role)


def get_spec(name: str) -> PolicySpec:
    """The policy ``name`` names -- a registered one, or a what-if of one (``p2p@w8``, ``cacheroute-chwbl``);
    ValueError listing the valid names otherwise."""
    base = name.split("@", 1)[0]
    for spec in SPECS.values():
        if base == spec.name or base in spec.named:
            return spec if name == spec.name else spec.variant(name)
    raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(SPECS)} (and their what-ifs, BASE@...)")
