"""How fast KV moves from each peer: the link figure a KV pull is priced with, per holder.

Every peer starts at the configured figure (``--kv-link-gbps``; 0 turns pulls off); each pull this ingress routed
and saw finish (its final message says how many bytes moved and how long it took) moves that holder's figure toward
the measured throughput (an exponentially weighted mean), so a slow or congested holder is priced as it is. A pull
that failed counts as a slow one: it cost a round trip and moved nothing useful.

Bounded: one float per peer ever seen, dropped with the peer (``forget``); a figure stays within
``MAX_LINK_FACTOR`` of the configured one either way (the report comes from the serving peer).
"""

from __future__ import annotations

import math

from p2pnode.config import KV_LINK_EWMA_WEIGHT, KV_LINK_MIN_MEASURED_BYTES

#: A measured figure is kept within this factor of the configured one, both ways: a report of 2**64 bytes in 5e-324 s
#: made a holder's figure inf for good (every pull from it priced free), one of NaN seconds turned its pulls off.
MAX_LINK_FACTOR = 1000.0

__all__ = ["LinkEstimates"]


class LinkEstimates:
    """Bytes per second a pull from each peer is expected to move (see the module docstring)."""

    def __init__(self, default_bytes_per_s: float) -> None:
        if default_bytes_per_s < 0:
            raise ValueError(f"default_bytes_per_s must be >= 0, got {default_bytes_per_s}")
        self.default = default_bytes_per_s
        self._measured: dict[str, float] = {}
        #: Bumped whenever a figure changes: readers that cache per-peer figures refresh them.
        self.version = 0

    @property
    def enabled(self) -> bool:
        return self.default > 0

    def get(self, node_id: str) -> float:
        """The figure for pulls from ``node_id`` (0 when pulls are off)."""
        if not self.enabled:
            return 0.0
        return self._measured.get(node_id, self.default)

    def observe(self, node_id: str, moved_bytes: int, seconds: float, ok: bool) -> None:
        """A pull from ``node_id`` finished: ``moved_bytes`` in ``seconds`` (``ok`` False: it failed)."""
        if not self.enabled or not math.isfinite(seconds) or seconds <= 0 or moved_bytes < 0:
            return
        if ok and moved_bytes < KV_LINK_MIN_MEASURED_BYTES:
            return  # too small to say anything about the link (the round trip dominates)
        rate = moved_bytes / seconds if ok else 0.0
        old = self._measured.get(node_id, self.default)
        new = (1 - KV_LINK_EWMA_WEIGHT) * old + KV_LINK_EWMA_WEIGHT * rate
        # a failing holder stays priced, not infinitely slow; no report makes one infinitely fast
        self._measured[node_id] = min(max(new, self.default / MAX_LINK_FACTOR), self.default * MAX_LINK_FACTOR)
        self.version += 1

    def forget(self, node_id: str) -> None:
        if self._measured.pop(node_id, None) is not None:
            self.version += 1
