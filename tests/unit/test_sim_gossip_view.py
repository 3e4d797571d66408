"""The real gossip agent as the simulator's view (``sim/gossip_view.py``): deterministic per seed, every request
served once, and once caches are quiet every ingress's estimate of every peer is the peer's real match rounded down
to the summary stride (never over it), with the peer's real load."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.gossip_view import NODE_LOAD_PERIOD_S, AgentGossip, DeliveryLag
from p2pnode.sim.staleness import StalenessGossip
from p2pnode.sim.views import SimView
from p2pnode.sim.workloads import Limit, WakmanMix, get_workloads
from p2pnode.sim.workloads.base import Stream

BS = 64
STRIDE = 4  # the agent's default summary stride


def _cluster(nodes: int = 4, seed: int = 0, view: SimView | None = None, **kw: object) -> Cluster:
    settings: dict = {"nodes": nodes, "seed": seed, "block_size": BS, "warmup_s": 2.0}
    settings["gossip"] = "agent"
    cfg = SimConfig(**{**settings, **kw}).with_routing(policy="p2p")
    return Cluster(cfg, view=view)


def _requests(c: Cluster, seed: int, duration: float = 15.0, qps: float = 30.0) -> Iterator[SimRequest]:
    return get_workloads("cacheroute-aggregate")[0].requests(qps, seed, c.space, Limit(duration_s=duration))


def test_agent_view_is_deterministic_per_seed() -> None:
    def once(seed: int) -> tuple[dict, list[int]]:
        c = _cluster(seed=seed)
        res = c.run(_requests(c, seed))
        assert isinstance(c.view, AgentGossip)
        return res, [a.stats.bytes_sent for a in c.view.agents]

    a, b = once(3), once(3)
    assert a == b
    assert a[0]["gossip_bytes_per_node_s"] > 0
    assert once(4)[1] != a[1]


def test_every_request_completes_exactly_once_with_the_agent() -> None:
    c = _cluster(nodes=3)
    c.recorder.keep_rids = True
    roots: list[SimRequest] = []

    def tee(it: Iterator[SimRequest]) -> Iterator[SimRequest]:
        for r in it:
            roots.append(r)
            yield r

    wl = WakmanMix(0.2, 0.4, 0.4)  # closed-loop agent steps: follow-ups released on completion
    res = c.run(tee(wl.requests(40.0, 0, c.space, Limit(duration_s=15.0))))
    everyone = []
    for r in roots:
        while r is not None:
            everyone.append(r)
            r = r.follow
    assert any(r.follow is not None for r in roots)
    assert sorted(c.recorder.rids) == sorted(r.rid for r in everyone)
    assert len(set(c.recorder.rids)) == len(everyone) == res["requests"] == res["completed"]
    assert res["forwarded_frac"] > 0  # routing used the agents' views to send work to peers
    view = c.view
    assert isinstance(view, AgentGossip) and view.network is not None
    # the agents' own byte counters are what the network carried (requests and replies)
    assert view.gossip_bytes() == sum(view.network.bytes_sent.values()) > 0
    assert all(a.stats.internal_errors == 0 and not a.stats.rejected for a in view.agents)


@pytest.mark.parametrize(
    ("kind", "stride"), [("agent", STRIDE), ("model-stride", STRIDE), ("agent-config", 2), ("model-config", 3)]
)
def test_quiet_caches_estimates_are_the_real_match_rounded_to_the_stride(kind: str, stride: int) -> None:
    """The agent's estimate (and the model's with the same stride) is the peer's real match rounded down to the
    stride once gossip has caught up: never over it, never lower by a stride or more. ``SimConfig.summary_stride``
    (``p2pnode sim --summary-stride``) sets it for either view."""
    nodes = 4
    view = StalenessGossip(1.0, seed=0, stride=STRIDE) if kind == "model-stride" else None
    config = {
        "agent-config": {"summary_stride": stride},
        "model-config": {"gossip": "model", "summary_stride": stride, "gossip_delay_s": 0.5},
    }.get(kind, {})
    c = _cluster(nodes=nodes, view=view, kv_capacity_tokens=4_000_000, **config)  # no evictions: no chain cut
    served: list[SimRequest] = []
    probe_t = 15.0 + 30.0  # arrivals stop at 15 s; every request is done well before; then several gossip rounds
    checked: list[int] = []

    def stream() -> Iterator[SimRequest]:
        for r in _requests(c, 0):
            served.append(r)
            yield r
        # a last request after the probe keeps the run (and its gossip) alive until then
        yield Stream(c.space, 10**6).request(10**9, probe_t + 1.0, "sentinel", 100, 1, "x")

    def probe(_: object) -> None:
        assert all(e.running == 0 and e.n_waiting == 0 for e in c.engines)
        ids = c.node_ids
        for i in range(nodes):
            directory = c.view.directory_for(i)
            for r in served:
                for chain in (r.chain[: r.n_prompt_blocks], r.chain):
                    estimates = directory.estimate_matches(chain)
                    for j in range(nodes):
                        if j == i:
                            continue
                        real = c.engines[j].cache.index.match_blocks(chain)
                        est = estimates.get(ids[j], 0)
                        assert est == real - real % stride, (i, j, est, real)  # never over, < stride under
                        checked.append(real)
            peers = {p.node_id: p for p in directory.peers()}
            for j in range(nodes):
                if j != i:
                    eng, load = c.engines[j], peers[ids[j]].load
                    assert load is not None and (load.running, load.waiting) == (0, 0)
                    assert load.kv_usage == pytest.approx(eng.kv_usage, abs=1e-3)
                    assert 0 <= peers[ids[j]].load_age_s < c.loop.now  # its current load arrived during the run
            assert directory.version > 0

    c.loop.at(probe_t, probe)
    res = c.run(stream())
    assert res["completed"] == len(served) + 1
    assert len(checked) > 100 and max(checked) >= 2 * STRIDE  # real matches of several strides were compared


def test_delivery_lag_measures_publish_to_visible() -> None:
    c = _cluster(nodes=8)
    lag = DeliveryLag(period_s=0.02, after_s=3.0)
    assert isinstance(c.view, AgentGossip)
    lag.attach(c.loop, c.view, lambda: c.done)
    c.run(_requests(c, 0, duration=10.0))
    s = lag.summary()
    assert s["n"] > 100
    # an owner's round reaches a peer within about a round (fanout 3 push-pull), never before it is written
    assert min(lag.lags) >= 0.0 and 0.0 < s["mean_s"] < 1.0 and s["max_s"] < 3.0


def test_cluster_rejects_an_unknown_gossip_mode() -> None:
    with pytest.raises(ValueError, match="gossip"):
        Cluster(SimConfig(nodes=2, gossip="exact"))


def test_load_period_is_the_nodes() -> None:
    from p2pnode.node import HEALTH_CHECK_INTERVAL_S

    assert NODE_LOAD_PERIOD_S == HEALTH_CHECK_INTERVAL_S


def test_cli_gossip_flag_reaches_the_config() -> None:
    import argparse

    from p2pnode.sim.cli import add_sim_parser

    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["sim", "--gossip", "agent"]).gossip == "agent"
    assert parser.parse_args(["sim"]).gossip is None  # SimConfig's default: the model
    assert SimConfig().gossip == "model"
    with pytest.raises(SystemExit):
        parser.parse_args(["sim", "--gossip", "exact"])
