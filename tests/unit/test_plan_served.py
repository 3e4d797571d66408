"""What destinations served, read from their gossiped loads, and a plan's expected loads scored against it; the
plan's work unit from a cost profile."""

from __future__ import annotations

import math

import msgpack
import pytest

from p2pnode.config import PlanConfig
from p2pnode.cost import PROFILES, fixed_step_profile
from p2pnode.load import MAX_LOAD_BYTES, NodeLoad, decode_load, encode_load
from p2pnode.plan.plan import Plan
from p2pnode.plan.planner import build_plan
from p2pnode.plan.rates import KeyRate, RateSummary
from p2pnode.plan.served import ServedHistory, max_over_mean, score
from p2pnode.plan.work import ServedWork, decode_token_cost


def load(at: float, requests: int, uncached: int, completion: int) -> NodeLoad:
    return NodeLoad(
        running=1, served_requests=requests, served_uncached_tokens=uncached, served_completion_tokens=completion,
        served_at=at,
    )


def test_the_served_figures_travel_with_the_load_within_its_bound() -> None:
    widest = NodeLoad(
        running=2**32, waiting=2**32, kv_usage=0.123, prefill_backlog_tokens=2**63, in_flight=2**32,
        served_requests=2**64 - 1, served_uncached_tokens=2**64 - 1, served_completion_tokens=2**64 - 1,
        served_at=1.7e9 + 0.1234,
    )
    data = encode_load(widest)
    assert len(data) <= MAX_LOAD_BYTES
    got = decode_load(data)
    assert got is not None and got.served_requests == 2**64 - 1 and got.served_at == pytest.approx(1.7e9 + 0.123)
    five = msgpack.packb(msgpack.unpackb(encode_load(NodeLoad(running=1)))[:5])  # from before the served figures
    old = decode_load(five)
    assert old is not None and (old.running, old.served_at, old.served_requests) == (1, 0.0, 0)
    for bad_at in (-1.0, float("nan"), "x"):
        items = msgpack.unpackb(data)
        items[-1] = bad_at
        assert decode_load(msgpack.packb(items)) is None


def test_served_work_over_a_window_is_interpolated_between_reports() -> None:
    h = ServedHistory(settle_s=3.0)
    h.record("a", load(100.0, 0, 0, 0))
    h.record("a", load(101.0, 10, 100, 80))
    h.record("a", load(102.0, 30, 300, 240))
    # [100.5, 102]: half of the first second's work (50 uncached + 40 completion) plus all of the second's
    assert h.served("a", 100.5, 102.0, now=102.5, prefill_token_cost=1.0, decode_token_cost=0.5) == pytest.approx(
        ((300 - 50) + 0.5 * (240 - 40)) / 1.5
    )
    assert h.served("a", 99.0, 101.0, now=110.0, prefill_token_cost=1.0, decode_token_cost=1.0) is None  # before
    # After the newest report: unknown until a change would have been reported, then unchanged (idle).
    assert h.served("a", 101.0, 103.0, now=104.0, prefill_token_cost=1.0, decode_token_cost=0.0) is None
    assert h.served("a", 101.0, 103.0, now=106.0, prefill_token_cost=1.0, decode_token_cost=0.0) == pytest.approx(
        200 / 2.0
    )
    assert h.served_since("a", 101.0, 1.0, 0.0) == pytest.approx(200.0)


def test_a_restart_repeats_and_the_bounds() -> None:
    h = ServedHistory(max_samples=4, settle_s=3.0)
    h.record("a", NodeLoad(running=3))  # no served figures: nothing recorded
    assert h.latest("a") is None
    for i in range(10):
        h.record("a", load(100.0 + i, i, i, i))
        h.record("a", load(100.0 + i, i, i, i))  # the same report again
    assert h.at("a", 105.0, now=200.0) is None  # only the last 4 reports are kept
    assert h.at("a", 107.5, now=200.0).requests == pytest.approx(7.5)
    h.record("a", load(110.0, 0, 0, 0))  # counts went backwards: the node restarted, a new series
    assert h.at("a", 108.0, now=200.0) is None and h.latest("a").requests == 0
    h.record("b", load(1.0, 1, 1, 1))
    h.retain(["a"])
    assert h.latest("b") is None and len(h) == 1
    spaced = ServedHistory(max_samples=4)
    for i in range(20):  # a report every 0.25 s, kept at least 1 s apart but the newest
        spaced.record("a", load(100.0 + i * 0.25, i, i, i), min_spacing_s=1.0)
    assert spaced.latest("a").at == pytest.approx(104.75)
    assert spaced.at("a", 102.5, now=104.75) is not None  # 4 reports span more than 2 s
    with pytest.raises(ValueError):
        ServedHistory(max_samples=1)


def plan_with(dest_load: dict[str, float], total: float, created_at: float = 100.0) -> Plan:
    return Plan(1, "a", created_at, 10.0, {"hot": tuple(dest_load)}, {"hot": sum(dest_load.values())}, dest_load,
                total_load=total, prefill_token_cost=1.0, decode_token_cost=0.25)


def test_expected_loads_water_fill_the_cold_traffic() -> None:
    p = plan_with({"a": 60.0, "b": 20.0, "c": 0.0}, total=120.0)
    assert p.expected_loads() == {"a": 60.0, "b": 30.0, "c": 30.0}  # 40 cold: c to b's level 20, then both to 30
    assert p.imbalance() == pytest.approx(60.0 / 40.0)


def test_a_plan_is_scored_against_what_was_served_while_it_was_in_force() -> None:
    p = plan_with({"a": 50.0, "b": 50.0}, total=100.0)  # expects a balanced mesh
    h = ServedHistory(settle_s=3.0)
    for node, per_s in (("a", 80), ("b", 20)):  # served 80 and 20 prompt tokens per second (all uncached)
        for t in range(95, 115):
            h.record(node, load(float(t), t, per_s * t, 0))
    assert score(p, 120.0, h, now=121.0) is None  # not known yet past the last report
    s = score(p, 110.0, h, now=111.0)
    assert s is not None
    assert dict(s.served) == pytest.approx({"a": 80.0, "b": 20.0}) and dict(s.expected) == {"a": 50.0, "b": 50.0}
    assert s.expected_imbalance == pytest.approx(1.0) and s.served_imbalance == pytest.approx(1.6)
    assert s.error == pytest.approx(0.6)
    assert max_over_mean([]) == 1.0 and max_over_mean([0.0, 0.0]) == 1.0


def test_the_work_unit_comes_from_the_cost_profile_and_served_figures() -> None:
    assert decode_token_cost(PROFILES["llama-3.1-8b-h100"]) == pytest.approx(5.34, abs=0.01)
    assert decode_token_cost(PROFILES["tiny-cpu"]) == pytest.approx(0.252, abs=0.001)  # steps are mostly overhead
    assert decode_token_cost(fixed_step_profile(0.01)) == 4.0  # no prefill cost to compare with: the default
    w = ServedWork(prompt_tokens=66, cached_tokens=64, completion_tokens=8)
    assert w.uncached_tokens == 2 and w.work(1.0, 0.25) == 4.0
    assert ServedWork(10, 16, 0).uncached_tokens == 0


def test_a_short_period_is_predicted_above_the_expected_loads_own_balance() -> None:
    """Requests arrive at random and a key's all go where the plan put them: one short period serves a max/mean
    above the expected loads' own, and the prediction of a period closes in on it as periods lengthen."""
    keys = [f"k{i}" for i in range(4)]
    p = Plan(1, "a", 0.0, 2.0, {k: (f"n{k[1]}",) for k in keys}, dict.fromkeys(keys, 60.0),
             {f"n{i}": 60.0 for i in range(4)}, total_load=240.0, dest_var={f"n{i}": 60.0 * 4.0 for i in range(4)})
    assert p.imbalance() == 1.0  # 4 keys of 15 req/s x 4 units each, one per destination
    short, long = p.period_imbalance(2.0), p.period_imbalance(200.0)
    assert short > long > 1.0 and long < 1.03
    assert 1.1 < short < 1.3  # ~30 requests per destination: +-18%, the max of four ~+1 sd
    assert p.period_imbalance(2.0) == short  # a fixed seed: every node computes the same figure


def test_a_warm_set_of_every_key_does_not_predict_noise_from_the_totals_residue() -> None:
    """Every key warm: the summaries' totals exceed the keys' sum only by rounding (the wire rounds token means),
    over a cold rate of ~0. That residue once read as one enormous cold request, and a plan expecting 1.09 x the mean
    predicted 1.95 for its period."""
    keys = [KeyRate(f"k{i}", 1.0, 0.0, 2.4, 8.0, 1.0, 2.4, 64.0) for i in range(8)]
    rate = math.fsum(k.rate for k in keys)
    s = RateSummary(tuple(keys), rate * (1 + 1e-9), math.fsum(k.rate * 2.4 for k in keys) + 3.2, rate * 8.0)
    p = build_plan([s], ["a", "b", "c", "d"], None, PlanConfig(prefill_token_cost=1.0, decode_token_cost=0.25), 1,
                   "a", 0.0)  # fmt: skip
    assert p.cold_request_work <= max(k.work(1.0, 0.25) for k in keys)
    assert p.period_imbalance(10.0) < p.imbalance() + 0.5
