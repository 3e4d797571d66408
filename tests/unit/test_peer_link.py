"""The link an ingress keeps to each peer (p2pnode/serving/peer_link.py), on in-process nodes over real loopback gRPC
(simulated engines): many requests on one stream, each with exactly its own output; a slow reader holding back its
own request only; deadlines at either end; a link that breaks; an idle link closed; a peer without links; and the
Link RPC's checks (each request authenticated as a Forward call, a broken frame refusing the link, not the node)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from p2pnode.config import (
    LINK_MAX_OPEN_BYTES,
    LINK_MAX_PENDING_BYTES,
    EngineConfig,
    ForwardingConfig,
    NodeConfig,
    ServerConfig,
)
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node
from p2pnode.request import Request, SamplingOptions
from p2pnode.serving import forward
from p2pnode.serving.errors import ServeCode, TargetFailed
from p2pnode.serving.forward import LINK_METHOD, ForwardClient
from p2pnode.serving.peer_link import LinkedCall
from p2pnode.v1 import forward_pb2, node_pb2
from tests.polling import until
from tests.unit.test_forward_faults import hang_engine, stop

BLOCK = 32
SECRET = b"unit-test-cluster-secret"


def make_node(node_id: str, seeds: tuple[str, ...] = (), **forwarding: object) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05),
        seeds=seeds,
        forwarding=ForwardingConfig(**forwarding),  # type: ignore[arg-type]
    )
    return Node(config, SimEngine(block_size=BLOCK, num_blocks=4096, max_model_len=8192, name=node_id))


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    await stop(*made)


async def start_pair(nodes: list[Node], a_forwarding: dict[str, object] | None = None,
                     b_forwarding: dict[str, object] | None = None) -> tuple[Node, Node, ForwardClient]:
    b = make_node("B", **(b_forwarding or {}))
    await b.start()
    nodes.append(b)
    a = make_node("A", seeds=(b.address,), **(a_forwarding or {}))
    await a.start()
    nodes.append(a)
    await until(lambda: a.agent.generation_of("B") > 0, "A to know B's generation")  # type: ignore[union-attr]
    forwarder = a.ingress.forwarder  # type: ignore[union-attr]
    assert forwarder is not None
    return a, b, forwarder


def request(rid: str, max_tokens: int, prompt: tuple[int, ...] = (5, 6, 7), deadline: float | None = None) -> Request:
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)
    return Request(rid, list(prompt), sampling, deadline=deadline)


async def tokens_of(messages: AsyncIterator[node_pb2.GenerateResponse]) -> list[int]:
    out: list[int] = []
    async for message in messages:
        out.extend(message.token_ids)
    return out


def linked_calls(forwarder: ForwardClient, target: str) -> list[LinkedCall]:
    calls = [attempt.call for attempt in forwarder._attempts.get(target, ())]
    assert all(isinstance(call, LinkedCall) for call in calls)
    return calls  # type: ignore[return-value]


async def test_requests_to_one_peer_share_one_link_and_each_gets_exactly_its_output(nodes: list[Node]) -> None:
    a, b, forwarder = await start_pair(nodes)
    sizes = [3 + 7 * i for i in range(12)]
    outputs = await asyncio.gather(*(
        tokens_of(forwarder.stream("B", b.address, request(f"r{i}", n, (5, 6, 7 + i)))) for i, n in enumerate(sizes)
    ))
    assert [len(out) for out in outputs] == sizes  # every token of each, none of another's, none twice
    assert a.channels.links_opened == 1  # type: ignore[union-attr]
    assert b.forwarder_service.received == 12  # type: ignore[union-attr]
    again = await tokens_of(forwarder.stream("B", b.address, request("again", 4)))
    assert len(again) == 4 and a.channels.links_opened == 1  # type: ignore[union-attr]
    routing = a.service.status().routing  # type: ignore[union-attr]
    assert (routing.peer_links, routing.peer_links_opened) == (1, 1)  # what /metrics shows


async def test_a_slow_reader_holds_back_its_own_request_only(nodes: list[Node]) -> None:
    """With a window of 2 messages, a request nobody reads stops at B after 2 messages (B keeps it open, A buffers at
    most 2), while another request on the same link is served whole; read later, the first ends with every token."""
    a, b, forwarder = await start_pair(nodes, a_forwarding={"link_window": 2})
    slow = forwarder.stream("B", b.address, request("slow", 3000))
    first = await slow.__anext__()
    (call,) = linked_calls(forwarder, "B")
    await asyncio.sleep(0.2)  # B would have sent the rest by now without flow control
    assert len(call._items) <= 2
    assert len(b.local.in_flight) == 1  # held at B by its credit, not finished
    quick = await tokens_of(forwarder.stream("B", b.address, request("quick", 5, (8, 9))))
    assert len(quick) == 5 and a.channels.links_opened == 1  # type: ignore[union-attr]
    assert len(b.local.in_flight) == 1
    rest = await tokens_of(slow)
    assert len(first.token_ids) + len(rest) == 3000
    await until(lambda: len(b.local.in_flight) == 0, "B to finish the slow request")


async def test_a_request_past_its_deadline_fails_and_is_aborted_at_the_peer(nodes: list[Node]) -> None:
    a, b, forwarder = await start_pair(nodes)
    hang_engine(b)
    with pytest.raises(TargetFailed) as err:
        await tokens_of(forwarder.stream("B", b.address, request("late", 2, deadline=time.monotonic() + 0.5)))
    assert err.value.code == ServeCode.DEADLINE_EXCEEDED and not err.value.retryable
    await until(lambda: len(b.local.in_flight) == 0, "B to abort the request")
    assert a.channels.links_opened == 1  # type: ignore[union-attr]


async def test_a_link_that_breaks_fails_its_requests_retryably_and_the_next_opens_a_new_one(nodes: list[Node]) -> None:
    a, b, forwarder = await start_pair(nodes)
    hang_engine(b)
    waiting = [asyncio.ensure_future(tokens_of(forwarder.stream("B", b.address, request(f"w{i}", 2))))
               for i in range(3)]
    await until(lambda: len(b.local.in_flight) == 3, "the three requests to reach B")
    await b.server.stop(grace=None)  # type: ignore[union-attr]
    for task in waiting:
        with pytest.raises(TargetFailed) as err:
            await task
        assert err.value.code == ServeCode.UNAVAILABLE and err.value.retryable
    with pytest.raises(TargetFailed):
        await tokens_of(forwarder.stream("B", b.address, request("next", 2)))
    assert a.channels.links_opened == 2  # type: ignore[union-attr]


async def test_an_idle_link_is_closed_and_the_next_request_opens_another(nodes: list[Node]) -> None:
    a, b, forwarder = await start_pair(nodes, a_forwarding={"link_idle_s": 0.2})
    assert len(await tokens_of(forwarder.stream("B", b.address, request("one", 3)))) == 3
    await until(lambda: not a.channels._links, "A to close the idle link")  # type: ignore[union-attr]
    assert len(await tokens_of(forwarder.stream("B", b.address, request("two", 3)))) == 3
    assert a.channels.links_opened == 2  # type: ignore[union-attr]


async def test_a_peer_without_links_is_sent_a_call_per_request(
    nodes: list[Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer of a version before links answers the link UNIMPLEMENTED: the request on it goes by a call of its own,
    and so do the next ones, without another link."""
    with monkeypatch.context() as patch:
        patch.setattr(forward, "LINK_METHOD_NAME", "NotALink")  # the nodes register no Link method
        a, b, forwarder = await start_pair(nodes)
    assert len(await tokens_of(forwarder.stream("B", b.address, request("one", 3)))) == 3
    assert len(await tokens_of(forwarder.stream("B", b.address, request("two", 4)))) == 4
    assert a.channels.links_opened == 1 and b.forwarder_service.received == 2  # type: ignore[union-attr]
    assert list(a.channels._no_link_until) == [(b.address, "")]  # type: ignore[union-attr]


# --- the Link RPC as a peer sees it: frames written by hand ---------------------------------------------------


def sealed(a: Node, b: Node, rid: str, max_tokens: int = 2) -> bytes:
    message = forward_pb2.ForwardRequest(request_id=rid, prompt_token_ids=[5, 6, 7], origin="A", hop=1)
    message.sampling.max_tokens = max_tokens
    return a.agent.auth.seal(message.SerializeToString(), "B", b.agent.generation)  # type: ignore[union-attr]


def up(*opens: tuple[int, bytes, float], cancels: tuple[int, ...] = ()) -> bytes:
    frame = forward_pb2.LinkUp(cancels=cancels)
    for call_id, envelope, timeout_s in opens:
        frame.opens.add(id=call_id, envelope=envelope, timeout_s=timeout_s, credit=8)
    return frame.SerializeToString()


async def ends(call: grpc.aio.StreamStreamCall, count: int) -> dict[int, tuple[int, str, int]]:
    """Read until ``count`` requests ended: each one's (status code, details, response messages)."""
    got: dict[int, int] = {}
    done: dict[int, tuple[int, str, int]] = {}
    while len(done) < count:
        for event in forward_pb2.LinkDown.FromString(await asyncio.wait_for(call.read(), 10.0)).events:
            got[event.id] = got.get(event.id, 0) + event.HasField("response")
            if event.end:
                done[event.id] = (event.code, event.details, got[event.id])
    return done


async def test_each_request_on_a_link_is_authenticated_as_a_forward_call_is(nodes: list[Node]) -> None:
    """A captured envelope opened on a link is refused (UNAUTHENTICATED) like a replayed call, for that request only:
    the link goes on serving; the server ends a request past its own deadline, and refuses requests past its cap."""
    a_node, b_node, _ = await start_pair(nodes, b_forwarding={"max_link_requests": 3})
    envelope = sealed(a_node, b_node, "r1")
    async with grpc.aio.insecure_channel(b_node.address) as channel:
        call = channel.stream_stream(LINK_METHOD)()
        assert await call.read() == b""  # the hello
        await call.write(up((1, envelope, 10.0)))
        assert (await ends(call, 1))[1][0] == grpc.StatusCode.OK.value[0]
        await call.write(up((2, envelope, 10.0), (3, sealed(a_node, b_node, "r3"), 10.0)))
        done = await ends(call, 2)
        assert done[2][0] == grpc.StatusCode.UNAUTHENTICATED.value[0] and done[2][2] == 0
        assert done[3][0] == grpc.StatusCode.OK.value[0] and done[3][2] > 0
        release = hang_engine(b_node)
        opens = [(4 + i, sealed(a_node, b_node, f"h{i}"), 0.4) for i in range(4)]
        await call.write(up(*opens))
        done = await ends(call, 4)
        codes = sorted(code for code, _, _ in done.values())
        capped = [details for code, details, _ in done.values() if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]) == 3 and len(capped) == 1
        assert "the most one link carries" in capped[0]
        release.set()
        await until(lambda: len(b_node.local.in_flight) == 0, "B to abort the requests past their deadline")
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert b_node.forwarder_service.rejected == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (b"\xff\xff\xff", "not a LinkUp"),
        (up((5, b"", 1.0), (5, b"", 1.0)), "opens[1].id: 5 is not above the last opened (5)"),
        (up((0, b"", 1.0)), "opens[0].id: 0 is not above"),
    ],
)
async def test_a_broken_frame_refuses_the_link_and_the_node_serves_on(
    nodes: list[Node], frame: bytes, field: str
) -> None:
    b = make_node("B")
    await b.start()
    nodes.append(b)
    async with grpc.aio.insecure_channel(b.address) as channel:
        call = channel.stream_stream(LINK_METHOD)()
        assert await call.read() == b""
        await call.write(frame)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            for _ in range(3):  # the requests opened before the broken part may be answered first
                await asyncio.wait_for(call.read(), 10.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (err.value.details() or "")
        again = channel.stream_stream(LINK_METHOD)()
        assert await again.read() == b""  # a new link is served
        again.cancel()


async def test_a_request_given_up_mid_stream_ends_only_itself(nodes: list[Node]) -> None:
    """Requests on one link share its writes: giving one up while its message is being written must not end the
    others (it did: the write they all waited on was cancelled with the given-up request's task, and they stopped
    without an end, their ingress waiting for it until the client's deadline)."""
    a, b, forwarder = await start_pair(nodes)

    async def read(i: int) -> int:
        return len(await tokens_of(forwarder.stream("B", b.address, request(f"kept{i}", 300, (5, 6, 7 + i)))))

    async def give_up(i: int) -> None:
        messages = forwarder.stream("B", b.address, request(f"dropped{i}", 300, (9, 9, i)))
        read = 0
        async for _ in messages:  # (a fast engine's tokens may come in a few messages)
            read += 1
            if read > i % 5:
                break
        await messages.aclose()

    async def one_round(round_: int) -> list[int]:
        kept = [asyncio.ensure_future(read(i)) for i in range(6)]
        await asyncio.gather(*(give_up(10 * round_ + i) for i in range(6)))
        return await asyncio.gather(*kept)

    for round_ in range(3):
        assert await asyncio.wait_for(one_round(round_), 30.0) == [300] * 6
    assert a.channels.links_opened == 1  # type: ignore[union-attr]


async def test_a_request_opened_and_given_up_in_one_frame_frees_its_place_and_the_link_closes(
    nodes: list[Node],
) -> None:
    """A request given up before the ingress's writer sends its open goes out with its cancel in the same frame; the
    peer's task for it is then cancelled before it starts. Its place on the link must still be freed (it was not: a
    leak per such request until the link's cap refused every request, and the idle link never closed at either end,
    the peer waiting for that request to finish)."""
    a, b, forwarder = await start_pair(nodes, a_forwarding={"link_idle_s": 0.2}, b_forwarding={"max_link_requests": 3})
    assert len(await tokens_of(forwarder.stream("B", b.address, request("first", 3)))) == 3
    (link,) = a.channels._links.values()  # type: ignore[union-attr]
    for i in range(4):  # more than the peer's cap on one link
        call = link.open(sealed(a, b, f"gone{i}"), 5.0)
        call.cancel()  # before the writer runs: the open and its cancel in one frame
        assert len(await tokens_of(forwarder.stream("B", b.address, request(f"kept{i}", 3)))) == 3
    (session,) = b.forwarder_service._links  # type: ignore[union-attr]
    await until(lambda: not session.open, "B to forget the requests given up")
    await until(lambda: not a.channels._links and link.failed, "A to close the idle link")  # type: ignore[union-attr]
    await until(lambda: not b.forwarder_service._links, "B to end the link A closed")  # type: ignore[union-attr]


async def test_a_link_whose_writer_is_behind_takes_no_more_requests_and_they_go_by_calls(nodes: list[Node]) -> None:
    """What an ingress buffers for a link's writer is bounded (``LINK_MAX_PENDING_BYTES``): a link whose writes stall
    would otherwise hold every request sent its way. Past the bound a request goes by a call of its own and is served;
    once the writer catches up the link takes requests again."""
    a, b, forwarder = await start_pair(nodes, b_forwarding={"max_link_requests": 64})
    assert len(await tokens_of(forwarder.stream("B", b.address, request("first", 3)))) == 3
    (link,) = a.channels._links.values()  # type: ignore[union-attr]
    stuck = [link.open(b"\0" * LINK_MAX_OPEN_BYTES, 5.0) for _ in range(LINK_MAX_PENDING_BYTES // LINK_MAX_OPEN_BYTES)]
    assert not link.has_room  # nothing written yet: the writer has not run since
    messages = forwarder.stream("B", b.address, request("by-call", 3))
    first = await messages.__anext__()
    (attempt,) = forwarder._attempts["B"]
    assert not isinstance(attempt.call, LinkedCall)  # a call of its own
    assert len(first.token_ids) + len(await tokens_of(messages)) == 3
    for call in stuck:  # the peer refuses each (not an envelope): that request alone
        with pytest.raises(grpc.aio.AioRpcError):
            await tokens_of(call)
    await until(lambda: link.has_room, "the link's writer to catch up")
    assert len(await tokens_of(forwarder.stream("B", b.address, request("linked", 3)))) == 3
    assert a.channels.links_opened == 1  # type: ignore[union-attr]


async def test_a_request_that_cannot_fall_back_to_a_call_fails_retryably(
    nodes: list[Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer without links answers UNIMPLEMENTED; if its channel is closing by then (retired from the channel cache
    meanwhile), the request cannot fall back to a call: it must fail, retryably, not wait forever (it did: the
    fallback's error escaped and the request never ended)."""
    with monkeypatch.context() as patch:
        patch.setattr(forward, "LINK_METHOD_NAME", "NotALink")  # the nodes register no Link method
        a, b, _ = await start_pair(nodes)
    link = a.channels.link(b.address, "B")  # type: ignore[union-attr]
    assert link is not None
    call = link.open(sealed(a, b, "one"), None)
    closing = asyncio.ensure_future(link.channel.close(grace=5.0))  # new calls refused; the link's own finishes
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await asyncio.wait_for(tokens_of(call), 30.0)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # what the ingress retries elsewhere
    assert not link.calls and link.failed
    await closing


class _Context:
    """What a LinkSession uses of a server's call context: its peer and writes."""

    def __init__(self) -> None:
        self.written: list[forward_pb2.LinkDown] = []

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def write(self, data: bytes) -> None:
        self.written.append(forward_pb2.LinkDown.FromString(data))


async def test_a_half_closed_link_ends_at_once_when_its_node_stops() -> None:
    """An ingress that retires a link half-closes it and lets its open requests finish; if the serving node stops
    meanwhile, the link must end then (it waited for those requests instead: a stopping node held the stream until
    its server's grace ran out)."""
    from p2pnode.log_limit import LogLimiter
    from p2pnode.serving.peer_link import LinkSession

    async def serve_forever(*_: object) -> AsyncIterator[node_pb2.GenerateResponse]:
        await asyncio.Event().wait()  # an engine request still running
        yield node_pb2.GenerateResponse()

    session = LinkSession(serve_forever, _Context(), None, 8, LogLimiter(forward.log))  # type: ignore[arg-type]
    frames: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def read() -> AsyncIterator[bytes]:
        while (frame := await frames.get()) is not None:
            yield frame

    running = asyncio.ensure_future(session.run(read()))
    frames.put_nowait(up((1, b"envelope", 0.0)))
    frames.put_nowait(None)  # the ingress half-closes with request 1 open
    await until(lambda: frames.empty() and session.open, "the session to take the frames")
    assert not running.done()  # an open request keeps a half-closed link
    session.close()  # the node stops
    await asyncio.wait_for(running, 10.0)
    await until(lambda: not session.open, "the request's task to unwind")


async def test_a_call_cut_by_its_channels_eviction_fails_over_instead_of_hanging(
    nodes: list[Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More peers than ``max_peer_channels``: the least recently used channel is closed after a grace, which cancels
    the calls still on it. Such a request must fail as a broken link fails it (UNAVAILABLE, retried before output,
    migrated after); it was a bare CancelledError nobody asked for, which skipped the retry and left a client of
    several sequences waiting forever."""
    monkeypatch.setattr(forward, "CHANNEL_CLOSE_GRACE_S", 0.1)
    a, b, forwarder = await start_pair(nodes, a_forwarding={"peer_links": False})
    release = hang_engine(b)  # the call stays open at B
    reading = asyncio.ensure_future(tokens_of(forwarder.stream("B", b.address, request("evicted", 3))))
    await until(lambda: forwarder._attempts.get("B"), "A to call B")
    a.channels.max_channels = 1  # type: ignore[union-attr]
    a.channels.get("127.0.0.1:1", "C")  # type: ignore[union-attr]  # another peer's channel: B's is evicted
    with pytest.raises(TargetFailed) as failed:
        await asyncio.wait_for(reading, 30.0)
    assert failed.value.code == ServeCode.UNAVAILABLE and failed.value.retryable
    release.set()


async def test_a_busy_link_keeps_its_channel_when_others_are_evicted(nodes: list[Node]) -> None:
    """The channel pool evicts the least recently used channel: a link in use counts as use (it did not: the busiest
    peer's channel, opened first, was the first evicted, and its requests failed over every few minutes)."""
    a, b, forwarder = await start_pair(nodes)
    assert len(await tokens_of(forwarder.stream("B", b.address, request("first", 3)))) == 3
    a.channels.max_channels = 2  # type: ignore[union-attr]
    a.channels.get("127.0.0.1:1", "C")  # type: ignore[union-attr]
    assert len(await tokens_of(forwarder.stream("B", b.address, request("again", 3)))) == 3  # on the link
    a.channels.get("127.0.0.1:2", "D")  # type: ignore[union-attr]  # one channel too many: C's goes, not B's
    assert list(a.channels._channels) == [(b.address, ""), ("127.0.0.1:2", "")]  # type: ignore[union-attr]
    assert not next(iter(a.channels._links.values())).closed  # type: ignore[union-attr]
