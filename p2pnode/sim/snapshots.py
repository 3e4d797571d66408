"""How an ingress turns what it knows into ``PeerSnapshot``s: the router's field semantics, in one place.

``p2pnode/routing/router.py`` builds the same snapshots inline; these two functions are the shape a shared helper
could take there (then the simulator would import it from ``p2pnode.routing``):
- **self**: the exact local match (its own PrefixIndex), the engine's live load, ``in_flight`` 0 (the engine's
  counts are live), ``info_age_s`` 0, ``cached_blocks`` the index size;
- **a peer**: the larger of the gossiped estimate and the speculative index's, the peer's last reported load, the
  requests this ingress sent it since that report, the report's age, and its cache size as gossiped.
The optional ``active_blocks`` and ``prefill_backlog_tokens`` stay None, as the router leaves them.
"""

from __future__ import annotations

from p2pnode.routing.policies.types import PeerSnapshot

__all__ = ["peer_snapshot", "self_snapshot"]


def self_snapshot(
    node_id: str, match_blocks: int, running: int, waiting: int, kv_usage: float, cached_blocks: int
) -> PeerSnapshot:
    return PeerSnapshot(
        node_id, True, True, match_blocks, running, waiting, kv_usage, 0, 0.0, None, None, cached_blocks
    )


def peer_snapshot(
    node_id: str,
    est_match_blocks: int,
    running: int,
    waiting: int,
    kv_usage: float,
    in_flight: int,
    info_age_s: float,
    cached_blocks: int | None,
    alive: bool = True,
) -> PeerSnapshot:
    return PeerSnapshot(
        node_id,
        False,
        alive,
        est_match_blocks if alive else 0,
        running,
        waiting,
        kv_usage,
        in_flight,
        info_age_s,
        None,
        None,
        cached_blocks,
    )
