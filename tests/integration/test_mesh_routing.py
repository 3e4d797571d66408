"""A three-node mesh on loopback: two real vLLM engines (n1, n2) and one simulated engine (n3), gossiping over real
gRPC with a shared cluster secret. This machine (2 cores, 24 GB) holds two tiny-model engines comfortably; a third
would only slow the suite, so n3 runs the simulated engine.

- Requests sharing a long prefix, sent to different ingress nodes, are served by the node holding the prefix, and
  that engine's own cached-token count confirms the hit.
- A serving node killed during a stream of requests: every request completes or fails with a clear status, none is
  lost or duplicated, and once gossip declares the node dead routing stops choosing it.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import GenerateResult, build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import BLOCK_SIZE, MULTI_ENGINE_ENV, make_sim_node, make_vllm_node

pytestmark = pytest.mark.integration

GOSSIP = ["--gossip-interval", "0.2"]
VOCAB = 512


def prompt(seed: int, blocks: int, tail: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    tmp = tmp_path_factory.mktemp("mesh")
    secret = tmp / "secret"
    secret.write_text("integration-test-cluster-secret\n")
    auth = ["--cluster-secret-file", str(secret), *GOSSIP]
    n1 = make_vllm_node(tiny_model, "n1", tmp, *auth, env=MULTI_ENGINE_ENV).start()
    seeds = ["--seeds", n1.address or ""]
    n2 = make_vllm_node(tiny_model, "n2", tmp, *auth, *seeds, env=MULTI_ENGINE_ENV)
    n3 = make_sim_node("n3", tmp, *auth, *seeds)
    starters = [threading.Thread(target=n.start) for n in (n2, n3)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    nodes = {"n1": n1, "n2": n2, "n3": n3}
    try:
        yield nodes
    finally:
        for node in nodes.values():
            node.kill()


async def status(address: str) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        return await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=5)


async def wait_for(address: str, predicate: Callable[[node_pb2.NodeStatus], bool], what: str) -> node_pb2.NodeStatus:
    """Poll a node's status until ``predicate`` holds (gossip converges asynchronously)."""
    for _ in range(300):
        s = await status(address)
        if predicate(s):
            return s
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last status of {address}: {s}")


def member(s: node_pb2.NodeStatus, node_id: str) -> node_pb2.MemberStatus | None:
    return next((m for m in s.members if m.node_id == node_id), None)


async def generate(address: str, tokens: list[int], **kw: object) -> GenerateResult:
    async with grpc.aio.insecure_channel(address) as channel:
        return await collect(node_pb2_grpc.NodeStub(channel), build_request(tokens, **kw), timeout=60)  # type: ignore[arg-type]


async def test_mesh_converges(mesh: dict[str, NodeProcess]) -> None:
    for node in mesh.values():
        s = await wait_for(
            node.address or "",
            lambda s: sorted(m.node_id for m in s.members if m.state == "alive") == ["n1", "n2", "n3"],
            "three alive members",
        )
        assert len({m.generation for m in s.members}) >= 1


async def test_shared_prefix_goes_to_the_node_that_holds_it(mesh: dict[str, NodeProcess]) -> None:
    shared = prompt(1, blocks=6, tail=0)
    first = await generate(mesh["n1"].address or "", [*shared, 11, 12, 13], max_tokens=4)
    assert first.served_by == "n1"  # nothing cached anywhere: the ingress serves it itself (no hop)
    for other in ("n2", "n3"):
        await wait_for(
            mesh[other].address or "",
            lambda s: (m := member(s, "n1")) is not None and m.summary_hashes > 0,
            "n1's cache summary to reach " + other,
        )
    for ingress, question in (("n2", [21, 22, 23]), ("n3", [31, 32, 33])):
        result = await generate(mesh[ingress].address or "", [*shared, *question], max_tokens=4)
        assert result.ingress == ingress
        assert result.served_by == "n1", result
        assert result.policy == "p2p"
        assert result.estimated_match_tokens >= 4 * BLOCK_SIZE  # summary stride 4: within 4 blocks of the truth
        # The real engine confirms: the whole shared prefix (6 blocks) came from its cache.
        assert result.cached_tokens == 6 * BLOCK_SIZE
        assert result.index_match_tokens == result.cached_tokens
    routing = (await status(mesh["n2"].address or "")).routing
    assert routing.forwarded >= 1 and routing.served >= 1


async def test_killing_a_target_mid_stream_loses_and_duplicates_nothing(mesh: dict[str, NodeProcess]) -> None:
    target = mesh["n2"]
    shared = prompt(2, blocks=8, tail=0)
    seeded = await generate(target.address or "", [*shared, 5], max_tokens=2)
    assert seeded.served_by == "n2"
    for other in ("n1", "n3"):
        await wait_for(
            mesh[other].address or "",
            lambda s: (m := member(s, "n2")) is not None and m.summary_hashes >= 2,
            "n2's summary to reach " + other,
        )

    ingresses = [mesh["n1"].address or "", mesh["n3"].address or ""]
    outcomes: dict[str, GenerateResult | grpc.aio.AioRpcError] = {}
    killed = asyncio.Event()

    async def one(i: int) -> None:
        rid = f"kill-{i}"
        try:
            outcomes[rid] = await generate(
                ingresses[i % 2], [*shared, 100 + i], max_tokens=48, ignore_eos=True, request_id=rid
            )
        except grpc.aio.AioRpcError as e:
            outcomes[rid] = e
        if i == 5:
            target.kill()  # SIGKILL the whole node (engine core included) while others stream from it
            killed.set()

    sent = 24
    await asyncio.gather(*(one(i) for i in range(sent)))
    assert killed.is_set()
    assert len(outcomes) == sent  # every request has exactly one outcome: nothing lost
    completed = {rid: r for rid, r in outcomes.items() if isinstance(r, GenerateResult)}
    failed = {rid: e for rid, e in outcomes.items() if isinstance(e, grpc.aio.AioRpcError)}
    for rid, r in completed.items():
        assert r.request_id == rid
        assert r.completion_tokens == 48 == len(r.token_ids), f"{rid}: output duplicated or cut: {r}"
    for rid, e in failed.items():
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), (rid, e)
        assert e.details(), rid
    assert any(r.served_by == "n2" for r in completed.values())  # the target did serve before it died

    # Once gossip declares n2 dead, routing no longer tries it: no retries, never served by n2.
    for ingress in ingresses:
        await wait_for(ingress, lambda s: (m := member(s, "n2")) is not None and m.state == "dead", "n2 declared dead")
    after = [await generate(ingresses[i % 2], [*shared, 200 + i], max_tokens=4) for i in range(6)]
    assert all(r.served_by != "n2" and r.attempts == 1 for r in after), after
