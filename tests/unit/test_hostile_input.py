"""Hostile bytes on the client API. Undecodable requests are INVALID_ARGUMENT with no traceback (they were
UNKNOWN with one ERROR traceback each: 1,000 garbage calls wrote 5,782 log lines); a client's request id cannot
forge log lines; a flood of garbage costs a few log lines a minute."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from p2pnode.config import EngineConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.node import Node
from p2pnode.v1 import node_pb2

BLOCK = 32


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    config = NodeConfig(
        node_id="h1",
        engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
    )
    node = Node(config, SimEngine(block_size=BLOCK, num_blocks=64, max_model_len=1024))
    await node.start()
    yield node
    await node.stop()


async def call(node: Node, method: str, data: bytes) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(node.address) as channel:
        try:
            if method == "Generate":
                async for _ in channel.unary_stream("/p2pnode.v1.Node/Generate")(data, timeout=10):
                    pass
            else:
                await channel.unary_unary(f"/p2pnode.v1.Node/{method}")(data, timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_undecodable_requests_are_invalid_argument_without_a_traceback(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    garbage = [b"\xff\xff\xff", b"\x0a\xff", b"\x12\x05\x08", bytes(range(256))]
    for _ in range(25):
        for data in garbage:
            assert await call(node, "Generate", data) == grpc.StatusCode.INVALID_ARGUMENT
    assert await call(node, "GetStatus", b"\xff\xff") == grpc.StatusCode.INVALID_ARGUMENT
    assert await call(node, "GetStatus", b"") == grpc.StatusCode.OK
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
    assert sum(r.levelno >= logging.WARNING for r in caplog.records) <= 10  # 101 refusals, a few lines
    assert node.ingress.counters.rejected == 100  # type: ignore[union-attr]


async def test_a_request_id_cannot_forge_log_lines(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.access")
    request = node_pb2.GenerateRequest(request_id="x\n2026-01-01 00:00:00 INFO p2pnode.node: forged", text="")
    assert await call(node, "Generate", request.SerializeToString()) == grpc.StatusCode.INVALID_ARGUMENT
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pnode.access"]
    assert len(lines) == 1 and "\n" not in lines[0] and "request_id" in lines[0]
