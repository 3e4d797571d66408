"""A stalled engine (work and no step: ``p2pnode/engine/stall.py``): the watch's rule on an injected clock, then
in-process nodes over real loopback gRPC whose simulated engine stops stepping (``SimEngine.hang``, its requests and
state kept, as a SIGSTOPped vLLM core's; tests/slow/test_faults.py stops a real one). Before the watch such a node
held every request on its engine for as long as the engine stalled (forever, for a hung core), stayed SERVING, and
peers kept routing to it by its last load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from p2pnode.client import build_request, collect, wait_for_members
from p2pnode.config import EngineConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.engine.stall import StepWatch
from p2pnode.gossip.config import GossipConfig
from p2pnode.load import LOAD_KEY
from p2pnode.node import Node
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.unit.sim_nodes import BLOCK, SECRET

TIMEOUT_S = 30.0
PROMPT = list(range(200, 200 + 4 * BLOCK))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_idle_engine_never_stalls_and_a_busy_one_stalls_until_it_steps() -> None:
    clock = Clock()
    watch = StepWatch(10.0, clock)
    clock.t += 3600
    assert watch.stalled_s(0) == 0.0  # idle for an hour: nothing to step (and work that comes is timed from here)
    clock.t += 9.9
    assert watch.stalled_s(1) == 0.0  # within the timeout of the request's arrival
    clock.t += 0.2
    assert watch.stalled_s(1) == pytest.approx(10.1)
    assert watch.stalled_s(0) == pytest.approx(10.1)  # its requests aborted: still stalled until a step
    assert watch.stalled_s(1) > 0  # nor does new work reset it
    watch.stepped()
    assert watch.stalled_s(1) == 0.0
    clock.t += 5
    watch.stepped()
    clock.t += 9
    assert watch.stalled_s(3) == 0.0  # steps keep a long-running batch healthy
    assert StepWatch(0.0, clock).stalled_s(5) == 0.0  # 0 watches nothing
    with pytest.raises(ValueError, match="stall timeout"):
        StepWatch(-1.0)


def make_node(node_id: str, clock: Clock, seeds: tuple[str, ...] = ()) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("models/sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05),
        seeds=seeds,
    )
    engine = SimEngine(block_size=BLOCK, num_blocks=1024, max_model_len=4096, name=node_id, stall_timeout_s=5.0,
                       stall_clock=clock)
    return Node(config, engine)


async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    """Wait (polling) for ``condition()``; fail naming ``what`` after TIMEOUT_S."""
    async with asyncio.timeout(TIMEOUT_S):
        while not condition():
            await asyncio.sleep(0.02)
    assert condition(), what


async def health(node: Node) -> int:
    async with grpc.aio.insecure_channel(node.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


async def status(node: Node) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(node.address) as channel:
        return await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest())


async def generate(node: Node, prompt: list[int]) -> str:
    """Who served the request (its error's code and details when it failed)."""
    async with grpc.aio.insecure_channel(node.address) as channel:
        try:
            result = await collect(node_pb2_grpc.NodeStub(channel), build_request(prompt, max_tokens=8), timeout=60)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        return result.served_by


async def test_a_stalled_engine_fails_its_requests_refuses_new_ones_and_serves_again_when_it_steps() -> None:
    clock = Clock()
    node = make_node("solo", clock)
    await node.start()
    try:
        engine = node.engine
        assert isinstance(engine, SimEngine)
        assert await generate(node, PROMPT) == "solo"
        engine.hang()
        held = asyncio.ensure_future(generate(node, [*PROMPT, 1]))
        await until(lambda: engine.status().unfinished == 1, "the request reached the engine")
        clock.t += 4.0
        await node.check_engine()
        assert not held.done() and await health(node) == health_pb2.HealthCheckResponse.SERVING  # a slow step
        clock.t += 2.0
        await node.check_engine()
        outcome = await asyncio.wait_for(held, TIMEOUT_S)  # before the watch: held for as long as the engine hung
        assert outcome.startswith("UNAVAILABLE") and "engine stalled" in outcome, outcome
        assert await health(node) == health_pb2.HealthCheckResponse.NOT_SERVING
        s = await status(node)
        assert not s.load.healthy and s.load.stalled_s >= 5.0
        refused = await asyncio.wait_for(generate(node, [*PROMPT, 2]), TIMEOUT_S)
        assert refused.startswith("UNAVAILABLE") and "engine is stalled" in refused, refused
        assert node.readiness() == (False, "engine stalled")
        first_probe = node._probe_task
        assert first_probe is not None
        first_probe.cancel()  # a probe that could not enter the engine: the next tick sends another
        await asyncio.gather(first_probe, return_exceptions=True)
        await node.check_engine()
        assert node._probe_task is not None and node._probe_task is not first_probe

        engine.resume()  # the core steps again: the probe's step ends the stall
        await until(lambda: engine.status().healthy, "the engine stepped")
        await node.check_engine()
        assert await health(node) == health_pb2.HealthCheckResponse.SERVING
        assert await generate(node, [*PROMPT, 3]) == "solo"
        assert (await status(node)).load.stalled_s == 0.0
    finally:
        await node.stop()


async def test_peers_stop_routing_to_a_stalled_node_and_route_to_it_again_once_it_steps() -> None:
    """The stalled node takes its load out of gossip (a peer routes only where it knows the load), reversibly: a
    withdrawal, a dead engine's answer, would keep it out of routing for good."""
    clock = Clock()
    a = make_node("a", clock)
    await a.start()
    b = make_node("b", clock, seeds=(a.address,))
    await b.start()
    try:
        await wait_for_members([a.address, b.address], timeout_s=TIMEOUT_S, poll_s=0.05)
        assert a.peering is not None and b.agent is not None

        def b_routable() -> bool:
            return LOAD_KEY in a.agent.read(LOAD_KEY).get("b", {})  # type: ignore[union-attr]

        await until(b_routable, "a knows b's load")
        engine = b.engine
        assert isinstance(engine, SimEngine)
        engine.hang()
        held = asyncio.ensure_future(generate(b, PROMPT))
        await until(lambda: engine.status().unfinished == 1, "the request reached b's engine")
        clock.t += 6.0
        await b.check_engine()
        await asyncio.wait_for(held, TIMEOUT_S)  # ended (and retried at a: b is its own ingress)
        assert held.result() == "a", held.result()
        await until(lambda: not b_routable(), "a no longer sees b's load")
        for i in range(8):  # every request at a is served by a now, b's prefixes or not
            assert await generate(a, [*PROMPT, 10 + i]) == "a"
        assert not b.agent.withdrawn  # reversible: b stays a member

        engine.resume()
        await until(lambda: engine.status().healthy, "b's engine stepped")
        await b.check_engine()
        await until(b_routable, "a sees b's load again")
    finally:
        await b.stop()
        await a.stop()
