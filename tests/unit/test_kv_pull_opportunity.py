"""scripts/kv_pull_opportunity.py: its hooks read the simulated mesh without changing it, and its sums add up."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kv_pull_opportunity.py"


@pytest.fixture(scope="module")
def probe_script():
    return load_script("kv_pull_opportunity")


def _config(module, link: float):
    from p2pnode.sim.cluster import SimConfig

    return SimConfig(
        nodes=4, kv_capacity_tokens=module.br.kv_capacity_tokens(0.25), block_size=512, warmup_s=2.0,
    ).with_routing(cost_profile=module.br.PROFILE, kv_link_gbps=link)  # fmt: skip


def _requests(cluster, qps: float = 6.0):
    from p2pnode.sim.workloads import Limit, get_workloads

    return get_workloads("platform-chat")[0].requests(qps, 0, cluster.space, Limit(duration_s=20.0))


def test_a_probed_run_is_the_run_without_the_probe(probe_script) -> None:
    from p2pnode.routing.policies import p2p
    from p2pnode.sim.cluster import Cluster

    cfg = _config(probe_script, 100.0)
    cluster = Cluster(cfg)
    plain = cluster.run(_requests(cluster))
    probed = probe_script.ProbedCluster(cfg)
    with probe_script.pulls_observed([probed.probe]):
        seen = probed.run(_requests(probed))
    for key in ("kv_hit", "pulled_frac", "ttft_p99_s", "requests"):
        assert seen[key] == plain[key], key
    assert seen["pulled_frac"] > 0  # pulls happened, so the wrapped pricing was exercised
    assert p2p._with_pulls.__name__ == "_with_pulls"  # the pricing is the policy's own again


def test_local_and_pulled_add_up_to_the_runs_kv_hit(probe_script) -> None:
    row = probe_script.run("platform-chat", 6.0, 4, 0, 0.25, 100.0, 20.0, "p2p")
    assert row["local"] + row["pulled"] == pytest.approx(row["kv_hit"], abs=1e-9)
    assert row["pulled"] > 0
    assert 0 < row["mesh_held"] <= row["ever_computed"] <= 1
    assert sum(row["gap_by_reason"].values()) == pytest.approx(row["gap"], abs=1e-9)


def test_an_infinite_free_tier_serves_at_least_what_the_mesh_holds(probe_script) -> None:
    none = probe_script.run("platform-chat", 6.0, 4, 0, 0.25, 0.0, 20.0, "p2p")
    ever = probe_script.run("platform-chat", 6.0, 4, 0, 0.25, 0.0, 20.0, "p2p", "ever")
    assert none["pulled"] == 0 and ever["pulled"] > 0
    assert ever["kv_hit"] > none["kv_hit"]
