"""Flow control at a node's front doors: a full node queues, a tenant over its rate limit gets 429 + Retry-After
while another is served, an overloaded node says so (503 + Retry-After), gRPC carries the same in its status and
trailing metadata, and /metrics counts it by tenant."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from p2pnode.client import build_request, collect
from p2pnode.config import FlowConfig, TenantSpec
from p2pnode.node import Node
from p2pnode.v1 import node_pb2_grpc
from tests.polling import until
from tests.unit.sim_nodes import make_node

BODY = {"model": "sim", "prompt": "hello", "max_tokens": 2}
ACME = {"Authorization": "Bearer sk-acme"}
BETA = {"Authorization": "Bearer sk-beta"}
#: acme: one request per second (a bucket of one); beta: unlimited; header-named tenants: one per second.
TENANTS = FlowConfig(
    tenant_header="x-tenant",
    tenants=(
        TenantSpec("acme", "sk-acme", requests_per_s=1.0),
        TenantSpec("beta", "sk-beta"),
        TenantSpec("*", requests_per_s=1.0),
    ),
)


@pytest.fixture
async def limited() -> Node:
    node = make_node(flow=TENANTS)
    await node.start()
    yield node
    await node.stop()


async def test_a_tenant_over_its_rate_limit_gets_429_with_retry_after_while_another_is_served(limited: Node) -> None:
    async with httpx.AsyncClient(base_url=f"http://{limited.http.address}", timeout=30) as http:
        assert (await http.post("/v1/completions", json=BODY, headers=ACME)).status_code == 200
        refused = await http.post("/v1/completions", json=BODY, headers=ACME)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429
        assert error["message"].startswith("rate limit: tenant 'acme'")
        for _ in range(3):
            assert (await http.post("/v1/completions", json=BODY, headers=BETA)).status_code == 200
        assert (await http.post("/v1/completions", json=BODY)).status_code == 401  # no key: auth is on
        scrape = (await http.get("/metrics")).text
    assert 'p2pnode:flow_refused_total{reason="rate_limit",tenant="acme"} 1.0' in scrape


async def test_grpc_rate_limit_is_resource_exhausted_with_retry_after_metadata(limited: Node) -> None:
    """A key that names no tenant leaves it to the header: a header-named tenant falls under '*'."""
    async with grpc.aio.insecure_channel(limited.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        metadata = (("authorization", "Bearer sk-beta"), ("x-tenant", "ignored: the key names beta"))
        for _ in range(2):
            await collect(stub, build_request("hi", max_tokens=1), metadata=metadata)
    node = make_node(flow=FlowConfig(tenant_header="x-tenant", tenants=(TenantSpec("*", requests_per_s=1.0),)))
    await node.start()
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            await collect(stub, build_request("hi", max_tokens=1), metadata=(("x-tenant", "team-a"),))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, build_request("hi", max_tokens=1), metadata=(("x-tenant", "team-a"),))
            await collect(stub, build_request("hi", max_tokens=1), metadata=(("x-tenant", "team-b"),))
    finally:
        await node.stop()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("rate limit: tenant 'team-a'")
    assert int(dict(err.value.trailing_metadata())["retry-after"]) >= 1


async def test_an_overloaded_node_answers_503_overloaded_with_retry_after() -> None:
    node = make_node(max_in_flight=1, flow=FlowConfig(max_queue_length=0), token_delay_s=0.01)
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            long = {**BODY, "max_tokens": 500, "stream": True}
            async with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.aiter_lines()
                await anext(lines)  # the first one is running
                refused = await http.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            error = refused.json()["error"]
            assert error["type"] == "OverloadedError" and "overloaded" in error["message"]
    finally:
        await node.stop()


async def test_a_full_node_queues_instead_of_refusing() -> None:
    """max_in_flight 1: the second call waits for the first, then is served."""
    node = make_node(max_in_flight=1, token_delay_s=0.01)
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            long = {**BODY, "max_tokens": 200, "stream": True}
            async with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.aiter_lines()
                await anext(lines)
                queued = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
                await until(lambda: len(node.local.queue) == 1, "the second call to wait")
                async for _ in lines:
                    pass
            assert (await queued).status_code == 200
            scrape = (await http.get("/metrics")).text
        assert "p2pnode:queued_requests_total 1.0" in scrape
        assert "p2pnode:queue_depth 0.0" in scrape
        assert "p2pnode:queue_wait_seconds_count 2.0" in scrape  # both entered the engine, one after waiting
    finally:
        await node.stop()


async def test_a_tenants_default_priority_applies_to_its_requests_that_name_none() -> None:
    """``--tenant live,priority=-1``: live's requests run as urgent (the load's urgent count shows them) unless they
    name a priority of their own; another tenant's stay at the default."""
    flow = FlowConfig(tenant_header="x-tenant", tenants=(TenantSpec("live", priority=-1),))
    node = make_node(token_delay_s=60.0, flow=flow)  # the first engine step takes a minute: nothing reaches a token
    await node.start()
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            own = build_request("named", max_tokens=2)
            own.sampling.priority = 5  # its own priority wins
            calls = [
                stub.Generate(build_request("live", max_tokens=2), metadata=(("x-tenant", "live"),)),
                stub.Generate(own, metadata=(("x-tenant", "live"),)),
                stub.Generate(build_request("other", max_tokens=2), metadata=(("x-tenant", "other"),)),
            ]
            await until(lambda: len(node.local.in_flight) == 3, "the three requests to be in flight")
            load = node._node_load()
            assert (load.urgent_waiting, load.urgent_backlog_tokens) == (1, len(b"live"))
            for call in calls:
                call.cancel()
    finally:
        await node.stop()


async def test_the_priority_header_sets_the_priority_of_requests_that_name_none_on_http_and_grpc() -> None:
    """``--priority-header x-priority`` (a gateway's, per request): an HTTP or gRPC request carrying ``-1`` there runs
    as urgent; a value that is no integer is refused (400 / INVALID_ARGUMENT) naming the header."""
    node = make_node(token_delay_s=60.0, flow=FlowConfig(priority_header="x-priority"))  # nothing reaches a token
    await node.start()
    try:
        async with (
            grpc.aio.insecure_channel(node.address) as channel,
            httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http,
        ):
            stub = node_pb2_grpc.NodeStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, build_request("bad", max_tokens=2), metadata=(("x-priority", "urgent"),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-priority" in (err.value.details() or "")
            refused = await http.post("/v1/completions", json=BODY, headers={"x-priority": "1.5"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "x-priority"

            call = stub.Generate(build_request("grpc", max_tokens=2), metadata=(("x-priority", "-1"),))
            posted = asyncio.create_task(http.post("/v1/completions", json={**BODY, "prompt": "http-call"},
                                                   headers={"X-Priority": "-2"}))
            plain = stub.Generate(build_request("plain", max_tokens=2))
            await until(lambda: len(node.local.in_flight) == 3, "the three requests to be in flight")
            load = node._node_load()
            assert load.urgent_waiting == 2, load
            call.cancel()
            plain.cancel()
            posted.cancel()
    finally:
        await node.stop()
