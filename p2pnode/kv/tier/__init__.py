"""The host-memory KV tier under the engine: vLLM's offloading connector, as it ships, with what p2pnode adds.

- ``connector``  ``TierConnector``: vLLM's ``OffloadingConnector`` reporting each request's tier load
- ``spec``       ``HostTierSpec``: vLLM's CPU spec on the CPU build, with p2pnode's worker
- ``worker``     ``BlockCopyWorker``: whole blocks copied between the engine's KV tensors and host tensors
- ``memory``     what the host can hold: a tier larger than its available memory is refused at start

The node's settings reach vLLM through ``kv/settings.py`` (the tier runs beside ``PeerPullConnector`` in vLLM's
``MultiConnector``); nothing here is imported by the node itself except ``memory`` (the rest runs in vLLM's processes).
"""
