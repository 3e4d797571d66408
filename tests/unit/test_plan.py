"""The shared rate plan: rate sketch, planner (admission, load, k_b, LPT), epochs and failover, churn, wire
formats, and the ``cacheroute`` policy that routes by the plan."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.cache.segments import SegmentReuse
from p2pnode.load import NodeLoad
from p2pnode.plan.plan import (
    DEFAULT_MAX_PLAN_BYTES,
    GateReport,
    KbHold,
    MalformedPlan,
    Plan,
    churn,
    decode_plan,
    encode_plan,
    newer,
    newest,
)
from p2pnode.plan.planner import (
    PlanConfig,
    admit,
    build_plan,
    choose_planner,
    next_epoch,
    plan_due,
)
from p2pnode.plan.rates import (
    DEFAULT_MAX_RATES_BYTES,
    HEAP_SLACK,
    KeyRate,
    MalformedRates,
    RateSketch,
    RateSummary,
    decode_summary,
    encode_summary,
    merge_summaries,
    summary_from_counts,
)
from p2pnode.routing.policies import cacheroute as cr
from p2pnode.routing.policies import get_spec
from p2pnode.routing.policies.chwbl import route as chwbl_route
from p2pnode.routing.policies.types import NoAliveCandidate, PeerSnapshot, RouteRequest
from p2pnode.routing.served_rate import ServedRate
from tests.requests import admitted

BS = 32
#: The planner tests work in whole shares (q_cap = one destination's share); the default's half share is tested apart.
CFG = PlanConfig(q_cap_factor=1.0)
WORK = CFG.prefill_token_cost * 1000 + CFG.decode_token_cost * 100  # per request of kr()'s default shape


def kr(key: str, rate: float, *, unc: float = 1000.0, dec: float = 100.0, err: float = 0.0) -> KeyRate:
    return KeyRate(key, rate, err, unc, dec)


def summary(keys: list[KeyRate], extra_rate: float = 0.0) -> RateSummary:
    """A node's summary whose totals are its keys plus ``extra_rate`` of cold traffic of the same shape."""
    rate = math.fsum(k.rate for k in keys) + extra_rate
    unc = math.fsum(k.rate * k.uncached_tokens for k in keys) + extra_rate * 1000
    dec = math.fsum(k.rate * k.decode_tokens for k in keys) + extra_rate * 100
    return RateSummary(tuple(sorted(keys, key=lambda k: (-k.rate, k.key))), rate, unc, dec)


def zipf_keys(n: int, total_rate: float, s: float = 1.1, prefix: str = "k") -> list[KeyRate]:
    w = [1 / (i + 1) ** s for i in range(n)]
    h = math.fsum(w)
    return [kr(f"{prefix}{i}", total_rate * x / h) for i, x in enumerate(w)]


def nodes(n: int) -> list[str]:
    return [f"n{i:03d}" for i in range(n)]


def plan_of(assignments: dict[str, tuple[str, ...]], epoch: int = 1, planner: str = "n000") -> Plan:
    dests = {d for ds in assignments.values() for d in ds}
    return Plan(epoch, planner, 0.0, 10.0, assignments, dict.fromkeys(assignments, 1.0), dict.fromkeys(dests, 1.0))


def plan(summaries: list[RateSummary], dests: list[str], previous: Plan | None = None, cfg: PlanConfig = CFG) -> Plan:
    return build_plan(summaries, dests, previous, cfg, next_epoch(previous), "n000", 100.0)


# --- planner: determinism ------------------------------------------------------------------------------------------


def test_same_inputs_give_the_same_plan_in_any_order() -> None:
    rng = random.Random(7)
    per_node = [summary(zipf_keys(400, 50.0, prefix=f"{j % 3}-"), extra_rate=20.0) for j in range(6)]
    dests = nodes(30)
    first = plan(per_node, dests)
    second = plan(per_node, dests, previous=first)
    for _ in range(5):
        shuffled = [RateSummary(tuple(rng.sample(s.keys, len(s.keys))), s.total_rate, s.total_uncached_tps,
                                s.total_decode_tps) for s in per_node]
        rng.shuffle(shuffled)
        ds = rng.sample(dests, len(dests))
        again = plan(shuffled, ds)
        assert again == first
        assert encode_plan(again) == encode_plan(first)
        assert plan(shuffled, ds, previous=first) == second
    assert decode_plan(encode_plan(first)) == first


def test_merge_is_order_independent_to_the_bit() -> None:
    rng = random.Random(3)
    parts = [summary([kr("a", rng.random() * 10, unc=rng.random() * 900) for _ in range(1)]
                     + zipf_keys(50, rng.random() * 100)) for _ in range(12)]
    m = merge_summaries(parts)
    for _ in range(5):
        rng.shuffle(parts)
        assert merge_summaries(parts) == m
    a = next(k for k in m.keys if k.key == "a")
    contrib = [k for p in parts for k in p.keys if k.key == "a"]
    assert a.rate == pytest.approx(sum(k.rate for k in contrib))
    assert a.uncached_tokens == pytest.approx(sum(k.rate * k.uncached_tokens for k in contrib) / a.rate)
    assert m.total_rate == pytest.approx(sum(p.total_rate for p in parts))
    assert [k.rate for k in m.keys] == sorted((k.rate for k in m.keys), reverse=True)


# --- planner: load, k_b, LPT ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_dests", [8, 30, 100])
def test_lpt_balances_synthetic_whales(n_dests: int) -> None:
    """5 whales carry 60% of the traffic, 120 Zipf keys the rest; the warm set is all of it."""
    whales = [kr(f"whale{i}", 12.0 * (1 + 0.1 * i)) for i in range(5)]
    tail = zipf_keys(120, 40.0)
    p = plan([summary(whales + tail)], nodes(n_dests), cfg=PlanConfig(q_cap_factor=1.0, min_rate=0.0))
    assert len(p.assignments) == 125
    assert p.warm_imbalance() <= 1.25
    assert p.imbalance() == pytest.approx(p.warm_imbalance())
    for w in whales:
        assert p.kb(w.key) > 1 or p.key_load[w.key] <= p.q_cap
    # Loads add up: every key's load is split evenly over its destinations.
    assert math.fsum(p.dest_load.values()) == pytest.approx(math.fsum(p.key_load.values()))


def test_affinity_without_splitting_is_what_lpt_fixes() -> None:
    """The same whales with k_b capped at 1 (affinity without LPT's splitting) are badly imbalanced."""
    whales = [kr(f"whale{i}", 12.0 * (1 + 0.1 * i)) for i in range(5)]
    cfg = PlanConfig(q_cap_factor=1.0, max_kb=1, min_rate=0.0)
    p = plan([summary(whales + zipf_keys(120, 40.0))], nodes(30), cfg=cfg)
    assert p.warm_imbalance() > 2.0


def test_by_default_a_key_above_half_a_share_is_split() -> None:
    """The default q_cap is half a destination's share: a whale carrying half of 16 destinations' load gets a piece
    on every one (at a whole share, 8 of them would carry it alone and the other 8 only single-destination keys,
    whose arrivals nothing absorbs), and a key of 0.6 shares gets two."""
    assert PlanConfig().q_cap_factor == 0.5
    whale = plan([summary([kr("whale", 50.0)], extra_rate=50.0)], nodes(16), cfg=PlanConfig())
    assert whale.kb("whale") == 16
    assert plan([summary([kr("whale", 50.0)], extra_rate=50.0)], nodes(16)).kb("whale") == 8  # a whole share
    assert plan([summary([kr("k", 6.0)], extra_rate=94.0)], nodes(10), cfg=PlanConfig()).kb("k") == 2


def test_a_key_above_q_cap_gets_k_b_destinations() -> None:
    # 10 destinations, total load = 10 shares; "big" carries 2.5 shares -> k_b = 3, each piece 0.83 share.
    big = kr("big", 25.0)
    p = plan([summary([big], extra_rate=75.0)], nodes(10))
    assert p.q_cap == pytest.approx(10.0 * WORK)
    assert p.kb("big") == 3
    assert len(set(p.destinations("big"))) == 3
    for d in p.destinations("big"):
        assert p.dest_load[d] == pytest.approx(25.0 * WORK / 3)
    # Capped by max_kb and by the number of destinations.
    assert plan([summary([big], extra_rate=75.0)], nodes(10), cfg=dataclasses.replace(CFG, max_kb=2)).kb("big") == 2
    huge = kr("huge", 1000.0)
    assert plan([summary([huge])], nodes(3)).kb("huge") == 3
    # At or below one share: a single destination.
    assert plan([summary([kr("s", 10.0)], extra_rate=90.0)], nodes(10)).kb("s") == 1


def test_k_b_shrinks_only_past_the_hysteresis_margin() -> None:
    dests = nodes(10)
    p1 = plan([summary([kr("w", 25.0)], extra_rate=75.0)], dests)
    assert p1.kb("w") == 3
    # 2.1 shares would need 3 only by 0.1 share: kept at 3 (raw 2.1 > (3-1) * 0.75).
    p2 = plan([summary([kr("w", 21.0)], extra_rate=79.0)], dests, previous=p1)
    assert p2.kb("w") == 3
    # 1.4 shares (<= 2 * 0.75): down to 2.
    p3 = plan([summary([kr("w", 14.0)], extra_rate=86.0)], dests, previous=p2)
    assert p3.kb("w") == 2
    # Growth is immediate.
    p4 = plan([summary([kr("w", 31.0)], extra_rate=69.0)], dests, previous=p3)
    assert p4.kb("w") == 4


def test_a_key_that_needed_k_b_keeps_it_for_the_hold_while_its_rate_holds() -> None:
    """A whale warming up: its rate is steady but its requests turn into hits, so its load reads as well below two
    shares for a while. Within ``kb_hold_s`` no plan gives it fewer destinations; after, or once its rate falls,
    the hysteresis alone decides. The hold travels in the plan, so another planner keeps it."""
    dests, cfg = nodes(4), PlanConfig(q_cap_factor=1.0, kb_hold_s=60.0)

    def at(t: float, rate: float, unc: float, previous: Plan | None, planner: str = "n000") -> Plan:
        rates = [summary([kr("whale", rate, unc=unc, dec=10)], extra_rate=100.0 - rate)]
        return build_plan(rates, dests, previous, cfg, next_epoch(previous), planner, t)

    p = at(0.0, 50.0, unc=1000.0, previous=None)  # 2 shares of misses: k_b 2, held from t = 0
    assert p.kb("whale") == 2 and p.holds["whale"].kb == 2
    p = at(10.0, 50.0, unc=100.0, previous=p)  # its hits: ~0.3 shares, far below (2 - 1) * 0.75
    assert p.kb("whale") == 2 and p.holds["whale"].since == 0.0
    p = at(40.0, 44.0, unc=100.0, previous=decode_plan(encode_plan(p)), planner="n001")  # another planner, -12%
    assert p.kb("whale") == 2
    assert at(61.0, 50.0, unc=100.0, previous=p).kb("whale") == 1  # the hold is over
    assert at(50.0, 30.0, unc=100.0, previous=p).kb("whale") == 1  # its rate fell by more than the hysteresis
    again = at(50.0, 50.0, unc=1000.0, previous=p)  # needs 2 again: the hold starts again
    assert again.kb("whale") == 2 and again.holds["whale"].since == 50.0
    assert not at(0.0, 10.0, unc=1000.0, previous=None).holds  # a key that never needed 2 has no hold


def test_previous_destinations_are_kept_when_balance_allows() -> None:
    rng = random.Random(11)
    base = zipf_keys(200, 100.0)
    dests = nodes(30)
    p1 = plan([summary(base)], dests)
    noisy = [kr(k.key, k.rate * (1 + rng.uniform(-0.05, 0.05))) for k in base]
    p2 = plan([summary(noisy)], dests, previous=p1)
    fresh = plan([summary(noisy)], dests)
    assert churn(p1, p2).cache_churn < 0.05
    assert churn(p1, p2).cache_churn <= churn(p1, fresh).cache_churn
    assert p2.warm_imbalance() <= 1.25
    # A dead destination's keys move, and only a few others make room for them: balance is kept.
    for dead in (p1.destinations("k0")[0], dests[-1]):
        survivors = [d for d in dests if d != dead]
        p3 = plan([summary(base)], survivors, previous=p1)
        assert dead not in p3.dest_load
        moved = [k for k in p1.assignments if set(p1.destinations(k)) != set(p3.destinations(k))]
        assert {k for k in p1.assignments if dead in p1.destinations(k)} <= set(moved)
        assert len(moved) <= 0.1 * len(p1.assignments)
        assert churn(p1, p3).cache_churn < 0.2 < churn(p1, plan([summary(base)], survivors)).cache_churn
        assert p3.imbalance() <= 1 + CFG.stickiness + 1e-9


key_rate_st = st.builds(
    lambda i, rate, unc, dec: kr(f"k{i}", rate, unc=unc, dec=dec),
    st.integers(0, 60),
    st.floats(0.0, 100.0),
    st.floats(0.0, 4000.0),
    st.floats(0.0, 500.0),
)


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.lists(key_rate_st, max_size=30, unique_by=lambda k: k.key), min_size=1, max_size=4),
    prev_parts=st.lists(key_rate_st, max_size=30, unique_by=lambda k: k.key),
    n_dests=st.integers(1, 12),
    top_k=st.integers(0, 20),
    max_kb=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_plan_invariants_on_random_inputs(
    parts: list[list[KeyRate]], prev_parts: list[KeyRate], n_dests: int, top_k: int, max_kb: int, seed: int
) -> None:
    cfg = PlanConfig(q_cap_factor=1.0, top_k=top_k, max_kb=max_kb, min_rate=0.5)
    dests = nodes(n_dests)
    previous = plan([summary(prev_parts)], nodes(n_dests + 2), cfg=cfg)
    summaries = [summary(p, extra_rate=float(i)) for i, p in enumerate(parts)]
    p = plan(summaries, dests, previous, cfg)
    assert len(p.assignments) <= top_k and p.epoch == previous.epoch + 1
    assert set(p.dest_load) == set(dests)
    for ds in p.assignments.values():
        assert 1 <= len(ds) <= min(max_kb, n_dests) and len(set(ds)) == len(ds) and set(ds) <= set(dests)
    assert math.fsum(p.dest_load.values()) == pytest.approx(math.fsum(p.key_load.values()))
    assert p.total_load >= math.fsum(p.key_load.values()) * (1 - 1e-9)
    assert decode_plan(encode_plan(p)) == p
    rng = random.Random(seed)
    shuffled = [RateSummary(tuple(rng.sample(s.keys, len(s.keys))), s.total_rate, s.total_uncached_tps,
                            s.total_decode_tps) for s in rng.sample(summaries, len(summaries))]
    assert plan(shuffled, rng.sample(dests, len(dests)), previous, cfg) == p


# --- planner: admission with hysteresis --------------------------------------------------------------------------


def _ranked(keys: list[KeyRate]) -> list[KeyRate]:
    return sorted(keys, key=lambda k: (-k.rate, k.key))


def test_admission_newcomer_needs_a_margin_to_displace_an_incumbent() -> None:
    cfg = PlanConfig(q_cap_factor=1.0, top_k=2, hysteresis=0.25)
    prev = plan_of({"a": ("n0",), "b": ("n1",)})
    assert [k.key for k in admit(_ranked([kr("a", 10), kr("b", 5), kr("c", 6)]), prev, cfg)] == ["a", "b"]
    assert [k.key for k in admit(_ranked([kr("a", 10), kr("b", 5), kr("c", 6.3)]), prev, cfg)] == ["a", "c"]
    # Without a previous plan it is plain top-K.
    assert [k.key for k in admit(_ranked([kr("a", 10), kr("b", 5), kr("c", 6)]), None, cfg)] == ["a", "c"]


def test_admission_evicts_incumbents_below_the_extended_rank_or_min_rate() -> None:
    cfg = PlanConfig(q_cap_factor=1.0, top_k=4, hysteresis=0.25)  # keep while rank < ceil(4 * 1.25) = 5
    keys = [kr(f"x{i}", 100 - i) for i in range(8)]
    prev = plan_of({"x4": ("n0",), "x5": ("n0",)})
    warm = {k.key for k in admit(_ranked(keys), prev, cfg)}
    assert "x4" in warm and "x5" not in warm and len(warm) == 4
    # Min rate: a newcomer needs its guaranteed rate (rate - error) >= min_rate; an incumbent min_rate / (1 + h).
    cfg = PlanConfig(q_cap_factor=1.0, top_k=4, min_rate=1.0)
    keys = [kr("hot", 5.0), kr("noisy", 1.5, err=0.8), kr("low", 0.5), kr("kept", 0.9)]
    warm = {k.key for k in admit(_ranked(keys), plan_of({"kept": ("n0",)}), cfg)}
    assert warm == {"hot", "kept"}


def test_warm_set_is_stable_under_small_rate_noise() -> None:
    """20 replans of the same Zipf traffic with +-10% noise: hysteresis keeps the warm set nearly fixed."""
    base = zipf_keys(1000, 500.0, s=0.9)
    dests = nodes(30)

    def replans(cfg: PlanConfig) -> tuple[list[int], list[float]]:
        rng = random.Random(5)
        prev: Plan | None = None
        changes, cache = [], []
        for _ in range(20):
            noisy = [kr(k.key, k.rate * (1 + rng.uniform(-0.1, 0.1))) for k in base]
            cur = plan([summary(noisy)], dests, previous=prev, cfg=cfg)
            if prev is not None:
                c = churn(prev, cur)
                changes.append(c.admitted + c.evicted)
                cache.append(c.cache_churn)
            prev = cur
        return changes, cache

    stable, stable_cache = replans(CFG)
    jumpy, jumpy_cache = replans(PlanConfig(q_cap_factor=1.0, hysteresis=0.0, stickiness=0.0))
    # The first plan's noisy top-K converges to the true top within a few replans, then never flaps.
    assert sum(stable) <= 4 and sum(stable[5:]) == 0
    assert sum(jumpy) > 5 * max(sum(stable), 1)
    assert max(stable_cache) < 0.1 and max(stable_cache[5:]) < 0.02 < max(jumpy_cache[5:])


def test_warm_set_never_exceeds_top_k() -> None:
    rng = random.Random(2)
    prev: Plan | None = None
    for _ in range(10):
        keys = [kr(f"k{i}", rng.uniform(0.5, 10)) for i in range(300)]
        prev = plan([summary(keys)], nodes(20), previous=prev)
        assert len(prev.assignments) == CFG.top_k


def test_empty_inputs() -> None:
    p = plan([], nodes(3))
    assert not p.assignments and p.dest_load == dict.fromkeys(nodes(3), 0.0) and p.imbalance() == 1.0
    p = plan([summary(zipf_keys(10, 10.0))], [])
    assert not p.assignments and not p.dest_load


def test_plan_is_trimmed_to_its_byte_budget() -> None:
    keys = [kr(("k" * 200) + str(i), 100.0 - i * 0.1) for i in range(128)]
    cfg = PlanConfig(q_cap_factor=1.0, max_plan_bytes=8192)
    p = plan([summary(keys)], nodes(30), cfg=cfg)
    assert 0 < len(p.assignments) < 128
    assert len(encode_plan(p, cfg.max_plan_bytes)) <= 8192
    kept = sorted(p.assignments, key=lambda k: -p.key_load[k])
    assert kept == [k.key for k in keys[: len(kept)]]  # the highest-load keys survive
    # Destination ids so long that even the full node list does not fit: only used destinations are listed.
    long_ids = [("n" * 250) + str(i) for i in range(60)]
    p = plan([summary(keys[:5])], long_ids, cfg=cfg)
    assert len(p.assignments) > 0 and len(p.dest_load) < 60
    assert len(encode_plan(p, 8192)) <= 8192


# --- epochs and failover ---------------------------------------------------------------------------------------------


def test_choose_planner_is_the_smallest_live_id_and_fails_over() -> None:
    members = ["n2", "n0", "n1"]
    assert choose_planner(members) == choose_planner(reversed(members)) == "n0"
    assert choose_planner(m for m in members if m != "n0") == "n1"
    with pytest.raises(ValueError, match="no live member"):
        choose_planner([])


def test_failover_plan_supersedes_the_dead_planners_plan() -> None:
    rates = [summary(zipf_keys(100, 50.0))]
    members = nodes(5)
    leader = choose_planner(members)
    p1 = build_plan(rates, members, None, CFG, next_epoch(None), leader, 0.0)
    # The leader dies: every survivor computes the same successor, which plans the next epoch.
    survivors = [m for m in members if m != leader]
    successor = choose_planner(survivors)
    assert successor != leader and all(choose_planner(random.sample(survivors, 4)) == successor for _ in range(5))
    assert not plan_due(p1, 5.0, CFG) and plan_due(p1, 10.0, CFG) and plan_due(None, 0.0, CFG)
    p2 = build_plan(rates, survivors, p1, CFG, next_epoch(p1), successor, 10.0)
    assert p2.epoch == p1.epoch + 1 and p2.planner_id == successor
    assert newer(p2, p1) and newest(p1, p2) is p2 and newest(p2, p1) is p2
    assert leader not in p2.dest_load
    # Until p2 arrives, p1 keeps routing (a plan never expires by itself).
    assert newest(None, p1) is p1


def test_an_older_epoch_never_replaces_a_newer_one() -> None:
    old, new = plan_of({"a": ("n1",)}, epoch=4, planner="n0"), plan_of({"a": ("n2",)}, epoch=5, planner="n0")
    assert newer(new, old) and not newer(old, new)
    assert not newer(old, old) and not newer(None, old) and newer(old, None)
    # An old planner coming back with a smaller id does not win with an older epoch...
    back = plan_of({"a": ("n3",)}, epoch=4, planner="a-smaller-id")
    assert not newer(back, new)
    # ...and two planners at the same epoch resolve the same way everywhere, whatever the arrival order.
    rival = plan_of({"a": ("n4",)}, epoch=5, planner="n9")
    assert newest(new, rival) is newest(rival, new) is rival
    held: Plan | None = None
    for p in random.Random(1).sample([old, new, back, rival], 4):
        if newer(p, held):
            held = p
    assert held is rival


# --- churn ------------------------------------------------------------------------------------------------------


def test_churn_on_hand_built_plans() -> None:
    prev = plan_of({"a": ("n1",), "b": ("n1", "n2")})
    cur = plan_of({"a": ("n2",), "b": ("n1", "n2", "n3"), "c": ("n3",)})
    c = churn(prev, cur)
    assert c.cache_churn == pytest.approx(1 - 2 / 6)  # pairs: 2 shared of 6 in the union
    assert c.count_churn == pytest.approx(1 / 2)  # of the shared keys a, b: only b's k_b changed
    assert (c.admitted, c.evicted, c.moved_pairs) == (1, 0, 3)
    same = churn(cur, cur)
    assert (same.cache_churn, same.count_churn, same.admitted, same.evicted) == (0.0, 0.0, 0, 0)
    assert churn(None, cur).cache_churn == 1.0
    assert churn(plan_of({}), plan_of({})).cache_churn == 0.0


def test_imbalance_water_fills_the_cold_load() -> None:
    p = Plan(1, "n0", 0.0, 10.0, {"a": ("n0",)}, {"a": 6.0}, {"n0": 6.0, "n1": 0.0, "n2": 0.0}, 3.0, 12.0)
    assert p.warm_imbalance() == pytest.approx(3.0)
    assert p.imbalance() == pytest.approx(6.0 / 4.0)  # 6 cold units fill n1 and n2 to 3 each; n0 stays at 6
    p = Plan(1, "n0", 0.0, 10.0, {"a": ("n0",)}, {"a": 3.0}, {"n0": 3.0, "n1": 0.0, "n2": 0.0}, 3.0, 30.0)
    assert p.imbalance() == pytest.approx(1.0)  # enough cold load to level everything


# --- plan: validation and wire -------------------------------------------------------------------------------------


def test_plan_rejects_inconsistent_fields() -> None:
    with pytest.raises(MalformedPlan, match="distinct"):
        Plan(1, "n0", 0.0, 10.0, {"a": ("n1", "n1")}, {"a": 1.0}, {"n1": 1.0})
    with pytest.raises(MalformedPlan, match="distinct"):
        Plan(1, "n0", 0.0, 10.0, {"a": ()}, {"a": 1.0}, {})
    with pytest.raises(MalformedPlan, match="no dest_load"):
        Plan(1, "n0", 0.0, 10.0, {"a": ("n1",)}, {"a": 1.0}, {})
    with pytest.raises(MalformedPlan, match="same keys"):
        Plan(1, "n0", 0.0, 10.0, {"a": ("n1",)}, {"b": 1.0}, {"n1": 1.0})
    with pytest.raises(MalformedPlan, match="finite"):
        Plan(1, "n0", 0.0, 10.0, {"a": ("n1",)}, {"a": -1.0}, {"n1": 1.0})
    with pytest.raises(MalformedPlan, match="epoch"):
        Plan(-1, "n0", 0.0, 10.0, {}, {}, {})
    p = plan_of({"a": ("n1",)})
    with pytest.raises(TypeError):
        p.assignments["b"] = ("n1",)  # type: ignore[index]


def test_plan_round_trip_size_and_malformed_input() -> None:
    p = plan([summary(zipf_keys(2000, 500.0), extra_rate=100.0)], nodes(300))
    data = encode_plan(p)
    assert len(data) <= DEFAULT_MAX_PLAN_BYTES
    assert decode_plan(data) == p
    assert encode_plan(decode_plan(data)) == data
    with pytest.raises(ValueError, match="exceeds"):
        encode_plan(p, max_bytes=100)
    with pytest.raises(MalformedPlan, match="exceeds"):
        decode_plan(data, max_bytes=100)
    obj = msgpack.unpackb(data)
    flat, tail = obj[10], obj[11:]  # tail: the verdict, the two token costs, the variances, a cold request's work
    assert obj[0] == 3 and tail[:3] == [None, CFG.prefill_token_cost, CFG.decode_token_cost]
    assert len(tail[3]) == len(obj[8]) and tail[4] > 0
    bad = [
        b"",
        b"\xc1",
        msgpack.packb([4, *obj[1:]]),
        msgpack.packb(obj[:-2]),
        msgpack.packb([*obj[:10], [*flat[:2], [len(obj[8])], None], *tail]),  # index out of the node table
        msgpack.packb([*obj[:10], [*flat[:2], [0, 0], None], *tail]),  # duplicate destination
        msgpack.packb([*obj[:10], [*flat[:4], *flat[:4]], *tail]),  # duplicate key
        msgpack.packb([*obj[:10], flat[:3], *tail]),  # a key without its hold slot
        msgpack.packb([*obj[:10], [*flat[:3], [0, 1.0, 1.0]], *tail]),  # held at 0 destinations
        msgpack.packb([*obj[:10], [*flat[:3], [len(flat[2]) + 1, 1.0, 1.0]], *tail]),  # held above its destinations
        msgpack.packb([*obj[:10], [*flat[:3], [1, "x", 1.0]], *tail]),  # hold since not a float
        msgpack.packb([*obj[:10], [*flat[:3], [1, 1.0, -1.0]], *tail]),  # negative hold rate
        msgpack.packb([*obj[:9], [*obj[9][:-1], -1.0], flat, *tail]),  # negative load
        msgpack.packb([*obj[:9], [*obj[9][:-1], math.nan], flat, *tail]),  # NaN load
        msgpack.packb([*obj[:8], [obj[8][0], obj[8][0]], [0.0, 0.0], [], *tail[:3], [0.0, 0.0], tail[4]]),  # dup id
        msgpack.packb([*obj[:7], 1, *obj[8:]]),  # affinity not a boolean
        msgpack.packb([obj[0], obj[1], "", *obj[3:]]),  # empty planner id
        msgpack.packb([*obj[:11], [True, "x", 1], *tail[1:]]),  # a verdict of the wrong shape
        msgpack.packb([*obj[:11], [True, "x", -1, 2, 0.1, 0.1, 0.1, 0.1, 0.0], *tail[1:]]),  # a negative count
        msgpack.packb([*obj[:12], 1, *obj[13:]]),  # a token cost not a float
        msgpack.packb([*obj[:12], -1.0, *obj[13:]]),  # a negative token cost
        msgpack.packb([*obj[:14], tail[3][:-1], tail[4]]),  # a variance short
        msgpack.packb([*obj[:14], [-1.0] * len(tail[3]), tail[4]]),  # negative variances
        msgpack.packb({"epoch": 1}),
    ]
    for b in bad:
        with pytest.raises(MalformedPlan):
            decode_plan(b)


def test_a_plan_carries_its_verdict_costs_and_holds_and_older_versions_still_read() -> None:
    verdict = GateReport(True, "affinity gains +12.0% KV hit", 400, 4, 0.5, 0.38, 0.2, 0.21, 1234.5)
    p = dataclasses.replace(
        plan_of({"hot": ("a", "b"), "cold": ("a",)}), verdict=verdict, prefill_token_cost=1.0, decode_token_cost=0.25,
        holds={"hot": KbHold(2, 90.0, 12.5)},
    )
    again = decode_plan(encode_plan(p))
    assert again == p
    assert (again.verdict, again.decode_token_cost) == (verdict, 0.25)
    assert dict(again.holds) == {"hot": KbHold(2, 90.0, 12.5)}
    obj = msgpack.unpackb(encode_plan(p))
    flat3 = [x for i in range(0, len(obj[10]), 4) for x in obj[10][i : i + 3]]  # without the holds
    v2 = msgpack.packb([2, *obj[1:10], flat3, obj[11]])  # a node from before the holds and costs travelled
    v1 = msgpack.packb([1, *obj[1:10], flat3])  # ... and from before the verdict did
    for data, version in ((v2, 2), (v1, 1)):
        old = decode_plan(data)
        assert old.assignments == p.assignments and not old.holds, version
        assert (old.prefill_token_cost, old.decode_token_cost) == (CFG.prefill_token_cost, CFG.decode_token_cost)
        assert old.verdict == (verdict if version == 2 else None)

# --- rate sketch ---------------------------------------------------------------------------------------------------


def _zipf_stream(n_keys: int, n: int, s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    w = [1 / (i + 1) ** s for i in range(n_keys)]
    return rng.choices([f"k{i}" for i in range(n_keys)], w, k=n)


def test_sketch_finds_the_top_keys_of_a_zipf_stream() -> None:
    stream = _zipf_stream(20_000, 100_000, 1.1, seed=1)
    sk = RateSketch(capacity=512, half_life_s=1e9)  # no decay: compare with exact counts
    t = 0.0
    for key in stream:
        t += 0.01
        sk.observe(key, t, 500, 100, 50)
    exact = Counter(stream)
    true_top = [k for k, _ in exact.most_common(30)]
    top = sk.top(50, t)
    found = {k.key for k in top}
    assert set(true_top[:30]) <= found
    bound = len(stream) / sk.capacity / t  # Space-Saving: overestimate <= N / capacity (as a rate)
    for k in top[:30]:
        true_rate = exact[k.key] / t
        # One-sided, within its own error (1e-4: the decay over 1000 s at a 1e9 s half-life).
        assert true_rate * (1 - 1e-4) <= k.rate <= (true_rate + k.error) * (1 + 1e-4)
        assert k.error <= bound + 1e-9
    for k in top[:10]:
        assert k.rate == pytest.approx(exact[k.key] / t, rel=0.01)
        assert k.uncached_tokens == pytest.approx(400) and k.decode_tokens == pytest.approx(50)
    assert sk.summary(t).total_rate == pytest.approx(len(stream) / t, rel=1e-4)


def test_sketch_rate_follows_a_poisson_stream_with_decay() -> None:
    rng = random.Random(4)
    sk = RateSketch(half_life_s=30.0)
    t = 0.0
    while t < 300.0:
        t += rng.expovariate(50.0)
        sk.observe("a", t, 100, 0, 10)
        if rng.random() < 0.2:
            sk.observe("b", t, 100, 0, 10)
    assert sk.rate("a", t) == pytest.approx(50.0, rel=0.1)
    assert sk.rate("b", t) == pytest.approx(10.0, rel=0.15)
    # Early estimates are unbiased too (corrected for the short window), not ramping up over half-lives.
    early = RateSketch(half_life_s=30.0)
    t = 0.0
    while t < 20.0:
        t += rng.expovariate(50.0)
        early.observe("a", t, 100, 0, 10)
    assert early.rate("a", t) == pytest.approx(50.0, rel=0.1)


def test_sketch_decays_a_key_that_stops() -> None:
    sk = RateSketch(half_life_s=30.0)
    for i in range(3000):
        sk.observe("old", i * 0.1, 100, 0, 10)  # 10/s for 300 s
    r0 = sk.rate("old", 300.0)
    assert r0 == pytest.approx(10.0, rel=0.02)
    assert sk.rate("old", 330.0) == pytest.approx(r0 / 2, rel=0.02)
    assert sk.rate("old", 390.0) == pytest.approx(r0 / 8, rel=0.02)
    for i in range(300):
        sk.observe("new", 390.0 + i * 0.1, 100, 0, 10)  # 10/s for 30 s
    assert [k.key for k in sk.top(2, 420.0)] == ["new", "old"]


def test_sketch_memory_is_bounded_and_long_runs_stay_finite() -> None:
    sk = RateSketch(capacity=64, half_life_s=1.0)
    rng = random.Random(9)
    t = 0.0
    for i in range(50_000):
        t += 0.5  # 25_000 s: ~25_000 half-lives, many renormalizations
        sk.observe(f"k{rng.randrange(10_000)}" if i % 2 else "hot", t, 100, 0, 10)
        assert len(sk) <= 64
        assert len(sk._heap) <= 2 * 64 + HEAP_SLACK
    top = sk.top(64, t)
    assert top[0].key == "hot" and all(math.isfinite(k.rate) for k in top)
    assert top[0].rate == pytest.approx(1.0, rel=0.5)  # 1/s
    assert len(sk.top(1000, t)) == 64


def test_sketch_first_request_and_clock_going_back() -> None:
    sk = RateSketch(min_window_s=5.0)
    sk.observe("a", 1000.0, 10, 0, 1)
    assert sk.rate("a", 1000.0) <= 1.1 / 5.0  # one request over the 5 s minimum window (+ decay weighting)
    sk.observe("a", 999.0, 10, 0, 1)  # an earlier time counts as the latest seen
    assert sk.rate("a", 998.0) == sk.rate("a", 1000.0)
    with pytest.raises(ValueError):
        RateSketch(capacity=0)
    with pytest.raises(ValueError):
        RateSketch(half_life_s=0.0)


def test_sketch_work_averages_use_only_the_keys_own_arrivals() -> None:
    sk = RateSketch(capacity=1)
    sk.observe("a", 0.0, 1000, 200, 100)
    sk.observe("b", 1.0, 300, 100, 7)  # takes over a's slot, inheriting its count as error
    (top,) = sk.top(1, 1.0)
    assert top.key == "b" and top.error > 0 and top.rate == pytest.approx(top.error)  # one own arrival: no rate yet
    assert top.uncached_tokens == pytest.approx(200) and top.decode_tokens == pytest.approx(7)
    sk.observe("c", 2.0, 10, 50, 0)  # cached > prompt: no negative work
    assert sk.top(1, 2.0)[0].uncached_tokens == 0


def test_keys_seen_once_at_start_up_are_not_admitted_and_keys_seen_twice_are() -> None:
    """A node's first seconds: every key seen once reads as 1 / min_window = 0.2 req/s, above min_rate, but one
    arrival is no evidence of a rate; a key that comes back is."""
    sk = RateSketch()
    for i in range(300):
        sk.observe(f"once{i}", i * 0.01, 500, 0, 16)
    for i in range(4):
        sk.observe("twice", 1.0 + i, 500, 0, 16)
        sk.observe(f"twice{i}", 1.0 + i, 500, 0, 16)
        sk.observe(f"twice{i}", 1.5 + i, 500, 0, 16)
    p = plan([sk.summary(5.0)], nodes(4))
    assert set(p.assignments) == {"twice", "twice0", "twice1", "twice2", "twice3"}


def test_summary_from_exact_counts() -> None:
    s = summary_from_counts([("a", 20, 20 * 300.0, 20 * 50.0), ("b", 5, 1000.0, 100.0), ("c", 0, 0.0, 0.0)], 10.0)
    assert [k.key for k in s.keys] == ["a", "b"]
    assert s.keys[0] == KeyRate("a", 2.0, 0.0, 300.0, 50.0)
    assert (s.total_rate, s.total_uncached_tps, s.total_decode_tps) == (2.5, 700.0, 110.0)
    with pytest.raises(ValueError):
        summary_from_counts([], 0.0)


# --- rate summary wire -----------------------------------------------------------------------------------------------


def test_summary_round_trip_and_size_bound() -> None:
    sk = RateSketch()
    for i, key in enumerate(_zipf_stream(5000, 20_000, 1.0, seed=2)):
        sk.observe(key, i * 0.01, 800, 300, 64)
    s = sk.summary(200.0)
    assert len(s.keys) == 256
    data = encode_summary(s)
    assert len(data) <= DEFAULT_MAX_RATES_BYTES
    back = decode_summary(data)
    assert [k.key for k in back.keys] == [k.key for k in s.keys]
    for a, b in zip(back.keys, s.keys, strict=True):
        assert a.rate == pytest.approx(b.rate, rel=1e-6) and a.error == pytest.approx(b.error, rel=1e-6, abs=1e-30)
        assert a.uncached_tokens == round(b.uncached_tokens) and a.decode_tokens == round(b.decode_tokens)
        assert a.hit_rate == pytest.approx(b.hit_rate, rel=1e-6) and (a.hit_uncached_tokens, a.prefix_tokens) == (
            500, 300
        )
    assert back.total_rate == pytest.approx(s.total_rate, rel=1e-6)
    assert encode_summary(back) == data  # float32 values are stable
    v1 = msgpack.packb([1, *msgpack.unpackb(data)[1:4], [x for i in range(0, 16, 8) for x in
                                                         msgpack.unpackb(data)[4][i : i + 5]]])  # fmt: skip
    old = decode_summary(v1)  # a node from before the resident figures: its keys never hit
    assert [k.key for k in old.keys] == [k.key for k in s.keys[:2]] and old.keys[0].hit_rate == 0.0


def test_a_warm_key_is_weighed_by_its_work_while_its_prefix_is_resident() -> None:
    """A key's first requests miss (nothing cached yet), the rest hit. The average over all its requests carries the
    misses for minutes; the planner weighs it by its hits', and counts each new destination's prefix once."""
    sk = RateSketch(half_life_s=30.0)
    for i in range(100):  # 1 req/s; the first 10 miss (66 uncached tokens), then 2 uncached of 66 (64 cached)
        sk.observe("k", float(i), 66, 0 if i < 10 else 64, 8)
    (k,) = sk.top(1, 100.0)
    assert k.work(1.0, 0.25) > 4.0 + 1.0  # the misses still weigh
    assert k.resident_work(1.0, 0.25) == pytest.approx(2 + 8 * 0.25) and k.prefix_tokens == pytest.approx(64)
    assert k.hit_rate == pytest.approx(k.rate * 0.9, rel=0.1)
    never = RateSketch()
    never.observe("u", 0.0, 100, 0, 8)
    assert never.top(1, 1.0)[0].resident_work(1.0, 1.0) == 108  # nothing reused: all its work is its own
    merged = merge_summaries([summary([KeyRate("k", 2.0, 0.0, 30.0, 8.0, 1.0, 2.0, 64.0)]),
                              summary([KeyRate("k", 2.0, 0.0, 10.0, 8.0, 2.0, 5.0, 32.0)])])  # fmt: skip
    assert merged.keys[0] == KeyRate("k", 4.0, 0.0, 20.0, 8.0, 3.0, 4.0, pytest.approx(128 / 3))
    # The plan: a key on a destination new to it carries its prefix build for the period, once.
    cfg = PlanConfig(q_cap_factor=1.0, prefill_token_cost=1.0, decode_token_cost=0.25, period_s=10.0)
    s1 = [summary([KeyRate("k", 1.0, 0.0, 10.0, 8.0, 0.9, 2.0, 64.0)])]
    first = build_plan(s1, ["a"], None, cfg, 1, "a", 0.0)
    assert first.key_load["k"] == pytest.approx(1.0 * (2 + 8 * 0.25))
    build = 64 * -math.expm1(-1.0 * 10.0) / 10.0
    assert first.dest_load["a"] == pytest.approx(4.0 + build)
    again = build_plan(s1, ["a"], first, cfg, 2, "a", 10.0)
    assert again.dest_load["a"] == pytest.approx(4.0)  # it stays: nothing to build


def test_summary_encode_drops_the_tail_to_fit() -> None:
    keys = [kr(("x" * 200) + f"{i:03d}", 100.0 - i) for i in range(100)] + [kr("y" * 300, 1000.0)]
    s = summary(keys)
    data = encode_summary(s, max_bytes=4096)
    assert len(data) <= 4096
    back = decode_summary(data, max_bytes=4096)
    assert 0 < len(back.keys) < 100
    assert [k.key for k in back.keys] == [k.key for k in keys[: len(back.keys)]]  # highest rates first, long key out
    with pytest.raises(ValueError):
        encode_summary(s, max_bytes=4)
    with pytest.raises(MalformedRates, match="exceeds"):
        decode_summary(data, max_bytes=100)


@pytest.mark.parametrize(
    "obj",
    [
        [3, 1.0, 1.0, 1.0, []],
        [2, 1.0, 1.0, 1.0, ["a", 1.0, 0.0, 1, 1]],  # version 2 has eight fields per key
        [2, 1.0, 1.0, 1.0, ["a", 1.0, 0.0, 1, 1, 2.0, 1, 1]],  # more hits than requests
        [2, 1.0, 1.0, 1.0, ["a", 1.0, 0.0, 1, 1, 0.5, -1, 1]],
        [1, 1.0, 1.0, 1.0],
        [1, -1.0, 1.0, 1.0, []],
        [1, math.inf, 1.0, 1.0, []],
        [1, 1.0, 1.0, 1.0, ["a", 1.0, 0.0, 1]],
        [1, 1.0, 1.0, 1.0, ["a", 1.0, 0.0, 1, 1, "a", 1.0, 0.0, 1, 1]],
        [1, 1.0, 1.0, 1.0, ["", 1.0, 0.0, 1, 1]],
        [1, 1.0, 1.0, 1.0, ["a" * 257, 1.0, 0.0, 1, 1]],
        [1, 1.0, 1.0, 1.0, ["a", math.nan, 0.0, 1, 1]],
        [1, 1.0, 1.0, 1.0, [b"a", 1.0, 0.0, 1, 1]],
        {"a": 1},
    ],
)
def test_summary_decode_rejects_malformed_input(obj: object) -> None:
    with pytest.raises(MalformedRates):
        decode_summary(msgpack.packb(obj, use_bin_type=True))


def test_summary_decode_rejects_garbage() -> None:
    for data in (b"", b"\xc1", b"\x91", bytes(range(64))):
        with pytest.raises(MalformedRates):
            decode_summary(data)


# --- cacheroute policy ----------------------------------------------------------------------------------------------


def req(key: str = "warm", n_blocks: int = 8, tiebreak: int = 0) -> RouteRequest:
    return RouteRequest(tuple(range(1, n_blocks + 1)), n_blocks * BS, 64, key, BS, tiebreak)


def peer(node_id: str, match: int = 0, *, running: int = 0, alive: bool = True) -> PeerSnapshot:
    return PeerSnapshot(node_id=node_id, alive=alive, est_match_blocks=match, load=NodeLoad(running=running))


def test_cacheroute_is_registered() -> None:
    assert get_spec("cacheroute").route is cr.route
    assert cr.DEFAULT_FALLBACK == "p2p"


def test_warm_key_goes_to_its_best_destination() -> None:
    p = plan_of({"warm": ("b", "c")})
    peers = [peer("a", 8, running=0), peer("b", 2, running=9), peer("c", 5, running=9), peer("d", running=1)]
    d = cr.route(req(), peers, p)
    assert d.ranked[:2] == ("c", "b")  # best match among its destinations (not a's 8 blocks, not least-loaded a)
    assert sorted(d.ranked) == ["a", "b", "c", "d"] and d.policy == "cacheroute" and d.est_match_blocks == 5
    assert d.ranked[2:] == ("a", "d")  # then the fallback's order (flat: least loaded)
    # Equal matches: the lower load.
    peers = [peer("a"), peer("b", 4, running=3), peer("c", 4, running=1)]
    assert cr.route(req(), peers, p).target == "c"


def test_whale_traffic_spreads_over_its_destinations() -> None:
    p = plan_of({"warm": ("a", "b", "c")})
    peers = [peer(x, 4) for x in "abcd"]
    targets = Counter(cr.route(req(tiebreak=i), peers, p).target for i in range(300))
    assert set(targets) == {"a", "b", "c"} and min(targets.values()) == 100


def split_req(sends: dict[str, int], tiebreak: int = 0) -> RouteRequest:
    return RouteRequest(tuple(range(1, 9)), 8 * BS, 64, "warm", BS, tiebreak, plan_sends=sends)


def test_a_warm_key_goes_to_a_destination_below_its_share_whatever_the_match() -> None:
    """The plan's split is the rule, the match only chooses among destinations still below their share."""
    p = plan_of({"warm": ("a", "b")})
    peers = [peer("a", 8), peer("b", 0), peer("c", 8)]
    assert cr.route(split_req({}), peers, p).target == "a"  # both below their share: the match decides
    assert cr.route(split_req({"a": 1}), peers, p).target == "b"  # a has had its half: b, without the prefix
    assert cr.route(split_req({"a": 5, "b": 5}), peers, p).target == "a"
    assert cr.route(split_req({"a": 5, "b": 6}), peers, p).target == "a"
    # Three destinations, equal shares and matches: the one furthest below its share...
    p3 = plan_of({"warm": ("a", "b", "c")})
    peers3 = [peer("a", 4, running=4), peer("b", 4, running=3), peer("c", 4, running=5)]
    assert cr.route(split_req({"a": 10, "b": 12, "c": 8}), peers3, p3).target == "c"
    # ...unless it is above the load bound over the key's destinations (the safety net): then the next below.
    peers3[2] = peer("c", 4, running=12)
    assert cr.route(split_req({"a": 10, "b": 12, "c": 8}), peers3, p3).target == "a"


def test_a_warm_key_with_segments_goes_to_the_destination_holding_its_documents() -> None:
    """Every destination of the key holds its prefix; what differs is which holds the request's documents: they are
    priced as p2p prices a request with segments, whatever destination the split would make due."""
    p = plan_of({"warm": ("a", "b", "c")})
    peers = [peer("a", 8), dataclasses.replace(peer("b", 8), est_segment_tokens=6 * BS), peer("c", 8), peer("d")]
    segmented = dataclasses.replace(split_req({"b": 9}), segment_mode=SegmentReuse.APPROXIMATE)
    d = cr.route(segmented, peers, p)
    assert d.target == "b" and "warm key with segments" in d.reason
    assert set(d.ranked[:3]) == {"a", "b", "c"} and d.ranked[3] == "d"  # the key's destinations first
    assert cr.route(split_req({"b": 9}), peers, p).target != "b"  # without segments: the split's (b has had its share)
    # a destination above the load bound over the key's destinations is passed over, documents or not
    peers[1] = dataclasses.replace(peer("b", 8, running=12), est_segment_tokens=6 * BS)
    assert cr.route(segmented, peers, p).target in ("a", "c")


def rated(node_id: str, work_per_s: float) -> PeerSnapshot:
    """A destination holding the whole prompt that served ``work_per_s`` (uncached prompt tokens) lately."""
    return PeerSnapshot(node_id=node_id, est_match_blocks=8, served_rate=ServedRate(1.0, work_per_s, 0.0))


def stream(peers: list[PeerSnapshot], p: Plan, n: int = 200) -> Counter[str]:
    """``n`` requests of the warm key from one ingress, each counted where it went (as the router's split does)."""
    sends: Counter[str] = Counter()
    for i in range(n):
        sends[cr.route(split_req(dict(sends), tiebreak=i), peers, p).target] += 1
    return sends


def test_a_whale_leans_away_from_the_destination_that_served_more_lately() -> None:
    """Its destinations all hold its prefix, so the split may follow realised load at no cache cost: one that served
    0.03 work/s above the pair's mean (its other keys ran hot) gets 0.03 of the key's 1.0 work/s less."""
    p = plan_of({"warm": ("a", "b")})  # the key's expected load: 1.0 work/s, two pieces of 0.5
    assert cr.FILL_GAIN == 1.0
    assert stream([rated("a", 1.06), rated("b", 1.0)], p) == {"a": 94, "b": 106}
    # Equal figures, or none: the plan's equal pieces.
    assert stream([rated("a", 1.2), rated("b", 1.2)], p) == {"a": 100, "b": 100}
    assert stream([peer("a", 8), peer("b", 8)], p) == {"a": 100, "b": 100}
    # Not where leaning could cost cache: a destination that does not hold the whole prompt (a conversation's latest
    # turn) -- the plan's equal shares, the match choosing within them; nor when neither holds all of it.
    def holding(p: PeerSnapshot, blocks: int) -> PeerSnapshot:
        return dataclasses.replace(p, est_match_blocks=blocks)

    assert stream([rated("a", 1.06), holding(rated("b", 1.0), 6)], p) == {"a": 100, "b": 100}
    assert stream([holding(rated("a", 1.06), 6), holding(rated("b", 1.0), 6)], p) == {"a": 100, "b": 100}
    # A destination without a figure counts as at the mean of those with one.
    p3 = plan_of({"warm": ("a", "b", "c")})
    sends = stream([rated("a", 1.13), rated("b", 1.07), peer("c", 8)], p3, 300)
    assert sends["a"] < sends["c"] < sends["b"]


def test_a_whale_leans_at_most_a_little_from_the_plans_shares() -> None:
    """However far apart the figures (a destination that restarted serves cold, costly requests for a while), each
    destination's share stays within 0.05 of its piece: the split still follows the plan an operator reads in status
    (within 0.1 of its shares, with room for noise), and no destination takes the key."""
    assert cr.FILL_MAX_SHIFT == 0.05
    p = plan_of({"warm": ("a", "b")})
    assert stream([rated("a", 0.0), rated("b", 50.0)], p) == {"a": 110, "b": 90}
    # Many ingresses reading the same figures each split their own requests by these shares: no herd.
    total = sum((stream([rated("a", 0.0), rated("b", 50.0)], p, 40) for _ in range(8)), Counter())
    assert total == {"a": 176, "b": 144}
    # Four pieces of 0.25, one destination far busier: it gives up 0.05, the other three share it evenly (clipping
    # each to 0.20-0.30, then dividing by the sum, would give the busy one 0.20 / 1.10 = 0.18: past its bound).
    p4 = plan_of({"warm": ("a", "b", "c", "d")})
    sends = stream([rated("a", 9.0), rated("b", 1.0), rated("c", 1.0), rated("d", 1.0)], p4, 600)
    assert sends == {"a": 120, "b": 160, "c": 160, "d": 160}


def test_a_warm_key_streamed_through_the_router_splits_by_the_plan() -> None:
    """Requests of one key, one ingress, a plan with k_b = 3: each destination gets a third, exactly, even though
    one of them holds the key's prefix and the others do not (they build it on their first request)."""
    from p2pnode.cache.prefix_index import PrefixIndex
    from p2pnode.routing.router import Router

    class Directory:  # three idle peers, the first of which holds the prompt
        version = 0

        def peers(self) -> list[object]:
            return [Peer(x) for x in ("a", "b", "c")]

        def peer(self, node_id: str) -> object:
            return Peer(node_id)

        def changes_since(self, version: int) -> None:
            return None

        def estimate_matches(self, hashes: object) -> dict[str, int]:
            return {"a": 8}

    class Peer:
        usable, load_age_s, info_age_s, cached_blocks = True, 0.0, 0.0, 0
        load = NodeLoad(prefill_backlog_tokens=0)

        def __init__(self, node_id: str) -> None:
            self.node_id = self.address = node_id

    router = Router("me", "me", PrefixIndex(BS), lambda: NodeLoad(running=50), Directory(), "cacheroute")
    router.plan = plan_of({"hot": ("a", "b", "c")})
    targets: Counter[str] = Counter()
    for i in range(300):
        route = router.route(admitted(list(range(8 * BS + 5)), "hot", 16, f"r{i}"))
        targets[route.decision.target] += 1
        router.end(route.decision.target, router.begin(route, route.decision.target))
    assert targets == {"a": 100, "b": 100, "c": 100}
    assert router.split.observed(router.plan) == {"hot": {"a": 100, "b": 100, "c": 100}}
    router.plan = plan_of({"hot": ("a", "b")}, epoch=2)  # a newer plan: counting starts afresh
    assert router.split.observed(router.plan) == {}


def test_a_destination_above_the_bound_loses_its_match_preference() -> None:
    # b holds the whale's prefix and took its traffic; a and c have not built it yet. Match first would keep
    # feeding b forever (a destination gets the prefix only by being chosen): the bound sends the next one away.
    p = plan_of({"warm": ("a", "b", "c")})
    peers = [peer("a", 0, running=2), peer("b", 8, running=12), peer("c", 0, running=1), peer("d", 8, running=0)]
    d = cr.route(req(), peers, p)  # cap = ceil(1.25 * 16 / 3) = 7: b (13 with this one) is above it
    assert d.target == "c" and d.ranked[:3] == ("c", "a", "b")
    # Within the bound the longest match still wins.
    peers[:3] = [peer("a", 0, running=4), peer("b", 8, running=4), peer("c", 0, running=3)]
    assert cr.route(req(), peers, p).target == "b"  # cap = ceil(1.25 * 12 / 3) = 5


def test_dead_destinations_are_skipped_and_never_chosen() -> None:
    p = plan_of({"warm": ("a", "b")})
    peers = [peer("a", 8, alive=False), peer("b", 1, running=5), peer("c", running=0)]
    d = cr.route(req(), peers, p)
    assert d.target == "b" and "a" not in d.ranked
    peers = [peer("a", 8, alive=False), peer("b", alive=False), peer("c", running=3), peer("d", 6, running=1)]
    d = cr.route(req(), peers, p)
    assert d.target == "d" and set(d.ranked) == {"c", "d"} and "none of 2" in d.reason
    with pytest.raises(NoAliveCandidate):
        cr.route(req(), [peer("a", alive=False)], p)


def test_a_plan_with_affinity_gated_off_routes_every_key_by_the_fallback() -> None:
    p = plan_of({"warm": ("a",)})
    off = Plan(p.epoch, p.planner_id, p.created_at, p.period_s, p.assignments, p.key_load, p.dest_load, affinity=False)
    assert decode_plan(encode_plan(off)) == off and not decode_plan(encode_plan(off)).affinity
    peers = [peer("a", 8, running=5), peer("b", running=0)]
    assert cr.route(req(), peers, p).target == "a"
    d = cr.route(req(), peers, off, fallback="flat")
    assert d.target == "b" and "affinity off" in d.reason


def test_cold_keys_and_no_plan_follow_the_fallback() -> None:
    p = plan_of({"warm": ("a",)})
    peers = [peer("a", running=0), peer("b", 8, running=2), peer("c", running=1)]
    for plan_arg in (p, None):
        d = cr.route(req("cold"), peers, plan_arg, fallback="flat")
        assert d.target == "a" and d.policy == "cacheroute" and "flat" in d.reason  # least loaded
        d = cr.route(req("cold"), peers, plan_arg, fallback="p2p")
        assert d.target == "b" and "p2p" in d.reason  # longest match, within p2p's load guard
        assert cr.route(req("cold"), peers, plan_arg) == d  # p2p is the default
        d = cr.route(req("cold"), peers, plan_arg, fallback="chwbl")
        assert d.policy == "cacheroute" and "chwbl" in d.reason
        assert d.target == chwbl_route(req("cold"), peers, None).target  # the key's ring owner within the cap
    with pytest.raises(ValueError, match="unknown cacheroute fallback"):
        cr.route(req(), peers, p, fallback="nope")


peer_st = st.builds(
    lambda i, match, running, alive: peer(f"p{i}", match, running=running, alive=alive),
    st.integers(0, 12),
    st.integers(0, 10),
    st.integers(0, 50),
    st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(
    peers=st.lists(peer_st, min_size=1, max_size=10, unique_by=lambda p: p.node_id).filter(
        lambda ps: any(p.alive for p in ps)
    ),
    planned=st.lists(st.integers(0, 14), min_size=1, max_size=5, unique=True),
    warm=st.booleans(),
    fallback=st.sampled_from(["flat", "p2p", "chwbl"]),
    tiebreak=st.integers(0, 2**64 - 1),
)
def test_cacheroute_contract_on_random_clusters(
    peers: list[PeerSnapshot], planned: list[int], warm: bool, fallback: str, tiebreak: int
) -> None:
    """Every alive peer exactly once; a warm key's target is an alive destination whenever one exists."""
    p = plan_of({"warm": tuple(f"p{i}" for i in planned)})
    d = cr.route(req("warm" if warm else "cold", tiebreak=tiebreak), peers, p, fallback=fallback)
    alive = {x.node_id for x in peers if x.alive}
    assert len(d.ranked) == len(alive) and set(d.ranked) == alive
    alive_dests = alive & set(p.destinations("warm"))
    if warm and alive_dests:
        assert d.target in alive_dests
        assert set(d.ranked[: len(alive_dests)]) == alive_dests
    assert d == cr.route(req("warm" if warm else "cold", tiebreak=tiebreak), list(reversed(peers)), p,
                         fallback=fallback)


def test_a_successor_plans_on_its_own_clock_after_a_planner_whose_clock_ran_ahead() -> None:
    """A plan's ``created_at`` is its planner's wall clock. The planner ran an hour ahead, then died: its successor
    judged the period from that time and built nothing for an hour, the dead planner's plan (keys on the dead node)
    in force all along. The period now runs from when the successor took the plan."""
    from p2pnode.plan.plan import encode_plan
    from p2pnode.plan.sync import PLAN_GOSSIP_KEY, PlanSync

    now = [1000.0]
    agent = _PlanAgent("b", ["b", "c"])  # "a", the planner, is gone: "b" plans now
    sync = PlanSync(agent, lambda plan: None, PlanConfig(period_s=5.0), clock=lambda: now[0])  # type: ignore[arg-type]
    ahead = Plan(epoch=7, planner_id="a", created_at=now[0] + 3600.0, period_s=5.0, assignments={"k": ("a", "c")},
                 key_load={"k": 1.0}, dest_load={"a": 0.5, "c": 0.5})
    agent.watchers[PLAN_GOSSIP_KEY]("a", PLAN_GOSSIP_KEY, encode_plan(ahead))
    now[0] += 6.0  # a period later, on b's clock
    sync.tick()
    assert sync.stats.plans_built == 1 and sync.plan.planner_id == "b" and sync.plan.epoch == 8  # type: ignore[union-attr]


class _PlanAgent:
    """What ``PlanSync`` uses of the gossip agent: the plan key's watcher, publishing, reading, the members."""

    def __init__(self, self_id: str, members: list[str]) -> None:
        self.self_id = self_id
        self.members = members
        self.watchers: dict = {}
        self.published: dict = {}

    def watch(self, key: str, callback) -> None:  # type: ignore[no-untyped-def]
        self.watchers[key] = callback

    def publish(self, key: str, value: bytes) -> None:
        self.published[key] = value

    def read(self, prefix: str) -> dict:
        return {}

    def usable_ids(self) -> list[str]:
        return self.members


def test_a_plan_published_under_another_name_or_beyond_any_epoch_is_ignored() -> None:
    """Any member could publish a plan as anyone's: one with epoch 2**64 - 1 was adopted everywhere, and every
    planner's next epoch then failed to build (past 64 bits): that plan stayed in force for good."""
    from p2pnode.plan.plan import encode_plan
    from p2pnode.plan.sync import PLAN_GOSSIP_KEY, PlanSync

    agent = _PlanAgent("a", ["a", "b"])
    sync = PlanSync(agent, lambda plan: None, PlanConfig(period_s=5.0), clock=lambda: 1000.0)  # type: ignore[arg-type]

    def plan(epoch: int, planner: str) -> bytes:
        return encode_plan(Plan(epoch=epoch, planner_id=planner, created_at=1000.0, period_s=5.0,
                                assignments={"k": ("a",)}, key_load={"k": 1.0}, dest_load={"a": 1.0}))

    agent.watchers[PLAN_GOSSIP_KEY]("b", PLAN_GOSSIP_KEY, plan(2**64 - 1, "zzz-not-a-member"))
    agent.watchers[PLAN_GOSSIP_KEY]("b", PLAN_GOSSIP_KEY, plan(2**64 - 1, "b"))
    assert sync.plan is None and sync.stats.plans_forged == 2
    agent.watchers[PLAN_GOSSIP_KEY]("b", PLAN_GOSSIP_KEY, plan(3, "b"))
    assert sync.plan is not None and sync.plan.epoch == 3


def test_rates_past_any_real_figure_are_refused_as_malformed() -> None:
    """A summary of 1e308 requests a second decoded (finite), and the planner's load / capacity was inf / inf: a
    NaN the planner raised on, every period, on every planner."""
    from p2pnode.plan.rates import MalformedRates, decode_summary, encode_summary

    honest = summary(zipf_keys(10, 50.0))
    assert decode_summary(encode_summary(honest)).keys  # an honest summary decodes
    huge = dataclasses.replace(honest, total_rate=1e30)
    with pytest.raises(MalformedRates, match="must be a number in"):
        decode_summary(encode_summary(huge))


@pytest.mark.parametrize("spread", [10.0, 1e4, 1e6])
def test_a_whales_split_leans_within_its_bounds_however_far_apart_the_served_rates(spread: float) -> None:
    """The shares' offset was bisected to within 1e-12, which floats past ~8,192 cannot reach: a served-rate spread
    ~10^4 times the key's load (a peer's odd report, a tiny planned load) held the ingress in one decision for good."""
    shares = cr._within({"a": 0.5 + spread, "b": 0.5 - spread}, 0.45, 0.55)
    assert shares["a"] == pytest.approx(0.55) and shares["b"] == pytest.approx(0.45)
    assert sum(shares.values()) == pytest.approx(1.0)
