"""Routing: what an ingress node knows about the mesh (``cluster_view``) and how it picks a target (``policies``).

Modules are imported directly (``from p2pnode.gossip.cluster_view import ClusterView``); this package file stays
empty so that importing one part never drags in the others.
"""
