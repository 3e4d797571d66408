"""Routing on the shared mesh (conftest.py): two real vLLM engines (n1, n2) and one simulated engine (n3), gossiping
over real gRPC with a shared cluster secret. This machine (2 cores, 24 GB) holds two tiny-model engines comfortably;
a third would only slow the suite, so n3 runs the simulated engine.

- Requests sharing a long prefix, sent to different ingress nodes, are served by the node holding the prefix, and
  that engine's own cached-token count confirms the hit.
- A serving node killed during a stream of requests: test_shutdown.py (it ends n2, so it runs after the others).
"""

from __future__ import annotations

import random

import pytest

from p2pnode.client import GenerateResult, build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import (
    BLOCK_SIZE,
    channel,
    stored_blocks,
    wait_idle,
    wait_summary_reaches,
    wait_until_status,
)

pytestmark = pytest.mark.integration

GOSSIP = ["--gossip-interval", "0.2"]
VOCAB = 512


def prompt(seed: int, blocks: int, tail: int = 7) -> list[int]:
    rng = random.Random(f"test_mesh_routing-{seed}")  # apart from the other modules' prompts on the shared mesh
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


@pytest.fixture
def mesh(shared_mesh: dict[str, NodeProcess]) -> dict[str, NodeProcess]:
    return shared_mesh


async def status(address: str) -> node_pb2.NodeStatus:
    async with channel(address) as ch:
        return await node_pb2_grpc.NodeStub(ch).GetStatus(node_pb2.GetStatusRequest(), timeout=5)


def member(s: node_pb2.NodeStatus, node_id: str) -> node_pb2.MemberStatus | None:
    return next((m for m in s.members if m.node_id == node_id), None)


async def generate(address: str, tokens: list[int], **kw: object) -> GenerateResult:
    async with channel(address) as ch:
        return await collect(node_pb2_grpc.NodeStub(ch), build_request(tokens, **kw), timeout=60)  # type: ignore[arg-type]


async def test_mesh_converges(mesh: dict[str, NodeProcess]) -> None:
    """Every node sees every node alive, at the address and generation that node reports for itself."""
    views = {}
    for node_id, node in mesh.items():
        views[node_id] = await wait_until_status(
            node.address or "",
            lambda s: sorted(m.node_id for m in s.members if m.state == "alive") == ["n1", "n2", "n3"],
            "three alive members",
        )
    selves = {m.node_id: (m.address, m.generation) for s in views.values() for m in s.members if m.is_self}
    assert sorted(selves) == ["n1", "n2", "n3"]
    assert selves["n1"][0] == mesh["n1"].address  # the address the others joined through
    for viewer, s in views.items():
        assert {m.node_id: (m.address, m.generation) for m in s.members} == selves, viewer


async def test_shared_prefix_goes_to_the_node_that_holds_it(mesh: dict[str, NodeProcess]) -> None:
    shared = prompt(1, blocks=6, tail=0)
    await wait_idle(mesh["n1"])
    stored = await stored_blocks(mesh["n1"])
    first = await generate(mesh["n1"].address or "", [*shared, 11, 12, 13], max_tokens=4)
    assert first.served_by == "n1"  # nothing cached anywhere: the ingress serves it itself (no hop)
    await wait_summary_reaches(mesh["n1"], [mesh["n2"], mesh["n3"]], stored, 6)
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
