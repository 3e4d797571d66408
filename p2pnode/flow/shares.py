"""Mesh-wide fair shares: how much of the work the rest of the mesh served each tenant a node charges to its queue.

Per round, each tenant's part of the work peers served beyond its weighted equal share of that work, among the
tenants that grew or wait here. A tenant served elsewhere no more than the others is charged nothing (charging every
tenant its whole remote work would push a light tenant behind a heavy one's queued requests, a round's work at a
time); only the excess orders it back. The node (``serving/tenant_served.py``, over gossip) and the simulator
(``sim/admission.MeshShares``) charge by this one rule, each as a debt of at most the work waiting at the node
(``FairQueue.charge``'s ``max_lead``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping


def excess_over_share(
    served: Mapping[str, float], waiting: Iterable[str], weight_of: Callable[[str], float]
) -> dict[str, float]:
    """Per tenant of ``served`` (the work peers served it this round), what it got beyond its weighted equal share
    of all of that work among the tenants that grew or ``waiting`` here; those at or below their share are left out."""
    if not served:
        return {}
    tenants = set(served).union(waiting)
    weights = {t: max(weight_of(t), 1e-9) for t in tenants}
    share = sum(served.values()) / sum(weights.values())
    out: dict[str, float] = {}
    for tenant, work in served.items():
        excess = work - weights[tenant] * share
        if excess > 0:
            out[tenant] = excess
    return out
