"""Forwarding between two in-process nodes over real loopback gRPC, on simulated engines (the real-vLLM mesh is in
tests/integration/test_mesh_routing.py): routing to the prefix holder, large forwarded prompts, retry before the
first token when the target is gone, and the Forward RPC's authentication and checks. Each test of the pair runs
over both transports: the link the ingress keeps to the peer, and a call per request (``--no-peer-links``, and what
a peer without links gets); tests/unit/test_peer_link.py tests the link's own behaviour."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from p2pnode.cache.block_hash import block_hashes, token_buffer
from p2pnode.client import build_request, collect
from p2pnode.config import DEFAULT_TENANT, EngineConfig, FlowConfig, ForwardingConfig, NodeConfig, ServerConfig
from p2pnode.engine.base import EngineRejected
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node
from p2pnode.request import Request, SamplingOptions
from p2pnode.serving.engine_queue import EngineQueue
from p2pnode.serving.errors import ServeCode, ServeError, TargetFailed, Throttle
from p2pnode.serving.forward import FORWARD_METHOD, forward_payload, request_of, to_forward
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc
from tests.polling import until

BLOCK = 32
SECRET = b"unit-test-cluster-secret"
MAX_LEN = 200_000


def make_node(
    node_id: str, seeds: tuple[str, ...] = (), listen: str = "127.0.0.1:0", peer_links: bool = True
) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen=listen),
        gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05),
        seeds=seeds,
        forwarding=ForwardingConfig(peer_links=peer_links),
    )
    return Node(config, SimEngine(block_size=BLOCK, num_blocks=8192, max_model_len=MAX_LEN, name=node_id))


@pytest.fixture(params=["link", "call"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Node, Node]]:
    links = request.param == "link"
    b = make_node("B", peer_links=links)
    await b.start()
    a = make_node("A", seeds=(b.address,), peer_links=links)
    await a.start()
    yield a, b
    if not links:
        assert a.channels.links_opened == 0  # type: ignore[union-attr]
    for node in (a, b):
        if node.service is not None and not node._stopped.is_set():
            await node.stop(leave=False)


async def generate(node: Node, prompt: list[int], **kw: object):
    async with grpc.aio.insecure_channel(node.address) as channel:
        return await collect(node_pb2_grpc.NodeStub(channel), build_request(prompt, **kw), timeout=30)  # type: ignore[arg-type]


def knows_summary(a: Node, peer: str) -> bool:
    view = a.peering.view  # type: ignore[union-attr]
    p = view.peer(peer)
    # and B's gossiped load says idle again: a busy holder may rightly lose to an idle ingress on a slow machine
    return p is not None and p.usable and p.load is not None and len(p.hashes) > 0 and not p.load.running


async def test_request_is_forwarded_to_the_prefix_holder(pair: tuple[Node, Node]) -> None:
    a, b = pair
    prefix = list(range(10, 10 + 8 * BLOCK))
    seeded = await generate(b, [*prefix, 1], max_tokens=2)
    assert seeded.served_by == "B"
    await until(lambda: knows_summary(a, "B"), "A to learn B's cache summary")
    result = await generate(a, [*prefix, 2, 3], max_tokens=3)
    assert (result.ingress, result.served_by, result.policy, result.attempts) == ("A", "B", "p2p", 1)
    assert result.cached_tokens == 8 * BLOCK
    assert result.estimated_match_tokens == 8 * BLOCK
    assert result.completion_tokens == 3
    assert b.forwarder_service is not None and b.forwarder_service.received == 1


async def test_a_token_id_prompt_is_admitted_with_its_wire_bytes(pair: tuple[Node, Node]) -> None:
    """What the router hashes for a client's token ids: their bytes from the wire, for every sequence of the call."""
    a, _ = pair
    assert a.forwarder_service is not None
    prompt = [7 + i % 500 for i in range(3 * BLOCK + 5)]
    message = build_request(prompt, max_tokens=2)
    message.n = 2
    call = await a.forwarder_service.admission.call([message], "grpc", lambda: "c1", None)
    assert [s.packed_tokens for s in call.sequences] == [bytes(token_buffer(prompt))] * 2
    assert [s.block_hashes(BLOCK) for s in call.sequences] == [block_hashes(prompt, BLOCK)] * 2


async def test_a_large_prompt_can_be_forwarded(pair: tuple[Node, Node]) -> None:
    a, b = pair
    prefix = [7 + i % 500 for i in range(4 * BLOCK)]
    await generate(b, [*prefix, 1], max_tokens=1)
    await until(lambda: knows_summary(a, "B"), "A to learn B's cache summary")
    big = [*prefix, *([300] * 150_000)]  # ~300 KB of token ids: above gossip's own 256 KiB envelope limit
    result = await generate(a, big, max_tokens=1)
    assert result.served_by == "B" and result.prompt_tokens == len(big)


async def test_target_gone_before_first_token_is_retried_elsewhere(pair: tuple[Node, Node]) -> None:
    a, b = pair
    prefix = list(range(20, 20 + 6 * BLOCK))
    await generate(b, [*prefix, 1], max_tokens=1)
    await until(lambda: knows_summary(a, "B"), "A to learn B's cache summary")
    await b.stop(leave=False)  # crash-like: no 'left', A still believes B is alive for a while
    result = await generate(a, [*prefix, 2], max_tokens=4)
    assert result.served_by == "A"
    assert result.attempts == 2
    assert result.completion_tokens == 4
    assert a.router.counters.retries == 1


async def test_forward_rejects_bad_envelopes_and_hops(pair: tuple[Node, Node]) -> None:
    a, b = pair
    request = forward_pb2.ForwardRequest(request_id="x", prompt_token_ids=[5, 6, 7], origin="A", hop=1)
    request.sampling.max_tokens = 1
    wrong = Authenticator(
        cluster_id="p2pnode", secret=b"another-cluster-secret!", sender_id="A", sender_address=a.address,
        sender_generation=1, wall_ms=lambda: time.time_ns() // 1_000_000, replay_window_s=60, max_seen_nonces=10,
        max_receive_bytes=1 << 20,
    )  # fmt: skip
    async with grpc.aio.insecure_channel(b.address) as channel:
        forward = channel.unary_stream(FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString)

        async def call(data: bytes) -> grpc.StatusCode:
            try:
                async for _ in forward(data, timeout=5):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        b_life = b.agent.generation  # type: ignore[union-attr]
        assert await call(wrong.seal(request.SerializeToString(), "B", b_life)) == grpc.StatusCode.UNAUTHENTICATED
        assert await call(b"\x00garbage") == grpc.StatusCode.INVALID_ARGUMENT
        auth = a.agent.auth  # type: ignore[union-attr]
        assert await call(auth.seal(request.SerializeToString(), "B", b_life)) == grpc.StatusCode.OK
        request.hop = 2
        assert await call(auth.seal(request.SerializeToString(), "B", b_life)) == grpc.StatusCode.INVALID_ARGUMENT
        request.hop, request.origin = 1, "someone-else"
        assert await call(auth.seal(request.SerializeToString(), "B", b_life)) == grpc.StatusCode.INVALID_ARGUMENT
    assert b.forwarder_service is not None and b.forwarder_service.rejected == 4


async def test_a_refusal_by_the_serving_engine_is_invalid_argument_and_never_retried(pair: tuple[Node, Node]) -> None:
    """An engine that refuses a request's values once it is running it (the ingress's own check passed) answers
    INVALID_ARGUMENT naming the field: not UNKNOWN, and not retried on another node, which would refuse it too."""
    a, b = pair
    prefix = list(range(30, 30 + 6 * BLOCK))
    await generate(b, [*prefix, 1], max_tokens=1)
    await until(lambda: knows_summary(a, "B"), "A to learn B's cache summary")
    original = b.engine.generate

    def refusing(request: Request, *args, **kwargs):  # type: ignore[no-untyped-def]
        if request.sampling.temperature > 1.5:
            raise EngineRejected("temperature", "must be in [0, 1.5] on this engine, got 1.9")
        return original(request, *args, **kwargs)

    b.engine.generate = refusing  # type: ignore[method-assign]
    for node in (a, b):  # forwarded (A -> B), and served where it arrived
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(node, [*prefix, 2], max_tokens=2, temperature=1.9)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("sampling.temperature: must be in [0, 1.5]")
    assert a.router.counters.retries == 0 and b.router.counters.retries == 0
    assert (a.ingress.counters.failed, b.ingress.counters.failed) == (1, 1)  # type: ignore[union-attr]


def test_the_tenant_travels_with_a_forwarded_request() -> None:
    sampling = SamplingOptions(max_tokens=3, temperature=0.0, top_p=1.0, top_k=0)
    request = Request("r1", [5, 6, 7], sampling, tenant="acme")
    message = to_forward(request, "A")
    assert message.tenant == "acme"
    assert request_of(message, sampling, 0.0).tenant == "acme"
    message.tenant = ""  # from a node that predates tenants
    assert request_of(message, sampling, 0.0).tenant == DEFAULT_TENANT


async def test_a_forwarded_prompt_read_once_by_admission_rebuilds_the_same_request(pair: tuple[Node, Node]) -> None:
    _, b = pair
    request = Request("r1", [5, 6, 7, 8], SamplingOptions(max_tokens=3, temperature=0.0, top_p=1.0, top_k=0))
    message = to_forward(request, "A")
    assert b.forwarder_service is not None
    sampling, tokens = b.forwarder_service.admission.forwarded(message, "A")
    assert tokens == [5, 6, 7, 8] and isinstance(tokens, list)
    assert request_of(message, sampling, 0.0, None, tokens) == request_of(message, sampling, 0.0)
    payload = forward_payload(request, "A")  # what the ingress sends: the prompt read back from these bytes
    assert forward_pb2.ForwardRequest.FromString(payload) == message
    assert b.forwarder_service.admission.forwarded(message, "A", payload) == (sampling, tokens)
    beyond = Request("r2", [5, 6, 1 << 20], request.sampling)  # past the vocabulary: refused naming the field
    with pytest.raises(ServeError, match=r"token 1048576 at position 2 is outside the vocabulary") as err:
        b.forwarder_service.admission.forwarded(to_forward(beyond, "A"), "A", forward_payload(beyond, "A"))
    assert err.value.field == "prompt_token_ids"


async def test_a_full_peer_refuses_forwarded_work_retryably_with_retry_after(pair: tuple[Node, Node]) -> None:
    """B, full with no room to queue, answers RESOURCE_EXHAUSTED with a retry-after: the ingress's attempt fails
    retryably (it tries the next node) and knows the peer is overloaded. With room, the request waits at B under
    the tenant its ingress named."""
    a, b = pair
    await until(lambda: a.peering.view.peer("B") is not None, "A to know B")  # type: ignore[union-attr]
    forwarder = a.ingress.forwarder  # type: ignore[union-attr]
    assert forwarder is not None
    sampling = SamplingOptions(max_tokens=3, temperature=0.0, top_p=1.0, top_k=0)
    b.local.queue = EngineQueue("B", 0, FlowConfig(max_queue_length=0))  # no slot, no queue
    b.local.queue.inside = 1  # and the spare slot for a tenant new to the engine taken
    with pytest.raises(TargetFailed) as err:
        async for _ in forwarder.stream("B", b.address, Request("full", [5, 6, 7], sampling)):
            pass
    e = err.value
    assert e.code == ServeCode.RESOURCE_EXHAUSTED and e.retryable
    assert e.throttle is Throttle.OVERLOAD and e.retry_after_s == 1.0
    b.local.queue = EngineQueue("B", 0, FlowConfig(max_queue_length=4))  # no slot, room to wait
    b.local.queue.inside = 1
    waiting = asyncio.ensure_future(
        _drain(forwarder.stream("B", b.address, Request("w", [5, 6], sampling, tenant="acme")))
    )
    await until(lambda: b.local.queue.waiting_by_tenant() == {"acme": 1}, "the request to wait at B as acme's")
    waiting.cancel()
    await until(lambda: len(b.local.queue) == 0, "the ingress's cancel to take it out of B's queue")


async def _drain(stream: AsyncIterator[node_pb2.GenerateResponse]) -> None:
    async for _ in stream:
        pass


def test_a_peers_retry_after_is_a_finite_bounded_delay() -> None:
    """``inf``, ``1e999`` or ``nan`` in a peer's retry-after made the ingress's answer INTERNAL (math.ceil raised
    building its own retry-after) where it is RESOURCE_EXHAUSTED; a huge one is kept to an hour."""
    from p2pnode.serving.retry_after import MAX_RETRY_AFTER_S, retry_after_of, trailing_metadata

    def refusal(value: str) -> grpc.aio.AioRpcError:
        trailing = grpc.aio.Metadata(("retry-after", value))
        return grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailing, "overloaded")

    for value in ("inf", "1e999", "nan", "-inf"):
        assert retry_after_of(refusal(value)) is None
    assert retry_after_of(refusal("1e9")) == MAX_RETRY_AFTER_S
    assert retry_after_of(refusal("2.5")) == 2.5 and trailing_metadata(2.5) == (("retry-after", "3"),)
