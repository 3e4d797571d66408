"""API keys: constant-time Bearer checks; the gRPC client API and HTTP /v1/* need one, probes and peers do not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from p2pnode.api.auth import ApiKeys
from p2pnode.client import auth_metadata, build_request, collect
from p2pnode.config import ClientApiConfig, EngineConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.node import Node
from p2pnode.v1 import node_pb2, node_pb2_grpc

KEY = "sk-test-key-1"


def test_bearer_tokens() -> None:
    keys = ApiKeys([KEY, "other"])
    assert keys.enabled
    assert keys.accepts(f"Bearer {KEY}") and keys.accepts("bearer other") and keys.accepts(f"  Bearer  {KEY} ")
    for bad in (None, "", KEY, f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", "Bearer sk-test-key-"):
        assert not keys.accepts(bad), bad
    assert ApiKeys().accepts(None) and not ApiKeys().enabled


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    config = NodeConfig(
        node_id="k1",
        engine=EngineConfig(model=Path("sim"), block_size=32),
        server=ServerConfig(listen="127.0.0.1:0"),
        api=ClientApiConfig(api_keys=(KEY,), stats_interval_s=0),
    )
    node = Node(config, SimEngine(block_size=32, max_model_len=1024))
    await node.start()
    yield node
    await node.stop()


async def test_grpc_client_api_needs_the_key_health_does_not(node: Node) -> None:
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        for metadata in (None, auth_metadata("wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, build_request("hi", max_tokens=1), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetStatus(node_pb2.GetStatusRequest(), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        result = await collect(stub, build_request("hi", max_tokens=2), metadata=auth_metadata(KEY))
        assert result.completion_tokens == 2
        status = await stub.GetStatus(node_pb2.GetStatusRequest(), metadata=auth_metadata(KEY))
        assert status.requests_rejected == 2 and status.requests_succeeded == 1  # GetStatus is not a request
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_http_v1_needs_the_key_probes_and_scrapes_do_not(node: Node) -> None:
    body = {"model": "sim", "prompt": "hi", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            reply = await http.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 401
            assert reply.json()["error"]["type"] == "AuthenticationError"
            assert (await http.get("/v1/models", headers=headers)).status_code == 401
            assert (await http.post("/tokenize", json={"prompt": "x"}, headers=headers)).status_code == 401
        ok = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert (await http.get(path)).status_code == 200, path
    assert node.ingress.counters.by_api[("http", "rejected")] == 3  # the completions; models/tokenize are no calls


async def test_two_authorization_headers_are_refused_not_split_between_auth_and_tenant() -> None:
    """The key check read the last Authorization header and the tenant the first: a bogus first one and a tenant's
    real key after it passed the check as "no tenant", escaping the key's own rate limit (5 of 5 served at 1/s)."""
    from p2pnode.config import FlowConfig, TenantSpec
    from tests.unit.sim_nodes import make_node

    node = make_node(flow=FlowConfig(tenants=(TenantSpec("acme", "sk-acme", requests_per_s=1.0),)))
    await node.start()
    try:
        body = {"model": "sim", "prompt": "hello", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            both = [("Authorization", "Bearer bogus"), ("Authorization", "Bearer sk-acme")]
            reply = await http.post("/v1/completions", json=body, headers=both)
            assert reply.status_code == 401
            codes = [
                (await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-acme"})).status_code
                for _ in range(3)
            ]
            assert codes[0] == 200 and 429 in codes  # the key's own limit holds
    finally:
        await node.stop()
