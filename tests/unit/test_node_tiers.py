"""A node with a host KV tier routes by it: its router reads the tier's index as deep as the tier holds a prompt past
the engine's hit (the simulated engine keeps no tier, so the tier's blocks are fed to the node's index as the KV
events of vLLM's offloading connector would be)."""

from __future__ import annotations

from pathlib import Path

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockStored
from p2pnode.cache.namespace import DEFAULT_NAMESPACE
from p2pnode.cache.tiers import Medium
from p2pnode.config import EngineConfig, NodeConfig, ServerConfig, TierConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.node import Node
from tests.requests import admitted

BLOCK = 32


async def _node(host_bytes: int, disk_path: str = "") -> Node:
    engine = SimEngine(block_size=BLOCK, num_blocks=48, max_model_len=1024)
    config = NodeConfig(
        node_id="t1",
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        tier=TierConfig(host_bytes=host_bytes, disk_path=disk_path),
    )
    node = Node(config, engine)
    await node.start()
    return node


def _stored_in_host_tier(node: Node, tokens: list[int], blocks: int, medium: Medium = Medium.HOST) -> None:
    hashes = block_hashes(tokens[: blocks * BLOCK], BLOCK, DEFAULT_NAMESPACE.root)
    node.tiers.apply(BlockStored(tuple(hashes), None, tuple(tokens[: blocks * BLOCK]), BLOCK, medium=medium))


async def test_the_router_counts_what_its_own_host_tier_holds() -> None:
    node = await _node(host_bytes=1 << 24)
    try:
        prompt = [(i * 7) % 250 + 1 for i in range(6 * BLOCK + 3)]
        _stored_in_host_tier(node, prompt, 4)
        route = node.router.route(admitted(prompt, request_id="tiered"))
        assert route.tier_depths == {"t1": 4}  # the engine holds none of it; its host tier the first four blocks
        assert route.estimated_tokens("t1") == 4 * BLOCK
    finally:
        await node.stop()


async def test_without_a_tier_the_router_reads_the_engine_alone() -> None:
    node = await _node(host_bytes=0)
    try:
        assert node.tiers.host is None and node.router.local_tiers is None
        prompt = [(i * 11) % 250 + 1 for i in range(3 * BLOCK + 1)]
        route = node.router.route(admitted(prompt, request_id="plain"))
        assert route.tier_depths is None and route.estimated_tokens("t1") == 0
    finally:
        await node.stop()


async def test_a_node_with_a_disk_tier_indexes_it_publishes_it_and_routes_by_it(tmp_path: Path) -> None:
    """Before, the node kept no index of its disk tier: the engine's disk events were dropped, its gossip said nothing
    of the disk, and its router saw only the host tier's depth (3 here)."""
    node = await _node(host_bytes=1 << 24, disk_path=str(tmp_path))
    try:
        prompt = [(i * 5) % 250 + 1 for i in range(6 * BLOCK + 3)]
        _stored_in_host_tier(node, prompt, 3)
        _stored_in_host_tier(node, prompt, 5, Medium.DISK)
        assert node.tiers.disk is not None and len(node.tiers.disk) == 5
        assert set(node.tiers.below()) == {Medium.HOST, Medium.DISK}  # what its gossip publishes a summary of
        route = node.router.route(admitted(prompt, request_id="on-disk"))
        assert route.tier_depths == {"t1": 5}
    finally:
        await node.stop()
