"""The ``low-reuse`` workload: unique prompts, a short shared prefix on half of them, skewed tenant keys."""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, LowReuse, get_workloads
from p2pnode.sim.workloads.lowreuse import N_TENANTS, TENANT_SHARE, tenant_weights

BS = 256


def _requests(n: int = 20_000, seed: int = 0) -> list:
    return list(LowReuse().requests(50.0, seed, BlockSpace(BS), Limit(max_requests=n)))


def test_registered_and_deterministic() -> None:
    (wl,) = get_workloads("low-reuse")
    assert isinstance(wl, LowReuse) and wl.name == "low-reuse" and wl.block_size == BS
    a, b = _requests(2000, seed=3), _requests(2000, seed=3)
    assert [(r.arrival, r.key, r.prompt_tokens, r.output_tokens, r.chain[: r.n_blocks]) for r in a] == [
        (r.arrival, r.key, r.prompt_tokens, r.output_tokens, r.chain[: r.n_blocks]) for r in b
    ]
    c = _requests(2000, seed=4)
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in c]


def test_reuse_is_low_and_only_in_tenant_prefixes() -> None:
    rs = _requests()
    uses = Counter(h for r in rs for h in r.chain[: r.n_prompt_blocks])
    shared_tokens = sum(BS for r in rs for h in r.chain[: r.n_prompt_blocks] if uses[h] > 1)
    frac = shared_tokens / sum(r.prompt_tokens for r in rs)
    assert 0.03 < frac < 0.10  # the upper bound of any policy's KV hit
    # prompts are unique: no block of a keyless request is shared
    for r in rs:
        if r.cls == "unique":
            assert r.key == "" and all(uses[h] == 1 for h in r.chain[: r.n_prompt_blocks])
    # at most the tenants' prefixes are shared: a tenant's requests agree on their first 1..4 blocks
    shared_blocks = {h for h, n in uses.items() if n > 1}
    assert len(shared_blocks) <= 4 * N_TENANTS


def test_tenant_share_and_skew() -> None:
    rs = _requests()
    tenants = [r for r in rs if r.cls == "tenant"]
    assert len(tenants) / len(rs) == pytest.approx(TENANT_SHARE, abs=0.02)
    keys = Counter(r.key for r in tenants)
    assert len(keys) <= N_TENANTS
    w = tenant_weights()
    assert keys.most_common(1)[0][1] / len(tenants) == pytest.approx(w[0] / sum(w), abs=0.02)  # ~21%
    assert statistics.median(r.prompt_tokens for r in rs) == pytest.approx(2048 + 192, rel=0.1)
    assert statistics.median(r.output_tokens for r in rs) == pytest.approx(200, rel=0.1)


def test_single_node_hit_rate_stays_below_the_shared_fraction() -> None:
    summary = Cluster(SimConfig(nodes=1, block_size=BS).with_routing(policy="flat")).run(
        iter(LowReuse().requests(2.0, 1, BlockSpace(BS), Limit(max_requests=300)))
    )
    assert summary["completed"] == 300
    assert 0.0 < summary["kv_hit"] < 0.10
