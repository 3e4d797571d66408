"""What an ingress knows about its peers in the simulator: each ingress routes through the node's own ``Router``
over a ``PeerDirectory`` (``p2pnode/routing/directory.py``), and a ``SimView`` hands it one.

Three views (``SimConfig.gossip`` / ``p2pnode sim --gossip`` picks between the first two):
- ``StalenessGossip`` (``staleness.py``, ``--gossip model``, the default): each peer's real PrefixIndex (exact, not
  stride-sampled) and load, as of the last gossip round, heard by every ingress a fixed delay later; one directory
  shared by every ingress, O(blocks + matching peers) per request;
- ``AgentGossip`` (``gossip_view.py``, ``--gossip agent``): a real ``GossipAgent`` per node on the in-memory
  transport; ingress i's directory *is* its agent's ``ClusterView``, the object the node's router reads;
- ``ExactView`` (here): every node's live index, load, segment store and KV tiers, for the ``upper-bound`` reference.

A view reads the mesh through ``MeshParts`` -- the loop, the node ids, the engines -- never the ``Cluster`` itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from p2pnode.cache.tiers import Medium
from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.load import NodeLoad
from p2pnode.routing.directory import PeerDirectory
from p2pnode.sim.des import EventLoop

__all__ = ["ExactView", "MeshParts", "PeerState", "SimView"]


@dataclass(frozen=True)
class MeshParts:
    """What a view may read of the simulated mesh."""

    loop: EventLoop
    node_ids: tuple[str, ...]
    engines: Sequence[NodeEngine]
    #: Whether the run is over (periodic tasks stop scheduling themselves then).
    is_done: Callable[[], bool]
    #: Per node, the forwarded requests on their way to it (sent, not yet delivered, or waiting for a KV pull there).
    in_transit: Sequence[int]
    #: Every node's KV layout fingerprint: the same non-empty one when the run moves KV (``SimConfig.routing``'s
    #: ``kv_link_gbps``), "" when it does not. Every view publishes it as a node's summary does.
    kv_layout: str = ""


class PeerState:
    """One peer as a simulated directory holds it: a ``PeerInfo`` with the load it last reported.

    Every simulated node has published an idle load before traffic starts (a node publishes its load before it
    joins: ``Node.start``), so every peer is a candidate from time 0.
    """

    __slots__ = ("_lag_s", "_loop", "address", "cached_blocks", "kv_layout", "load", "node_id", "report_time")

    usable = True

    def __init__(self, node_id: str, loop: EventLoop, lag_s: float = 0.0) -> None:
        """Ages are read off ``loop``'s clock, ``lag_s`` behind it (read on every routed request: no callable)."""
        self.node_id = node_id
        self.address = node_id  # addresses only name the peer in the simulator
        self._loop = loop
        self._lag_s = lag_s
        self.load = NodeLoad(prefill_backlog_tokens=0)
        self.cached_blocks = 0
        self.kv_layout = ""  # every simulated node's KV is interchangeable when the run moves KV (set by the view)
        self.report_time = 0.0  # when the ingress received the current load (its sends after that are not in it)

    @property
    def load_age_s(self) -> float:
        return self._loop.now - self._lag_s - self.report_time

    @property
    def info_age_s(self) -> float:
        return self._loop.now - self._lag_s - self.report_time


class SimView(Protocol):
    """Per-ingress directories over the simulated mesh (see the module docstring)."""

    def start(self, mesh: MeshParts) -> None:
        """Schedule whatever the view needs on the mesh's loop (gossip rounds)."""
        ...

    def directory_for(self, ingress: int) -> PeerDirectory:
        """The directory ingress ``ingress`` routes with (a shared object for models without per-node state)."""
        ...

    def gossip_bytes(self) -> int:
        """Bytes the gossip carried so far (0 when not modelled)."""
        ...


class ExactView:
    """Every node's live index and load: ``upper-bound``'s "instantly shared" cache state.

    Live: ``version`` changes at every read, so a router rebuilds its peer table for every request, and a load is
    newer than any send (``load_age_s`` is slightly negative), so no send counts as in flight on top of it; requests
    on their way to a node count as waiting there.
    """

    def __init__(self) -> None:
        self._mesh: MeshParts | None = None
        self._states: list[PeerState] = []
        self._versions = itertools.count()

    def start(self, mesh: MeshParts) -> None:
        self._mesh = mesh
        self._states = [PeerState(nid, mesh.loop, 1e-9) for nid in mesh.node_ids]
        for st in self._states:
            st.kv_layout = mesh.kv_layout

    def directory_for(self, ingress: int) -> ExactView:
        return self

    @property
    def version(self) -> int:
        return next(self._versions)

    def peers(self) -> Sequence[PeerState]:
        mesh = self._mesh
        assert mesh is not None
        now = mesh.loop.now
        for st, eng, transit in zip(self._states, mesh.engines, mesh.in_transit, strict=True):
            st.load = NodeLoad(
                running=eng.running, waiting=eng.n_waiting + transit, kv_usage=eng.kv_usage,
                prefill_backlog_tokens=eng.prefill_backlog_tokens,
                urgent_waiting=eng.urgent_waiting if eng.priority_policy else 0,
                urgent_backlog_tokens=eng.urgent_backlog_tokens if eng.priority_policy else None,
            )
            st.cached_blocks = len(eng.cache.refs)
            st.report_time = now
        return self._states

    def peer(self, node_id: str) -> PeerState | None:
        return next((st for st in self.peers() if st.node_id == node_id), None)

    def changes_since(self, version: int) -> None:
        return None  # every load is live: re-read them all

    def segment_holders(self, keys: Sequence[int]) -> dict[str, list[int]]:
        """Every node's live segment store (``PeerDirectory.segment_holders``)."""
        mesh = self._mesh
        assert mesh is not None
        out: dict[str, list[int]] = {}
        for node_id, eng in zip(mesh.node_ids, mesh.engines, strict=True):
            segments = eng.segments
            if segments is not None and segments.store is not None:
                held = [i for i, key in enumerate(keys) if segments.holds(key)]
                if held:
                    out[node_id] = held
        return out

    def estimate_matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        mesh = self._mesh
        assert mesh is not None
        out: dict[str, int] = {}
        for node_id, eng in zip(mesh.node_ids, mesh.engines, strict=True):
            m = eng.cache.index.match_blocks(block_hashes)
            if m:
                out[node_id] = m
        return out

    def estimate_tier_matches(self, block_hashes: Sequence[int], medium: Medium) -> dict[str, int]:
        """Every node's live cumulative depth of the chain in its engine and tiers down to ``medium``'s, for the nodes
        with such a tier whose depth is not 0 (``staleness.StalenessGossip.estimate_tier_matches``)."""
        mesh = self._mesh
        assert mesh is not None
        out: dict[str, int] = {}
        n = len(block_hashes)
        for node_id, eng in zip(mesh.node_ids, mesh.engines, strict=True):
            tiers = eng.cache.tiers
            if tiers is None or (medium is Medium.DISK and tiers.disk is None):
                continue
            gpu = eng.cache.index.match_blocks(block_hashes)
            host, disk = tiers.depths(block_hashes, gpu, n)
            depth = host if medium is Medium.HOST else disk
            if depth:
                out[node_id] = depth
        return out

    def gossip_bytes(self) -> int:
        return 0
