"""Forwarding under faults, on two in-process nodes over real loopback gRPC (simulated engines): a peer
that never sends its first token, a peer that turns suspect while calls to it wait, peers not trusted routed last,
and a captured Forward envelope replayed to its receiver, to another node and to its sender."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import build_request, collect
from p2pnode.config import EngineConfig, ForwardingConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node
from p2pnode.request import Request
from p2pnode.serving.forward import FORWARD_METHOD
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc
from tests.polling import until

BLOCK = 32
SECRET = b"unit-test-cluster-secret"


def make_node(node_id: str, seeds: tuple[str, ...] = (), first_token_timeout_s: float = 30.0) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        gossip=GossipConfig(
            cluster_secret=SECRET, interval_s=0.05, fd_initial_interval_s=0.1, fd_max_interval_s=1.0
        ),
        seeds=seeds,
        forwarding=ForwardingConfig(first_token_timeout_s=first_token_timeout_s),
    )
    return Node(config, SimEngine(block_size=BLOCK, num_blocks=4096, max_model_len=4096, name=node_id))


async def start_pair(first_token_timeout_s: float = 30.0) -> tuple[Node, Node]:
    b = make_node("B")
    await b.start()
    a = make_node("A", seeds=(b.address,), first_token_timeout_s=first_token_timeout_s)
    await a.start()
    return a, b


async def stop(*nodes: Node) -> None:
    for node in nodes:
        if node.service is not None and not node._stopped.is_set():
            await node.stop(leave=False)


async def generate(node: Node, prompt: list[int], **kw: object):  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(node.address) as channel:
        return await collect(node_pb2_grpc.NodeStub(channel), build_request(prompt, **kw), timeout=60)  # type: ignore[arg-type]


def hang_engine(node: Node) -> asyncio.Event:
    """Make ``node``'s engine accept requests and never produce a token (until the returned event is set)."""
    original = node.engine.generate
    release = asyncio.Event()

    async def stuck(request: Request, *args, **kwargs):  # type: ignore[no-untyped-def]
        await release.wait()
        async for chunk in original(request, *args, **kwargs):
            yield chunk

    node.engine.generate = stuck  # type: ignore[method-assign]
    return release


async def warm(a: Node, b: Node, prefix: list[int]) -> None:
    """B holds ``prefix``, A knows it (so A routes requests sharing it to B) and trusts B."""
    await generate(b, [*prefix, 1], max_tokens=1)
    view = a.peering.view  # type: ignore[union-attr]

    def ready() -> bool:
        p = view.peer("B")
        return p is not None and p.usable and len(p.hashes) > 0 and a.agent.trusted("B")  # type: ignore[union-attr]

    await until(ready, "A to learn B's cache summary and see it alive")


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    await stop(*made)


async def test_a_peer_without_a_first_token_is_abandoned_and_the_request_retried(nodes: list[Node]) -> None:
    """Before the hardening a forwarded call had no timeout when the client set none: a peer whose engine never answered
    held the request forever. Now the first-token timeout cancels it there and the next node serves it, once."""
    a, b = await start_pair(first_token_timeout_s=1.0)
    nodes += [a, b]
    prefix = list(range(40, 40 + 6 * BLOCK))
    await warm(a, b, prefix)
    hang_engine(b)
    started = time.monotonic()
    result = await generate(a, [*prefix, 2], max_tokens=4, ignore_eos=True)
    took = time.monotonic() - started
    assert (result.served_by, result.attempts, result.completion_tokens) == ("A", 2, 4)
    assert len(result.token_ids) == 4  # nothing duplicated
    assert 1.0 <= took < 10.0
    assert a.ingress.forwarder.abandoned["first_token_timeout"] == 1  # type: ignore[union-attr]
    await until(lambda: len(b.local.in_flight) == 0, "B to abort the abandoned request")


async def test_calls_to_a_peer_turning_suspect_are_retried_elsewhere_before_the_timeout(nodes: list[Node]) -> None:
    """A frozen peer (here: its engine stuck and its gossip silent) held every call forwarded to it for the whole
    freeze. Now the calls waiting for a first token are cancelled when gossip turns it suspect, and retried."""
    a, b = await start_pair(first_token_timeout_s=60.0)
    nodes += [a, b]
    prefix = list(range(60, 60 + 6 * BLOCK))
    await warm(a, b, prefix)
    hang_engine(b)
    calls = [asyncio.create_task(generate(a, [*prefix, 3 + i], max_tokens=3, ignore_eos=True)) for i in range(3)]
    await until(lambda: len(b.local.in_flight) == 3, "the three calls to reach B")
    started = time.monotonic()
    await b.agent.stop(leave=False)  # B's heartbeats stop: A sees it suspect within a few 50 ms intervals
    results = await asyncio.gather(*calls)
    assert time.monotonic() - started < 15.0  # far below the 60 s first-token timeout
    assert all((r.served_by, r.completion_tokens, len(r.token_ids)) == ("A", 3, 3) for r in results)
    abandoned = a.ingress.forwarder.abandoned  # type: ignore[union-attr]
    assert abandoned["peer_suspect"] + abandoned["peer_dead"] == 3 and abandoned["first_token_timeout"] == 0
    assert not a.agent.trusted("B")  # type: ignore[union-attr]
    # B is still a candidate (suspect peers are usable) but no longer the first: a new request goes to A directly
    again = await generate(a, [*prefix, 9], max_tokens=2)
    assert (again.served_by, again.attempts) == ("A", 1)


async def test_a_captured_forward_is_served_once_by_its_receiver_and_refused_everywhere_else(
    nodes: list[Node],
) -> None:
    """Before the hardening a Forward envelope captured from A to B was served again by B's peers and by A itself (the
    MAC did not name the receiver; nonce caches are per node; Forward accepted the receiver's own id)."""
    a, b = await start_pair()
    nodes += [a, b]
    c = make_node("C", seeds=(b.address,))
    await c.start()
    nodes.append(c)
    request = forward_pb2.ForwardRequest(request_id="r1", prompt_token_ids=[5, 6, 7], origin="A", hop=1)
    request.sampling.max_tokens = 2
    b_life = b.agent.generation  # type: ignore[union-attr]
    captured = a.agent.auth.seal(request.SerializeToString(), "B", b_life)  # type: ignore[union-attr]
    as_b = b.agent.auth.seal(  # type: ignore[union-attr]
        request.SerializeToString().replace(b"\x22\x01A", b"\x22\x01B"), "B", b_life
    )

    async def send(node: Node, data: bytes) -> tuple[grpc.StatusCode, int]:
        tokens = 0
        async with grpc.aio.insecure_channel(node.address) as channel:
            forward = channel.unary_stream(FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString)
            try:
                async for message in forward(data, timeout=10):
                    tokens += len(message.token_ids)
            except grpc.aio.AioRpcError as e:
                return e.code(), tokens
        return grpc.StatusCode.OK, tokens

    assert await send(b, captured) == (grpc.StatusCode.OK, 2)
    for node in (b, c, a):
        assert await send(node, captured) == (grpc.StatusCode.UNAUTHENTICATED, 0), node.config.node_id
    assert await send(b, as_b) == (grpc.StatusCode.UNAUTHENTICATED, 0)  # never from the receiver's own id
    assert b.forwarder_service.rejected == 2 and c.forwarder_service.rejected == 1  # type: ignore[union-attr]
    assert a.forwarder_service.rejected == 1  # type: ignore[union-attr]
