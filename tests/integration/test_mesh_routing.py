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
from tests.integration.conftest import BLOCK_SIZE, channel, wait_idle, wait_until_status

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


async def summaries_of(mesh: dict[str, NodeProcess], holder: str) -> dict[str, int]:
    """How many of ``holder``'s summary hashes each other node has (0: none, or ``holder`` unknown there)."""
    seen = {}
    for other in mesh:
        if other != holder:
            m = member(await status(mesh[other].address or ""), holder)
            seen[other] = m.summary_hashes if m is not None else 0
    return seen


async def wait_summary_grows(mesh: dict[str, NodeProcess], holder: str, before: dict[str, int], nodes=None) -> None:  # type: ignore[no-untyped-def]
    """Until every other node (of ``nodes``) has a larger summary of ``holder``'s cache than ``before``: what the
    holder cached since reached them (a count above 0 is not enough on a mesh other tests used first)."""
    for other in nodes or before:
        await wait_until_status(
            mesh[other].address or "",
            lambda s, o=other: (m := member(s, holder)) is not None and m.summary_hashes > before[o],
            f"{holder}'s new prefix to reach {other}'s view of its summary",
        )


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
    before = await summaries_of(mesh, "n1")
    await wait_idle(mesh["n1"])
    first = await generate(mesh["n1"].address or "", [*shared, 11, 12, 13], max_tokens=4)
    assert first.served_by == "n1"  # nothing cached anywhere: the ingress serves it itself (no hop)
    await wait_summary_grows(mesh, "n1", before)
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
