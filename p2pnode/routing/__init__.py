"""Routing: how an ingress picks the node that serves a request.

``router`` (the ingress: hash, estimate, assemble, decide, account), ``directory`` (what it reads about peers: the
gossip agent's ``ClusterView`` implements it), ``peer_table`` (every peer as of its last report), ``ledger`` (sends in
flight), ``speculative`` (prefixes just routed), ``candidates`` (what a policy is handed), ``policies`` (pure
functions). Modules are imported directly; this package file stays empty so that importing one part never drags in
the others.
"""
