"""The CacheRoute-style shared rate plan: per-key rates (``rates``), the planner (``planner``), the plan value and its
wire form (``plan``), keeping one plan across the mesh over gossip (``sync``) and the shadow-replay gate (``gate``).

Routing reads a plan (``p2pnode.routing.policies.cacheroute``); nothing here routes. Modules are imported directly
so that importing one part never drags in the others.
"""
