"""Workloads: statistics roughly match their specs; generation is deterministic and lazy."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import Counter

import pytest

from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads import Limit, WakmanMix, get_workloads
from p2pnode.sim.workloads.aggregate import CacheRouteAggregate, key_weights
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.whales import WHALE_SHARES

SPACE = BlockSpace(128)


def gini(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return sum((2 * i - n + 1) * x for i, x in enumerate(v)) / (n * sum(v))


def top_share(values: list[float], frac: float) -> float:
    v = sorted(values, reverse=True)
    return sum(v[: int(frac * len(v))]) / sum(v)


def test_aggregate_key_popularity_matches_cacheroute() -> None:
    w = key_weights()
    assert len(w) == 128_000
    assert gini(w) == pytest.approx(0.756, abs=0.01)
    assert top_share(w, 0.04) == pytest.approx(0.47, abs=0.015)


def test_aggregate_threads_match_cacheroute() -> None:
    agg = CacheRouteAggregate()
    rng = random.Random(0)
    turns = [agg.thread_turns(rng) for _ in range(100_000)]
    assert statistics.fmean(turns) == pytest.approx(2.64, abs=0.03)
    assert sum(t for t in turns if t > 1) / sum(turns) == pytest.approx(0.808, abs=0.005)
    # sampled traffic: the top 4% of keys by weight carry ~47% of requests
    keys = [agg.pick_key(rng) for _ in range(100_000)]
    w = key_weights()
    top = set(sorted(range(agg.n_keys), key=lambda k: -w[k])[: int(0.04 * agg.n_keys)])
    assert sum(k in top for k in keys) / len(keys) == pytest.approx(0.46, abs=0.02)


def test_aggregate_requests_are_threads_in_arrival_order() -> None:
    agg = CacheRouteAggregate()
    reqs = list(agg.requests(200.0, 1, SPACE, Limit(duration_s=300.0)))
    times = [r.arrival for r in reqs]
    assert times == sorted(times)
    assert len(reqs) / 300 == pytest.approx(200, rel=0.05)
    multi = sum(r.cls == "multi" for r in reqs) / len(reqs)
    assert 0.7 < multi < 0.82  # threads still open at the end are cut, which lowers it a little
    # a follow-up's prompt extends its thread's previous prompt + output
    by_chain: dict[int, list] = {}
    for r in reqs:
        by_chain.setdefault(id(r.chain), []).append(r)
    followups = [rs for rs in by_chain.values() if len(rs) > 1]
    assert followups
    for rs in followups[:200]:
        for a, b in itertools.pairwise(rs):
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens
            assert b.arrival - a.arrival >= 2.0


def test_deterministic_and_seed_dependent() -> None:
    def sig(seed: int) -> list[tuple]:
        wl = get_workloads("cacheroute-aggregate")[0]
        rs = wl.requests(50.0, seed, SPACE, Limit(max_requests=300))
        return [(r.arrival, r.key, r.prompt_tokens, r.output_tokens, tuple(r.chain[: r.n_blocks])) for r in rs]

    assert sig(1) == sig(1)
    assert sig(1) != sig(2)


def test_whales_shares() -> None:
    wl = get_workloads("whales")[0]
    reqs = list(wl.requests(500.0, 0, SPACE, Limit(max_requests=40_000)))
    share = sum(r.cls == "whale" for r in reqs) / len(reqs)
    assert share == pytest.approx(sum(WHALE_SHARES), abs=0.01)
    counts = Counter(r.key for r in reqs)
    assert counts.most_common(1)[0][1] / len(reqs) == pytest.approx(WHALE_SHARES[0], abs=0.01)


def test_wakman_has_21_mixes_with_the_right_class_shares() -> None:
    mixes = get_workloads("wakman-mixes")
    assert len(mixes) == 21 and len({m.name for m in mixes}) == 21
    mix = WakmanMix(0.2, 0.4, 0.4)
    roots = list(mix.requests(100.0, 0, SPACE, Limit(duration_s=600.0)))
    counts = {"single": 0, "chat": 0, "agent": 0}
    for r in roots:
        while r is not None:
            counts[r.cls] += 1
            r = r.follow
    total = sum(counts.values())
    assert counts["single"] / total == pytest.approx(0.2, abs=0.05)
    assert counts["chat"] / total == pytest.approx(0.4, abs=0.06)
    assert counts["agent"] / total == pytest.approx(0.4, abs=0.08)
    agent = next(r for r in roots if r.cls == "agent" and r.follow is not None)
    assert agent.follow.prompt_tokens > agent.prompt_tokens + agent.output_tokens and agent.follow_gap_s >= 0
    assert get_workloads("wakman-mixes/s20-c40-a40")[0].name == "wakman-mixes/s20-c40-a40"


def test_mmlu_repeats_whole_questions() -> None:
    wl = get_workloads("mmlu")[0]
    reqs = list(wl.requests(100.0, 0, SPACE, Limit(max_requests=20_000)))
    prompts = {}
    repeats = 0
    for r in reqs:
        sig = tuple(r.chain[: r.n_prompt_blocks])
        repeats += prompts.get(sig, 0) > 0 and r.n_prompt_blocks > 0
        prompts[sig] = prompts.get(sig, 0) + 1
        assert r.output_tokens == 2 and r.key == ""
    assert repeats > 1000  # 20k draws from 14k questions, skewed by subject
    first_blocks = {r.chain[0] for r in reqs}
    assert len(first_blocks) <= 57


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("gamma", 1.9)])
def test_arrival_processes(process: str, cv: float) -> None:
    times = list(itertools.islice(arrival_times(random.Random(3), 10.0, process, 1.9), 50_000))
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.05)


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="cacheroute-aggregate, whales, wakman-mixes, mmlu"):
        get_workloads("nope")
    with pytest.raises(ValueError, match="valid"):
        get_workloads("wakman-mixes/s1-c2-a3")
    assert math.isfinite(1.0)
