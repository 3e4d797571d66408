"""The simulated mesh: hand-computed hits on one node, conservation, determinism, every policy, the gossip view."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator

import pytest

from p2pnode.config import DEFAULT_SPECULATIVE_TTL_S
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.load import NodeLoad
from p2pnode.routing.policies import SPECS
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.des import EventLoop, fewer_collections
from p2pnode.sim.staleness import StalenessGossip, agent_fitted_delay, default_delay, one_hop_push_delay
from p2pnode.sim.views import MeshParts
from p2pnode.sim.workloads import Limit, WakmanMix, get_workloads
from p2pnode.sim.workloads.base import Stream

BS = 4


def _all(roots: list[SimRequest]) -> list[SimRequest]:
    out = []
    for r in roots:
        while r is not None:
            out.append(r)
            r = r.follow
    return out


def test_single_node_hits_match_hand_computation() -> None:
    c = Cluster(SimConfig(nodes=1, block_size=BS).with_routing(policy="p2p"))
    sp = c.space
    shared = (8, *_prefix(c))
    s0 = Stream(sp, 100, shared)
    r0 = s0.request(0, 0.0, "k", 4, 4, "x")  # prompt 12, nothing cached; caches 3 prompt + 1 output block
    r1 = Stream(sp, 101, shared).request(1, 10.0, "k", 4, 1, "x")  # shares the 8-token prefix: 8 cached
    r2 = Stream(sp, 101, shared).request(2, 20.0, "k", 4, 1, "x")  # same prompt as r1: capped at (12-1)//4 = 2
    r3 = Stream(sp, 101, shared).request(3, 30.0, "k", 5, 1, "x")  # r1's 12 tokens + 1: 3 blocks cached
    r4 = s0.request(4, 40.0, "k", 4, 1, "x")  # r0's next turn: its prompt (12) + output (4) cached
    res = c.run([r0, r1, r2, r3, r4])
    assert [r.cached_tokens for r in (r0, r1, r2, r3, r4)] == [0, 8, 8, 12, 16]
    assert res["kv_hit"] == pytest.approx(44 / (12 + 12 + 12 + 13 + 20))
    assert res["forwarded_frac"] == 0 and res["completed"] == 5


def _prefix(c: Cluster) -> tuple[list[int], list[int]]:
    chain: list[int] = []
    cids: list[int] = []
    c.space.extend(chain, cids, [1, 2])
    return chain, cids


def _run(
    policy: str, workload: str, seed: int = 0, nodes: int = 4, speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
    **kw: object,
) -> tuple[Cluster, dict, list]:
    cfg = SimConfig(nodes=nodes, seed=seed, block_size=64, warmup_s=2.0, **kw)  # type: ignore[arg-type]
    cfg = cfg.with_routing(policy=policy, speculative_ttl_s=speculative_ttl_s)
    c = Cluster(cfg)
    c.recorder.keep_rids = True
    wl = get_workloads(workload)[0] if not isinstance(workload, WakmanMix) else workload
    roots: list[SimRequest] = []

    def tee(it: Iterator[SimRequest]) -> Iterator[SimRequest]:
        for r in it:
            roots.append(r)
            yield r

    res = c.run(tee(wl.requests(40.0, seed, c.space, Limit(duration_s=15.0))))
    return c, res, roots


def test_conservation_every_request_completes_exactly_once() -> None:
    c, res, roots = _run("p2p", WakmanMix(0.2, 0.4, 0.4), nodes=3)  # type: ignore[arg-type]
    everyone = _all(roots)
    assert any(r.follow is not None for r in roots)  # closed-loop agent steps are in there
    assert sorted(c.recorder.rids) == sorted(r.rid for r in everyone)
    assert len(set(c.recorder.rids)) == len(everyone) == res["requests"] == res["completed"]
    for r in everyone:
        assert r.t_done >= r.t_first >= r.arrival >= 0 and not r.dropped
        if r.follow is not None:
            assert r.follow.arrival >= r.t_done
    for eng in c.engines:
        cache = eng.cache
        assert set(cache.refs) == {h for h, _ in cache.index.iter_blocks()}
        assert cache.free + len(cache.refs) == cache.num_blocks and cache.n_pinned == 0
        assert not eng.waiting and not eng.prefilling and eng.n_decode == 0
    assert not any(router.ledger.peers() for router in c.routers)  # every send ended at its ingress
    assert c.in_transit == [0] * len(c.engines)


def _strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in ("wall_s", "cpu_s")}


def test_deterministic_with_a_seed() -> None:
    _c1, a, _ = _run("p2p", "cacheroute-aggregate", seed=3)
    _c2, b, _ = _run("p2p", "cacheroute-aggregate", seed=3)
    _, other, _ = _run("p2p", "cacheroute-aggregate", seed=4)
    assert _strip(a) == _strip(b)
    assert a["ttft_p99_s"] != other["ttft_p99_s"]


def test_a_run_leaves_the_collector_as_it_found_it() -> None:
    """A run collects garbage less often while it runs (``des.fewer_collections``), and only then."""
    before = gc.get_threshold()
    seen: list[int] = []
    loop = EventLoop()
    loop.at(1.0, lambda _: seen.append(gc.get_threshold()[0]))
    with fewer_collections(gen0=before[0] + 1000):
        loop.run()
    assert seen == [before[0] + 1000]
    assert gc.get_threshold() == before
    _run("p2p", "cacheroute-aggregate", seed=3)
    assert gc.get_threshold() == before


@pytest.mark.parametrize("policy", [*SPECS, "cacheroute-p2p", "upper-bound"])
def test_every_policy_runs_and_forwards(policy: str) -> None:
    _c, res, _ = _run(policy, "whales", nodes=4)
    assert res["completed"] == res["requests"] > 100
    assert 0.0 <= res["kv_hit"] <= 1.0
    served = res["per_node"]["served"]
    assert sum(served) == res["measured"]
    if policy != "sticky":
        assert min(served) > 0  # every balancing policy uses every node


def test_cacheroute_with_its_default_fallback_named_is_cacheroute() -> None:
    """``cacheroute-p2p`` names the fallback ``cacheroute`` uses anyway: the same decisions, homes included."""
    _c, a, _ = _run("cacheroute", "whales", nodes=4)
    _c, b, _ = _run("cacheroute-p2p", "whales", nodes=4)
    assert _strip(a) == _strip(b)


def test_affinity_beats_cache_blind_balancing_on_shared_prefixes() -> None:
    hits = {p: _run(p, "whales", nodes=4)[1]["kv_hit"] for p in ("flat", "p2p", "upper-bound")}
    assert hits["flat"] < hits["p2p"] <= hits["upper-bound"] + 0.05


def test_staleness_view_matches_brute_force() -> None:
    g = StalenessGossip(1.0, 0.0)
    ids = tuple(f"n{j}" for j in range(5))
    g.start(MeshParts(EventLoop(), ids, [], lambda: True, [0] * 5))
    rng = random.Random(5)
    truth: list[set[int]] = [set() for _ in range(5)]
    for _ in range(300):
        j = rng.randrange(5)
        changes = []
        for h in rng.sample(range(40), 6):
            added = rng.random() < 0.6
            if added != (h in truth[j]):
                (truth[j].add if added else truth[j].discard)(h)
                changes.append(h if added else ~h)  # journal entries: a hash added, ~hash removed
        if rng.random() < 0.1:  # now and then a full snapshot (the journal did not reach back)
            g._apply((j, 0.0, None, sorted(truth[j]), (NodeLoad(), 0)))
        else:
            g._apply((j, 0.0, changes, None, (NodeLoad(), 0)))
        chain = rng.sample(range(40), 5)
        estimates = g.estimate_matches(chain)
        for n in range(5):
            m = 0
            while m < len(chain) and chain[m] in truth[n]:
                m += 1
            assert estimates.get(ids[n], 0) == m
        assert 0 not in estimates.values()


def test_gossip_delay_default_and_bytes() -> None:
    assert one_hop_push_delay(1.0, 32) == pytest.approx(2.5)
    # the default is the real agent's measured lag (0.48 rounds at 30 nodes), not the one-hop push's
    assert default_delay(1.0, 32) == agent_fitted_delay(1.0, 32) == pytest.approx(0.48)
    assert default_delay(1.0, 4) == 0.0  # fanout 3 reaches every other node directly
    _, res, _ = _run("p2p", "mmlu", nodes=4)
    assert res["gossip_bytes_per_node_s"] > 0
    _, fresh, _ = _run("p2p", "mmlu", nodes=4, gossip_interval_s=0.1, gossip_delay_s=0.0)
    _, stale, _ = _run("p2p", "mmlu", nodes=4, gossip_interval_s=5.0, gossip_delay_s=5.0, speculative_ttl_s=0.0)
    assert fresh["est_error_tokens"] <= stale["est_error_tokens"]


def _quick_second_turns(policy: str, conversations: int = 120, gap_s: float = 0.5) -> float:
    """Share of second turns served where their first turn was, when each comes ``gap_s`` after the first -- before
    any gossip report of the first (rounds every 1 s, heard 2 s later) -- at a random ingress. Every conversation
    begins with one system prompt, which the mesh has cached and reported by then."""
    c = Cluster(SimConfig(nodes=8, seed=3, block_size=64, gossip_delay_s=2.0).with_routing(policy=policy))
    system = (128, *_prefix(c))  # two 64-token blocks
    warm = [Stream(c.space, 10 + i, system).request(10_000 + i, 0.25 * i, "", 300, 8, "chat") for i in range(16)]
    turns = []
    for i in range(conversations):
        s = Stream(c.space, 1000 + i, system)
        t = 10.0 + 0.25 * i
        turns.append(s.request(2 * i, t, "", 1500, 40, "chat"))
        turns.append(s.request(2 * i + 1, t + gap_s, "", 200, 40, "chat"))
    turns.sort(key=lambda r: r.arrival)
    c.run(warm + turns)
    by_rid = {r.rid: r.target for r in turns}
    return sum(by_rid[2 * i] == by_rid[2 * i + 1] for i in range(conversations)) / conversations


def test_a_conversations_quick_next_turn_goes_where_its_first_went() -> None:
    """Before gossip reports a new conversation's first turn, its next turn (at another ingress) still finds it:
    both hash to the same home (``p2p.context_homes``). Without a home it lands where its first turn is cached only
    by chance (the same ingress's speculative index, or a lucky draw)."""
    with_homes = _quick_second_turns("p2p")
    without = _quick_second_turns("p2p@o0")
    assert with_homes >= 0.9, with_homes
    assert without <= 0.45, without


def test_clients_send_only_to_the_ingresses_configured_and_every_node_still_serves() -> None:
    _, res, roots = _run("p2p", WakmanMix(0.2, 0.4, 0.4), nodes=4, ingresses=1)  # type: ignore[arg-type]
    everyone = _all(roots)
    assert {r.ingress for r in everyone} == {0}  # one router decides for the whole mesh
    assert res["completed"] == len(everyone)
    assert len({r.target for r in everyone}) == 4  # and sends work to every node
    _, _, roots = _run("p2p", WakmanMix(0.2, 0.4, 0.4), nodes=4)  # type: ignore[arg-type]
    assert {r.ingress for r in _all(roots)} == {0, 1, 2, 3}  # the default: every node takes requests
    with pytest.raises(ValueError, match="ingresses"):
        Cluster(SimConfig(nodes=2, ingresses=-1))
