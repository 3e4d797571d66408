"""What a KV tier below the engine costs: the seconds to load a prefix's blocks back into the engine's KV.

A node's host-memory tier loads over PCIe at the profile's ``host_load_bytes_per_s``; its disk tier is read at
``disk_load_bytes_per_s`` into host memory first and then loaded like a host block (vLLM's tiering promotes a
secondary tier's blocks to the host tier before the engine reads them: staged, not pipelined), so a disk token costs
both. The engine's own KV (``Medium.GPU``) costs nothing. Stores are not priced: vLLM issues them asynchronously on
their own stream and a request never waits for one (``engine/simulated/tiers.py`` counts their bytes).

The router prices every candidate's tier blocks with ``load_seconds`` (``routing/policies/p2p.py``, through the
rates a policy is bound with, ``TierRates``) and the simulated engine delays a request's prefill by the same figure,
so the simulator and the node price a load alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the media are named, never built, here: cost stays below the cache layer
    from p2pnode.cache.tiers import Medium

__all__ = ["TierRates", "load_seconds"]


class TierBandwidths(Protocol):
    """What pricing a load reads of a cost profile (``CostProfile`` is one)."""

    kv_bytes_per_token: int
    host_load_bytes_per_s: float
    disk_load_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class TierRates:
    """The figures a load is priced with: KV bytes per token and the two tiers' read rates (0: no such tier)."""

    kv_bytes_per_token: int = 0
    host_load_bytes_per_s: float = 0.0
    disk_load_bytes_per_s: float = 0.0

    @classmethod
    def of(cls, profile: TierBandwidths) -> TierRates:
        return cls(profile.kv_bytes_per_token, profile.host_load_bytes_per_s, profile.disk_load_bytes_per_s)

    @property
    def host(self) -> bool:
        """A host tier can be priced (KV bytes and a host rate are known)."""
        return self.kv_bytes_per_token > 0 and self.host_load_bytes_per_s > 0

    @property
    def disk(self) -> bool:
        """A disk tier can be priced (it loads through the host tier: both rates are known)."""
        return self.host and self.disk_load_bytes_per_s > 0

    def seconds(self, medium: Medium, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens of KV from ``medium`` into the engine's KV (module docstring);
        ValueError for a tier the rates do not describe."""
        name = medium.name
        if name == "GPU" or tokens <= 0:
            return 0.0
        return self.host_seconds(tokens) if name == "HOST" else self.disk_seconds(tokens)

    def host_seconds(self, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens from the host tier."""
        if tokens <= 0:
            return 0.0
        if not self.host:
            raise ValueError(f"no host tier rate to price a load with: {self}")
        return tokens * self.kv_bytes_per_token / self.host_load_bytes_per_s

    def disk_seconds(self, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens from the disk tier: read into host memory, then loaded from there."""
        if tokens <= 0:
            return 0.0
        if not self.disk:
            raise ValueError(f"no disk tier rate to price a load with: {self}")
        return tokens * self.kv_bytes_per_token / self.disk_load_bytes_per_s + self.host_seconds(tokens)

    def load_seconds(self, host_tokens: int, disk_tokens: int) -> float:
        """A request's whole load: ``host_tokens`` from the host tier and ``disk_tokens`` from the disk tier."""
        return self.host_seconds(host_tokens) + self.disk_seconds(disk_tokens)


def load_seconds(profile: TierBandwidths, medium: Medium, tokens: int) -> float:
    """Seconds to load ``tokens`` tokens of KV from ``medium`` into the engine's KV, at ``profile``'s rates."""
    return TierRates.of(profile).seconds(medium, tokens)
