"""A node's eviction policy end to end on the simulated engine: the flag's policy in the engine, ``adaptive``
switching from the requests it serves, and both in GetStatus and /metrics."""

from __future__ import annotations

import random
from pathlib import Path

import grpc

from p2pnode.api.metrics import MeshMetrics
from p2pnode.cli import build_parser
from p2pnode.client import build_request, collect
from p2pnode.config import EngineConfig, EvictionConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.node import Node
from p2pnode.serving.ingress import RequestCounters
from p2pnode.v1 import node_pb2, node_pb2_grpc

BLOCK = 32


async def _node(eviction: EvictionConfig, blocks: int = 48) -> tuple[Node, SimEngine]:
    engine = SimEngine(block_size=BLOCK, num_blocks=blocks, max_model_len=1024)
    config = NodeConfig(
        node_id="e1",
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        eviction=eviction,
    )
    node = Node(config, engine)
    await node.start()
    return node, engine


def test_the_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--node-id", "n", "--eviction-policy", "s3fifo"])
    assert args.eviction_policy == "s3fifo"
    assert build_parser().parse_args(["serve", "--model", "m", "--node-id", "n"]).eviction_policy == "adaptive"


async def test_a_static_policy_is_set_in_the_engine_and_shown() -> None:
    node, engine = await _node(EvictionConfig(policy="s3fifo"))
    try:
        assert engine._engine is not None and engine._engine.cache.policy.active_name == "s3fifo"
        async with grpc.aio.insecure_channel(node.address) as channel:
            status = await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest())
        assert (status.eviction.policy, status.eviction.active) == ("s3fifo", "s3fifo")
        assert not status.eviction.shadow_hit_rates  # no selector under a static policy
    finally:
        await node.stop()


async def test_adaptive_switches_the_engine_on_a_scan_heavy_stream() -> None:
    cfg = EvictionConfig(policy="adaptive", min_requests=50, period=25)
    node, engine = await _node(cfg)
    rng = random.Random(2)
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            scan = 1000
            for _ in range(400):  # 8 hot 3-block prompts read between one-time prompts: frequency wins
                if rng.random() < 0.5:
                    k = rng.randrange(8)
                    prompt = [k * 97 % 250 + 1] * 3 * BLOCK + [7]
                else:
                    scan += 1
                    prompt = [(scan * 31 + i) % 250 + 1 for i in range(3 * BLOCK + 1)]
                await collect(stub, build_request(prompt, max_tokens=1))
            status = await stub.GetStatus(node_pb2.GetStatusRequest())
        ev = status.eviction
        assert ev.policy == "adaptive" and ev.active != "lru" and ev.switches >= 1
        assert ev.observed_requests == ev.sampled_requests == 400 and ev.sample_rate == 1.0
        assert ev.shadow_hit_rates[ev.active] > ev.shadow_hit_rates["lru"]
        assert engine._engine is not None and engine._engine.cache.policy.active_name == ev.active
        index = status.index
        assert index.unknown_removals == 0 and index.orphaned_blocks == 0
        text = MeshMetrics(lambda: status, RequestCounters()).exposition().decode()
        assert f'p2pnode:eviction_policy{{active="{ev.active}",configured="adaptive"}} 1.0' in text
        assert 'p2pnode:eviction_shadow_hit_rate{policy="lru"}' in text
    finally:
        await node.stop()


class _Engine:
    """An engine that takes eviction switches (and fails the next one when asked to)."""

    def __init__(self) -> None:
        self.active = ""
        self.calls: list[str] = []
        self.fail_next = False

    def kv_capacity_blocks(self) -> int:
        return 200

    async def set_eviction(self, name: str) -> dict[str, str]:
        self.calls.append(name)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine busy")
        self.active = name
        return {"active": name}


async def test_the_shadows_keep_namespaces_apart_as_the_engine_does() -> None:
    """The selector's shadows hashed every request in the default namespace: the same tokens under an adapter and
    under a salt (kept apart by the engine and the index) hit each other there, inflating the shadows' hit rates."""
    from p2pnode.cache.namespace import CacheNamespace
    from p2pnode.engine.eviction_control import EvictionControl

    control = EvictionControl(EvictionConfig(policy="adaptive"), _Engine(), 4)
    await control.start()
    assert control.selector is not None
    prompt, output = list(range(1, 33)), [7] * 8
    control.observe_tokens(prompt, output, CacheNamespace("a", ""))
    control.observe_tokens(prompt, output, CacheNamespace("", "s"))
    assert control.selector.snapshot().hit_rates["lru"] == 0.0  # another namespace: nothing of it is cached
    control.observe_tokens(prompt, output, CacheNamespace("", "s"))
    assert control.selector.snapshot().hit_rates["lru"] > 0.0  # its own namespace again: a hit


async def test_a_switch_the_engine_failed_to_take_is_asked_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The selector reports a choice when it changes only: one failed set_eviction left the engine on the old
    policy for good while the status said the selector's."""
    import asyncio

    from p2pnode.engine import eviction_control
    from p2pnode.engine.eviction_control import EvictionControl

    monkeypatch.setattr(eviction_control, "APPLY_RETRY_S", 0.0)
    engine = _Engine()
    control = EvictionControl(EvictionConfig(policy="adaptive", min_requests=50, period=25), engine, 4)
    await control.start()
    assert control.selector is not None
    engine.fail_next = True
    rng = random.Random(0)
    hot = [[1000 * k + j for j in range(40)] for k in range(12)]
    for i in range(3000):
        tokens = rng.choice(hot) if rng.random() < 0.5 else [10**6 + 40 * i + j for j in range(40)]
        control.observe_tokens(tokens, [])
        await asyncio.sleep(0)
    assert control.selector.switches >= 1 and engine.calls.count(control.selector.active) >= 2  # failed, then again
    assert engine.active == control.selector.active == control.engine_policy
