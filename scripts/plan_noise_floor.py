#!/usr/bin/env python3
"""How far a period's served max/mean can stray from any prediction when the plan is perfect: the noise floor of
the plan-scoring targets (docs/plan.md, "Expected and served").

Requests arrive as Poisson processes; even a plan that gives every destination exactly the same expected load sees
each destination serve a Poisson count over a window, so the served max/mean of the window scatters. This prints,
for the plan-mesh scene's rate (7.5 requests/s per destination) and the windows the targets use, the mean and
standard deviation of that max/mean over many draws, how often it exceeds 1.15, and the 95th percentile of its
distance from its own mean -- the smallest tolerance a per-plan prediction can meet 95% of the time. Requests of
equal work; real work varies per request, which only widens the scatter.

    python scripts/plan_noise_floor.py
    python scripts/plan_noise_floor.py --json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SCENES = [(16, 35.0), (16, 10.0), (16, 2.0), (4, 35.0), (4, 10.0), (4, 2.0)]


def floor(nodes: int, rate: float, seconds: float, draws: int, seed: int) -> dict[str, float]:
    counts = np.random.default_rng(seed).poisson(rate * seconds, size=(draws, nodes))
    ratio = counts.max(axis=1) / counts.mean(axis=1)
    return {
        "nodes": nodes,
        "window_s": seconds,
        "mean": round(float(ratio.mean()), 3),
        "std": round(float(ratio.std()), 3),
        "p_above_1_15": round(float((ratio > 1.15).mean()), 3),
        "dev_p95": round(float(np.quantile(np.abs(ratio - ratio.mean()), 0.95)), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-per-node", type=float, default=7.5)
    parser.add_argument("--draws", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [floor(n, args.rate_per_node, s, args.draws, args.seed) for n, s in SCENES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"served max/mean of a perfectly balanced plan, Poisson arrivals at {args.rate_per_node} req/s per node")
    print(f"{'nodes':>5} {'window s':>8} {'mean':>6} {'std':>6} {'P(>1.15)':>8} {'|dev| p95':>9}")
    for r in rows:
        print(
            f"{r['nodes']:>5} {r['window_s']:>8g} {r['mean']:>6.3f} {r['std']:>6.3f} {r['p_above_1_15']:>8.2f} "
            f"{r['dev_p95']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
