"""Mesh-wide rate limits: what a node publishes of its tenants' admitted totals, how a peer charges their growth,
and two nodes of a mesh refusing a tenant over its limit wherever it asks."""

from __future__ import annotations

import httpx
import msgpack

from p2pnode.config import FlowConfig, TenantSpec
from p2pnode.flow.rate_limit import RateLimit, TenantRateLimits
from p2pnode.serving.tenant_usage import (
    MAX_USAGE_BYTES,
    MAX_USAGE_TENANTS,
    TenantUsage,
    decode_usage,
    encode_usage,
)
from tests.polling import until
from tests.unit.sim_nodes import make_node

LIMITED = {"acme", "beta"}


def usage(clock: list[float]) -> TenantUsage:
    limits = TenantRateLimits(lambda t: RateLimit(requests_per_s=1.0) if t in LIMITED else RateLimit())
    return TenantUsage(limits, lambda t: t in LIMITED, clock=lambda: clock[0])


def test_only_limited_tenants_are_published_newest_first() -> None:
    u = usage([0.0])
    assert decode_usage(u.value()) == {}  # published from the start: a peer's first read is a baseline of nothing
    for tenant, tokens in (("acme", 10), ("free", 99), ("beta", 5), ("acme", 7)):
        u.record(tenant, tokens)
    assert decode_usage(u.value()) == {"acme": (2, 17), "beta": (1, 5)}
    assert list(decode_usage(u.value()) or {}) == ["acme", "beta"]


def test_the_published_value_is_bounded() -> None:
    many = {f"{'t' * 60}{i:04d}": (2**40, 2**50) for i in range(100)}
    value = encode_usage(many)
    assert len(value) <= MAX_USAGE_BYTES
    decoded = decode_usage(value)
    assert decoded is not None and 0 < len(decoded) <= MAX_USAGE_TENANTS


def test_malformed_values_are_ignored() -> None:
    for raw in (
        [1, 2],
        {"a": [1]},
        {"a": [-1, 2]},
        {"a": ["1", 2]},
        {"": [1, 2]},
        {"a\n": [1, 2]},
        {f"t{i}": [1, 1] for i in range(MAX_USAGE_TENANTS + 1)},
    ):
        assert decode_usage(msgpack.packb(raw)) is None
    assert decode_usage(b"\xc1garbage") is None
    assert decode_usage(b"\x80" * (MAX_USAGE_BYTES + 1)) is None


def test_a_peer_s_growth_is_charged_from_the_second_value_on() -> None:
    clock = [0.0]
    u = usage(clock)
    u.apply("p", encode_usage({"acme": (5, 500)}))  # the first value: what p admitted before we watched
    assert u.charged == (0, 0) and u.limits.admit("acme", 1, 0.0) == 0.0
    u.apply("p", encode_usage({"acme": (7, 700), "beta": (1, 10), "free": (3, 3)}))
    assert u.charged == (3, 210)  # acme's growth, beta's whole first total; free has no limit to charge
    assert u.limits.admit("acme", 1, 0.0) > 0  # its bucket is in debt: refused here too
    u.apply("p", encode_usage({"acme": (1, 50)}))  # p restarted: its new life's total is all new
    assert u.charged == (4, 260)
    u.apply("p", b"\xc1")  # malformed: nothing charged
    u.apply("p", None)  # p gone: its next value is a first one again
    u.apply("p", encode_usage({"acme": (9, 900)}))
    assert u.charged == (4, 260)


async def test_a_tenant_over_its_limit_at_one_node_is_refused_at_another() -> None:
    """acme may send one request per 10 s mesh-wide: after one at a, b refuses the next within a gossip round."""
    flow = FlowConfig(tenants=(TenantSpec("acme", "sk-acme", requests_per_s=0.1), TenantSpec("beta", "sk-beta")))
    a = make_node("a", mesh=True, flow=flow)
    await a.start()
    b = make_node("b", mesh=True, seeds=(a.address,), flow=flow)
    await b.start()
    body = {"model": "sim", "prompt": "mesh-wide", "max_tokens": 1}
    acme = {"Authorization": "Bearer sk-acme"}
    try:
        await until(lambda: b.peering.view.peer("a") is not None, "b to know a")  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=f"http://{a.http.address}", timeout=30) as http:
            assert (await http.post("/v1/completions", json=body, headers=acme)).status_code == 200
        await until(lambda: b.tenant_usage.charged[0] == 1, "a's admission to reach b's buckets")
        async with httpx.AsyncClient(base_url=f"http://{b.http.address}", timeout=30) as http:
            refused = await http.post("/v1/completions", json=body, headers=acme)
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            beta = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-beta"})
            assert beta.status_code == 200
    finally:
        await b.stop()
        await a.stop()
