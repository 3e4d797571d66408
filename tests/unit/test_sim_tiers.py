"""KV tiers below the simulated engine (``engine/simulated/tiers.py``): what a tier stores, evicts and loads, how long
a load delays a request, what the gossip model and the exact view say of a node's tiers, and a whole run with them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from p2pnode.cache.tiers import Medium
from p2pnode.cost import CostProfile, get_profile
from p2pnode.cost.tiers import TierRates, load_seconds
from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.simulated.tiers import KvTier, NodeTiers, TierConfig
from p2pnode.load import NodeLoad
from p2pnode.routing.policies import dynamo, get_spec
from p2pnode.routing.policies.types import PeerSnapshot, RouteRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.des import EventLoop
from p2pnode.sim.staleness import StalenessGossip
from p2pnode.sim.views import ExactView, MeshParts
from p2pnode.sim.workloads import Limit, get_workloads
from p2pnode.sim.workloads.base import Stream

BS = 16
#: Round numbers for timing by hand: 1,000 B of KV per token, a host tier loading 1 MB/s (16 ms a block) and a disk
#: read at 0.5 MB/s.
PROFILE = CostProfile(
    name="tiered-test",
    description="",
    sources=(),
    kv_capacity_tokens=8 * BS,
    max_num_seqs=8,
    max_num_batched_tokens=4096,
    step_base_s=0.010,
    prefill_s_per_token=0.001,
    prefill_attn_s_per_token2=0.0,
    decode_s_per_seq=0.0,
    kv_read_s_per_token=0.0,
    kv_bytes_per_token=1000,
    host_load_bytes_per_s=1e6,
    host_store_bytes_per_s=1e6,
    disk_load_bytes_per_s=0.5e6,
    disk_store_bytes_per_s=0.5e6,
)


def _tiers(host: int, disk: int = 0, **kw: object) -> NodeTiers:
    return NodeTiers(TierConfig(host_blocks=host, disk_blocks=disk, **kw), BS * PROFILE.kv_bytes_per_token)  # type: ignore[arg-type]


def _request(space: BlockSpace, seq: int, blocks: int, output: int = 1, rid: int = 0) -> SimRequest:
    """A prompt of ``blocks`` full blocks plus one token (every block usable from cache)."""
    return Stream(space, seq).request(rid, 0.0, "k", blocks * BS + 1, output, "")


# --- pricing ----------------------------------------------------------------------------------------------------------


def test_a_load_costs_its_bytes_at_the_tiers_rates() -> None:
    assert load_seconds(PROFILE, Medium.GPU, 10_000) == 0.0
    assert load_seconds(PROFILE, Medium.HOST, 16) == pytest.approx(0.016)
    assert load_seconds(PROFILE, Medium.DISK, 16) == pytest.approx(0.032 + 0.016)  # read to host, then loaded
    assert TierRates.of(PROFILE).load_seconds(16, 16) == pytest.approx(0.016 + 0.048)
    h100 = get_profile("llama-3.1-8b-h100")
    block = load_seconds(h100, Medium.HOST, 512)
    assert 1e-3 < block < 2e-3 < 512 * h100.prefill_s_per_token / 10  # a 512-token block: ~1.3 ms, >10x cheaper
    with pytest.raises(ValueError, match="disk"):
        TierRates(1000, 1e6).seconds(Medium.DISK, 16)


# --- one tier ---------------------------------------------------------------------------------------------------------


def test_a_tier_evicts_least_recent_first_and_keeps_a_journal() -> None:
    tier = KvTier(Medium.HOST, 3, "lru")
    assert tier.insert([1, 2, 3]) == []
    tier.touch([1, 2])  # a request finished with 1, 2: 1 (the head) most recent
    assert tier.insert([4]) == [3]
    assert tier.insert([5, 6]) == [2, 1]
    assert set(tier.blocks) == {4, 5, 6} and tier.evictions == 3
    changes = tier.changes_since(3)
    assert changes is not None and [(added, h) for _, added, h in changes] == [
        (False, 3), (True, 4), (False, 2), (False, 1), (True, 5), (True, 6)
    ]  # fmt: skip
    assert tier.changes_since(tier.version) == [] and tier.changes_since(tier.version + 1) is None


def test_arc_keeps_reused_blocks_over_a_scan() -> None:
    lru, arc = KvTier(Medium.HOST, 4, "lru"), KvTier(Medium.HOST, 4, "arc")
    for tier in (lru, arc):
        tier.insert([1, 2])
        tier.touch([1, 2], reused=True)  # used again: a second hit
        for h in range(100, 104):  # a one-time scan
            tier.insert([h])
    assert {1, 2} <= set(arc.blocks)
    assert not {1, 2} & set(lru.blocks)


# --- a node's tiers ---------------------------------------------------------------------------------------------------


def test_every_offered_block_is_stored_or_only_blocks_seen_twice() -> None:
    every, twice = _tiers(100), _tiers(100, store_threshold=2)
    chain = [11, 12, 13, 14]
    for tiers in (every, twice):
        tiers.offer(chain, 0, 3)
    assert set(every.host.blocks) == {11, 12, 13} and every.host_store_blocks == 3
    assert not twice.host.blocks and twice.stores_skipped == 3
    twice.offer(chain, 1, 4)
    assert set(twice.host.blocks) == {12, 13} and twice.host_store_blocks == 2  # 14 was offered once
    assert twice.depths(chain, 0, 4) == (0, 0)  # the head is missing: nothing continues the engine's (empty) hit
    assert twice.depths(chain, 1, 4) == (3, 3)


def test_the_disk_keeps_what_the_host_evicted_and_a_read_promotes_it() -> None:
    tiers = _tiers(2, 8)
    tiers.offer([1, 2], 0, 2)
    tiers.offer([3, 4], 0, 2)  # host holds 3, 4; the disk every block written through
    assert set(tiers.host.blocks) == {3, 4} and set(tiers.disk.blocks) == {1, 2, 3, 4}  # type: ignore[union-attr]
    assert tiers.disk_store_blocks == 4
    assert tiers.depths([1, 2, 9], 0, 3) == (0, 2)
    assert tiers.load([1, 2, 9], 0, 0, 2) == 2  # both from disk
    assert set(tiers.host.blocks) == {1, 2} and tiers.disk_load_blocks == 2 and tiers.host_load_blocks == 2
    assert tiers.bytes_moved() == {
        "host_store": 4 * BS * 1000, "host_load": 2 * BS * 1000, "disk_store": 4 * BS * 1000,
        "disk_load": 2 * BS * 1000,
    }  # fmt: skip
    with pytest.raises(ValueError, match="host tier above"):
        TierConfig(disk_blocks=4)


# --- the paged cache over tiers ---------------------------------------------------------------------------------------


def _cache(tiers: NodeTiers, blocks: int = 8) -> PagedPrefixCache:
    space = BlockSpace(BS)
    return PagedPrefixCache(blocks, BS, "lru", space.block_tokens, tiers=tiers)


def _serve(cache: PagedPrefixCache, r: SimRequest) -> int:
    assert cache.admit(r)
    cache.store_prompt(r)
    cache.release(r)
    return r.cached_tokens


@pytest.mark.parametrize("prompt_only", [False, True])
def test_a_prefix_evicted_from_the_engine_is_loaded_back_from_the_host_tier(prompt_only: bool) -> None:
    tiers = _tiers(64, prompt_only=prompt_only)
    cache = _cache(tiers)
    space = BlockSpace(BS)
    conversation = Stream(space, 1)
    first = conversation.request(0, 0.0, "k", 4 * BS, 2 * BS, "")  # 4 prompt blocks, 2 output blocks
    assert _serve(cache, first) == 0
    assert tiers.host_store_blocks == (4 if prompt_only else 6)
    for seq in range(2, 6):  # others push it out of the engine's 8 blocks
        _serve(cache, _request(space, seq, 6))
    assert cache.match_blocks(first.chain, 6) == 0
    nxt = conversation.request(9, 0.0, "k", 1, 1, "")  # the next turn: its history and one more token
    assert cache.admit(nxt)
    loaded = 4 if prompt_only else 6
    assert nxt.cached_tokens == nxt.tier_host_tokens == loaded * BS and nxt.tier_disk_tokens == 0
    assert nxt.tier_offer_from == loaded
    assert cache.match_blocks(first.chain, 6) == loaded  # cached in the engine from then on, in the index too
    assert {h for h, _ in cache.index.iter_blocks()} == set(cache.refs)
    cache.store_prompt(nxt)
    cache.release(nxt)
    assert cache.free + len(cache.refs) == cache.num_blocks and cache.n_pinned == 0


def test_a_pulled_request_loads_nothing_from_the_tiers() -> None:
    tiers = _tiers(64)
    cache = _cache(tiers, blocks=32)
    space = BlockSpace(BS)
    r = _request(space, 1, 4)
    tiers.offer(r.chain, 0, 4)  # the tier holds all four blocks
    r.pull_lo, r.pull_hi = 0, 2  # two were pulled from a peer: the pull serves this request's load
    assert cache.admit(r)
    assert r.cached_tokens == r.pulled_tokens == 2 * BS and r.tier_host_tokens == 0


# --- the engine: a load delays the prefill ----------------------------------------------------------------------------


def test_a_load_delays_the_prefill_by_its_time_and_queues_on_the_host_link() -> None:
    loop = EventLoop()
    space = BlockSpace(BS)
    tiers = _tiers(64)
    cache = PagedPrefixCache(64, BS, "lru", space.block_tokens, tiers=tiers)
    done: list[SimRequest] = []
    eng = NodeEngine(0, loop, replace(PROFILE, kv_capacity_tokens=64 * BS), cache, done.append)
    a, b = _request(space, 1, 4), _request(space, 2, 2, rid=1)
    tiers.offer(a.chain, 0, 4)
    tiers.offer(b.chain, 0, 2)
    loop.at(0.0, eng.submit, a)
    loop.at(0.0, eng.submit, b)
    loop.run()
    # a loads 4 blocks (64 tokens: 0.064 s), then prefills its last token in one step (0.011 s)
    assert a.tier_host_tokens == 4 * BS and a.tier_load_s == pytest.approx(0.064)
    assert a.t_first == pytest.approx(0.064 + 0.010 + 0.001)
    # b's 2 blocks load after a's on the same link: ready at 0.096 s, then its step
    assert b.tier_load_s == pytest.approx(0.096)
    assert b.t_first == pytest.approx(0.096 + 0.011)
    assert eng.prefill_backlog_tokens == 0 and not eng.loading and len(done) == 2


def test_a_profile_without_tier_rates_cannot_time_a_tier() -> None:
    space = BlockSpace(BS)
    cache = PagedPrefixCache(64, BS, "lru", space.block_tokens, tiers=_tiers(8))
    with pytest.raises(ValueError, match="no host tier rate"):
        NodeEngine(0, EventLoop(), replace(PROFILE, host_load_bytes_per_s=0.0), cache, lambda r: None)


# --- what routing sees of a node's tiers ------------------------------------------------------------------------------


def _mesh(c: Cluster) -> MeshParts:
    return MeshParts(c.loop, c.node_ids, c.engines, lambda: False, c.in_transit)


def test_the_exact_view_and_the_gossip_model_see_a_nodes_tiers() -> None:
    c = Cluster(SimConfig(nodes=3, block_size=BS, host_kv_tokens=64 * BS))
    r = _request(c.space, 1, 6)
    c.engines[1].cache.tiers.offer(r.chain, 0, 6)  # type: ignore[union-attr]
    c.engines[2].cache.tiers.offer(r.chain, 0, 3)  # type: ignore[union-attr]
    exact = ExactView()
    exact.start(_mesh(c))
    assert exact.estimate_tier_matches(r.chain, Medium.HOST) == {"n01": 6, "n02": 3}
    assert exact.estimate_tier_matches(r.chain, Medium.DISK) == {}
    model = StalenessGossip(1.0, delay_s=0.5)
    model.start(_mesh(c))
    assert model.estimate_tier_matches(r.chain, Medium.HOST) == {}  # nothing heard yet
    c.loop.run(until=2.0)
    assert model.estimate_tier_matches(r.chain, Medium.HOST) == {"n01": 6, "n02": 3}
    assert model.estimate_matches(r.chain) == {}  # a tier is not the engine's summary
    assert model.gossip_bytes() > 0


def test_a_run_with_tiers_hits_more_and_says_where_from() -> None:
    w = get_workloads("platform-chat")[0]
    limit = Limit(duration_s=60.0)
    base = SimConfig(nodes=4, seed=1, kv_capacity_tokens=20_000, warmup_s=12.0, block_size=w.block_size)
    for policy in ("p2p", "sticky"):  # a tier is the node's: every policy's engines have it
        cfg = base.with_routing(policy=policy)
        c = Cluster(cfg)
        plain = c.run(w.requests(1.0, 1, c.space, limit))
        c = Cluster(replace(cfg, host_kv_tokens=160_000))
        tiered = c.run(w.requests(1.0, 1, c.space, limit))
        assert "kv_hit_host" not in plain
        assert tiered["kv_hit_host"] > 0.02 and tiered["kv_hit"] > plain["kv_hit"], policy
        parts = tiered["kv_hit_gpu"] + tiered["kv_hit_host"] + tiered["kv_hit_disk"] + tiered["pulled_frac"]
        assert parts == pytest.approx(tiered["kv_hit"])
        assert tiered["tier_host_store_bytes_per_req"] > 0 and tiered["tier_host_load_bytes_per_req"] > 0
        assert tiered["tier_load_s_mean"] > 0


# --- routing by tier --------------------------------------------------------------------------------------------------

H100 = get_profile("llama-3.1-8b-h100")
RBS = 512  # the production shapes' block: 64 MiB of the 8B profile's KV, ~1.3 ms to load from host


def _route_request(blocks: int) -> RouteRequest:
    return RouteRequest(tuple(range(1, blocks + 1)), blocks * RBS + 100, 200, "k", RBS, 0)


def _snap(node_id: str, gpu: int = 0, host: int = 0, disk: int = 0, waiting: int = 0, **kw: object) -> PeerSnapshot:
    load = NodeLoad(running=2, waiting=waiting, prefill_backlog_tokens=waiting * 4000)
    return PeerSnapshot(
        node_id=node_id, est_match_blocks=gpu, est_host_blocks=host, est_disk_blocks=disk, load=load, **kw
    )  # type: ignore[arg-type]


def test_p2p_prices_a_host_tier_like_a_cheap_load_and_the_engine_loads_it() -> None:
    spec = get_spec("p2p").for_profile(H100)
    r = _route_request(16)
    peers = [_snap("a", is_self=True), _snap("b", gpu=1, host=16), _snap("c", gpu=1)]
    decision = spec(r, peers)
    assert decision.target == "b" and decision.est_match_blocks == 16  # it would load 15 blocks from its host tier
    # a tier the router cannot price is no reason to go there (a profile without tier rates)
    unpriced = get_spec("p2p").for_profile(replace(H100, host_load_bytes_per_s=0.0, disk_load_bytes_per_s=0.0))
    busy_b = [_snap("a", is_self=True), _snap("b", gpu=1, host=16, waiting=1), _snap("c", gpu=1)]
    assert spec(r, busy_b).target == "b"  # a short queue is worth 15 blocks loaded, not computed
    assert unpriced(r, busy_b).target != "b"
    # loaded at its time, which delays this request only (weight 1, against a prefill's 4 as work others wait for):
    # a host tier 8x slower than computing is no reason to queue there
    rate = H100.kv_bytes_per_token / H100.prefill_s_per_token / 8
    slow = get_spec("p2p").for_profile(replace(H100, host_load_bytes_per_s=rate))
    assert slow(r, busy_b).target != "b"


def test_p2p_draws_holders_by_their_tiers_depth() -> None:
    """A peer whose only copy is in its tier is a holder among the candidates (the router draws it as p2p would)."""
    spec = get_spec("p2p").for_profile(H100)
    r = RouteRequest(tuple(range(1, 17)), 16 * RBS + 100, 200, "k", RBS, 0, sampled=("s",))
    peers = [_snap("a", is_self=True), _snap("s"), _snap("t", host=12), _snap("u", disk=16), _snap("v")]
    assert spec(r, peers).target == "u"  # 16 blocks from disk (read to host, then loaded) beat 12 from host


def test_dynamo_credits_host_and_disk_blocks_as_dynamo_does() -> None:
    r = _route_request(16)
    gpu, host, disk = _snap("g", gpu=8), _snap("h", gpu=4, host=8), _snap("d", gpu=4, disk=8)
    logit = {p.node_id: dynamo.logit(r, p) for p in (gpu, host, disk)}
    # against 8 device blocks: 4 host blocks leave 4 x 0.25 blocks to prefill, 4 disk blocks 4 x 0.75; either way 4
    # more blocks to allocate (decode blocks count the device overlap only)
    assert logit["h"] - logit["g"] == pytest.approx(1 + 4)
    assert logit["d"] - logit["g"] == pytest.approx(3 + 4)
    assert dynamo.logit(r, _snap("x", gpu=8, host=8)) == dynamo.logit(r, gpu)  # nothing past the device overlap


def test_a_request_that_fits_waits_for_one_loading_from_the_tier_instead_of_being_dropped() -> None:
    """Admission dropped a request as "larger than the whole cache" whenever nothing prefilled or decoded, but a
    request loading from the host tier holds its blocks meanwhile: a 6-block request beside a 5-block one loading in
    a 10-block cache was dropped for good (``whales`` at 8k tokens of KV: 41 of 360 requests)."""
    profile = get_profile("llama-3.1-8b-h100")
    loop = EventLoop()
    tiers = NodeTiers(TierConfig(host_blocks=100), BS * profile.kv_bytes_per_token)
    cache = PagedPrefixCache(10, BS, "lru", lambda r, lo, hi: [], tiers=tiers)
    done: list[SimRequest] = []
    engine = NodeEngine(0, loop, profile, cache, done.append)

    def request(rid: int, t: float, base: int, prompt: int) -> SimRequest:
        chain = list(range(base, base + 10))
        return SimRequest(rid, t, "", prompt, 16, chain, list(range(10)), BS)

    loop.at(0.0, engine.submit, request(1, 0.0, 1000, 64))  # 5 blocks, offered to the host tier when done
    loop.at(1.0, engine.submit, request(2, 1.0, 2000, 144))  # 10 blocks: evicts the first from the cache

    def both(_: object) -> None:
        engine.submit(request(3, 2.0, 1000, 64))  # the first again: loads from the tier, holding 5 blocks
        engine.submit(request(4, 2.0, 3000, 80))  # 6 blocks: fits once the loading one is done

    loop.at(2.0, both)
    loop.run()
    served = {r.rid: r for r in done}
    assert served[3].tier_host_tokens > 0  # the case: it loaded from the tier
    assert not any(r.dropped for r in done) and sorted(served) == [1, 2, 3, 4]
