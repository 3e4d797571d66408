"""/metrics on a simulated-engine mesh: every p2pnode:* family is there, parses with prometheus_client's own
parser, and moves with requests; the stats line and JSON logs. (vllm:* live in the process registry, so they show
wherever a vLLM engine ran in the same process, as in the full suite.)"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode import logs
from p2pnode.api.metrics import _kv_tier
from p2pnode.api.stats_log import stats_line
from p2pnode.node import Node
from p2pnode.v1 import node_pb2
from tests.polling import until
from tests.unit.sim_nodes import make_node

#: A scrape's timeout: the first one in a process imports vLLM's metrics modules (several seconds here), past
#: httpx's 5 s default when this file runs alone.
SCRAPE_TIMEOUT_S = 60.0

FAMILIES = {
    "p2pnode:requests": "counter",
    "p2pnode:requests_in_flight": "gauge",
    "p2pnode:routed_requests": "counter",
    "p2pnode:forwards_received": "counter",
    "p2pnode:peer_links": "gauge",
    "p2pnode:peer_links_opened": "counter",
    "p2pnode:stream_migrations": "counter",
    "p2pnode:routing_estimated_cached_tokens": "counter",
    "p2pnode:engine_cached_tokens": "counter",
    "p2pnode:routing_estimate_error_tokens": "counter",
    "p2pnode:gossip_sent_bytes": "counter",
    "p2pnode:gossip_received_bytes": "counter",
    "p2pnode:members": "gauge",
    "p2pnode:plan_epoch": "gauge",
    "p2pnode:plan_warm_keys": "gauge",
    "p2pnode:prefix_index_blocks": "gauge",
    "p2pnode:kv_event_gaps": "counter",
    "p2pnode:kv_tier_capacity_bytes": "gauge",
    "p2pnode:kv_tier_used_bytes": "gauge",
    "p2pnode:kv_tier_loads": "counter",
    "p2pnode:kv_tier_load_seconds": "counter",
    "p2pnode:kv_tier_evicted_blocks": "counter",
    "p2pnode:time_to_first_token_seconds": "histogram",
    "p2pnode:e2e_request_latency_seconds": "histogram",
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[Node, Node]]:
    b = make_node("B", mesh=True)
    await b.start()
    a = make_node("A", mesh=True, seeds=(b.address,))
    await a.start()
    yield a, b
    for n in (a, b):
        await n.stop(leave=False)


async def test_families_parse_and_counters_move_with_requests(mesh: tuple[Node, Node]) -> None:
    a, _ = mesh
    async with httpx.AsyncClient(base_url=f"http://{a.http.address}", timeout=SCRAPE_TIMEOUT_S) as http:
        async def joined() -> httpx.Response | None:
            reply = await http.get("/metrics")
            return reply if samples(reply.text)[("p2pnode:members", (("state", "alive"),))] == 2 else None

        reply = await until(joined, "both members alive in A's metrics (gossip has flowed)")
        assert reply.headers["content-type"].startswith("text/plain")
        families = {f.name: f.type for f in text_string_to_metric_families(reply.text)}
        for name, kind in FAMILIES.items():
            assert families.get(name) == kind, name
        before = samples(reply.text)
        for _ in range(3):
            assert (await http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 2})).status_code \
                == 200
        assert (await http.post("/v1/completions", json={"prompt": "x", "top_p": 7})).status_code == 400
        after = samples((await http.get("/metrics")).text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("p2pnode:requests_total", api="http", outcome="success") == 3
    assert delta("p2pnode:requests_total", api="http", outcome="rejected") == 1
    assert delta("p2pnode:requests_total", api="grpc", outcome="success") == 0
    assert delta("p2pnode:routed_requests_total", path="local") + delta(
        "p2pnode:routed_requests_total", path="forwarded") == 3
    path = "local" if delta("p2pnode:routed_requests_total", path="local") == 3 else "forwarded"
    assert delta("p2pnode:time_to_first_token_seconds_count", api="http", path=path) > 0
    assert delta("p2pnode:e2e_request_latency_seconds_count", api="http", path="local") + delta(
        "p2pnode:e2e_request_latency_seconds_count", api="http", path="forwarded") == 3
    assert after[("p2pnode:members", (("state", "alive"),))] == 2
    assert before[("p2pnode:gossip_sent_bytes_total", ())] > 0
    assert before[("p2pnode:gossip_received_bytes_total", ())] > 0


def test_stats_line_reports_the_interval() -> None:
    before, after = node_pb2.NodeStatus(), node_pb2.NodeStatus()
    after.routing.served_locally, after.routing.forwarded, after.routing.served = 3, 1, 4
    after.routing.estimated_cached_tokens, after.routing.engine_cached_tokens = 96, 128
    after.routing.estimate_abs_error_tokens = 32
    after.members.add(node_id="a", state="alive")
    after.members.add(node_id="b", state="dead")
    line, busy = stats_line(before, after, {}, {("http", "success"): 3, ("grpc", "failed"): 1}, 2.0)
    assert busy
    assert "ingress 2.0 calls/s (http 3, grpc 1: success 3, rejected 0, failed 1, cancelled 0)" in line
    assert "served here 3, forwarded 1" in line and "members alive 1/2" in line
    assert "routing estimate 96 vs engine-cached 128 tokens (mean |error| 8.0 tokens over 4)" in line
    _, busy = stats_line(after, after, {}, {}, 10.0)
    assert not busy


def test_json_log_lines_carry_the_access_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/dev/null")  # no file for this process's vLLM
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.configure("INFO", "json")
        stream = io.StringIO()
        root.handlers[0].stream = stream  # type: ignore[attr-defined]
        logging.getLogger("p2pnode.access").info(
            "request r1 api=http", extra={"access": {"request_id": "r1", "status": "OK", "ttft_ms": 1.5}}
        )
        line = json.loads(stream.getvalue().strip().splitlines()[-1])
        assert line["name"] == "p2pnode.access" and line["levelname"] == "INFO"
        assert line["access"] == {"request_id": "r1", "status": "OK", "ttft_ms": 1.5}
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


async def test_vllms_http_request_families_count_requests_by_route(mesh: tuple[Node, Node]) -> None:
    """vLLM's http_* families (prometheus-fastapi-instrumentator, as ``vllm serve``): dashboards built on them work
    (they were missing). Handlers are route templates, health and metrics paths are left out as vLLM leaves them."""
    a, _ = mesh
    async with httpx.AsyncClient(base_url=f"http://{a.http.address}", timeout=SCRAPE_TIMEOUT_S) as http:
        for _ in range(2):
            assert (await http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 2})).status_code \
                == 200
        assert (await http.post("/v1/completions", json={"prompt": "x", "top_p": 7})).status_code == 400
        assert (await http.get("/no/such/path")).status_code == 404
        assert (await http.get("/health")).status_code == 200
        text = (await http.get("/metrics")).text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["http_requests"] == "counter" and families["http_request_duration_seconds"] == "histogram"
    sizes_and_latency = {"http_request_size_bytes", "http_response_size_bytes", "http_request_duration_highr_seconds"}
    assert sizes_and_latency <= set(families)
    got = samples(text)
    key = "http_requests_total"
    assert got[(key, (("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx")))] == 2
    assert got[(key, (("handler", "/v1/completions"), ("method", "POST"), ("status", "4xx")))] == 1
    assert got[(key, (("handler", "none"), ("method", "GET"), ("status", "4xx")))] == 1
    assert not [k for k in got if k[0] == key and dict(k[1])["handler"] in ("/health", "/metrics")]


def test_a_disk_tier_adds_its_samples_to_the_kv_tier_families() -> None:
    def samples(tier: node_pb2.TierStatus) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels["medium"]): s.value for family in _kv_tier(tier) for s in family.samples}

    host_only = samples(node_pb2.TierStatus(host_bytes=1 << 24, load_bytes=10))
    assert ("p2pnode:kv_tier_capacity_bytes", "host") in host_only
    assert all(medium == "host" for _, medium in host_only)  # no disk tier: no disk samples
    both = samples(node_pb2.TierStatus(
        host_bytes=1 << 24, disk_bytes=1 << 30, disk_blocks=7, disk_load_bytes=300, disk_store_bytes=400,
        disk_failures=2,
    ))
    assert both[("p2pnode:kv_tier_capacity_bytes", "disk")] == 1 << 30
    assert both[("p2pnode:kv_tier_blocks", "disk")] == 7
    assert both[("p2pnode:kv_tier_load_bytes_total", "disk")] == 300
    assert both[("p2pnode:kv_tier_store_bytes_total", "disk")] == 400
    assert both[("p2pnode:kv_tier_failures_total", "disk")] == 2
