"""Peering: what a node tells its peers through gossip and what it hears of them, wired once for the node and the
simulator alike.

The gossip agent knows none of this (``gossip/agent.py``): the node publishes its load (``load.LoadPublisher``), its
cache summary (``cache/summary.SummaryPublisher``) and one per KV tier below its engine, its LoRA adapters
(``lora.AdapterPublisher``) and, when its engine keeps a segment store, the hot segment keys it holds
(``cache/segment_summary.SegmentPublisher``) at the start of each round, in that order, and reads every peer's
through a ``routing/cluster_view.ClusterView`` subscribed to the agent -- the directory its router routes with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segment_summary import SegmentPublisher
from p2pnode.cache.summary import SummaryPublisher
from p2pnode.cache.tiers import Medium
from p2pnode.config import DEFAULT_SEGMENT_SUMMARY_BYTES
from p2pnode.gossip.agent import GossipAgent
from p2pnode.load import LoadPublisher
from p2pnode.lora import AdapterPublisher, AdapterSet
from p2pnode.node_info import INFO_KEY, NodeInfo, encode_info
from p2pnode.routing.cluster_view import ClusterView

__all__ = ["Peering", "peer"]


@dataclass(frozen=True)
class Peering:
    """One node's side of the mesh: what it publishes and the view it routes with."""

    view: ClusterView
    load: LoadPublisher
    summary: SummaryPublisher
    adapters: AdapterPublisher | None = None
    #: The hot segment keys it publishes (None: its engine keeps no segment store).
    segments: SegmentPublisher | None = None
    #: The summaries of its KV tiers below the engine, by medium (empty: it has none).
    tiers: Mapping[Medium, SummaryPublisher] = field(default_factory=dict)

    def notify(self) -> None:
        """The node's indexes changed: publish soon."""
        self.summary.notify()
        for tier in self.tiers.values():
            tier.notify()


def peer(
    agent: GossipAgent,
    index: PrefixIndex,
    kv_layout: str = "",
    adapters: Callable[[], AdapterSet] | None = None,
    segment_holdings: Callable[[], Mapping[int, int]] | None = None,
    segment_summary_bytes: int = DEFAULT_SEGMENT_SUMMARY_BYTES,
    info: NodeInfo | None = None,
    tiers: Mapping[Medium, PrefixIndex] | None = None,
) -> Peering:
    """Publish ``index``'s summary and the node's load through ``agent`` (the load set with ``Peering.load.set``),
    and keep a ClusterView of every peer; the summary's stride and size bounds are the agent's configuration's, and
    it says whether the node's KV can move (``kv_layout``, "" when it takes part in no KV transfer). ``adapters``:
    the node's LoRA adapters now, published when they change (None: it serves none). ``segment_holdings``: the
    segment keys (-> tokens) the engine's store holds, oldest first; published within ``segment_summary_bytes``
    (None or 0 bytes: no segment keys are published). ``info``: its versions and served names, published once.
    ``tiers``: the exact index of each KV tier below the engine (a host tier...), each published as a summary of its
    own, with the engine's stride and the same hash budget as the engine's summary."""
    if info is not None:
        agent.publish(INFO_KEY, encode_info(info))
    load = LoadPublisher(agent, agent.config.load_updates_per_s)
    summary = SummaryPublisher(index, agent.config.summary_stride, agent.config.summary_max_hashes, kv_layout)
    summary.attach(agent, agent.config.summary_min_gap_s)  # node.py notifies it of every batch of cache events
    tier_summaries = {}
    for medium, tier_index in (tiers or {}).items():
        config = agent.config
        tier_summaries[medium] = SummaryPublisher(
            tier_index, config.summary_stride, config.summary_max_hashes, kv_layout, medium
        )
        tier_summaries[medium].attach(agent, config.summary_min_gap_s)
    publisher = AdapterPublisher(agent, adapters) if adapters is not None else None
    segments = None
    if segment_holdings is not None and segment_summary_bytes > 0:
        segments = SegmentPublisher(segment_holdings, segment_summary_bytes)
        segments.attach(agent)
    view = ClusterView.attach(agent, block_size=index.block_size)
    return Peering(view, load, summary, publisher, segments, tier_summaries)
