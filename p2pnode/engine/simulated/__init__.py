"""The simulated engine: vLLM-style continuous batching over a paged prefix cache, timed by a cost profile.

One engine, two clocks: the cluster simulator (``p2pnode.sim``) drives ``batching.NodeEngine`` on its discrete-event
loop, and a node started with ``--engine sim`` drives the same ``NodeEngine`` in real time through
``realtime.SimEngine`` (the ``Engine`` protocol). Its steps are timed by ``p2pnode.cost``'s profiles. Parts:
``kvcache`` (paged blocks with pin counts and an eviction policy from ``p2pnode.cache.eviction``, mirrored into the
node's real ``PrefixIndex``), ``request`` (one request's state), ``batching`` (the scheduler).
"""
