"""Per-tenant rate limits: a bucket of requests and one of tokens, the Retry-After they answer, the mesh's debt."""

from __future__ import annotations

import pytest

from p2pnode.flow.rate_limit import RateLimit, TenantRateLimits


def limits(**per_tenant: RateLimit) -> TenantRateLimits:
    return TenantRateLimits(lambda tenant: per_tenant.get(tenant, RateLimit()))


def test_requests_per_second_admit_a_burst_then_say_when_to_retry():
    rl = limits(a=RateLimit(requests_per_s=2, burst_s=1))
    assert rl.admit("a", 10, now=0.0) == 0.0
    assert rl.admit("a", 10, now=0.0) == 0.0
    assert rl.admit("a", 10, now=0.0) == pytest.approx(0.5)  # one request refills in 1/2 s
    assert rl.admit("a", 10, now=0.5) == 0.0
    assert rl.admit("b", 10, now=0.5) == 0.0  # another tenant, unlimited


def test_a_refused_request_is_not_charged():
    rl = limits(a=RateLimit(tokens_per_s=100, burst_s=1))
    assert rl.admit("a", 80, now=0.0) == 0.0
    assert rl.admit("a", 80, now=0.0) == pytest.approx(0.6)
    assert rl.admit("a", 80, now=0.0) == pytest.approx(0.6)  # the refusal took nothing
    assert rl.admit("a", 80, now=0.6) == 0.0


def test_a_request_larger_than_the_bucket_waits_for_a_full_bucket_then_runs():
    rl = limits(a=RateLimit(tokens_per_s=100, burst_s=1))
    assert rl.admit("a", 1000, now=0.0) == 0.0  # full bucket: admitted, the bucket goes 900 into debt
    assert rl.admit("a", 1, now=0.0) == pytest.approx(9.01)


def test_usage_admitted_elsewhere_drains_the_tenants_buckets_here():
    rl = limits(a=RateLimit(requests_per_s=10, burst_s=1))
    rl.consume("a", requests=30, tokens=0, now=0.0)  # the rest of the mesh admitted 30 requests just now
    assert rl.admit("a", 1, now=0.0) == pytest.approx(2.1)
    assert rl.admit("a", 1, now=2.1) == 0.0


def test_tracked_tenants_are_bounded():
    rl = TenantRateLimits(lambda tenant: RateLimit(requests_per_s=1), max_tenants=100)
    for i in range(1000):
        rl.admit(f"t{i}", 1, now=0.0)
    assert len(rl) == 100


@pytest.mark.parametrize("bad", [dict(requests_per_s=-1), dict(tokens_per_s=float("nan")), dict(burst_s=0)])
def test_bad_limits_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RateLimit(**bad)
