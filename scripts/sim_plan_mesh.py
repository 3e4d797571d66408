#!/usr/bin/env python3
"""The live plan-mesh scene (scripts/bench_plan_mesh.py) on N simulated nodes: does the plan balance the work the
nodes serve, and does each plan's expected max/mean match what was served while it was in force?

The scene: ``--rate-per-node`` requests/s per node (7.5: the live bench's 30 req/s over 4 nodes), half with routing
key ``hot`` (one shared 64-token prefix), the rest over ``--keys`` keys with a prefix of their own; every prompt is
its key's prefix plus 2 tokens, 8 tokens generated; simulated engines of the ``tiny-cpu`` profile with 1,024 KV blocks
of 16 tokens; ``cacheroute`` with the real planner (``p2pnode/sim/plan.py``: the node's sketch, recording served
work, and ``build_plan``) every ``--plan-period`` seconds; ``--warm`` seconds not measured, then ``--steady``
measured. Work is a request's uncached prompt tokens plus its completion tokens, counted at the node that served it
(arrivals in the window); each plan is scored in its own work unit against the work of the requests that finished
while it was in force.

    python scripts/sim_plan_mesh.py                    # 16 nodes, a table
    python scripts/sim_plan_mesh.py --nodes 4 --json   # one JSON object
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.cost import get_profile
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.plan.plan import Plan
from p2pnode.plan.served import max_over_mean
from p2pnode.plan.work import decode_token_cost
from p2pnode.routing.policies import PLAN_POLICY, get_spec
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.plan import PlanInput, PlanProvider, provider_for
from p2pnode.sim.workloads.base import PrefixTable, Stream

BLOCK = 16
PREFIX_TOKENS = 64  # every key's shared prompt prefix (4 blocks)
SUFFIX_TOKENS = 2
MAX_TOKENS = 8
KV_BLOCKS = 1024
PROFILE = "tiny-cpu"
HOT = "hot"
#: Requests a plan's window must hold before its score is judged (as in the live bench).
MIN_PLAN_REQUESTS = 30


def scene(rate: float, keys: int, seconds: float, seed: int) -> Iterator[SimRequest]:
    """Poisson arrivals at ``rate``; half on ``hot``, the rest uniformly over ``keys`` keys."""
    rng = random.Random(seed)
    space = BlockSpace(BLOCK)
    prefixes = PrefixTable(space, lambda _: PREFIX_TOKENS)
    t, rid = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return
        k = 0 if rng.random() < 0.5 else 1 + rng.randrange(keys)
        key = HOT if k == 0 else f"k{k - 1}"
        yield Stream(space, rid + 1, prefixes.get(k)).request(rid, t, key, SUFFIX_TOKENS, MAX_TOKENS, key)
        rid += 1


class Recording:
    """The simulator's plan provider, keeping every plan it built."""

    def __init__(self, inner: PlanProvider) -> None:
        self.inner = inner
        self.period_s = inner.period_s
        self.plans: list[Plan] = []

    def plan(self, inp: PlanInput) -> Plan | None:
        p = self.inner.plan(inp)
        if p is not None:
            self.plans.append(p)
        return p


@dataclass
class PlanRow:
    epoch: int
    start: float
    requests: int  # finished while it was in force
    kb_hot: int
    expected_imbalance: float  # the plan's expected loads' max/mean
    period_imbalance: float  # what it predicts one period of its length serves (arrivals' chance included)
    served_imbalance: float


@dataclass
class Report:
    nodes: int
    rate: float
    plan_period_s: float
    requests: int  # arrived in the measured window
    served: dict[str, int]
    work: dict[str, int]
    requests_max_over_mean: float
    work_max_over_mean: float
    hot_kb: int
    hot_largest_share: float  # of the hot key's requests, the largest share one node served
    plans: list[PlanRow]
    #: Over plans of at least MIN_PLAN_REQUESTS requests: max |served - predicted for the period| and |served -
    #: expected loads' max/mean|.
    max_imbalance_error: float
    max_expected_error: float
    #: Over the same plans: mean of (served - predicted for the period), its bias, and mean |served - predicted|.
    mean_imbalance_bias: float
    mean_imbalance_error: float
    #: Per destination, (served - expected) load of one plan's period against the next's: their correlation over
    #: every destination and consecutive pair of measured plans. Near 0: what a plan misses is the period's chance,
    #: not a bias that served figures could teach the planner to correct.
    residual_autocorrelation: float
    wall_s: float


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def autocorrelation(residuals: list[dict[str, float]], ids: list[str]) -> float:
    """Pearson correlation of each destination's residual with its residual in the next plan (0 when undefined)."""
    xs = [a[d] for a, _ in itertools.pairwise(residuals) for d in ids]
    ys = [b[d] for _, b in itertools.pairwise(residuals) for d in ids]
    if len(xs) < 2:
        return 0.0
    mx, my = mean(xs), mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else 0.0


def run(args: argparse.Namespace) -> Report:
    started = time.perf_counter()
    profile = get_profile(PROFILE)
    cfg = SimConfig(nodes=args.nodes, block_size=BLOCK, kv_capacity_tokens=KV_BLOCKS * BLOCK, seed=args.seed)
    cfg = cfg.with_routing(policy=PLAN_POLICY, cost_profile=PROFILE, plan_period_s=args.plan_period)
    provider = Recording(provider_for(get_spec(PLAN_POLICY), decode_token_cost(profile), args.plan_period))
    rate = args.rate_per_node * args.nodes
    requests = list(scene(rate, args.keys, args.warm + args.steady, args.seed))
    cluster = Cluster(cfg, plan_provider=provider)
    cluster.run(requests)
    ids = cluster.node_ids
    window = [r for r in requests if args.warm <= r.arrival and not r.dropped]
    served = Counter(ids[r.target] for r in window)
    work = Counter()
    for r in window:
        work[ids[r.target]] += max(r.prompt_tokens - r.cached_tokens, 0) + r.output_tokens
    hot = Counter(ids[r.target] for r in window if r.key == HOT)

    rows: list[PlanRow] = []
    residuals: list[dict[str, float]] = []  # per measured plan: destination -> served - expected (per second)
    plans = provider.plans
    for p, nxt in itertools.pairwise(plans):
        if nxt.created_at <= args.warm or p.created_at >= args.warm + args.steady:
            continue
        done = [r for r in requests if p.created_at <= r.t_done < nxt.created_at and not r.dropped]
        load = {d: 0.0 for d in ids}
        for r in done:
            load[ids[r.target]] += (max(r.prompt_tokens - r.cached_tokens, 0) * p.prefill_token_cost
                                    + r.output_tokens * p.decode_token_cost)
        expected = p.expected_loads()
        seconds = nxt.created_at - p.created_at
        residuals.append({d: load[d] / seconds - expected.get(d, 0.0) for d in ids})
        rows.append(PlanRow(p.epoch, round(p.created_at, 1), len(done), p.kb(HOT), round(p.imbalance(), 3),
                            round(p.period_imbalance(nxt.created_at - p.created_at), 3),
                            round(max_over_mean(load.values()), 3)))  # fmt: skip
    judged = [r for r in rows if r.requests >= MIN_PLAN_REQUESTS]
    return Report(
        nodes=args.nodes, rate=rate, plan_period_s=args.plan_period, requests=len(window),
        served={d: served[d] for d in ids}, work={d: work[d] for d in ids},
        requests_max_over_mean=round(max_over_mean(served[d] for d in ids), 3),
        work_max_over_mean=round(max_over_mean(work[d] for d in ids), 3),
        hot_kb=plans[-1].kb(HOT) if plans else 0,
        hot_largest_share=round(max(hot.values()) / sum(hot.values()), 3) if hot else 0.0,
        plans=rows,
        max_imbalance_error=round(max((abs(r.served_imbalance - r.period_imbalance) for r in judged), default=0), 3),
        max_expected_error=round(max((abs(r.served_imbalance - r.expected_imbalance) for r in judged), default=0), 3),
        mean_imbalance_bias=round(mean([r.served_imbalance - r.period_imbalance for r in judged]), 3),
        mean_imbalance_error=round(mean([abs(r.served_imbalance - r.period_imbalance) for r in judged]), 3),
        residual_autocorrelation=round(autocorrelation(residuals, ids), 3),
        wall_s=round(time.perf_counter() - started, 1),
    )  # fmt: skip


def table(r: Report) -> str:
    lines = [
        f"{r.nodes} simulated nodes ({PROFILE}), {r.rate:g} req/s (half on '{HOT}'), plan period {r.plan_period_s:g} s:"
        f" {r.requests} requests measured, {r.wall_s} s wall",
        "",
        "| | max/mean | per node |",
        "|---|---:|---|",
        f"| requests served | {r.requests_max_over_mean:.3f} | {'/'.join(str(v) for v in r.served.values())} |",
        f"| token work (uncached prompt + completion) | {r.work_max_over_mean:.3f} | "
        f"{'/'.join(f'{v:,}' for v in r.work.values())} |",
        "",
        f"hot key: k_b {r.hot_kb}, largest destination share {r.hot_largest_share:.3f}",
        "",
        "| plan | from (s) | requests finished | hot k_b | expected max/mean | predicted for the period | served |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {p.epoch} | {p.start:.1f} | {p.requests} | {p.kb_hot} | {p.expected_imbalance:.3f} | "
          f"{p.period_imbalance:.3f} | {p.served_imbalance:.3f} |" for p in r.plans),
        "",
        f"over plans of at least {MIN_PLAN_REQUESTS} requests: max |served - predicted for the period| "
        f"{r.max_imbalance_error:.3f}, max |served - expected| {r.max_expected_error:.3f}; mean (served - predicted) "
        f"{r.mean_imbalance_bias:+.3f}, mean |served - predicted| {r.mean_imbalance_error:.3f}",
        f"per destination, (served - expected) of one plan against the next: correlation "
        f"{r.residual_autocorrelation:+.3f}",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rate-per-node", type=float, default=7.5, help="requests/s per node (default %(default)s)")
    parser.add_argument("--keys", type=int, default=50, help="keys sharing the other half (default %(default)s)")
    parser.add_argument("--plan-period", type=float, default=10.0, help="seconds (default %(default)s)")
    parser.add_argument("--warm", type=float, default=75.0)
    parser.add_argument("--steady", type=float, default=35.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    print(json.dumps(asdict(report), indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
