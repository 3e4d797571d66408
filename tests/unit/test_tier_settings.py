"""What the node tells vLLM about the host tier (``kv/settings.py``, ``config.TierConfig``, ``kv/tier/memory.py``):
the tier runs beside p2pnode's connector in vLLM's MultiConnector, p2pnode's first, and vLLM resolves every class
named."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pnode.config import KvSetup, TierConfig
from p2pnode.kv.settings import ConnectorSettings, transfer_config
from p2pnode.kv.tier.memory import check_host_tier

SETTINGS = ConnectorSettings.of(KvSetup(), "", Path("/tmp/kv-port"), 0)


def test_without_a_tier_the_engine_runs_p2pnodes_connector_alone() -> None:
    config = transfer_config(SETTINGS, TierConfig(), cpu_build=True)
    assert config["kv_connector"] == "PeerPullConnector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert not KvSetup().tier.enabled and not TierConfig().enabled  # off by default


def test_a_tier_runs_beside_it_in_vllms_multiconnector_p2pnodes_first() -> None:
    tier = TierConfig(host_bytes=1 << 30, store_threshold=2, store_outputs=False, eviction="arc")
    config = transfer_config(SETTINGS, tier, cpu_build=True)
    assert config["kv_connector"] == "MultiConnector"
    peer_pull, host = config["kv_connector_extra_config"]["connectors"]
    assert peer_pull["kv_connector"] == "PeerPullConnector"  # an explicit pull wins over the tier
    assert peer_pull["kv_connector_extra_config"] == SETTINGS.to_extra()
    assert host["kv_connector"] == "TierConnector"
    extra = host["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 1 << 30
    assert (extra["store_threshold"], extra["offload_prompt_only"], extra["eviction_policy"]) == (2, True, "arc")
    assert extra["self_describing_kv_events"] is True  # the node indexes what the tier holds
    assert extra["spec_name"] == "HostTierSpec"
    gpu_extra = transfer_config(SETTINGS, tier, cpu_build=False)["kv_connector_extra_config"]["connectors"][1]
    assert "spec_name" not in gpu_extra["kv_connector_extra_config"]  # a GPU build: vLLM's own CPU spec


def test_vllm_resolves_every_class_the_config_names() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from p2pnode.kv.connector import PeerPullConnector
    from p2pnode.kv.tier.connector import TierConnector
    from p2pnode.kv.tier.spec import HostTierSpec

    config = transfer_config(SETTINGS, TierConfig(host_bytes=1 << 20), cpu_build=True)
    KVTransferConfig(**config)
    classes = [
        KVConnectorFactory.get_connector_class(KVTransferConfig(**child))
        for child in config["kv_connector_extra_config"]["connectors"]
    ]
    assert classes == [PeerPullConnector, TierConnector]
    tier_extra = config["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(tier_extra) is HostTierSpec


def test_a_disk_tier_runs_below_the_host_tier_as_a_secondary_tier_of_vllms_tiering_spec() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from p2pnode.kv.tier.disk import DiskTier
    from p2pnode.kv.tier.spec import TieredHostSpec

    assert not TierConfig().disk_enabled and not TierConfig(host_bytes=1).disk_enabled  # off by default
    tier = TierConfig(host_bytes=1 << 20, disk_path="/var/kv", disk_bytes=1 << 30)
    config = transfer_config(SETTINGS, tier, cpu_build=True, kv_layout="w/bfloat16/b32")
    extra = config["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieredHostSpec
    assert "store_threshold" not in extra  # vLLM's tiering spec refuses one
    (disk,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(disk) is DiskTier
    assert (disk["root_dir"], disk["max_bytes"], disk["kv_layout"]) == ("/var/kv", 1 << 30, "w/bfloat16/b32")
    gpu = transfer_config(SETTINGS, tier, cpu_build=False, kv_layout="w")["kv_connector_extra_config"]["connectors"]
    assert OffloadingSpecFactory.get_spec_cls(gpu[1]["kv_connector_extra_config"]) is TieringOffloadingSpec
    with pytest.raises(ValueError, match="layout"):
        transfer_config(SETTINGS, tier, cpu_build=True)  # entries without the layout in their key: never


def test_disk_tier_settings_are_checked_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--disk-kv-path needs --host-kv-bytes"):
        TierConfig(disk_path="/var/kv")
    with pytest.raises(ValueError, match="--disk-kv-bytes"):
        TierConfig(host_bytes=1, disk_path="/var/kv", disk_bytes=0)
    with pytest.raises(ValueError, match="--tier-store-threshold 1"):
        TierConfig(host_bytes=1, disk_path="/var/kv", store_threshold=2)


def test_tier_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="store threshold"):
        TierConfig(host_bytes=1, store_threshold=0)
    with pytest.raises(ValueError, match="eviction"):
        TierConfig(host_bytes=1, eviction="fifo")
    with pytest.raises(ValueError, match="bytes"):
        TierConfig(host_bytes=-1)


def test_a_tier_larger_than_the_machines_memory_is_refused_naming_the_flag() -> None:
    assert check_host_tier(0, available=0) is None
    assert check_host_tier(1 << 30, available=2 << 30) is None
    refused = check_host_tier(4 << 30, available=2 << 30)
    assert refused is not None and refused.startswith("--host-kv-bytes")


def test_tier_io_sums_vllms_offloading_counters_whatever_their_nesting() -> None:
    from p2pnode.kv.tier.stats import TierIo

    step = {  # MultiConnector's stats: by connector class, each the offloading connector's own {"types", "data"}
        "TierConnector": {
            "types": {"vllm:kv_offload_load_bytes": "counter", "vllm:kv_offload_load_time": "counter",
                      "vllm:kv_offload_allocation_failure": "counter", "vllm:kv_offload_cpu_cache_usage_perc": "gauge"},
            "data": {"vllm:kv_offload_load_bytes": {(): 1024}, "vllm:kv_offload_load_time": {(): 0.25},
                     "vllm:kv_offload_allocation_failure": {(): 2}, "vllm:kv_offload_cpu_cache_usage_perc": {(): 0.5}},
        },
        "PeerPullConnector": {"something": "else"},
    }
    disk_failures = "vllm:kv_offload_p2pnode_disk_tier_failures"
    step["TierConnector"]["types"].update({"vllm:kv_offload_tiering_read_bytes": "counter", disk_failures: "counter"})
    step["TierConnector"]["data"].update({"vllm:kv_offload_tiering_read_bytes": {("DiskTier",): 512},
                                          disk_failures: {("corrupt",): 1, ("store",): 2}})
    io = TierIo()
    assert io.add(step) == 2
    io.add(step["TierConnector"])
    assert (io.load_bytes, io.load_seconds, io.store_bytes, io.store_failures) == (2048, 0.5, 0, 4)
    assert (io.disk_load_bytes, io.disk_store_bytes, io.disk_failures) == (1024, 0, 6)
    assert io.add(None) == 0 and io.add({"TierConnector": "garbage"}) == 0


def test_vllm_can_rebuild_the_connectors_stats_by_class_name() -> None:
    """vLLM's stat loggers look MultiConnector's per-connector stats up by class name alone (in the node's process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from p2pnode.kv.settings import register_connectors

    register_connectors()
    register_connectors()  # once per process is enough; again is harmless
    assert KVConnectorFactory.get_connector_class_by_name("TierConnector").__name__ == "TierConnector"
    stats = MultiConnector.build_kv_connector_stats({"TierConnector": {"types": {}, "data": {}}})
    assert stats is not None and "TierConnector" in stats.data
