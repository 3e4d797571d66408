"""KV pulls in the simulator (``sim/pulls.py``): what moves, over what link, what it costs, how it is counted, and
that nothing pulls without a link figure or under a baseline."""

from __future__ import annotations

import pytest

from p2pnode.engine.simulated.request import (
    PULL_FAILED,
    PULL_FULL,
    PULL_NONE,
    PULL_PARTIAL,
    SimRequest,
)
from p2pnode.load import NodeLoad
from p2pnode.routing.policies import Role, names_of, p2p
from p2pnode.routing.policies.types import PeerSnapshot, RouteRequest
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, get_workloads
from p2pnode.sim.workloads.base import Stream

BS = 16
LINK_GBPS = 100.0
BASELINES = names_of(Role.BASELINE)


def _cluster(nodes: int = 3, **kw: object) -> Cluster:
    cfg = SimConfig(nodes=nodes, block_size=BS, **kw).with_routing(kv_link_gbps=LINK_GBPS)  # type: ignore[arg-type]
    c = Cluster(cfg)
    c.pulls.observe = None  # type: ignore[union-attr]  # no routers here: the pulls are driven by hand
    return c


def _conversation(c: Cluster, blocks: int, seq: int = 1) -> SimRequest:
    """A request of ``blocks`` full blocks plus one token (so every block is usable from cache), 4 output tokens."""
    return Stream(c.space, seq).request(0, 0.0, "k", blocks * BS + 1, 4, "")


def _hold(c: Cluster, j: int, r: SimRequest, blocks: int) -> None:
    """Node j's cache holds the first ``blocks`` blocks of ``r``'s chain (computed and finished: evictable)."""
    cache = c.engines[j].cache
    done = SimRequest(10_000 + j, 0.0, "k", blocks * BS, 0, r.chain, r.cids, BS)
    assert cache.admit(done)
    cache.store_prompt(done)
    cache.release(done)
    assert cache.match_blocks(r.chain, blocks) == blocks


def _pull(c: Cluster, r: SimRequest, target: int, holder: int, blocks: int) -> None:
    """What ``Cluster._arrive`` does with a decision that pulls (the request is at its target, not forwarded)."""
    r.target, r.ingress = target, target
    r.pull_holder, r.pull_blocks = holder, blocks
    c.in_transit[target] += 1
    c.pulls.request(r)  # type: ignore[union-attr]


def _link_s(c: Cluster, blocks: int) -> float:
    return blocks * BS * c.profile.kv_bytes_per_token / (LINK_GBPS * 1e9 / 8)


def test_a_pull_moves_exactly_what_the_target_lacks_and_it_counts_as_cached() -> None:
    c = _cluster()
    r = _conversation(c, 8)
    _hold(c, 1, r, 8)  # the holder has the whole prefix, the target its first 3 blocks
    _hold(c, 0, r, 3)
    _pull(c, r, target=0, holder=1, blocks=8)
    step = c.engines[1].step_s()
    c.loop.run()
    assert r.pull_outcome == PULL_FULL
    assert (r.pull_lo, r.pull_hi) == (3, 8)
    assert r.pull_bytes == 5 * BS * c.profile.kv_bytes_per_token
    assert r.pull_wait_s == 0.0
    assert r.pull_s == pytest.approx(p2p.PULL_RTT_S + step + _link_s(c, 5))
    # Admitted after the pull: 3 blocks its own, 5 pulled, nothing of them recomputed; the pulled ones cached there.
    assert r.cached_tokens == 8 * BS and r.pulled_tokens == 5 * BS
    assert r.t_first > r.pull_s
    assert c.engines[0].cache.match_blocks(r.chain, 8) == 8
    assert c.engines[0].prefill_tokens == 1  # only the last prompt token was computed
    assert c.in_transit == [0, 0, 0]


def test_concurrent_pulls_from_one_holder_share_its_link_first_come_first_served() -> None:
    c = _cluster(nodes=3)
    a, b = _conversation(c, 6, seq=1), _conversation(c, 6, seq=2)
    for r in (a, b):
        _hold(c, 2, r, 6)
    _pull(c, a, target=0, holder=2, blocks=6)
    _pull(c, b, target=1, holder=2, blocks=6)
    c.loop.run()
    assert a.pull_bytes == b.pull_bytes == 6 * BS * c.profile.kv_bytes_per_token
    assert a.pull_wait_s == 0.0 and b.pull_wait_s == pytest.approx(a.pull_s)
    assert b.pull_s == pytest.approx(2 * a.pull_s)  # twice as long: it waited for the whole of the first

    # From two holders, the same two pulls run side by side.
    c = _cluster(nodes=4)
    a, b = _conversation(c, 6, seq=1), _conversation(c, 6, seq=2)
    _hold(c, 2, a, 6)
    _hold(c, 3, b, 6)
    _pull(c, a, target=0, holder=2, blocks=6)
    _pull(c, b, target=1, holder=3, blocks=6)
    c.loop.run()
    assert b.pull_wait_s == 0.0 and b.pull_s == pytest.approx(a.pull_s)


def test_a_holder_that_evicted_the_blocks_moves_nothing_and_the_request_computes_them() -> None:
    c = _cluster()
    r = _conversation(c, 8)
    _hold(c, 0, r, 2)  # the target holds 2 blocks; the holder nothing (evicted since gossip said otherwise)
    _pull(c, r, target=0, holder=1, blocks=8)
    c.loop.run()
    assert r.pull_outcome == PULL_FAILED and r.pull_bytes == 0 and r.pull_hi == 0
    assert r.pull_s == pytest.approx(p2p.PULL_RTT_S)  # the holder answered that it had nothing
    assert r.pulled_tokens == 0 and r.cached_tokens == 2 * BS
    assert c.engines[0].prefill_tokens == 6 * BS + 1

    # A holder with part of it left moves that part; the rest is computed.
    c = _cluster()
    r = _conversation(c, 8)
    _hold(c, 1, r, 5)
    _pull(c, r, target=0, holder=1, blocks=8)
    c.loop.run()
    assert r.pull_outcome == PULL_PARTIAL and r.pull_bytes == 5 * BS * c.profile.kv_bytes_per_token
    assert r.pulled_tokens == 5 * BS and r.cached_tokens == 5 * BS


def test_pulled_tokens_count_as_hit_and_as_pulled() -> None:
    c = _cluster()
    r = _conversation(c, 8)
    _hold(c, 1, r, 8)
    _hold(c, 0, r, 3)
    _pull(c, r, target=0, holder=1, blocks=8)
    c.loop.run()
    s = c.recorder.summary(c.engines, arrived=1, last_arrival=0.0, sim_time=r.t_done, gossip_bytes=0, events=0)
    prompt = 8 * BS + 1
    assert s["kv_hit"] == pytest.approx(8 * BS / prompt)
    assert s["pulled_frac"] == pytest.approx(5 * BS / prompt)
    assert s["kv_hit_local"] == pytest.approx(3 * BS / prompt)
    assert s["pulls_per_req"] == 1.0 and s["pulls_failed_frac"] == 0.0
    assert s["pull_bytes_per_req"] == r.pull_bytes


def _run(policy: str, link: float, qps: float = 12.0, **kw: object) -> tuple[Cluster, dict]:
    cfg = SimConfig(
        nodes=4, block_size=512, warmup_s=3.0, kv_capacity_tokens=60_000, **kw,  # type: ignore[arg-type]
    ).with_routing(policy=policy, kv_link_gbps=link)
    c = Cluster(cfg)
    c.decisions = []
    res = c.run(get_workloads("tool-agent")[0].requests(qps, 1, c.space, Limit(duration_s=15.0)))
    return c, res


def test_the_default_pulls_when_the_link_is_fast_and_every_pull_is_accounted_for() -> None:
    c, res = _run("p2p", LINK_GBPS, qps=30.0)  # busy enough that holders fall clearly behind (p2p: "Pulls")
    pulls = [d.pull for d in c.decisions if d.pull is not None]  # type: ignore[union-attr]
    assert pulls and all(p.target != p.holder and p.blocks > 0 for p in pulls)
    assert res["pulls_per_req"] > 0 and res["pulled_frac"] > 0
    assert res["kv_hit"] == pytest.approx(res["kv_hit_local"] + res["pulled_frac"])
    assert res["completed"] == res["requests"] and c.in_transit == [0] * 4


def test_the_router_that_chose_a_pull_learns_the_holders_link_from_it() -> None:
    """As a node's ingress does from the final message (``ingress.py``). Before, only segment jobs taught the
    simulated routers, so a holder whose link was queued or failing kept its configured figure."""
    c, res = _run("p2p", LINK_GBPS, qps=30.0)
    assert res["pulls_per_req"] > 0
    configured = LINK_GBPS * 1e9 / 8
    learned = {(ingress, holder): router.links.get(holder)  # type: ignore[union-attr]
               for ingress, router in zip(c.node_ids, c.routers, strict=True) for holder in c.node_ids}
    assert any(figure != configured for figure in learned.values())
    # each figure is what its own pulls measured: a pull's whole time (round trip, holder's step, its link queue)
    assert all(figure <= configured for figure in learned.values())


def test_no_pulls_without_a_link_figure() -> None:
    c, res = _run("p2p@f1", 0.0)  # even pricing every pull at zero: no peer has a layout or a link
    assert c.pulls is None and c.kv_layout == ""
    assert all(d.pull is None for d in c.decisions)  # type: ignore[union-attr]
    assert res["pulled_frac"] == res["pulls_per_req"] == res["pull_bytes_per_req"] == 0
    _, plain = _run("p2p", 0.0)
    assert {k: v for k, v in res.items() if k != "events"} == {k: v for k, v in plain.items() if k != "events"}


@pytest.mark.parametrize("policy", BASELINES)
def test_baselines_never_pull_and_do_not_depend_on_the_link(policy: str) -> None:
    c, res = _run(policy, LINK_GBPS, policy_ttft_slo_s=15.0)
    assert all(d.pull is None for d in c.decisions)  # type: ignore[union-attr]
    _, without = _run(policy, 0.0, policy_ttft_slo_s=15.0)
    assert res == without


def test_the_links_model_takes_measured_figures() -> None:
    """Calibration: the link's real speed and a pull's fixed time are parameters of their own."""
    c = _cluster(kv_pull_link_gbps=10.0, kv_pull_fixed_s=0.05)
    r = _conversation(c, 4)
    _hold(c, 1, r, 4)
    _pull(c, r, target=0, holder=1, blocks=4)
    step = c.engines[1].step_s()
    c.loop.run()
    assert r.pull_s == pytest.approx(0.05 + step + 4 * BS * c.profile.kv_bytes_per_token / (10e9 / 8))
    assert r.pull_outcome != PULL_NONE


def test_the_kv_running_requests_hold_is_sampled_after_the_warm_up() -> None:
    """What bounds a mesh short of KV: its caches full of running requests (``metrics.py``)."""
    _, short = _run("p2p", 0.0)
    c = Cluster(SimConfig(nodes=4, block_size=512, warmup_s=3.0, kv_capacity_tokens=600_000))
    roomy = c.run(get_workloads("tool-agent")[0].requests(12.0, 1, c.space, Limit(duration_s=15.0)))
    assert 0 < roomy["kv_running_frac"] < short["kv_running_frac"] <= 1
    assert 0 <= roomy["waiting_frac"] <= short["waiting_frac"] <= 1


def _snap(node_id: str, match: int, backlog: int, running: int, *, is_self: bool = False) -> PeerSnapshot:
    load = NodeLoad(running=running, waiting=1 if backlog else 0, prefill_backlog_tokens=backlog)
    return PeerSnapshot(
        node_id=node_id, is_self=is_self, alive=True, est_match_blocks=match, load=load, kv_layout="sim",
        link_bytes_per_s=LINK_GBPS * 1e9 / 8,
    )


def test_a_holder_within_the_bound_keeps_its_request_and_a_pull_wins_on_cost_alone() -> None:
    """A pulling candidate ranks by the prefix it holds (``p2p``, "Pulls"): the request's home, an idle node, does
    not take a conversation off a holder whose queue the bound calls noise, though pulling there is cheaper; once
    the holder is clearly behind, the idle node serves it with the history pulled."""
    bs = 512
    r = RouteRequest(tuple(range(1, 21)), 20 * bs + 100, 200, "k", bs, 0, homes=("idle",))
    price = {"kv_bytes_per_token": 131_072, "prefill_s_per_token": 4.0e-5, "choices": 0, "holders": 0}
    me = _snap("me", 0, 0, 2, is_self=True)
    idle = _snap("idle", 0, 0, 0)
    near = _snap("holder", 20, 6_000, 4)  # a few thousand tokens queued: within the bound of the pull's cost
    d = p2p.route(r, [me, idle, near], **price)  # type: ignore[arg-type]
    assert d.target == "holder" and d.pull is None
    far = _snap("holder", 20, 200_000, 40)  # a long queue: the pull is the cheaper way to the first token
    d = p2p.route(r, [me, idle, far], **price)  # type: ignore[arg-type]
    assert d.pull is not None and d.pull.holder == "holder" and d.target in {"idle", "me"}
    assert d.pull.target == d.target and d.pull.blocks == 20


def test_every_view_publishes_the_layout_when_the_run_moves_kv() -> None:
    """The model, the real agent (its summary's meta) and the exact view all tell routers every node's KV layout."""
    for extra in ({"gossip": "agent", "summary_stride": 1}, {"gossip": "model"}):
        c, _ = _run("p2p", LINK_GBPS, qps=30.0, **extra)
        assert any(d.pull is not None for d in c.decisions), extra  # type: ignore[union-attr]
    c, _ = _run("upper-bound", LINK_GBPS, qps=30.0)
    assert any(d.pull is not None for d in c.decisions)  # type: ignore[union-attr]
