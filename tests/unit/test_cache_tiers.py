"""Media and tier depths (``cache/tiers.py``)."""

from __future__ import annotations

import pytest

from p2pnode.cache.tiers import Medium, TierDepths


def test_event_media_map_to_p2pnode_media() -> None:
    assert Medium.of_event(None) is Medium.GPU
    assert Medium.of_event("GPU") is Medium.GPU
    assert Medium.of_event("CPU") is Medium.HOST
    assert Medium.of_event("STORAGE") is Medium.DISK
    assert Medium.of_event("cpu") is Medium.HOST
    assert Medium.of_event("OBJECT") is None
    assert Medium.of_event(7) is None


def test_depths_are_cumulative() -> None:
    depths = TierDepths(2, 5, 9)
    assert (depths.host_blocks, depths.disk_blocks) == (3, 4)
    assert TierDepths.gpu_only(4) == TierDepths(4, 4, 4)
    with pytest.raises(ValueError):
        TierDepths(3, 2, 5)
    with pytest.raises(ValueError):
        TierDepths(-1, 0, 0)
