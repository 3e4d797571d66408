"""``oracle``: the p2p rule with perfect information -- exact, instantly shared cache state and live loads.

Not a deployable policy (no node can know every peer's cache and load the instant they change), so it lives in
the simulator. It is the ``p2p`` policy function itself; what makes it an oracle is the view the simulator builds
its snapshots from (``views.ExactView``: every node's live PrefixIndex and engine load, requests on their way to a
node counted as waiting there) and no speculative index. The gap between ``p2p`` and ``oracle`` is what stale
gossip costs.
"""

from __future__ import annotations

from p2pnode.routing.policies import p2p

__all__ = ["NAME", "route"]

NAME = "oracle"
route = p2p.route
