"""Routing policies on hand-built cluster views: each one's documented rule, and the contract they all share."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pkgutil
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.load import NodeLoad
from p2pnode.plan.plan import Plan
from p2pnode.routing import policies
from p2pnode.routing.policies import (
    DEFAULT_POLICY,
    SPECS,
    PolicySpec,
    Role,
    cacheroute,
    chwbl,
    dualmap,
    dynamo,
    get_spec,
    names_of,
    p2p,
    preble,
    sglang,
    sticky,
)
from p2pnode.routing.policies.hashring import HashRing, key_point, ring_for
from p2pnode.routing.policies.types import (
    Decision,
    NoAliveCandidate,
    PeerSnapshot,
    RouteRequest,
    context_homes,
    draw_holders,
    sample_peers,
)

EMPTY_PLAN = Plan(1, "planner", 0.0, 10.0, {}, {}, {})

BS = 32
NAMES = list(SPECS)


def req(
    n_blocks: int = 8, *, extra_tokens: int = 0, max_tokens: int = 128, key: str = "tenant-a", tiebreak: int = 0
) -> RouteRequest:
    return RouteRequest(tuple(range(1, n_blocks + 1)), n_blocks * BS + extra_tokens, max_tokens, key, BS, tiebreak)


def peer(
    node_id: str,
    match: int = 0,
    *,
    running: int = 0,
    waiting: int = 0,
    in_flight: int = 0,
    alive: bool = True,
    is_self: bool = False,
    prefill_backlog_tokens: int | None = None,
    **optional: int | None,
) -> PeerSnapshot:
    load = NodeLoad(running=running, waiting=waiting, prefill_backlog_tokens=prefill_backlog_tokens)
    return PeerSnapshot(
        node_id=node_id, is_self=is_self, alive=alive, est_match_blocks=match, load=load, in_flight=in_flight,
        **optional,
    )


def with_load(p: PeerSnapshot, **changes: int) -> PeerSnapshot:
    """``p`` with these load fields changed."""
    return dataclasses.replace(p, load=dataclasses.replace(p.load, **changes))


def nodes(n: int) -> list[PeerSnapshot]:
    return [peer(f"n{i:02d}") for i in range(n)]


# --- the contract every policy keeps ---------------------------------------------------------------------------


def test_every_policy_module_is_registered_under_its_own_name() -> None:
    """A module that defines a ``SPEC`` has its line in ``SPECS``, under the ``NAME`` its decisions carry."""
    names = (f"{policies.__name__}.{m.name}" for m in pkgutil.iter_modules(policies.__path__))
    modules = (importlib.import_module(name) for name in names)
    defined = {m.NAME: m.SPEC for m in modules if isinstance(getattr(m, "SPEC", None), PolicySpec)}
    assert defined == dict(SPECS)
    for name in NAMES:
        assert get_spec(name) is SPECS[name] and get_spec(name).name == name


def test_roles_split_the_registry_into_published_baselines_and_ours() -> None:
    baselines, ours = names_of(Role.BASELINE), names_of(Role.OURS)
    assert baselines and DEFAULT_POLICY in ours and cacheroute.NAME in ours
    assert sorted([*baselines, *ours]) == sorted(SPECS)  # a reference is no policy a node runs
    for name in baselines:  # a published algorithm: its module cites where it comes from
        module = importlib.import_module(SPECS[name].route.__module__)
        assert "Source" in (module.__doc__ or ""), name


def test_a_runs_ttft_threshold_reaches_only_policies_that_steer_by_one_and_keeps_their_name() -> None:
    steering = [name for name, spec in SPECS.items() if spec.ttft_slo_param is not None]
    assert steering == [dualmap.NAME]
    for spec in SPECS.values():
        bound = spec.with_ttft_slo(9.0)
        assert bound.name == spec.name and spec.with_ttft_slo(None) is spec
        if spec.ttft_slo_param is None:
            assert bound is spec
        else:  # what the what-if letter sets, under the policy's own name
            assert bound.effective == get_spec(f"{spec.name}@t9").effective != spec.effective
    with pytest.raises(ValueError, match="ttft_slo_param"):
        dataclasses.replace(SPECS[p2p.NAME], ttft_slo_param="no_such_parameter")


def test_what_ifs_are_the_named_variants_other_than_the_policy_itself() -> None:
    spec = SPECS[cacheroute.NAME]
    assert set(spec.named) == {f"{cacheroute.NAME}-{fb}" for fb in cacheroute.FALLBACKS}
    assert spec.what_ifs == tuple(n for n in spec.named if n != f"{cacheroute.NAME}-{cacheroute.DEFAULT_FALLBACK}")
    assert all(not s.what_ifs for s in SPECS.values() if not s.named)


def test_unknown_policy_error_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'nope'") as err:
        get_spec("nope")
    for name in NAMES:
        assert name in str(err.value)


def test_route_request_rejects_malformed_input() -> None:
    with pytest.raises(ValueError, match="routing_key"):
        RouteRequest((1,), 32, 16, "", BS, 0)
    with pytest.raises(ValueError, match="block_size"):
        RouteRequest((1,), 32, 16, "k", 0, 0)
    with pytest.raises(ValueError, match="shorter"):
        RouteRequest((1, 2), 40, 16, "k", BS, 0)


def test_decision_target_and_overlong_estimates_are_clamped() -> None:
    d = get_spec("p2p")(req(4), [peer("a", 99), peer("b", -3)], None)
    assert d.target == d.ranked[0] == "a"
    assert d.est_match_blocks == 4


@pytest.mark.parametrize("name", NAMES)
def test_never_returns_a_dead_peer(name: str) -> None:
    # The dead peer would win every criterion: the full match, no load, self.
    peers = [peer("dead", 8, alive=False, is_self=True), peer("a", 1, running=5), peer("b", 0, running=9)]
    d = get_spec(name)(req(), peers, None)
    assert "dead" not in d.ranked
    assert sorted(d.ranked) == ["a", "b"]
    assert d.policy == name


@pytest.mark.parametrize("name", NAMES)
def test_no_alive_peer_raises(name: str) -> None:
    with pytest.raises(NoAliveCandidate):
        get_spec(name)(req(), [peer("a", alive=False), peer("b", alive=False)], None)
    with pytest.raises(NoAliveCandidate):
        get_spec(name)(req(), [], None)


@pytest.mark.parametrize("name", NAMES)
def test_duplicate_node_ids_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        get_spec(name)(req(), [peer("a"), peer("a", 3)], None)


@pytest.mark.parametrize("name", NAMES)
def test_single_alive_peer_is_the_target(name: str) -> None:
    d = get_spec(name)(req(), [peer("x", 3, running=500), peer("y", 8, alive=False)], None)
    assert d.ranked == ("x",)
    assert d.est_match_blocks == 3


peer_st = st.builds(
    lambda i, match, running, waiting, in_flight, alive, is_self, backlog, active, cached: peer(
        f"p{i}",
        match,
        running=running,
        waiting=waiting,
        in_flight=in_flight,
        alive=alive,
        is_self=is_self,
        prefill_backlog_tokens=backlog,
        active_blocks=active,
        cached_blocks=cached,
    ),
    st.integers(0, 40),
    st.integers(0, 12),
    st.integers(0, 80),
    st.integers(0, 20),
    st.integers(0, 10),
    st.booleans(),
    st.booleans(),
    st.none() | st.integers(0, 5000),
    st.none() | st.integers(0, 500),
    st.none() | st.integers(0, 1000),
)
cluster_st = st.lists(peer_st, min_size=1, max_size=12, unique_by=lambda p: p.node_id).filter(
    lambda ps: any(p.alive for p in ps)
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(
    peers=cluster_st,
    n_blocks=st.integers(0, 10),
    extra=st.integers(0, BS - 1),
    key=st.text(min_size=1),
    tiebreak=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 1000),
)
def test_contract_on_random_clusters(
    name: str, peers: list[PeerSnapshot], n_blocks: int, extra: int, key: str, tiebreak: int, seed: int
) -> None:
    """Every alive peer exactly once, target first; deterministic; independent of the peers' order."""
    policy = get_spec(name)
    r = req(n_blocks, extra_tokens=extra, key=key, tiebreak=tiebreak)
    d = policy(r, peers, None)
    alive = {p.node_id for p in peers if p.alive}
    assert len(d.ranked) == len(alive) and set(d.ranked) == alive
    assert d.est_match_blocks == min({p.node_id: p for p in peers}[d.ranked[0]].est_match_blocks, n_blocks)
    assert d.reason and d.policy == name
    assert policy(r, list(peers), None) == d
    assert policy(r, peers, EMPTY_PLAN) == d  # a plan without this key changes nothing
    shuffled = list(peers)
    random.Random(seed).shuffle(shuffled)
    assert policy(r, shuffled, None) == d


# --- p2p ----------------------------------------------------------------------------------------------------


def everyone(request: RouteRequest, peers: list[PeerSnapshot], **rule: float) -> Decision:
    """p2p with every peer and every holder a candidate: the cost rule alone, without the random sample."""
    return p2p.route(request, peers, None, choices=0, holders=0, **rule)


#: p2p's target as the least cost alone (no allowance for a longer match).
LEAST_COST = {"allowance": 1.0, "slack": 0}


def conversation(blocks: int, new_tokens: int, *, key: str = "c", tiebreak: int = 0) -> RouteRequest:
    """A conversation's next turn: ``blocks`` full blocks of history, then ``new_tokens`` more."""
    return RouteRequest(tuple(range(1, blocks + 1)), blocks * BS + new_tokens, 64, key, BS, tiebreak)


def test_p2p_cost_is_the_prefill_before_the_first_token() -> None:
    """With weight 1 the cost is the time to this request's first token, in prefill tokens."""
    ttft = functools.partial(p2p.cost, uncached_weight=1.0)
    assert ttft(uncached=1000, backlog=0, load=0) == 1000 + p2p.STEP_OVERHEAD_TOKENS
    assert ttft(1000, 3000, 0) == 4000 + p2p.STEP_OVERHEAD_TOKENS  # what is queued comes first
    assert ttft(1000, 0, 10) == 1000 + p2p.STEP_OVERHEAD_TOKENS + 10 * p2p.SEQ_TOKENS  # decodes share the step
    big = 3 * p2p.STEP_TOKENS
    assert ttft(big, 0, 10) == big + 3 * (p2p.STEP_OVERHEAD_TOKENS + 10 * p2p.SEQ_TOKENS)  # three steps


def test_p2p_cost_weighs_a_prefill_above_a_queued_token() -> None:
    """A prefill is also work every later request waits for: by default a token not served from cache costs more
    than a token of queue, so a node 1,000 tokens busier that saves 1,000 tokens of prefill is the cheaper."""
    assert p2p.UNCACHED_WEIGHT > 1
    assert p2p.cost(uncached=1000, backlog=1000, load=0) < p2p.cost(uncached=2000, backlog=0, load=0)
    assert p2p.cost(1000, 0, 0) == p2p.UNCACHED_WEIGHT * 1000 + p2p.STEP_OVERHEAD_TOKENS


def test_p2p_picks_the_longest_match_when_loads_are_equal() -> None:
    peers = [peer("a", 2, running=4), peer("b", 7, running=4), peer("c", 5, running=4, is_self=True)]
    d = get_spec("p2p")(req(), peers, None)
    assert d.ranked == ("b", "c", "a")
    assert d.est_match_blocks == 7
    assert d.reason.startswith("longest match 7 blocks")


def test_p2p_a_prefix_every_peer_holds_does_not_narrow_the_choice() -> None:
    """The production shape: every node that ever served holds the one-block platform prompt; the request's
    own 40 blocks are cached nowhere. The router counts a block most of the mesh holds as held everywhere
    (``common_match_blocks``), so the request goes where the queue is shortest, whoever holds the shared block."""
    r = dataclasses.replace(conversation(41, 20), common_match_blocks=1)
    holders = [peer(f"h{i}", 1, running=6, prefill_backlog_tokens=2000) for i in range(6)]
    idle = peer("idle", 0, running=0, prefill_backlog_tokens=0)  # never served: not even the platform prompt
    assert everyone(r, [*holders, idle]).target == "idle"
    # A block a few peers hold is a real match: with equal queues a holder wins.
    few = [*holders[:2], *(peer(f"o{i}", 0, running=6, prefill_backlog_tokens=2000) for i in range(5))]
    assert everyone(conversation(41, 20), few).target in {"h0", "h1"}


def test_p2p_a_long_conversation_match_beats_a_mildly_lower_load() -> None:
    """Turn 5 of a conversation: 30 blocks of history cached at its node, which is a little busier."""
    r = conversation(30, 200)
    holder = peer("holder", 30, running=12, prefill_backlog_tokens=500)
    calmer = peer("calmer", 0, running=8, prefill_backlog_tokens=0)
    assert everyone(r, [holder, calmer]).target == "holder"
    # ...but not at any price: a holder some engine steps behind loses to the calmer node.
    swamped = peer("holder", 30, running=12, prefill_backlog_tokens=3 * p2p.STEP_TOKENS)
    assert everyone(r, [swamped, calmer]).target == "calmer"


def test_p2p_an_idle_node_with_no_match_gets_traffic_when_others_queue() -> None:
    """Requests matching a little everywhere, sent to every ingress: the idle, cache-less node is chosen whenever it
    is a candidate (as the ingress or the random peer), instead of never."""
    busy = [peer(f"b{i}", 2, running=10, waiting=3, prefill_backlog_tokens=3 * p2p.STEP_TOKENS) for i in range(7)]
    targets: Counter[str] = Counter()
    for t in range(400):
        me = t % 8  # the request entered at node `me`
        peers = [replace_self(p, i == me) for i, p in enumerate([*busy, peer("idle")])]
        targets[get_spec("p2p")(req(tiebreak=t), peers, None).target] += 1
    assert targets["idle"] >= 400 / 8  # at least every request that entered there, plus those that sampled it


def test_p2p_an_empty_node_takes_a_request_it_starts_sooner_than_a_queued_holder() -> None:
    """tool-agent's shape: every request matches a 200-block application prompt its holders cache; they queue
    (20,000 prompt tokens ahead). An empty node (nothing cached, nothing running) starts the request sooner than
    they do -- its whole prefill, 6,500 tokens, is shorter than their queue -- so it takes it, although its prefill
    at ``UNCACHED_WEIGHT`` costs more than a holder's queue and the cost alone would keep it unused."""
    r = conversation(200, 100)
    queued = {"running": 8, "waiting": 2, "prefill_backlog_tokens": 20_000, "cached_blocks": 900}
    holders = [peer(f"h{i}", 200, **queued) for i in range(3)]
    empty = peer("new", 0, cached_blocks=0, prefill_backlog_tokens=0)
    assert everyone(r, [*holders, empty], fill_empty=False).target.startswith("h")  # the cost alone
    decision = everyone(r, [*holders, empty])
    assert decision.target == "new" and decision.reason.startswith("empty node")
    # Not a node that holds other prefixes (its cache is what another request will want), nor one with work of
    # its own (a request on its way there makes it a node like any other), ...
    for busy in (dataclasses.replace(empty, cached_blocks=50), dataclasses.replace(empty, in_flight=1)):
        assert everyone(r, [*holders, busy]).target.startswith("h")
    # ...not when the holders start it sooner (a queue shorter than the empty node's whole prefill), ...
    short = [with_load(h, waiting=0, prefill_backlog_tokens=5_000) for h in holders]
    assert everyone(r, [*short, empty]).target.startswith("h")
    # ...and not when the holder has no queue, however slow its steps (thousands of decodes running).
    decoding = [with_load(h, running=3_000, waiting=0, prefill_backlog_tokens=0) for h in holders]
    assert everyone(r, [*decoding, empty], fill_empty=False).target.startswith("h")
    assert everyone(r, [*decoding, empty]).target.startswith("h")


def replace_self(p: PeerSnapshot, is_self: bool) -> PeerSnapshot:
    return dataclasses.replace(p, is_self=is_self)


def test_p2p_counts_running_work_and_this_ingress_bursts() -> None:
    # Same match, no reported backlog: running requests and this ingress's own sends are load.
    assert everyone(req(), [peer("a", 4, running=50), peer("b", 4, running=5)]).target == "b"
    assert everyone(req(), [peer("a", 4), peer("b", 4, in_flight=3)]).target == "a"


def test_p2p_without_a_reported_backlog_assumes_queued_requests_like_this_one() -> None:
    # b saves 8 blocks = 256 tokens, but 3 requests wait there, each assumed to miss what this one would there.
    peers = [peer("a", 0, running=3), peer("b", 8, running=3, waiting=3)]
    assert everyone(req(8, extra_tokens=400), peers, **LEAST_COST).target == "a"
    peers = [peer("a", 0, running=3), peer("b", 8, running=3, waiting=0)]
    assert everyone(req(8, extra_tokens=400), peers, **LEAST_COST).target == "b"


def test_p2p_keeps_a_longer_match_within_the_allowance_of_the_least_cost() -> None:
    """Gossiped loads are seconds old: a holder whose cost is within ALLOWANCE x the least + SLACK_TOKENS keeps its
    request (the least cost alone would move it on a difference smaller than one engine step)."""
    r = req(8, extra_tokens=400)
    holder = peer("holder", 8, running=3, prefill_backlog_tokens=p2p.STEP_TOKENS // 2)
    idle = peer("idle", 0)
    assert everyone(r, [holder, idle], **LEAST_COST).target == "idle"
    assert everyone(r, [holder, idle]).target == "holder"
    far_behind = peer("holder", 8, running=3, prefill_backlog_tokens=4 * p2p.STEP_TOKENS)
    assert everyone(r, [far_behind, idle]).target == "idle"


def test_p2p_ties_break_on_match_then_self_then_tiebreak() -> None:
    p2p_route = get_spec("p2p")
    same = [peer("a", 5, running=2), peer("b", 5, running=2, is_self=True), peer("c", 5, running=2)]
    assert p2p_route(req(), same, None).ranked[0] == "b"
    others = [peer("a", 5, running=2), peer("c", 5, running=2)]
    assert {p2p_route(req(tiebreak=t), others, None).ranked[0] for t in range(4)} == {"a", "c"}


def test_p2p_with_no_match_is_the_least_loaded_candidate() -> None:
    peers = [peer("a", running=5), peer("b", running=1), peer("c", running=3)]
    d = everyone(req(), peers)
    assert d.ranked == ("b", "c", "a")
    assert d.reason.startswith("no match")


def test_p2p_with_no_match_picks_the_less_loaded_of_self_and_a_random_peer() -> None:
    """Stale loads: the peer that looks least loaded to every ingress is not where every request goes."""
    peers = [peer("self", running=2, is_self=True), peer("idle")] + [peer(f"n{i}", running=1) for i in range(8)]
    targets = Counter(get_spec("p2p")(req(tiebreak=t), peers, None).target for t in range(900))
    assert targets["self"] == 0  # a sampled peer is always less loaded than self here
    assert 60 <= targets["idle"] <= 140  # its 1/9 share of the draws, not all 900 (as with every peer a candidate)
    assert len(targets) == 9
    assert {everyone(req(tiebreak=t), peers).target for t in range(50)} == {"idle"}


def test_p2p_keeps_the_deepest_holders_and_spreads_over_equal_ones() -> None:
    """A prefix 20 peers hold at the same depth: each request considers only a couple of them (at random), so a
    burst judged on the same stale loads does not pile onto the one that looks least loaded."""
    holders = [peer(f"h{i:02d}", 8, running=3 + (i == 0)) for i in range(20)]
    deep = peer("deep", 12, running=30)  # the deepest holder is always considered
    r = RouteRequest(tuple(range(1, 13)), 12 * BS + 5, 16, "k", BS, 0, sampled=("h05",))
    assert "deep" in p2p.route(r, [*holders, deep], None).ranked[:4]
    targets = Counter(get_spec("p2p")(req(8, tiebreak=t), holders, None).target for t in range(400))
    assert len(targets) >= 15  # spread over the holders, not all to the least-loaded-looking one


def test_p2p_uses_the_callers_sample_and_keeps_every_peer_in_the_ranking() -> None:
    busy = 4 * p2p.STEP_TOKENS
    peers = [peer("self", running=5, is_self=True), peer("a"), peer("b", running=3),
             peer("c", 2, running=60, prefill_backlog_tokens=busy)]  # fmt: skip
    r = RouteRequest(tuple(range(1, 9)), 8 * BS, 16, "k", BS, 0, sampled=("b",))
    d = get_spec("p2p")(r, peers, None)
    # a is less loaded but not a candidate: only self, c (a match, too busy) and the sample b are.
    assert d.target == "b"
    assert sorted(d.ranked) == ["a", "b", "c", "self"] and d.ranked[-1] == "a"
    ids = [f"n{i}" for i in range(20)]
    assert sample_peers(ids, 7, 3) == sample_peers(ids, 7, 3) and len(set(sample_peers(ids, 7, 3))) == 3
    assert sample_peers(ids[:2], 7, 3) == tuple(ids[:2])


# --- flat ---------------------------------------------------------------------------------------------------


def test_flat_picks_the_least_loaded_and_ignores_the_cache() -> None:
    peers = [peer("a", 8, running=5), peer("b", 0, running=2, waiting=1), peer("c", 0, in_flight=4)]
    assert get_spec("flat")(req(), peers, None).ranked == ("b", "c", "a")


def test_flat_spreads_equal_loads_round_robin_via_tiebreak() -> None:
    flat = get_spec("flat")
    peers = [peer(f"n{i}", running=3) for i in range(4)] + [peer("busy", running=4)]
    counts = Counter(flat(req(tiebreak=t), peers, None).ranked[0] for t in range(400))
    assert counts == {"n0": 100, "n1": 100, "n2": 100, "n3": 100}
    rng = random.Random(7)
    hashed = Counter(flat(req(tiebreak=rng.getrandbits(64)), peers, None).ranked[0] for _ in range(4000))
    assert set(hashed) == {"n0", "n1", "n2", "n3"} and min(hashed.values()) > 800


# --- sticky -------------------------------------------------------------------------------------------------


KEYS = [f"key-{i}" for i in range(3000)]


def targets(name: str, peers: list[PeerSnapshot]) -> dict[str, str]:
    policy = get_spec(name)
    return {k: policy(req(key=k), peers, None).ranked[0] for k in KEYS}


def test_sticky_is_stable_per_key_and_blind_to_load_and_cache() -> None:
    sticky_policy = get_spec("sticky")
    quiet = nodes(6)
    busy = [peer(p.node_id, 8 if i % 2 else 0, running=100 * i) for i, p in enumerate(quiet)]
    for k in KEYS[:200]:
        assert sticky_policy(req(key=k), quiet, None).ranked == sticky_policy(req(key=k, tiebreak=9), busy, None).ranked


def test_sticky_spreads_keys_over_nodes() -> None:
    shares = Counter(targets("sticky", nodes(8)).values())
    assert len(shares) == 8
    assert all(0.5 / 8 < c / len(KEYS) < 1.6 / 8 for c in shares.values())


def test_sticky_moves_only_the_keys_of_a_dead_node() -> None:
    before = targets("sticky", nodes(10))
    after = targets("sticky", [peer(p.node_id, alive=p.node_id != "n03") for p in nodes(10)])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "n03"}


def test_sticky_adding_one_node_moves_about_one_nth_of_keys_all_to_it() -> None:
    before = targets("sticky", nodes(10))
    after = targets("sticky", nodes(11))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.03 < len(moved) / len(KEYS) < 0.2  # expect 1/11 ~ 0.09
    assert all(after[k] == "n10" for k in moved)


def test_sticky_ranked_list_is_ring_order() -> None:
    peers = nodes(5)
    d = get_spec("sticky")(req(key="abc"), peers, None)
    ring = ring_for(p.node_id for p in peers)
    assert d.ranked == tuple(ring.walk(key_point("abc")))


# --- hash ring ----------------------------------------------------------------------------------------------


def test_ring_is_cached_by_membership_and_order_free() -> None:
    assert ring_for(["b", "a", "c"]) is ring_for(["c", "b", "a"])
    assert ring_for(["a", "b"]) is not ring_for(["a", "b"], seed=1)


def test_ring_walk_yields_each_node_once_and_lookup_filters() -> None:
    ring = HashRing([f"n{i}" for i in range(20)])
    for point in (0, 2**63, 2**64 - 1, key_point("x")):
        walked = list(ring.walk(point))
        assert sorted(walked) == sorted(ring.nodes)
        owner = walked[0]
        assert ring.lookup(point, lambda n, owner=owner: n != owner) == walked[1]
    assert ring.lookup(0, lambda _n: False) is None
    assert list(HashRing([]).walk(5)) == []


# --- chwbl --------------------------------------------------------------------------------------------------


def test_chwbl_cap_arithmetic() -> None:
    assert chwbl.load_cap(total_load=7, n_alive=4) == 3  # ceil(1.25 * 8 / 4) = ceil(2.5)
    assert chwbl.load_cap(total_load=3, n_alive=4) == 2  # ceil(1.25)
    assert chwbl.load_cap(total_load=0, n_alive=1) == 2  # ceil(1.25)
    assert chwbl.load_cap(total_load=15, n_alive=4) == 5  # exactly 5.0: no float round-up
    assert chwbl.load_cap(total_load=15, n_alive=4, balance_factor=1.0) == 4


def test_chwbl_without_load_agrees_with_sticky() -> None:
    assert targets("chwbl", nodes(7)) == targets("sticky", nodes(7))


def test_chwbl_falls_back_along_the_ring_when_the_owner_is_at_the_cap() -> None:
    ids = [f"n{i}" for i in range(5)]
    order = list(ring_for(ids).walk(key_point("hot")))
    # Owner at 4, everyone else at 1: total 8, cap = ceil(1.25 * 9 / 5) = 3 -> owner (4 + 1 > 3) is skipped.
    peers = [peer(n, running=4 if n == order[0] else 1) for n in ids]
    d = get_spec("chwbl")(req(key="hot"), peers, None)
    assert d.ranked == (*order[1:], order[0])
    assert "skipped 1" in d.reason
    # Second on the ring also full: the third takes it.
    peers = [peer(n, running=4 if n in order[:2] else 1) for n in ids]
    assert get_spec("chwbl")(req(key="hot"), peers, None).ranked[0] == order[2]


def test_chwbl_never_exceeds_the_cap_under_a_hot_key() -> None:
    policy = get_spec("chwbl")
    rng = random.Random(3)
    load = {f"n{i}": 0 for i in range(8)}
    for i in range(2000):
        key = "whale" if rng.random() < 0.8 else f"k{i}"
        peers = [peer(n, running=v) for n, v in load.items()]
        cap = chwbl.load_cap(sum(load.values()), len(load))
        target = policy(req(key=key), peers, None).ranked[0]
        assert load[target] + 1 <= cap
        load[target] += 1
    assert max(load.values()) <= math.ceil(1.25 * sum(load.values()) / len(load))


# --- sglang -------------------------------------------------------------------------------------------------


def test_sglang_imbalanced_by_both_thresholds_uses_shortest_queue() -> None:
    # 200 - 100 > 64 and 200 > 1.5 * 100: imbalanced, so the full match on the busiest peer is ignored.
    peers = [peer("hot", 8, running=200), peer("mid", 0, running=150), peer("cold", 0, running=100)]
    d = get_spec("sglang")(req(), peers, None)
    assert d.ranked == ("cold", "mid", "hot")
    assert d.reason.startswith("imbalanced")


@pytest.mark.parametrize(("high", "low"), [(1000, 900), (30, 10), (164, 100)])
def test_sglang_one_threshold_alone_is_not_imbalance(high: int, low: int) -> None:
    # (1000, 900): gap 100 > 64 but ratio 1.11; (30, 10): ratio 3 but gap 20; (164, 100): gap exactly 64.
    peers = [peer("hot", 8, running=high), peer("cold", 0, running=low)]
    assert get_spec("sglang")(req(), peers, None).ranked[0] == "hot"


def test_sglang_prefix_match_above_threshold_wins() -> None:
    # 3 of 8 blocks = 0.375 > 0.3.
    peers = [peer("a", 3, running=10, cached_blocks=900), peer("b", 1, running=1, cached_blocks=10)]
    d = get_spec("sglang")(req(), peers, None)
    assert d.ranked == ("a", "b")
    assert "0.38 > 0.3" in d.reason


@pytest.mark.parametrize(("n_blocks", "match"), [(8, 2), (10, 3)])  # 0.25, and exactly 0.3 (not above)
def test_sglang_match_at_or_below_threshold_goes_to_smallest_tree(n_blocks: int, match: int) -> None:
    peers = [
        peer("a", match, running=1, cached_blocks=900),
        peer("b", 0, running=5, cached_blocks=10),
        peer("c", 0, running=0, cached_blocks=50),
    ]
    d = get_spec("sglang")(req(n_blocks), peers, None)
    assert d.ranked == ("b", "c", "a")
    assert "smallest tree" in d.reason


def test_sglang_a_node_busy_prefilling_a_long_prompt_does_not_look_emptiest() -> None:
    """Its gossiped cache is small only because the long prompt it is computing is not stored yet: counted with its
    queued prefill, its tree is the largest, and cold requests go elsewhere."""
    peers = [
        peer("busy", 0, running=1, cached_blocks=5, prefill_backlog_tokens=12_000),
        peer("quiet", 0, running=1, cached_blocks=60, prefill_backlog_tokens=0),
    ]
    assert get_spec("sglang")(req(), peers, None).target == "quiet"
    assert sglang.tree_blocks(peers[0], BS) == 5 + 12_000 // BS


def test_sglang_threshold_overrides() -> None:
    peers = [peer("a", 2, running=1), peer("b", 0, running=0)]
    assert get_spec("sglang")(req(), peers, None).ranked[0] == "b"
    assert sglang.route(req(), peers, None, cache_threshold=0.2).ranked[0] == "a"


# --- dynamo -------------------------------------------------------------------------------------------------


def test_dynamo_argmin_worked_example() -> None:
    """isl = 256 tokens, block_size 32 -> 8 request blocks; logit = 1.0 * prefill_blocks + decode_blocks.

    a: overlap 6, active 40, backlog 0   -> prefill (256 - 192 + 0) / 32 = 2,  decode (8 - 6) + 40 = 42 -> 44
    b: overlap 0, active 30, backlog 0   -> prefill 256 / 32 = 8,              decode 8 + 30 = 38       -> 46
    c: overlap 2, active 20, backlog 320 -> prefill (256 - 64 + 320) / 32 = 16, decode (8 - 2) + 20 = 26 -> 42
    """
    peers = [
        peer("a", 6, active_blocks=40, prefill_backlog_tokens=0),
        peer("b", 0, active_blocks=30, prefill_backlog_tokens=0),
        peer("c", 2, active_blocks=20, prefill_backlog_tokens=320),
    ]
    r = req(8)
    assert [dynamo.logit(r, p) for p in peers] == [44.0, 46.0, 42.0]
    d = get_spec("dynamo")(r, peers, None)
    assert d.ranked == ("c", "a", "b")
    assert d.est_match_blocks == 2
    assert "42.00" in d.reason
    # Weight 0 ignores the cache (Dynamo's pure load balancing): a 42, b 38, c 26.
    assert dynamo.route(r, peers, None, overlap_score_weight=0.0).ranked == ("c", "b", "a")
    # Weight 2 favours the cache: a 2*2+42 = 46, b 2*8+38 = 54, c 2*16+26 = 58.
    assert dynamo.route(r, peers, None, overlap_score_weight=2.0).ranked == ("a", "b", "c")


def test_dynamo_partial_last_block_and_ties_on_tree_size() -> None:
    # 100 tokens, block_size 32: 3 full blocks hashed, 4 blocks occupied. Both logits: 100/32 + 4 + 0.
    r = RouteRequest((1, 2, 3), 100, 16, "k", BS, 0)
    peers = [
        peer("big", 0, active_blocks=0, prefill_backlog_tokens=0, cached_blocks=500),
        peer("small", 0, active_blocks=0, prefill_backlog_tokens=0, cached_blocks=5),
    ]
    assert dynamo.logit(r, peers[0]) == 100 / 32 + 4
    assert get_spec("dynamo")(r, peers, None).ranked == ("small", "big")


def test_dynamo_unknown_block_counts_fall_back_to_load() -> None:
    # active_blocks unknown -> load x 8 request blocks: a = 8 + 8 + 3*8 = 40, b = 8 + 8 + 1*8 = 24.
    peers = [peer("a", 0, running=3), peer("b", 0, running=1)]
    assert [dynamo.logit(req(), p) for p in peers] == [40.0, 24.0]
    assert get_spec("dynamo")(req(), peers, None).ranked == ("b", "a")


# --- dualmap ------------------------------------------------------------------------------------------------


def test_dualmap_candidates_are_two_distinct_ring_choices() -> None:
    peers = nodes(8)
    ids = [p.node_id for p in peers]
    for k in KEYS[:300]:
        first, second = dualmap.candidates(req(key=k), peers)
        assert first == ring_for(ids, seed=dualmap.SEED_A).lookup(key_point(k, dualmap.SEED_A))
        assert second != first
        ring_b = ring_for(ids, seed=dualmap.SEED_B)
        assert second == ring_b.lookup(key_point(k, dualmap.SEED_B), lambda n, first=first: n != first)


def test_dualmap_prefers_the_candidate_with_better_affinity() -> None:
    peers = nodes(8)
    first, second = dualmap.candidates(req(key="t"), peers)
    view = [
        peer(
            p.node_id,
            6 if p.node_id == second else (8 if p.node_id not in (first, second) else 0),
            running=1 if p.node_id == second else 0,
        )
        for p in peers
    ]
    d = get_spec("dualmap")(req(key="t"), view, None)
    # The second candidate holds 6 blocks; a non-candidate holding all 8 is never considered first.
    assert d.ranked[:2] == (second, first)
    assert d.reason.startswith("affinity candidate")


def test_dualmap_switches_to_the_faster_candidate_when_affinity_breaks_the_slo() -> None:
    peers = nodes(8)
    first, second = dualmap.candidates(req(key="t"), peers)

    def view(backlog: int) -> list[PeerSnapshot]:
        return [
            peer(p.node_id, 6 if p.node_id == first else 0, prefill_backlog_tokens=backlog if p.node_id == first else 0)
            for p in peers
        ]

    # TTFT at first = (backlog + 64 uncached) x 1e-4 s: 3.5 s is 34_936 tokens of backlog.
    assert get_spec("dualmap")(req(key="t"), view(34_900), None).ranked[0] == first
    d = get_spec("dualmap")(req(key="t"), view(40_000), None)
    assert d.ranked[:2] == (second, first)
    assert d.reason.startswith("SLO")
    assert dualmap.route(req(key="t"), view(40_000), None, ttft_slo_s=10.0).ranked[0] == first


def test_dualmap_skips_dead_candidates() -> None:
    peers = nodes(6)
    first, _ = dualmap.candidates(req(key="t"), peers)
    view = [peer(p.node_id, alive=p.node_id != first) for p in peers]
    assert first not in dualmap.candidates(req(key="t"), view)
    assert get_spec("dualmap")(req(key="t"), view, None).ranked[0] != first


# --- preble -------------------------------------------------------------------------------------------------


def test_preble_exploits_a_match_over_half_the_prompt() -> None:
    # 5 of 8 blocks cached (0.625 > 0.5): the holder wins despite its load.
    peers = [peer("holder", 5, running=40), peer("idle", 0)]
    d = get_spec("preble")(req(), peers, None)
    assert d.ranked == ("holder", "idle")
    assert d.reason.startswith("exploit")


def test_preble_explores_at_exactly_half() -> None:
    # 4 of 8 blocks = 0.5, not above: explore -> lowest L + P.
    # holder: L = 4 * 128 * 0.15 = 76.8, P = 128 * 1e-4; idle: L = 0, P = 256 * 1e-4.
    peers = [peer("holder", 4, running=4), peer("idle", 0)]
    assert preble.cost(req(), peers[0]) == pytest.approx(76.8 + 0.0128)
    assert preble.cost(req(), peers[1]) == pytest.approx(0.0256)
    d = get_spec("preble")(req(), peers, None)
    assert d.ranked == ("idle", "holder")
    assert d.reason.startswith("explore")


def test_preble_explore_weighs_prefill_when_loads_are_equal() -> None:
    peers = [peer("a", 1, running=2), peer("b", 3, running=2), peer("c", 0, running=2)]
    assert get_spec("preble")(req(), peers, None).ranked == ("b", "a", "c")


def test_preble_exploit_picks_the_cheapest_holder() -> None:
    peers = [peer("h1", 6, running=9), peer("h2", 6, running=2), peer("x", 0)]
    assert get_spec("preble")(req(), peers, None).ranked == ("h2", "h1", "x")


def test_preble_threshold_override() -> None:
    peers = [peer("holder", 4, running=4), peer("idle", 0)]
    assert preble.route(req(), peers, None, exploit_threshold=0.4).ranked[0] == "holder"


# --- sticky/chwbl/dualmap share one seed convention ---------------------------------------------------------


def test_ring_policies_use_ring_a() -> None:
    assert sticky.SEED == chwbl.SEED == dualmap.SEED_A
    assert dualmap.SEED_B != dualmap.SEED_A


def test_p2p_holders_drawn_by_the_caller_are_the_ones_it_would_take() -> None:
    """The router draws p2p's holders over every estimate (``draw_holders``) and hands it only those: the decision
    is the one p2p makes when handed every peer and drawing them itself."""
    rng = random.Random(5)
    for t in range(300):
        peers = [peer(f"p{i:02d}", rng.choice([0, 0, 3, 5, 5, 8]), running=rng.randrange(6), is_self=i == 0)
                 for i in range(24)]  # fmt: skip
        r = req(8, tiebreak=t)
        sampled = sample_peers(sorted(p.node_id for p in peers if not p.is_self), t, p2p.CHOICES)
        estimates = {p.node_id: p.est_match_blocks for p in peers if not p.is_self}
        drawn = draw_holders(estimates, len(r.block_hashes), t, {"p00", *sampled}, lambda _: True, p2p.HOLDERS)
        own = p2p.route(dataclasses.replace(r, sampled=sampled), peers, None)
        given = p2p.route(dataclasses.replace(r, sampled=sampled, holders=drawn), peers, None)
        assert own.target == given.target and sorted(own.ranked) == sorted(given.ranked), t


def test_p2p_context_homes_hash_the_first_block_past_the_deepest_match() -> None:
    ids = tuple(f"n{i:02d}" for i in range(16))
    chain = tuple(range(101, 121))
    (home,) = context_homes(chain, 3, ids, 1)
    assert home in ids
    assert context_homes(chain[:4] + (999,) * 16, 3, ids, 1) == (home,)  # only block 3 (past a 3-block match) counts
    assert len({context_homes(chain, d, ids, 1) for d in range(1, 12)}) > 1
    assert context_homes(chain, 20, ids, 1) == ()  # the whole prompt is cached somewhere: nothing of its own
    assert context_homes(chain, 0, ids, 1) == ()  # shares nothing cached: most likely a one-off, no home
    two = context_homes(chain, 3, ids, count=2)
    assert two[0] == home and two[1] != home and two[1] in ids
    assert context_homes(chain, 3, ids[:1], count=2) == (ids[0],)
    homes = Counter(context_homes((1, h), 1, ids, 1)[0] for h in range(3200))
    assert len(homes) == 16 and max(homes.values()) < 2 * 3200 / 16  # spread over every node


def test_p2p_prefers_the_home_among_equal_matches_within_the_bound() -> None:
    """A new conversation behind a platform prompt every node holds: every candidate matches alike, so the request
    goes to its home, a little busier than the ingress and the random peer, unless the home is clearly busier."""
    me = peer("me", 1, running=2, is_self=True, prefill_backlog_tokens=0)
    drawn = peer("drawn", 1, running=1, prefill_backlog_tokens=0)
    h1 = peer("h1", 1, running=3, prefill_backlog_tokens=1500)
    h2 = peer("h2", 1, running=3, prefill_backlog_tokens=500)
    r = dataclasses.replace(conversation(20, 300), common_match_blocks=1, sampled=("drawn",), homes=("h1", "h2"))
    assert get_spec("p2p")(r, [me, drawn, h1, h2], None).target == "h1"
    assert p2p.route(r, [me, drawn, h1, h2], None, homes=2).ranked[:2] == ("h2", "h1")  # the cheaper of two
    assert p2p.route(r, [me, drawn, h1, h2], None, homes=0).target == "drawn"  # without a home: the least cost
    swamped = with_load(h1, prefill_backlog_tokens=8 * p2p.STEP_TOKENS)
    assert get_spec("p2p")(r, [me, drawn, swamped, h2], None).target == "drawn"
    # A deeper match still comes first: the holder of the conversation's history beats its home.
    holder = peer("holder", 12, running=3, prefill_backlog_tokens=1500)
    assert get_spec("p2p")(r, [me, drawn, h1, h2, holder], None).target == "holder"


# --- KV pulls: serve here with the prefix moved from its holder, when that costs less -------------------------------

#: An 8B model on an H100 (the default profile): 128 KiB of KV per token, ~40 us per prefilled token.
PULL_RULE = {"kv_bytes_per_token": 131_072, "prefill_s_per_token": 4.0e-5}
GBPS = 1e9 / 8


def movable(p: PeerSnapshot, gbps: float, layout: str = "llama-8b/bf16/16") -> PeerSnapshot:
    """``p`` as a node whose KV can move, pulls from it priced at ``gbps``."""
    return dataclasses.replace(p, kv_layout=layout, link_bytes_per_s=gbps * GBPS)


def busy_holder_and_idle_node(gbps: float, layout: str = "llama-8b/bf16/16") -> list[PeerSnapshot]:
    """A conversation's 200-block history (6,400 tokens at this test's block size) sits on a node with a long queue;
    another node is idle and holds nothing of it."""
    holder = movable(peer("holder", 200, running=40, waiting=10, prefill_backlog_tokens=60_000), gbps)
    idle = movable(peer("idle", 0, running=2, prefill_backlog_tokens=0), gbps, layout)
    return [holder, idle]


def test_p2p_pulls_the_history_to_an_idle_node_when_moving_it_costs_less_than_the_holders_queue() -> None:
    r = conversation(200, 100)
    d = everyone(r, busy_holder_and_idle_node(gbps=100), **PULL_RULE)
    assert d.target == "idle" and d.pull is not None
    assert (d.pull.target, d.pull.holder, d.pull.blocks) == ("idle", "holder", 200)
    assert d.est_match_blocks == 200 and "pull 200 blocks from holder" in d.reason
    # without a link figure (pulls off), the same mesh keeps the request off the idle node's prefill: no pull at all
    off = everyone(r, [dataclasses.replace(p, link_bytes_per_s=0.0) for p in busy_holder_and_idle_node(100)])
    assert off.pull is None


def test_p2p_declines_a_pull_that_costs_more_than_it_saves() -> None:
    """Over a slow link (0.1 Gb/s: 6,400 tokens x 128 KiB take ~67 s) the pull costs more than the holder's queue or
    a prefill at the idle node: no pull."""
    d = everyone(conversation(200, 100), busy_holder_and_idle_node(gbps=0.1), **PULL_RULE)
    assert d.pull is None


def test_p2p_never_pulls_between_different_kv_layouts_and_force_prices_pulls_at_zero() -> None:
    r = conversation(200, 100)
    other = busy_holder_and_idle_node(gbps=100, layout="llama-8b/bf16/32")  # another block size: not interchangeable
    assert everyone(r, other, **PULL_RULE).pull is None
    slow = busy_holder_and_idle_node(gbps=0.1)
    forced = everyone(r, slow, **PULL_RULE, force_pull=True)
    assert forced.pull is not None and forced.target == "idle"


def test_p2p_never_pulls_a_prompt_whose_kv_cannot_move_and_sends_it_to_its_holder() -> None:
    """An adapter's or a salted prompt's KV does not move (``RouteRequest.kv_movable``): not even a forced pull is
    planned, and the request goes where its prefix is, as it would with pulls off."""
    r = dataclasses.replace(conversation(200, 100), kv_movable=False)
    holder, idle = busy_holder_and_idle_node(gbps=100)
    quiet_holder = with_load(holder, running=3, waiting=0, prefill_backlog_tokens=0)
    for rule in (PULL_RULE, {**PULL_RULE, "force_pull": True}):
        d = everyone(r, [quiet_holder, idle], **rule)
        assert d.pull is None and d.target == "holder", rule
    assert everyone(dataclasses.replace(r, kv_movable=True), [quiet_holder, idle], **PULL_RULE, force_pull=True).pull


def test_p2p_pulls_only_the_part_the_target_lacks_and_the_holder_never_pulls_from_itself() -> None:
    """A target that holds part of the prefix pulls the rest; the holder is never told to pull; an idle holder
    serves its own request (no pull is cheaper than no transfer)."""
    r = conversation(200, 100)
    holder, idle = busy_holder_and_idle_node(gbps=100)
    half = dataclasses.replace(idle, est_match_blocks=100)
    d = everyone(r, [holder, half], **PULL_RULE)
    assert d.pull is not None and d.pull.blocks == 200 and d.target == "idle"
    quiet_holder = with_load(holder, running=1, waiting=0, prefill_backlog_tokens=0)
    d = everyone(r, [quiet_holder, idle], **PULL_RULE)
    assert d.target == "holder" and d.pull is None
