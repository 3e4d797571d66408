"""Benchmark of the CacheRoute-style planner and the rate sketch (a measurement, not a test).

    python scripts/bench_plan.py [--json] [--repeats 3]

Measures, on one core:
- ``build_plan`` time for 10k / 100k distinct keys x 30 / 300 destinations. Every key's rate (Zipf, s = 1.0) is
  split over 3 random nodes' published summaries, so the merge does real work (3 contributions per key). Two
  warm-set sizes: the default top-K (128: what a node runs every period) and K = every key (a stress test of the
  LPT placement itself, with the byte budget lifted; run once). "plan" is a first plan, "replan" the next one from rates
  with +-10% noise and the first plan as ``previous`` (hysteresis and stickiness at work); the replan's cache
  churn and the expected imbalance (``Plan.imbalance``, max/mean total load) are reported too;
- the rate sketch: ``observe`` cost per arrival, ``summary`` + ``encode_summary`` time, and memory per monitored
  key (tracemalloc) at the default capacity.

Runs in about a minute on 2 cores (the timings vary ~2x when other jobs share them).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass

from p2pnode.plan.plan import churn, encode_plan
from p2pnode.plan.planner import PlanConfig, build_plan
from p2pnode.plan.rates import (
    DEFAULT_SKETCH_CAPACITY,
    KeyRate,
    RateSketch,
    RateSummary,
    encode_summary,
)

KEYS = (10_000, 100_000)
DESTINATIONS = (30, 300)
CONTRIBUTORS_PER_KEY = 3
TOTAL_RATE = 5_000.0  # requests/s over the whole mesh
ZIPF_S = 1.0
NOISE = 0.10
SKETCH_ARRIVALS = 200_000
SKETCH_KEYS = 100_000


@dataclass(frozen=True)
class PlanRow:
    keys: int
    destinations: int
    top_k: int
    plan_ms: float  # median over repeats
    replan_ms: float
    warm_keys: int
    sum_kb: int
    max_kb: int
    imbalance: float  # expected max/mean total load per destination, first plan
    replan_imbalance: float
    replan_cache_churn: float
    replan_count_churn: float
    plan_bytes: int


def summaries(n_keys: int, n_nodes: int, noise: float, seed: int) -> list[RateSummary]:
    """Per-node summaries of a Zipf key population, each key's rate split over a few nodes."""
    rng = random.Random(seed)
    h = math.fsum(1 / (i + 1) ** ZIPF_S for i in range(n_keys))
    per_node: list[list[KeyRate]] = [[] for _ in range(n_nodes)]
    shape = random.Random(0)  # the keys' work does not change between plan and replan
    for i in range(n_keys):
        rate = TOTAL_RATE / (i + 1) ** ZIPF_S / h * (1 + rng.uniform(-noise, noise))
        unc, dec = shape.randrange(200, 4000), shape.randrange(50, 500)
        for node in rng.sample(range(n_nodes), min(CONTRIBUTORS_PER_KEY, n_nodes)):
            per_node[node].append(KeyRate(f"key-{i:06d}", rate / CONTRIBUTORS_PER_KEY, 0.0, unc, dec))
    out = []
    for keys in per_node:
        keys.sort(key=lambda k: (-k.rate, k.key))
        tot = math.fsum(k.rate for k in keys)
        unc = math.fsum(k.rate * k.uncached_tokens for k in keys)
        dec = math.fsum(k.rate * k.decode_tokens for k in keys)
        out.append(RateSummary(tuple(keys), tot, unc, dec))
    return out


def timed(fn, repeats: int):  # type: ignore[no-untyped-def]
    times, result = [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), result


def bench_plan(n_keys: int, n_dests: int, top_k: int | None, repeats: int) -> PlanRow:
    dests = [f"node-{i:04d}" for i in range(n_dests)]
    cfg = PlanConfig() if top_k is None else PlanConfig(top_k=top_k, min_rate=0.0, max_plan_bytes=1 << 30)
    first_rates = summaries(n_keys, n_dests, 0.0, seed=1)
    next_rates = summaries(n_keys, n_dests, NOISE, seed=2)
    plan_ms, p1 = timed(lambda: build_plan(first_rates, dests, None, cfg, 1, dests[0], 0.0), repeats)
    replan_ms, p2 = timed(lambda: build_plan(next_rates, dests, p1, cfg, 2, dests[0], 10.0), repeats)
    c = churn(p1, p2)
    kbs = [len(v) for v in p1.assignments.values()]
    return PlanRow(
        keys=n_keys,
        destinations=n_dests,
        top_k=cfg.top_k,
        plan_ms=round(plan_ms, 1),
        replan_ms=round(replan_ms, 1),
        warm_keys=len(p1.assignments),
        sum_kb=sum(kbs),
        max_kb=max(kbs, default=0),
        imbalance=round(p1.imbalance(), 3),
        replan_imbalance=round(p2.imbalance(), 3),
        replan_cache_churn=round(c.cache_churn, 3),
        replan_count_churn=round(c.count_churn, 3),
        plan_bytes=len(encode_plan(p1, 1 << 30)),
    )


def bench_sketch() -> dict[str, float]:
    rng = random.Random(3)
    w = [1 / (i + 1) ** ZIPF_S for i in range(SKETCH_KEYS)]
    stream = rng.choices([f"key-{i:06d}" for i in range(SKETCH_KEYS)], w, k=SKETCH_ARRIVALS)
    sk = RateSketch()
    gc.collect()
    t0 = time.perf_counter()
    t = 0.0
    for key in stream:
        t += 0.001
        sk.observe(key, t, 2000, 500, 200)
    observe_us = (time.perf_counter() - t0) / len(stream) * 1e6
    t0 = time.perf_counter()
    data = encode_summary(sk.summary(t))
    summary_ms = (time.perf_counter() - t0) * 1e3
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    full = RateSketch()
    for i in range(DEFAULT_SKETCH_CAPACITY * 2):
        full.observe(f"key-{i:06d}", i * 0.001, 2000, 500, 200)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {
        "capacity": DEFAULT_SKETCH_CAPACITY,
        "observe_us": round(observe_us, 2),
        "summary_encode_ms": round(summary_ms, 2),
        "summary_bytes": len(data),
        "bytes_per_key": round(used / DEFAULT_SKETCH_CAPACITY),
        "sketch_mb": round(used / 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median reported)")
    args = ap.parse_args()
    rows = []
    for n_keys in KEYS:
        for n_dests in DESTINATIONS:
            for top_k in (None, n_keys):  # the K = all stress rows run once: they take seconds each
                rows.append(bench_plan(n_keys, n_dests, top_k, args.repeats if top_k is None else 1))
                print(f"  {rows[-1]}", file=sys.stderr)
    sketch = bench_sketch()
    env = {"python": platform.python_version(), "machine": platform.machine()}
    if args.json:
        print(json.dumps({"env": env, "plan": [asdict(r) for r in rows], "sketch": sketch}, indent=2))
        return
    print("| keys | destinations | K | plan (ms) | replan (ms) | warm keys | Σk_b | max k_b | imbalance | "
          "replan imbalance | replan cache churn | count churn | plan bytes |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.keys:,} | {r.destinations} | {r.top_k:,} | {r.plan_ms:.1f} | {r.replan_ms:.1f} | {r.warm_keys:,} "
              f"| {r.sum_kb:,} | {r.max_kb} | {r.imbalance:.3f} | {r.replan_imbalance:.3f} | "
              f"{r.replan_cache_churn:.3f} | {r.replan_count_churn:.3f} | {r.plan_bytes:,} |")
    print()
    print(f"Rate sketch (capacity {sketch['capacity']}): observe {sketch['observe_us']} µs/arrival; summary + encode "
          f"{sketch['summary_encode_ms']} ms ({sketch['summary_bytes']:,} bytes); {sketch['bytes_per_key']} bytes per "
          f"monitored key ({sketch['sketch_mb']} MB full).")


if __name__ == "__main__":
    main()
