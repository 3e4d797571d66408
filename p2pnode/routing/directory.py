"""The seam between what an ingress knows about its peers and how it routes: the ``PeerDirectory`` protocol.

The node's directory is the ``ClusterView`` its gossip agent keeps current (``cluster_view.py``); the simulator's are
its gossip views (``p2pnode/sim/views.py``). The router (``router.py``) reads nothing else about peers, so the node and
the simulator route through the very same code over either.

Invariants a directory keeps: ``version`` moves whenever a peer's liveness, load or address changes (a router may
reuse what it derived from ``peers()`` until it does), and ``changes_since(v)`` names every peer changed after
version ``v`` (or None when it no longer knows); ``estimate_matches`` names only usable peers, each with a positive
estimate in blocks (peers it leaves out are estimated at 0).

A directory may also answer ``segment_holders(keys) -> {node id: [indices into keys]}``: which of a request's
segments each usable peer's segment store holds, as gossiped (``cache/segment_summary.py``); the router reads it for
approximate-mode segments and treats a directory without it as one where no peer holds any (``routing/segments.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from p2pnode.load import NodeLoad

__all__ = ["PeerDirectory", "PeerInfo"]


class PeerInfo(Protocol):
    """One peer as a directory knows it."""

    @property
    def node_id(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def usable(self) -> bool:
        """Alive or suspect: requests may be sent there."""
        ...

    @property
    def load(self) -> NodeLoad | None:
        """The last reported load; None before the first report (the peer is not a candidate until then)."""
        ...

    @property
    def load_age_s(self) -> float:
        """Seconds since the current load value arrived: sends after that cannot be in it yet."""
        ...

    @property
    def info_age_s(self) -> float:
        """Seconds since anything from the peer was last known current."""
        ...

    @property
    def cached_blocks(self) -> int:
        """Size of its (estimated) prefix cache, in blocks."""
        ...

    @property
    def kv_layout(self) -> str:
        """Its KV layout fingerprint ("" when it takes part in no KV transfer)."""
        ...


class PeerDirectory(Protocol):
    """Every known peer and a prefix-match estimate for each (see the module docstring)."""

    @property
    def version(self) -> int: ...

    def peers(self) -> Sequence[PeerInfo]:
        """Every known peer, possibly this node and unusable peers included (the router skips them)."""
        ...

    def peer(self, node_id: str) -> PeerInfo | None:
        """One peer, None when unknown (forgotten)."""
        ...

    def changes_since(self, version: int) -> Collection[str] | None:
        """The peers whose liveness, load or address changed after ``version``; None when the directory cannot
        tell (the reader then re-reads every peer)."""
        ...

    def estimate_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """``{node id: estimated cached prefix of the chain, in blocks}`` for the usable peers whose estimate > 0."""
        ...
