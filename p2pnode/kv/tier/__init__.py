"""The host-memory KV tier under the engine: vLLM's offloading connector, as it ships, with what p2pnode adds.

- ``connector``  ``TierConnector``: vLLM's ``OffloadingConnector`` reporting each request's tier load
- ``spec``       ``HostTierSpec``: vLLM's CPU spec on the CPU build, with p2pnode's worker; ``TieredHostSpec``: vLLM's
                 tiering spec (a host tier with tiers below it) on the CPU build, with the same worker
- ``worker``     ``BlockCopyWorker``: whole blocks copied between the engine's KV tensors and host tensors
- ``memory``     what the host can hold: a tier larger than its available memory is refused at start
- ``disk``       ``DiskTier``: the disk tier below the host tier, a secondary tier of vLLM's tiering manager
- ``disk_store`` its files: keyed by the whole KV layout, checksummed, bounded, found again after a restart
- ``disk_space`` where it can live: an unwritable path or a bound above the disk's free space is refused at start

The node's settings reach vLLM through ``kv/settings.py`` (the tier runs beside ``PeerPullConnector`` in vLLM's
``MultiConnector``); the node itself imports only ``memory``, ``disk_space`` and ``stats`` (the rest runs in vLLM's
processes).
"""
