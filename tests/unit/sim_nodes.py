"""In-process nodes on the simulated engine with the HTTP API on (the HTTP, metrics and auth unit tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from p2pnode.config import ClientApiConfig, EngineConfig, FlowConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node

BLOCK = 32
SECRET = b"unit-test-cluster-secret"


def make_node(node_id: str = "h1", *, token_delay_s: float = 0.0, seeds: tuple[str, ...] = (), mesh: bool = False,
              max_in_flight: int = 64, flow: FlowConfig | None = None, **api: Any) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("models/sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0", max_in_flight=max_in_flight),
        flow=flow or FlowConfig(),
        gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05) if mesh else None,
        seeds=seeds,
        api=ClientApiConfig(stats_interval_s=0, **api),
    )
    engine = SimEngine(block_size=BLOCK, num_blocks=1024, max_model_len=4096, token_delay_s=token_delay_s)
    return Node(config, engine)
