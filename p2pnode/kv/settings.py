"""What a node tells its engine's KV connectors: the one place their settings are written.

``ConnectorSettings`` is ``PeerPullConnector``'s, in one type both sides share: the node writes it into vLLM's
``kv_connector_extra_config`` (``to_extra``); vLLM hands that dict to the connector in its scheduler and worker
processes, which read it back (``from_extra``). Every field is written by the node and none has a default here, so the
connector never runs on a value of its own: a setting the node did not send fails the engine's start instead of
silently meaning something else.

``transfer_config`` is the whole of vLLM's ``KVTransferConfig``: ``PeerPullConnector`` alone, or -- with a host tier
-- vLLM's ``MultiConnector`` running it first and the tier's connector (``kv/tier/``) second.

How MultiConnector combines them (vLLM 0.32, ``kv_connector/v1/multi_connector.py``): it asks every connector for a
request's external tokens, in order, and lets the first that offers any load them (the others see the allocation with
no tokens to load); saves, ``request_finished`` and the worker hooks go to all; a finished request's answer is the
union of the connectors' ``kv_transfer_params``, a key two of them set being an error -- so each keeps its own
(``params.KEY``, ``params.TIER_KEY``) -- and its blocks stay held while any of them holds them. Every connector reads
the same request, ``kv_transfer_params`` included: ``PeerPullConnector`` offers tokens only for what the node asked
(a pull, a segment load), so an explicit pull wins and the tier serves every other request's hit, an export's among
them (the holder's engine loads the prefix from its tier before leasing it). One request cannot load from both (a
pull from a peer does not top up from the local tier): routing prices one source per request.

Why MultiConnector, and not vLLM's secondary tiers or one connector of p2pnode's: the tier is vLLM's offloading
machinery as it ships (its lookups, LRU/ARC, admission threshold, KV events, and the fencing of a block reused while a
store from it is in flight), so a GPU build runs vLLM's own CUDA worker and a vLLM upgrade brings its fixes; one
connector of ours would re-implement that scheduler side. vLLM's secondary tiers (``secondary_tiers``, its P2P tier's
``remote_kv_source``) sit *below* the host tier, found by lookup: they cannot carry routing's per-request choice of a
holder, its lease, the mesh's authenticated Export, caps and layout check, which a pull needs; and on the CPU build
they need the host tier in the shared memory region its GPU path uses. A disk tier below the host tier is one of those
secondary tiers (``kv/tier/disk.py``): with ``--disk-kv-path`` the host tier's connector runs vLLM's tiering spec, on
the CPU build with the host tier in that region (``kv/tier/spec.TieredHostSpec``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pnode.config import KvSetup, TierConfig

__all__ = ["ConnectorSettings", "register_connectors", "tier_extra", "transfer_config"]

#: How vLLM finds p2pnode's connectors (each module is imported in vLLM's three processes).
PEER_PULL_CONNECTOR = {"kv_connector": "PeerPullConnector", "kv_connector_module_path": "p2pnode.kv.connector"}
TIER_CONNECTOR = {"kv_connector": "TierConnector", "kv_connector_module_path": "p2pnode.kv.tier.connector"}
#: The host tier's spec on the CPU build (vLLM's own ``CPUOffloadingSpec`` refuses it); a GPU build uses vLLM's.
CPU_BUILD_SPEC = {"spec_name": "HostTierSpec", "spec_module_path": "p2pnode.kv.tier.spec"}
#: With a disk tier below it: vLLM's tiering spec (its secondary tiers), on the CPU build with p2pnode's worker.
TIERED_SPEC = {"spec_name": "TieringOffloadingSpec"}
CPU_BUILD_TIERED_SPEC = {"spec_name": "TieredHostSpec", "spec_module_path": "p2pnode.kv.tier.spec"}
#: The disk tier, a secondary tier of vLLM's tiering manager (``kv/tier/disk.py``).
DISK_TIER = {"type": "DiskTier", "module_path": "p2pnode.kv.tier.disk"}
#: Both connectors answer in the same role; a load that fails is computed, never the request failed.
_COMMON = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings (``kv/connector.py``), from the node's ``KvSetup``."""

    #: The engine's KV layout fingerprint ("": it lends and pulls no blocks).
    kv_layout: str
    #: Where its block server listens ("": none) and writes the port it took.
    kv_host: str
    kv_port_file: str
    #: Pulls its block server streams at once; longest a pull's transfer may take; fault injection per block sent.
    max_streams: int
    fetch_timeout_s: float
    block_delay_s: float
    #: The segment store of approximate reuse (0 bytes: none), its eviction policy, the offers a computed segment
    #: needs before it is stored, and whether loaded segments' keys are re-rotated to their new positions.
    segment_store_bytes: int
    segment_policy: str
    segment_store_threshold: int
    segment_rotation: bool

    @classmethod
    def of(cls, kv: KvSetup, layout: str, port_file: Path, store_bytes: int) -> ConnectorSettings:
        """The settings for an engine whose layout is ``layout`` ("" unless it pulls) and whose platform keeps a
        segment store of ``store_bytes``."""
        pulls = kv.pulls
        return cls(
            kv_layout=layout,
            kv_host=kv.block_server_host,
            kv_port_file=str(port_file),
            max_streams=pulls.max_streams if pulls else 0,
            fetch_timeout_s=pulls.fetch_timeout_s if pulls else 0.0,
            block_delay_s=pulls.block_delay_s if pulls else 0.0,
            segment_store_bytes=store_bytes,
            segment_policy=kv.segments.policy,
            segment_store_threshold=kv.segments.store_threshold,
            segment_rotation=kv.segments.rotate,
        )

    def to_extra(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """Read back what ``to_extra`` wrote (KeyError names a setting the node did not send)."""
        return cls(**{f.name: extra[f.name] for f in dataclasses.fields(cls)})


def tier_extra(tier: TierConfig, cpu_build: bool, kv_layout: str = "") -> dict[str, Any]:
    """The host tier's ``kv_connector_extra_config`` (vLLM's offloading keys). Its KV events describe themselves
    (token ids, block size and parent, as the engine's own do), so the node can index what the tier holds. With a disk
    tier, vLLM's tiering spec runs the host tier with the disk tier below it; ``kv_layout`` (the engine's fingerprint,
    ``kv/layout.py``) is part of the disk entries' key."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": tier.host_bytes,
        "eviction_policy": tier.eviction,
        "store_threshold": tier.store_threshold,
        "offload_prompt_only": not tier.store_outputs,
        "self_describing_kv_events": True,
    }
    if not tier.disk_enabled:
        return {**extra, **CPU_BUILD_SPEC} if cpu_build else extra
    if not kv_layout:
        raise ValueError("a disk tier needs the engine's KV layout: its entries are keyed by it")
    disk = {**DISK_TIER, "root_dir": tier.disk_path, "max_bytes": tier.disk_bytes, "kv_layout": kv_layout}
    del extra["store_threshold"]  # vLLM's tiering spec refuses one (TierConfig allows only 1 with a disk tier)
    return {**extra, **(CPU_BUILD_TIERED_SPEC if cpu_build else TIERED_SPEC), "secondary_tiers": [disk]}


def transfer_config(
    settings: ConnectorSettings, tier: TierConfig, cpu_build: bool, kv_layout: str = ""
) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` fields for the engine: ``PeerPullConnector`` alone, or beside the host tier in a
    ``MultiConnector`` (module docstring); ``kv_layout``: the engine's, for a disk tier's key."""
    peer_pull = {**PEER_PULL_CONNECTOR, **_COMMON, "kv_connector_extra_config": settings.to_extra()}
    if not tier.enabled:
        return peer_pull
    host_tier = {**TIER_CONNECTOR, **_COMMON, "kv_connector_extra_config": tier_extra(tier, cpu_build, kv_layout)}
    connectors = {"connectors": [peer_pull, host_tier]}  # the order is MultiConnector's choice of who loads
    return {"kv_connector": "MultiConnector", **_COMMON, "kv_connector_extra_config": connectors}


def register_connectors() -> None:
    """Name p2pnode's connectors in vLLM's registry (in this process; imports vLLM). The engine core finds them by
    module path, but vLLM's stat loggers rebuild ``MultiConnector``'s per-connector stats by class name alone, in the
    process that runs ``AsyncLLM``, and fail on a name the registry lacks ("Connector 'TierConnector' is not
    registered": every request then fails with the output handler)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for connector in (PEER_PULL_CONNECTOR, TIER_CONNECTOR):
        name, module = connector["kv_connector"], connector["kv_connector_module_path"]
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
