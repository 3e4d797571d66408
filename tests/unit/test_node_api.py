"""The Node gRPC API over real loopback gRPC, on the simulated engine (the real-vLLM path is in
tests/integration): validation, status codes, cancellation, drain, engine failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from p2pnode.api.grpc.reflection import V1_SERVICE
from p2pnode.client import build_request, collect
from p2pnode.config import EngineConfig, FlowConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.node import Node
from p2pnode.v1 import grpc_reflection_v1_pb2, grpc_reflection_v1_pb2_grpc, node_pb2, node_pb2_grpc
from tests.polling import until

BLOCK = 32


async def start_node(
    token_delay_s: float = 0.0, flow: FlowConfig | None = None, **server: object
) -> tuple[Node, SimEngine]:
    engine = SimEngine(block_size=BLOCK, num_blocks=64, max_model_len=1024, token_delay_s=token_delay_s)
    config = NodeConfig(
        node_id="t1",
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0", **server),  # type: ignore[arg-type]
        flow=flow or FlowConfig(),
    )
    node = Node(config, engine)
    await node.start()
    return node, engine


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    node, _ = await start_node(token_delay_s=0.001, max_receive_message_bytes=64 * 1024, max_in_flight=4)
    yield node
    await node.stop()


@pytest.fixture
async def stub(node: Node) -> AsyncIterator[node_pb2_grpc.NodeStub]:
    async with grpc.aio.insecure_channel(node.address) as channel:
        yield node_pb2_grpc.NodeStub(channel)


async def status(stub: node_pb2_grpc.NodeStub) -> node_pb2.NodeStatus:
    return await stub.GetStatus(node_pb2.GetStatusRequest())


async def test_generate_streams_tokens_and_reports_final(stub: node_pb2_grpc.NodeStub) -> None:
    result = await collect(stub, build_request("hello mesh", max_tokens=5))
    assert result.completion_tokens == 5 == len(result.token_ids)
    assert len(result.text) == 5
    assert result.prompt_tokens == len(b"hello mesh")
    assert result.served_by == "t1"
    assert result.finish_reason == "length"
    assert result.timings["total_s"] >= result.timings["ttft_s"] > 0


async def test_token_id_prompt_and_repeat_hits_cache(stub: node_pb2_grpc.NodeStub) -> None:
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    first = await collect(stub, build_request(prompt, max_tokens=2))
    assert first.cached_tokens == 0 and first.index_match_tokens == 0
    second = await collect(stub, build_request(prompt, max_tokens=2))
    assert second.cached_tokens == 3 * BLOCK
    assert second.index_match_tokens == second.cached_tokens
    assert second.tier_hits == {"gpu": 3 * BLOCK, "host": 0, "disk": 0, "pulled": 0}  # no tier here: all the engine's


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (build_request(""), "prompt.text"),
        (node_pb2.GenerateRequest(), "prompt"),
        (build_request([]), "prompt.token_ids"),
        (build_request([1, 2, 99999]), "prompt.token_ids"),
        (build_request([5] * 1024), "prompt.token_ids"),
        (build_request("x" * 1000, max_tokens=100), "sampling.max_tokens"),
        (build_request("hi", max_tokens=0), "sampling.max_tokens"),
        (build_request("hi", temperature=-0.5), "sampling.temperature"),
        (build_request("hi", temperature=float("nan")), "sampling.temperature"),
        (build_request("hi", top_p=0.0), "sampling.top_p"),
        (build_request("hi", top_p=1.5), "sampling.top_p"),
        (build_request("hi", top_k=-2), "sampling.top_k"),
        (build_request("hi", stop=[""]), "sampling.stop[0]"),
        (build_request("hi", stop=["s"] * 17), "sampling.stop"),
        (build_request("hi", request_id="r" * 129), "request_id"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    stub: node_pb2_grpc.NodeStub, request_: node_pb2.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    # ...and the node keeps serving.
    assert (await collect(stub, build_request("still up", max_tokens=1))).completion_tokens == 1


async def test_oversized_message_is_refused_and_node_survives(stub: node_pb2_grpc.NodeStub, node: Node) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, build_request("y" * (128 * 1024)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await collect(stub, build_request("ok", max_tokens=1))).served_by == "t1"


async def test_a_model_name_of_any_length_is_refused_naming_the_field(stub: node_pb2_grpc.NodeStub) -> None:
    """Before: echoed whole in NOT_FOUND: 20,000 characters came back as RESOURCE_EXHAUSTED "received metadata size
    exceeds hard limit" (the status text too long), 3 MB as an access-log line of 3 MB."""
    request_ = build_request("hi", max_tokens=1)
    request_.model = "m" * 20_000
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "model: at most 256 characters, got 20000"


async def test_a_request_whose_adapter_went_away_after_admission_fails_retryably(
    stub: node_pb2_grpc.NodeStub, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter unloaded while a request for it waited: the engine refuses it at generate time. It was a permanent
    INVALID_ARGUMENT, though a peer serving the adapter could serve it; it is UNAVAILABLE (retried elsewhere)."""
    from p2pnode.engine.base import AdapterNotServed

    async def unloaded(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        raise AdapterNotServed("adapter 'gone' is not served by this node")
        yield  # an async generator, as generate is

    monkeypatch.setattr(node.engine, "generate", unloaded)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, build_request("hi", max_tokens=1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not served by this node" in err.value.details()


async def test_duplicate_running_request_id_is_refused(stub: node_pb2_grpc.NodeStub) -> None:
    long = build_request("a", max_tokens=200, request_id="dup")
    call = stub.Generate(long)
    await call.read()  # first chunk: the request is running
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, build_request("b", max_tokens=1, request_id="dup"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()


async def test_in_flight_limit_gives_resource_exhausted() -> None:
    """Without a queue (--max-queue-length 0) a full node refuses at once, retry-after in the trailing metadata."""
    node, _ = await start_node(token_delay_s=0.001, flow=FlowConfig(max_queue_length=0), max_in_flight=4)
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            calls = [stub.Generate(build_request(f"p{i}", max_tokens=300)) for i in range(4)]
            for call in calls:
                await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, build_request("one too many", max_tokens=1))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_in_flight" in err.value.details()
            assert "overloaded" in err.value.details()
            assert dict(err.value.trailing_metadata())["retry-after"] == "1"
            for call in calls:
                call.cancel()
    finally:
        await node.stop()


async def test_beyond_in_flight_limit_a_request_waits_and_is_served(stub: node_pb2_grpc.NodeStub, node: Node) -> None:
    """With the default queue the one too many waits for a slot (counted in the gossiped load as waiting), and is
    served once one frees."""
    calls = [stub.Generate(build_request(f"p{i}", max_tokens=300)) for i in range(4)]
    for call in calls:
        await call.read()
    waiting = asyncio.ensure_future(collect(stub, build_request("one too many", max_tokens=1)))
    await until(lambda: len(node.local.queue) == 1, "the fifth to wait")
    assert node._node_load().waiting >= 1
    assert (await status(stub)).load.queued == 1
    calls[0].cancel()
    result = await waiting
    assert result.served_by == "t1" and result.completion_tokens == 1
    assert len(node.local.queue) == 0
    for call in calls[1:]:
        call.cancel()


async def test_client_cancel_aborts_engine_request(stub: node_pb2_grpc.NodeStub, node: Node) -> None:
    call = stub.Generate(build_request("cancel me", max_tokens=500))
    await call.read()
    assert (await status(stub)).load.engine_unfinished == 1
    call.cancel()
    async def dropped() -> node_pb2.NodeStatus | None:
        s = await status(stub)
        return s if s.load.engine_unfinished == 0 and s.load.in_flight == 0 else None

    s = await until(dropped, "the node to drop the cancelled request")
    assert s.requests_cancelled == 1


async def test_deadline_aborts_engine_request(stub: node_pb2_grpc.NodeStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, build_request("slow", max_tokens=1000), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def aborted() -> bool:
        return (await status(stub)).load.engine_unfinished == 0

    await until(aborted, "the engine to abort the request past its deadline")


async def test_health_and_reflection(node: Node) -> None:
    async with grpc.aio.insecure_channel(node.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="p2pnode.v1.Node"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in responses for s in r.list_services_response.service]
        assert "p2pnode.v1.Node" in names


async def test_reflection_v1_lists_and_describes_the_services(node: Node) -> None:
    """grpcurl, Postman and grpcui ask for reflection v1 first; grpcio-reflection ships only v1alpha (was
    UNIMPLEMENTED)."""
    async with grpc.aio.insecure_channel(node.address) as channel:
        refl = grpc_reflection_v1_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            grpc_reflection_v1_pb2.ServerReflectionRequest(list_services=""),
            grpc_reflection_v1_pb2.ServerReflectionRequest(file_containing_symbol="p2pnode.v1.Node"),
            grpc_reflection_v1_pb2.ServerReflectionRequest(file_containing_symbol=V1_SERVICE),
        ]
        listed, node_file, reflection_file = [r async for r in refl.ServerReflectionInfo(iter(requests))]
    names = {s.name for s in listed.list_services_response.service}
    assert {"p2pnode.v1.Node", V1_SERVICE, "grpc.reflection.v1alpha.ServerReflection"} <= names
    described = [descriptor_pb2.FileDescriptorProto.FromString(b).name
                 for b in node_file.file_descriptor_response.file_descriptor_proto]
    assert "p2pnode/v1/node.proto" in described
    assert reflection_file.file_descriptor_response.file_descriptor_proto, reflection_file


async def test_engine_failure_is_unavailable_and_health_not_serving() -> None:
    node, engine = await start_node()
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            engine.dead = True
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, build_request("hi", max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel)

            async def not_serving() -> bool:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

            await until(not_serving, "health to turn NOT_SERVING")
    finally:
        await node.stop()


async def test_drain_finishes_in_flight_and_refuses_new() -> None:
    node, _ = await start_node(token_delay_s=0.002)
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        running = asyncio.create_task(collect(stub, build_request("long one", max_tokens=300)))

        async def in_flight() -> bool:
            return (await status(stub)).load.in_flight > 0

        await until(in_flight, "the long request to be in flight")
        drain = asyncio.create_task(node.drain())
        await until(lambda: node.service.draining, "the drain to start")  # type: ignore[union-attr]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, build_request("late", max_tokens=1))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.details()
        result = await running
        assert result.completion_tokens == 300 and result.finish_reason == "length"
        await drain


async def test_drain_serves_the_requests_that_wait_in_the_queue() -> None:
    """A request waiting for the engine was admitted: the drain lets it run and finish, as the running one."""
    node, _ = await start_node(token_delay_s=0.002, max_in_flight=1)
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        running = asyncio.create_task(collect(stub, build_request("long one", max_tokens=300)))
        await until(lambda: node.local.queue.inside == 1, "the long request to hold the engine")
        queued = asyncio.create_task(collect(stub, build_request("queued", max_tokens=3)))
        await until(lambda: len(node.local.queue) == 1, "the second to wait")
        drain = asyncio.create_task(node.drain())
        await until(lambda: node.service.draining, "the drain to start")  # type: ignore[union-attr]
        assert (await running).completion_tokens == 300
        assert (await queued).completion_tokens == 3
        await drain


async def test_the_published_load_counts_urgent_requests_apart_until_their_first_token() -> None:
    """What routing reads for a request of better than the default priority (``NodeLoad.urgent``): the urgent
    requests still before their first token and their prompt tokens, besides the whole backlog; both drop to zero
    once those requests are gone."""
    node, _ = await start_node(token_delay_s=60.0)  # the first engine step takes a minute: nothing reaches a token
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            urgent = build_request("u" * 40, max_tokens=4)
            urgent.sampling.priority = -1
            calls = [stub.Generate(urgent), stub.Generate(build_request("d" * 100, max_tokens=4))]

            async def both_in_flight() -> bool:
                return (await status(stub)).load.in_flight == 2

            await until(both_in_flight, "both requests to be in flight")
            load = node._node_load()
            assert (load.urgent_waiting, load.urgent_backlog_tokens, load.prefill_backlog_tokens) == (1, 40, 140)
            for call in calls:
                call.cancel()

            async def gone() -> bool:
                return (await status(stub)).load.in_flight == 0

            await until(gone, "the cancelled requests to leave")
            load = node._node_load()
            assert (load.urgent_waiting, load.urgent_backlog_tokens, load.prefill_backlog_tokens) == (0, 0, 0)
    finally:
        await node.stop()
