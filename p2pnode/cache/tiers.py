"""Where a cached block lives: the engine's own KV (GPU), the host-memory tier below it, or the disk tier below that.

vLLM's KV events name the medium of each stored or removed block (``"GPU"``, ``"CPU"``, and a secondary tier's
own name); ``Medium`` holds those names (``Medium.of_event`` reads one). A request reuses a prefix from a tier only
after the engine's own hit and contiguously (vLLM's offloading connector loads the blocks that follow the local hit),
so what a node can reuse of a prompt is a cumulative depth per tier: ``TierDepths``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from p2pnode.frozen import fast_init

__all__ = ["Medium", "TierDepths"]


class Medium(enum.Enum):
    """A medium that holds KV blocks (the value: vLLM's ``medium`` in KV events)."""

    GPU = "GPU"
    HOST = "CPU"
    DISK = "DISK"

    @classmethod
    def of_event(cls, medium: object) -> Medium | None:
        """The medium of a KV event's ``medium`` field: absent means the engine's own cache (vLLM leaves it out of
        GPU events when it equals the default); its secondary storage tiers ("STORAGE", a file system) are disk;
        anything else is a medium p2pnode does not index (None)."""
        if medium is None:
            return cls.GPU
        if not isinstance(medium, str):
            return None
        return _EVENT_MEDIA.get(medium.upper())


_EVENT_MEDIA = {"GPU": Medium.GPU, "CPU": Medium.HOST, "DISK": Medium.DISK, "STORAGE": Medium.DISK}


@fast_init
@dataclass(frozen=True, slots=True)
class TierDepths:
    """Cumulative depths, in blocks, of a prompt's prefix on one node: ``gpu`` blocks lie in the engine's KV cache;
    ``host`` (>= ``gpu``) is how far the prefix reaches with the host tier's blocks after those; ``disk`` (>= ``host``)
    likewise with the disk tier's after those. A request there reuses ``gpu`` blocks for free and loads ``host - gpu``
    from host memory and ``disk - host`` from disk (``cache/tier_index.py`` computes them as vLLM loads)."""

    gpu: int = 0
    host: int = 0
    disk: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.gpu <= self.host <= self.disk:
            raise ValueError(f"tier depths must be cumulative (0 <= gpu <= host <= disk), got {self}")

    @classmethod
    def gpu_only(cls, blocks: int) -> TierDepths:
        """The depths of a node without tiers (or of a prefix no tier extends)."""
        return cls(blocks, blocks, blocks)

    @property
    def host_blocks(self) -> int:
        """Blocks a request would load from host memory."""
        return self.host - self.gpu

    @property
    def disk_blocks(self) -> int:
        """Blocks a request would load from disk."""
        return self.disk - self.host
