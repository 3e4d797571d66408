"""What an ingress knows about its peers in the simulator: the seam between routing and gossip.

The node's router reads a ``ClusterView`` (gossip) for every peer: an estimated prefix match for the request's
block chain, the peer's load, and how old that information is. In the simulator a ``SimView`` plays that part.
Three implementations (``SimConfig.gossip`` / ``p2pnode sim --gossip`` picks between the first two):
- ``StalenessGossip`` (``staleness.py``, ``--gossip model``, the default): each peer's real PrefixIndex (exact, not
  stride-sampled) and load, as of the last gossip round, heard by every ingress a fixed delay later; one shared
  view, O(blocks + nodes) per request;
- ``AgentGossip`` (``gossip_view.py``, ``--gossip agent``): a real ``GossipAgent`` per node on the in-memory
  transport, driven by ``des.LoopClock``; ``view_for(i)`` wraps ingress i's own ``ClusterView``
  (``estimate_all``: the stride-sampled summary, per-receiver delivery). About 5x slower on 30 nodes, and the
  reference the model is checked against (docs/simulator.md, "Gossip: model vs real agent");
- ``ExactView`` (here): every node's live index and load, for the ``oracle`` policy.

Only ``match_all`` and ``states`` are on the per-request path, so ``match_all`` answers for all nodes at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from p2pnode.sim.cluster import Cluster

__all__ = ["ExactView", "PeerState", "SimView"]


class PeerState:
    """One peer's load as the view holds it, and when the peer reported it."""

    __slots__ = ("cached_blocks", "kv_usage", "report_time", "running", "version", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.cached_blocks = 0
        self.report_time = 0.0
        self.version = 0  # bumped whenever any field changes: snapshot caches key on it


class SimView(Protocol):
    """A per-ingress picture of the cluster (see the module docstring)."""

    #: Whether the load fields are live (no in-flight correction needed): True only for the oracle.
    live: bool
    #: Bumped whenever any peer's state changes (cheap "anything new?" test for the router's caches).
    updates: int

    def start(self, cluster: Cluster) -> None:
        """Schedule whatever the view needs on the cluster's loop (gossip rounds)."""
        ...

    def view_for(self, ingress: int) -> SimView:
        """The view ingress ``ingress`` routes with (a shared object for models without per-node state)."""
        ...

    def states(self) -> Sequence[PeerState]:
        """Per node index, its load as this view believes it."""
        ...

    def match_all(self, hashes: Sequence[int], out: list[int]) -> list[int]:
        """``out[j]`` = node j's estimated cached prefix of ``hashes``, in blocks, for every node j; returns the
        nodes whose estimate is not 0 (any order)."""
        ...

    def gossip_bytes(self) -> int:
        """Bytes the gossip carried so far (0 when not modelled)."""
        ...


class ExactView:
    """Every node's live index and load: the oracle's "instantly shared" cache state."""

    live = True
    updates = 0  # unused: live views are read afresh on every request

    def __init__(self) -> None:
        self._cluster: Cluster | None = None
        self._states: list[PeerState] = []

    def start(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._states = [PeerState() for _ in cluster.engines]

    def view_for(self, ingress: int) -> ExactView:
        return self

    def states(self) -> Sequence[PeerState]:
        assert self._cluster is not None
        now = self._cluster.loop.now
        for st, eng in zip(self._states, self._cluster.engines, strict=True):
            st.running = eng.running
            st.waiting = eng.n_waiting + self._cluster.hop_counts[eng.idx]
            st.kv_usage = eng.kv_usage
            st.cached_blocks = len(eng.cache.refs)
            st.report_time = now
            st.version += 1
        return self._states

    def match_all(self, hashes: Sequence[int], out: list[int]) -> list[int]:
        assert self._cluster is not None
        for j, eng in enumerate(self._cluster.engines):
            out[j] = eng.cache.index.match_blocks(hashes)
        return [j for j, m in enumerate(out) if m]

    def gossip_bytes(self) -> int:
        return 0
