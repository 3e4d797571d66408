"""``upper-bound``: the default rule with perfect information and no search limit -- a reference, not a policy.

The ``p2p`` cost rule (``routing/policies/p2p.py``) with every node a candidate (no random sample, every holder)
over exact, instantly shared state (``views.ExactView``: every node's live PrefixIndex and engine load, requests on
their way counted as waiting where they go) and no speculative index. No node can know every peer's cache and load
the instant they change, so it is not deployable; the gap between ``p2p`` and ``upper-bound`` is what stale gossip
and sampling cost. It bounds what the rule can reach with better information; it is not the optimum of routing
(a greedy rule with perfect state is not an optimal schedule), and another rule can beat it.
"""

from __future__ import annotations

from dataclasses import replace

from p2pnode.routing.policies import Role, p2p

__all__ = ["NAME", "SPEC"]

NAME = "upper-bound"
#: ``p2p`` with every peer and every holder a candidate (the simulator runs it over ``views.ExactView``).
SPEC = replace(p2p.SPEC.with_params(name=NAME, choices=0, holders=0), role=Role.REFERENCE)
