"""Each peer's recent served rate, read off its gossiped served counts (``routing/served_rate.py``), and how it reaches
the snapshots a policy reads: a peer's through the peer table, this node's through the router, a simulated node's
through its engine's load."""

from __future__ import annotations

import pytest

from p2pnode.load import NodeLoad
from p2pnode.routing.peer_table import PeerTable
from p2pnode.routing.served_rate import ServedRate, ServedRates


def served(at: float, requests: int, uncached: int = 0, completion: int = 0) -> NodeLoad:
    return NodeLoad(
        served_requests=requests, served_uncached_tokens=uncached, served_completion_tokens=completion, served_at=at
    )


def test_a_steady_peer_reads_at_its_rate_once_its_reports_span_the_minimum() -> None:
    rates = ServedRates(tau_s=20.0, min_span_s=5.0)
    seen = [rates.observe("a", served(100.0 + t, 10 * t, 20 * t, 80 * t)) for t in range(8)]
    assert seen[:5] == [None] * 5  # 0-4 s of reports: not yet
    rate = seen[-1]
    assert rate is not None
    # Bias-corrected: 10 requests/s after 7 s, not 10 * (1 - exp(-7/20)).
    assert (rate.requests, rate.uncached_tokens, rate.completion_tokens) == pytest.approx((10.0, 20.0, 80.0))
    assert rate.work(1.0, 0.25) == pytest.approx(40.0)
    assert rates.observe("a", served(107.0, 70, 140, 560)) is rate  # a repeat changes nothing


def test_recent_work_weighs_more_than_old() -> None:
    """A peer that served 10/s for a minute, then 20/s for 20 s, reads well above the minute's mean (13.3/s)."""
    rates = ServedRates(tau_s=20.0, min_span_s=5.0)
    n = 0
    for t in range(1, 81):
        n += 10 if t <= 60 else 20
        rate = rates.observe("a", served(float(t), n))
    assert rate is not None and 16.0 < rate.requests < 20.0


def test_a_restarted_peer_starts_again_and_forgotten_peers_go() -> None:
    rates = ServedRates(tau_s=20.0, min_span_s=2.0)
    for t in range(5):
        rates.observe("a", served(1.0 + t, 100 * t))
    assert rates.rate("a") is not None
    assert rates.observe("a", served(6.0, 3)) is None  # counts went backwards: it restarted
    assert rates.observe("b", NodeLoad()) is None  # no served figures: nothing known
    rates.retain({"b"})
    assert len(rates) == 0 and rates.rate("a") is None
    with pytest.raises(ValueError, match="tau_s"):
        ServedRates(tau_s=0.0)


class _Peer:
    usable, info_age_s, load_age_s, cached_blocks = True, 0.0, 0.0, 0

    def __init__(self, node_id: str, load: NodeLoad) -> None:
        self.node_id = self.address = node_id
        self.load = load


class _Directory:
    def __init__(self) -> None:
        self.version = 0
        self.loads: dict[str, NodeLoad] = {}

    def peers(self) -> list[_Peer]:
        return [_Peer(n, load) for n, load in self.loads.items()]

    def peer(self, node_id: str) -> _Peer | None:
        load = self.loads.get(node_id)
        return _Peer(node_id, load) if load is not None else None

    def changes_since(self, version: int) -> None:
        return None


def test_the_peer_table_gives_each_snapshot_its_peers_served_rate_from_gossiped_loads() -> None:
    table = PeerTable("me", "me")
    directory = _Directory()
    for t in range(10):
        directory.loads = {"a": served(1.0 + t, 5 * t), "b": served(1.0 + t, 15 * t)}
        directory.version += 1
        table.refresh(directory, float(t), refresh_s=1e9)
    rates = {n: table.by_id[n].served_rate for n in ("a", "b")}
    assert rates == {"a": pytest.approx(ServedRate(5.0, 0.0, 0.0)), "b": pytest.approx(ServedRate(15.0, 0.0, 0.0))}
    directory.loads = {"b": served(11.0, 150)}  # a left the mesh
    directory.version += 1
    table.refresh(directory, 11.0, refresh_s=1e9)
    assert "a" not in table.by_id and table.served_rates.rate("a") is None


def test_a_simulated_engine_reports_the_work_it_served_as_a_node_does() -> None:
    from p2pnode.sim.cluster import Cluster, SimConfig
    from p2pnode.sim.workloads import Limit, get_workloads

    cluster = Cluster(SimConfig(nodes=2, seed=1).with_routing(policy="cacheroute"))
    cluster.run(get_workloads("whales")[0].requests(20.0, 1, cluster.space, Limit(max_requests=400)))
    for eng in cluster.engines:
        load = eng.load()
        assert load.served_requests == eng.finished - eng.dropped > 0
        assert load.served_at > 0 and load.served_uncached_tokens > 0 and load.served_completion_tokens > 0
    # Every ingress's router has read a rate for every node, its own included.
    for router in cluster.routers:
        assert all(router.table.served_rates.rate(n) is not None for n in cluster.node_ids)
