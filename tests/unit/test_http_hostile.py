"""Hostile HTTP on a node's OpenAI-compatible front (simulated engine, real loopback sockets): deep JSON, a client
gone mid-body, slow headers and bodies, one client opening too many connections, too many stop strings, and a flood
of refused calls. Each answered with a 4xx naming the problem, without a traceback, and counted. The same faults on
real processes: scripts/chaos.py (tests/slow/test_faults.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.client import build_request
from p2pnode.config import DEFAULT_HTTP_MAX_JSON_DEPTH, MAX_STOP_STRINGS
from p2pnode.node import Node
from p2pnode.v1 import node_pb2_grpc
from tests.polling import until
from tests.unit.sim_nodes import make_node


async def started(**api: Any) -> Node:
    node = make_node(**api)
    await node.start()
    return node


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    node = await started()
    yield node
    await node.stop()


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def raw(address: str, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return reader, writer


def post_head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body the server sent before closing the connection (it must close it)."""
    data = await asyncio.wait_for(reader.read(), 30)  # EOF: the server closed the connection
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else 0, body


def metric(node: Node, name: str, **labels: str) -> float:
    assert node.metrics is not None
    text = node.metrics.exposition().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name}{labels} not exported")


@pytest.mark.parametrize("depth", [DEFAULT_HTTP_MAX_JSON_DEPTH + 1, 1_000, 100_000])
async def test_deep_json_is_a_400_naming_the_bound(
    node: Node, caplog: pytest.LogCaptureFixture, depth: int
) -> None:
    """Before: 1,000 levels answered 500 "internal error: RecursionError" with two tracebacks."""
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
        body = b'{"model": "sim", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        reply = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "body" and f"at most {DEFAULT_HTTP_MAX_JSON_DEPTH}" in error["message"]
        nested = {"model": "sim", "prompt": "ok", "max_tokens": 1, "stop": ["a"], "chat_template_kwargs": {"a": {}}}
        assert (await http.post("/v1/completions", json=nested)).status_code == 200  # shallow nesting is fine
    assert tracebacks(caplog) == []


async def test_a_client_gone_mid_body_is_one_debug_line(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """Before: two ERROR tracebacks (~98 lines) per connection."""
    caplog.set_level(logging.DEBUG, logger="p2pnode")
    for _ in range(3):
        _, writer = await raw(node.http.address, post_head(5000) + b'{"model": "sim", "prompt": "')
        writer.close()
        await writer.wait_closed()

    def settled() -> bool:
        gone = [r for r in caplog.records if "went away" in r.getMessage()]
        return len(gone) == 3 or bool(tracebacks(caplog))

    await until(settled, "the server to see the three clients gone")
    assert tracebacks(caplog) == []
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 3 and all(r.levelno == logging.DEBUG for r in gone)
    assert node.ingress.counters.total == 0  # nothing was admitted


async def test_slow_headers_are_cut_with_408() -> None:
    """Before: a connection sending its header slowly (slowloris) was never closed."""
    node = await started(http_header_timeout_s=0.3)
    try:
        reader, writer = await raw(node.http.address, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        status, body = await answer(reader)
        assert status == 408 and b"header" in body
        writer.close()
        silent, writer = await raw(node.http.address, b"")  # connects and sends nothing at all
        assert (await answer(silent))[0] == 408
        writer.close()
        assert node.http.guard.cut["header"] == 2
        assert metric(node, "p2pnode:http_connections_cut_total", phase="header") == 2
    finally:
        await node.stop()


async def test_slow_bodies_are_cut_and_their_call_never_runs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="p2pnode")
    node = await started(http_body_timeout_s=0.3)
    try:
        reader, writer = await raw(node.http.address, post_head(100) + b'{"model": ')
        status, body = await answer(reader)
        assert status == 408 and b"body" in body
        writer.close()
        await until(lambda: any("went away" in r.getMessage() for r in caplog.records), "the handler to end")
        assert node.http.guard.cut["body"] == 1 and node.ingress.counters.total == 0
        assert tracebacks(caplog) == []
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:  # still serving
            reply = await http.post("/v1/completions", json={"model": "sim", "prompt": "ok", "max_tokens": 1})
            assert reply.status_code == 200
    finally:
        await node.stop()


async def test_one_client_holds_at_most_its_cap_of_connections() -> None:
    node = await started(http_max_connections_per_client=3)
    try:
        held = [await raw(node.http.address, b"GET /health HTTP/1.1\r\nHost: x\r\n") for _ in range(3)]
        await until(lambda: node.http.guard.open["127.0.0.1"] == 3, "three connections open")
        reader, writer = await raw(node.http.address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = await answer(reader)
        assert status == 429 and json.loads(body)["error"]["code"] == 429
        writer.close()
        assert metric(node, "p2pnode:http_connections_refused_total") == 1
        held[0][1].close()  # one closes: the client may open another
        await until(lambda: node.http.guard.open["127.0.0.1"] == 2, "the closed one to be released")
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
        for _, w in held[1:]:
            w.close()
    finally:
        await node.stop()


async def test_the_stop_limit_is_vllms_and_named_on_both_apis(node: Node) -> None:
    """Before: HTTP refused 5 stop strings with "Input should be a valid string"; gRPC took up to 16."""
    import vllm.envs

    assert MAX_STOP_STRINGS == vllm.envs.VLLM_MAX_STOP_STRINGS == 4
    too_many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    refusal = "at most 4 stop strings (vLLM's limit, VLLM_MAX_STOP_STRINGS), got 5"
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            reply = await http.post(path, json={"model": "sim", "max_tokens": 1, "stop": too_many, **extra})
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert error["param"] == "stop"
            assert error["message"] == f"stop: {refusal}"
            ok = await http.post(path, json={"model": "sim", "max_tokens": 1, "stop": too_many[:4], **extra})
            assert ok.status_code == 200
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(build_request("hi", max_tokens=1, stop=too_many)):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"sampling.stop: {refusal}"
        messages = [m async for m in stub.Generate(build_request("hi", max_tokens=1, stop=too_many[:4]))]
        assert messages[-1].HasField("final")


async def test_a_huge_n_is_refused_before_the_front_sizes_anything_by_it(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: ``echo`` built a list of n prompts before admission checked n -- n = 20,000,000 held the event loop
    1.5 s and 157 MB, n near 2**32 would have exhausted the node's memory; the 400 came only after."""
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            reply = await http.post(path, json={"model": "sim", "max_tokens": 1, "n": 2**32 - 1, "echo": True, **extra})
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert error["param"] == "n" and "at most 128" in error["message"]
    assert tracebacks(caplog) == []


async def test_a_responses_value_vllm_refuses_is_a_400_naming_it(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """Before: 500 "internal error: VLLMValidationError" with two tracebacks (vLLM's validation error is not a
    ValueError)."""
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
        for field, value in (("max_output_tokens", 0), ("max_output_tokens", -3), ("temperature", 3), ("top_p", 0)):
            for stream in (False, True):
                body = {"model": "sim", "input": "hi", "max_output_tokens": 2, field: value, "stream": stream}
                reply = await http.post("/v1/responses", json=body)
                assert reply.status_code == 400, (field, value, stream)
                assert reply.json()["error"]["param"] == field
    assert tracebacks(caplog) == []


async def test_refused_calls_are_sampled_in_the_access_log_and_all_counted(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: one INFO line per refused call (1,000 refused streams wrote 2,232 lines)."""
    caplog.set_level(logging.INFO)
    bad = {"model": "sim", "prompt": "hi", "temperature": 9.0, "stream": True}
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
        for _ in range(1000):
            assert (await http.post("/v1/completions", json=bad)).status_code == 400
        assert (await http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})).status_code == 404
    lines = [r for r in caplog.records if r.name.startswith("p2pnode")]
    assert len(lines) <= 20, [r.getMessage() for r in lines]
    assert any("model" in r.getMessage() for r in lines if r.name == "p2pnode.access")  # another kind still shows
    assert metric(node, "p2pnode:rejected_requests_total", api="http", code="INVALID_ARGUMENT") == 1000
    assert metric(node, "p2pnode:rejected_requests_total", api="http", code="NOT_FOUND") == 1
    assert metric(node, "p2pnode:requests_total", api="http", outcome="rejected") == 1001
