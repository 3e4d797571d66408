"""The rate plan across a real (in-process, loopback gRPC) mesh of three nodes on simulated engines: the planner is
the smallest live id, every node adopts its plan, a dead planner's plan keeps working until the next planner takes
over with a newer epoch, and an older epoch never replaces a newer one."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import build_request, collect
from p2pnode.config import EngineConfig, NodeConfig, RoutingConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node
from p2pnode.plan.plan import GateReport
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.polling import until

BLOCK = 32
SECRET = b"unit-test-cluster-secret"


def make_node(node_id: str, seeds: tuple[str, ...] = (), gate: bool = False) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        routing=RoutingConfig(policy="cacheroute", plan_period_s=0.2, shadow_gate=gate),
        gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05),
        seeds=seeds,
    )
    return Node(config, SimEngine(block_size=BLOCK, num_blocks=4096, max_model_len=4096, name=node_id))


@pytest.fixture
async def mesh() -> AsyncIterator[dict[str, Node]]:
    n1 = make_node("n1")
    await n1.start()
    nodes = {"n1": n1}
    for name in ("n2", "n3"):
        nodes[name] = make_node(name, seeds=(n1.address,))
        await nodes[name].start()
    yield nodes
    for node in nodes.values():
        if not node._stopped.is_set():
            await node.stop(leave=False)


async def send_traffic(node: Node, keys: int, per_key: int) -> None:
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        for i in range(per_key):
            for k in range(keys):
                await collect(stub, build_request([10 + k] * (3 * BLOCK) + [i + 3], max_tokens=1, routing_key=f"k{k}"))


def plan_of(node: Node):
    return node.plan_sync.plan if node.plan_sync is not None else None


async def test_plan_is_built_by_the_smallest_live_id_and_fails_over(mesh: dict[str, Node]) -> None:
    await until(lambda: all(len(n.agent.usable_ids()) == 3 for n in mesh.values()), "convergence")
    await send_traffic(mesh["n2"], keys=4, per_key=6)
    await until(
        lambda: all(plan_of(n) is not None and len(plan_of(n).assignments) > 0 for n in mesh.values()),
        "every node to adopt a plan with warm keys",
    )
    assert {plan_of(n).planner_id for n in mesh.values()} == {"n1"}
    assert set(plan_of(mesh["n3"]).assignments) <= {f"k{k}" for k in range(4)}
    assert mesh["n1"].plan_sync.stats.plans_built > 0 and mesh["n2"].plan_sync.stats.plans_built == 0
    assert mesh["n2"].router.plan is plan_of(mesh["n2"])  # the router routes with it

    epoch_before = plan_of(mesh["n3"]).epoch
    await mesh["n1"].stop(leave=False)  # the planner dies without a word
    survivors = [mesh["n2"], mesh["n3"]]
    # Its last plan keeps working until gossip declares it dead and n2 takes over with a newer epoch.
    await until(
        lambda: all(plan_of(n).planner_id == "n2" and plan_of(n).epoch > epoch_before for n in survivors),
        "n2 to take over planning",
    )
    assert all("n1" not in ds for n in survivors for ds in plan_of(n).assignments.values())


async def test_an_older_epoch_never_replaces_a_newer_one(mesh: dict[str, Node]) -> None:
    await send_traffic(mesh["n1"], keys=2, per_key=4)
    await until(lambda: plan_of(mesh["n3"]) is not None, "a plan at n3")
    sync = mesh["n3"].plan_sync
    current = sync.plan
    older = dataclasses.replace(current, epoch=current.epoch - 1, planner_id="n0")
    sync._adopt(older)
    assert sync.plan.epoch >= current.epoch and sync.plan.planner_id != "n0"
    assert sync.stats.plans_ignored_older >= 1


async def test_a_new_planner_keeps_the_gate_verdict_of_the_plan_in_force() -> None:
    """The planner dies; the next one's own gate has no evidence yet. Before, its first plan turned affinity off
    for the whole mesh; now it carries the verdict (and the affinity) of the plan in force until it has its own."""
    n1 = make_node("n1", gate=True)
    await n1.start()
    nodes = [n1, make_node("n2", seeds=(n1.address,), gate=True), make_node("n3", seeds=(n1.address,), gate=True)]
    try:
        for node in nodes[1:]:
            await node.start()
        await until(lambda: all(len(n.agent.usable_ids()) == 3 for n in nodes), "convergence")
        verdict = GateReport(True, "affinity gains +20.0% KV hit", 300, 3, 0.6, 0.4, 0.2, 0.2, time.time())
        n1.plan_sync.gate.report = verdict  # what n1's replay concluded
        await send_traffic(n1, keys=2, per_key=4)
        await until(lambda: all(plan_of(n) is not None and plan_of(n).verdict == verdict for n in nodes),
                    "every node to hold a plan carrying n1's verdict")
        assert all(plan_of(n).affinity for n in nodes)
        status = await nodes[2].service.GetStatus(node_pb2.GetStatusRequest(), None)  # a non-planner's status
        assert status.plan.gate == verdict.reason and status.plan.affinity and status.plan.gate_requests == 300

        await n1.stop(leave=False)
        survivors = nodes[1:]
        await until(lambda: all(plan_of(n).planner_id == "n2" for n in survivors), "n2 to take over")
        assert nodes[1].plan_sync.gate.report is None  # n2 has no evidence of its own...
        assert all(plan_of(n).affinity and plan_of(n).verdict == verdict for n in survivors)  # ...and keeps n1's
    finally:
        for node in nodes:
            if not node._stopped.is_set():
                await node.stop(leave=False)


async def test_the_plan_counts_served_work_and_is_scored_against_what_was_served(
    mesh: dict[str, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ingress counts a request once served, with the work its engine reported (not the router's estimate or
    max_tokens); every node reads the others' served work from their gossiped loads, shows each destination's
    expected and served load, and scores each plan against what was served while it was in force."""
    await until(lambda: all(len(n.agent.usable_ids()) == 3 for n in mesh.values()), "convergence")
    served: dict[str, list[tuple[int, int, int]]] = {}  # key -> (prompt, cached, completion) as the engines reported
    ingress_sync = mesh["n2"].plan_sync
    observed: list[str] = []
    count = ingress_sync.served_request

    def counted(key: str, work: object) -> None:
        observed.append(key)
        count(key, work)

    monkeypatch.setattr(ingress_sync, "served_request", counted)
    async with grpc.aio.insecure_channel(mesh["n2"].address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        for i in range(8):
            for k in range(3):
                prompt = [10 + k] * (3 * BLOCK) + [i + 3]
                r = await collect(stub, build_request(prompt, max_tokens=3, routing_key=f"k{k}"))
                served.setdefault(f"k{k}", []).append((r.prompt_tokens, r.cached_tokens, r.completion_tokens))
    await until(lambda: len(observed) == 24, "the ingress to count the 24 requests once served")
    counted_rates = {kr.key: kr for kr in ingress_sync.sketch.top(10, time.time())}
    for key, finals in served.items():
        misses = [p - c for p, c, _ in finals]
        assert 0 < min(misses) < max(misses)  # the first request of a key misses, the next ones hit
        assert counted_rates[key].decode_tokens == pytest.approx(3.0)
        # the sketch's mean (weighted by a 30 s decay over a second: within 5% of the plain mean)
        assert counted_rates[key].uncached_tokens == pytest.approx(sum(misses) / len(misses), rel=0.05)

    sync = mesh["n3"].plan_sync
    await until(lambda: sync.stats.plans_scored > 0, "a plan scored at n3")
    status = await mesh["n3"].service.GetStatus(node_pb2.GetStatusRequest(), None)
    plan = status.plan
    assert plan.decode_token_cost == pytest.approx(5.34, abs=0.01)  # the default cost profile's (8B on H100)
    assert {d.node_id for d in plan.loads} == {"n1", "n2", "n3"} and sum(d.expected for d in plan.loads) > 0
    last = plan.last_score
    assert last.epoch > 0 and last.seconds > 0 and plan.plans_scored >= 1
    assert {d.node_id for d in last.destinations} == {"n1", "n2", "n3"}
    assert last.served_load == pytest.approx(sum(d.served for d in last.destinations))
    assert last.expected_imbalance >= 1.0 and last.served_imbalance >= 1.0
