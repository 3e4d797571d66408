"""Flow control end to end, through ``p2pnode serve``'s own flags: a standalone node on the simulated engine with
``--max-in-flight 1`` queues a second request instead of refusing it, and a tenant over its rate limit gets 429 with
a Retry-After while another tenant is served (the in-process details are tests/unit/test_flow_control.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from p2pnode.launcher import NodeProcess
from tests.integration.conftest import make_sim_node
from tests.polling import until

pytestmark = pytest.mark.integration

ACME = {"Authorization": "Bearer sk-acme"}
BETA = {"Authorization": "Bearer sk-beta"}
BODY = {"model": "sim", "prompt": "flow control", "max_tokens": 2}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp: Path = tmp_path_factory.mktemp("flow")
    process = make_sim_node(
        "flow1",
        tmp,
        "--http-listen",
        "127.0.0.1:0",
        "--sim-profile",
        "tiny-cpu",
        "--max-in-flight",
        "1",
        "--tenant",
        "acme=sk-acme,rps=0.1",
        "--tenant",
        "beta=sk-beta,weight=2",
    ).start()
    yield process
    process.kill()


async def metric(http: httpx.AsyncClient, line_start: str) -> float:
    """The value of the /metrics line that starts with ``line_start`` (0 when absent)."""
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_full_node_queues_the_next_request_and_serves_it(node: NodeProcess) -> None:
    async with httpx.AsyncClient(base_url=f"http://{node.http_address}", timeout=60) as http:
        long = {**BODY, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=long, headers=BETA) as running:
            lines = running.aiter_lines()
            await anext(lines)  # the engine's one slot is taken
            queued = asyncio.ensure_future(http.post("/v1/completions", json=BODY, headers=BETA))

            async def depth() -> float:
                return await metric(http, "p2pnode:queue_depth ")

            await until(depth, "the second request to wait in the queue", holds=lambda d: d == 1)
        # the first stream is closed: its slot goes to the waiting request, which is served, not refused
        answer = await queued
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
        assert await metric(http, "p2pnode:queued_requests_total ") == 1


async def test_a_tenant_over_its_rate_limit_gets_429_while_another_is_served(node: NodeProcess) -> None:
    async with httpx.AsyncClient(base_url=f"http://{node.http_address}", timeout=60) as http:
        assert (await http.post("/v1/completions", json=BODY, headers=ACME)).status_code == 200
        refused = await http.post("/v1/completions", json=BODY, headers=ACME)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert (await http.post("/v1/completions", json=BODY, headers=BETA)).status_code == 200
        assert await metric(http, 'p2pnode:flow_refused_total{reason="rate_limit",tenant="acme"}') == 1
