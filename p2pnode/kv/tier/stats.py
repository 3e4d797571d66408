"""What the engine's host tier moved, as vLLM's offloading connector counts it.

Each engine step's scheduler stats carry the connectors' counters (``SchedulerStats.kv_connector_stats``): with
``MultiConnector``, a dict by connector class name, each the offloading connector's own ``{"types", "data"}`` dict
(``offloading/metrics.py``: a counter's values by label tuple, summed here). The node's stat logger adds each step's to
a ``TierIo``; status and ``/metrics`` read the totals. Reading only the names below, it ignores whatever else a
connector reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pnode.config import TierConfig

__all__ = ["TierIo", "TierStatus"]

#: vLLM's counter names (``offloading/metrics.py``).
LOAD_BYTES = "vllm:kv_offload_load_bytes"
LOAD_TIME = "vllm:kv_offload_load_time"
STORE_BYTES = "vllm:kv_offload_store_bytes"
STORE_TIME = "vllm:kv_offload_store_time"
ALLOCATION_FAILURE = "vllm:kv_offload_allocation_failure"
#: vLLM's tiering manager's counts of what its tiers below the host tier (the disk tier) read and wrote
#: (``v1/kv_offload/tiering/base.py``), and the disk tier's own failures (``disk.py``). That one is named in vLLM's
#: namespace, beside its tiers' counters: vLLM registers a tier's counters with Prometheus itself and, when an engine
#: starts again in the same process, drops only the ``vllm:`` ones it registered before (another name is a duplicate
#: and fails the start).
DISK_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
DISK_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
DISK_FAILURES = "vllm:kv_offload_p2pnode_disk_tier_failures"


@dataclass
class TierIo:
    """Totals since the engine started."""

    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    #: Stores the tier could not take: every block it could drop was in use (vLLM's allocation failures).
    store_failures: int = 0
    #: The disk tier: bytes it loaded into the host tier and stored from it, and its failures (each recomputed).
    disk_load_bytes: int = 0
    disk_store_bytes: int = 0
    disk_failures: int = 0

    def add(self, connector_stats: Any) -> int:
        """Add one step's ``kv_connector_stats``; returns the store failures it reported (the caller logs them)."""
        counters = _counters(connector_stats)
        self.load_bytes += int(counters.get(LOAD_BYTES, 0))
        self.load_seconds += float(counters.get(LOAD_TIME, 0.0))
        self.store_bytes += int(counters.get(STORE_BYTES, 0))
        self.store_seconds += float(counters.get(STORE_TIME, 0.0))
        failures = int(counters.get(ALLOCATION_FAILURE, 0))
        self.store_failures += failures
        self.disk_load_bytes += int(counters.get(DISK_READ_BYTES, 0))
        self.disk_store_bytes += int(counters.get(DISK_WRITE_BYTES, 0))
        self.disk_failures += int(counters.get(DISK_FAILURES, 0))
        return failures


def _counters(stats: Any) -> dict[str, float]:
    """Every counter named in ``stats`` (any nesting of connectors), summed over its labels."""
    out: dict[str, float] = {}
    stack = [stats]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            node = getattr(node, "data", None)
            if not isinstance(node, dict):
                continue
        types, data = node.get("types"), node.get("data")
        if isinstance(types, dict) and isinstance(data, dict):
            for name, kind in types.items():
                values = data.get(name)
                if kind == "counter" and isinstance(values, dict):
                    total = sum(v for v in values.values() if isinstance(v, int | float) and not isinstance(v, bool))
                    out[name] = out.get(name, 0) + total
            continue
        stack.extend(node.values())
    return out


@dataclass(frozen=True)
class TierStatus:
    """The engine's host tier now: its settings, the blocks it holds (by its KV events: ``stored_blocks`` in,
    ``evicted_blocks`` out since the engine started), their size, and what it moved."""

    config: TierConfig
    blocks: int = 0
    block_bytes: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    io: TierIo = field(default_factory=TierIo)

    @property
    def used_bytes(self) -> int:
        return self.blocks * self.block_bytes
