"""What moves KV inside vLLM: the peer-pull KV connector and what the node tells it.

- ``params``     the ``kv_transfer_params`` a node hands its engine for a request (pull this prefix from there;
                 lease that prefix for a peer) and what the engine answers (what was pulled, the lease)
- ``layout``     a node's KV layout fingerprint: blocks move only between equal layouts
- ``blocks``     the block server in a holder engine's worker process, and the client a puller's worker fetches with
- ``segment_transfer``  stored segments (plain K/V) on that block server's stream, and the puller's fetch of them
- ``connector``  ``PeerPullConnector``, the vLLM KV connector (``kv_connector_module_path = p2pnode.kv.connector``)

The connector runs inside vLLM's engine-core and worker processes; the node reaches it only through these parameters,
a request at a time (docs/kv.md tells the whole exchange).
"""
