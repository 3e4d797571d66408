"""Where a cached block lives: the engine's own KV (GPU), the host-memory tier below it, or the disk tier below that.

vLLM's KV events name the medium of each stored or removed block (``"GPU"``, ``"CPU"``, and a secondary tier's
own name); ``Medium`` holds those names. A request reuses a prefix from a tier only after the engine's own hit and
contiguously (vLLM's offloading connector loads the blocks that follow the local hit), so what a node can reuse of a
prompt is a cumulative depth per tier: ``TierDepths``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Medium", "TierDepths"]


class Medium(enum.Enum):
    """A medium of cached KV, valued as vLLM's KV events name it."""

    GPU = "GPU"
    HOST = "CPU"
    DISK = "DISK"


@dataclass(frozen=True, slots=True)
class TierDepths:
    """A prompt's reusable prefix on one node, in blocks: ``gpu`` wholly in the engine's KV; ``host`` every block in
    the engine or the host tier (>= gpu); ``disk`` the same with the disk tier too (>= host)."""

    gpu: int
    host: int
    disk: int
