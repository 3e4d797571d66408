#!/usr/bin/env python3
"""Eviction's evidence: every eviction policy, ``adaptive`` and Belady's optimum over the WAKMan mixes (+ ``revisit``).

    python scripts/eviction_eval.py [--json] [--seeds 3] [--kv 100000,400000] [--duration 600] [--closed-loop]
        [--candidates lru,arc] [--half-life 150] [--confirm 1] [--jobs 2]

For each workload, seed and KV size, one simulated mesh (``--nodes`` 8, ``p2p`` routing, ``--qps`` 40, LRU) records
every node's stream of admitted requests (blocks, lookup limit, prompt length: what the node's selector sees).
Each node's stream is then replayed (``p2pnode/cache/eviction/replay.py``) through every static policy, through
``adaptive`` (the selector and ``Switchable`` the simulator and the node run) and through Belady's MIN
(``belady.py``), in a cache of the node's size; a workload's hit rate is token-weighted over its nodes, after the
warm-up (the first ``--warmup`` of the arrival window; every policy sees the whole stream). The replay serves one
request at a time (no blocks pinned by concurrent requests), which is what makes Belady computable and every
policy comparable on the same stream; the recording run's routing followed LRU's caches.

``--closed-loop`` also runs the mesh itself once per policy (``p2pnode sim --eviction <policy>``: concurrency,
routing on each policy's caches, ``adaptive`` choosing live), which has no Belady.

Output: one table (hit per policy per workload and KV size, then per policy: mean and worst gap to Belady in
points), the adaptive - LRU difference with its 95% Student-t interval over (workload, KV size) pairs (seeds
averaged), adaptive's largest shortfall against the best static policy, and whether the eviction targets
(docs/eviction.md) hold.
``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

from p2pnode.cache.eviction import PolicyFactory, get_eviction
from p2pnode.cache.eviction.adaptive import Adaptive
from p2pnode.cache.eviction.belady import belady_hits
from p2pnode.cache.eviction.registry import STATIC_POLICIES
from p2pnode.cache.eviction.replay import Access, ReplayCache
from p2pnode.config import EvictionConfig
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.report import t_interval
from p2pnode.sim.workloads import Limit, get_workloads

STATIC = list(STATIC_POLICIES)
POLICIES = [*STATIC, "adaptive"]


def _replay_factories(args: argparse.Namespace) -> dict[str, PolicyFactory]:
    """Each replayed policy's factory; ``adaptive`` with the defaults, or what ``--candidates``/``--half-life``/
    ``--confirm`` ask for (to compare settings on the same streams; the closed loop always runs the defaults)."""
    cfg = EvictionConfig(policy="adaptive")
    cfg = replace(
        cfg,
        candidates=tuple(args.candidates.split(",")) if args.candidates else cfg.candidates,
        half_life=args.half_life or cfg.half_life,
        confirm=args.confirm or cfg.confirm,
    )
    return {p: get_eviction(p) for p in STATIC} | {"adaptive": partial(Adaptive, config=cfg)}


def _replay(trace: list[Access], capacity: int, policy: PolicyFactory) -> list[int]:
    cache = ReplayCache(capacity, policy)
    observe = getattr(cache.policy, "observe", None)
    hits = []
    for a in trace:
        hits.append(cache.request(a.blocks, a.lookup))
        if observe is not None:
            observe(a.blocks, a.lookup, a.prompt_blocks)
    return hits


def _mesh(workload: str, seed: int, kv: int, args: argparse.Namespace, eviction: str, record: bool) -> tuple:
    """One simulated mesh run: its KV hit, and (``record``) each node's admitted stream with admission times."""
    w = get_workloads(workload)[0]
    warmup = args.warmup * args.duration
    cfg = SimConfig(
        nodes=args.nodes,
        seed=seed,
        kv_capacity_tokens=kv,
        warmup_s=warmup,
        block_size=w.block_size,
        eviction=eviction,
        gossip_delay_s=args.gossip_delay,
    )
    cluster = Cluster(cfg)
    traces: list[list[tuple[float, Access]]] = [[] for _ in cluster.engines]
    if record:
        loop = cluster.loop
        for j, eng in enumerate(cluster.engines):

            def rec(blocks: Any, lookup: int, prompt_blocks: float, out: list = traces[j]) -> None:
                out.append((loop.now, Access(tuple(blocks), lookup, prompt_blocks)))

            eng.cache.observe = rec
    summary = cluster.run(w.requests(args.qps, seed, cluster.space, Limit(duration_s=args.duration)))
    return summary["kv_hit"], traces, cluster.engines[0].cache.num_blocks, warmup


def evaluate(job: tuple[str, int, int, argparse.Namespace]) -> dict[str, Any]:
    """One (workload, seed, KV size): the replayed hit of every policy and Belady; closed-loop hits if asked."""
    workload, seed, kv, args = job
    t0 = time.perf_counter()
    lru_mesh, traces, capacity, warmup = _mesh(workload, seed, kv, args, "lru", record=True)
    factories = _replay_factories(args)
    num = dict.fromkeys([*POLICIES, "belady"], 0.0)
    den = 0.0
    for node in traces:
        trace = [a for _, a in node]
        skip = sum(1 for t, _ in node if t < warmup)
        den += sum(a.prompt_blocks for a in trace[skip:])
        for p, factory in factories.items():
            num[p] += sum(_replay(trace, capacity, factory)[skip:])
        num["belady"] += sum(belady_hits(trace, capacity)[skip:])
    out: dict[str, Any] = {
        "workload": workload,
        "seed": seed,
        "kv_tokens": kv,
        "capacity_blocks": capacity,
        "requests": sum(len(n) for n in traces),
        "replay": {p: (v / den if den else 0.0) for p, v in num.items()},
    }
    if args.closed_loop:
        out["closed_loop"] = {"lru": lru_mesh}
        for p in POLICIES:
            if p != "lru":
                out["closed_loop"][p] = _mesh(workload, seed, kv, args, p, record=False)[0]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def summarise(runs: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Per (workload, kv): seed means; per policy: mean and worst gap to Belady; adaptive vs LRU and vs best static."""
    cells: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in runs:
        if model in r:
            cells.setdefault((r["workload"], r["kv_tokens"]), []).append(r[model])
    rows = []
    for (w, kv), per_seed in sorted(cells.items(), key=lambda c: (c[0][1], c[0][0])):
        names = per_seed[0].keys()
        rows.append(
            {
                "workload": w,
                "kv_tokens": kv,
                "seeds": len(per_seed),
                **{p: _mean(s[p] for s in per_seed) for p in names},
            }
        )
    out: dict[str, Any] = {"model": model, "rows": rows}
    if not rows:
        return out
    policies = [p for p in POLICIES if p in rows[0]]
    if "belady" in rows[0]:
        out["gap_to_belady_points"] = {
            p: {
                "mean": 100 * _mean(r["belady"] - r[p] for r in rows),
                "worst": 100 * max(r["belady"] - r[p] for r in rows),
            }
            for p in policies
        }
    diffs = [100 * (r["adaptive"] - r["lru"]) for r in rows]
    mean_d, half = t_interval(diffs)
    out["adaptive_minus_lru_points"] = {"mean": mean_d, "ci95": half, "n": len(diffs)}
    shortfall = [(100 * (max(r[p] for p in STATIC) - r["adaptive"]), r["workload"], r["kv_tokens"]) for r in rows]
    worst = max(shortfall)
    out["adaptive_below_best_static_points"] = {"worst": worst[0], "where": f"{worst[1]} @ {worst[2]} tokens"}
    if "gap_to_belady_points" in out:
        gaps = out["gap_to_belady_points"]
        lowest_mean = min(gaps, key=lambda p: gaps[p]["mean"]) == "adaptive"
        lowest_worst = min(gaps, key=lambda p: gaps[p]["worst"]) == "adaptive"
    else:
        lowest_mean = lowest_worst = None
    out["done_when"] = {
        "lowest_mean_gap": lowest_mean,
        "lowest_worst_gap": lowest_worst,
        "beats_lru_ci_excludes_0": mean_d - half > 0,
        "never_1_point_below_best_static": worst[0] <= 1.0,
    }
    return out


def _short(w: str) -> str:
    return w.removeprefix("wakman-mixes/")


def table(s: dict[str, Any]) -> str:
    rows = s["rows"]
    if not rows:
        return ""
    cols = [p for p in [*POLICIES, "belady"] if p in rows[0]]
    lines = [
        f"### {s['model']}",
        "",
        "| workload | KV tokens | " + " | ".join(cols) + " | best static |",
        "|---|---:|" + "---:|" * (len(cols) + 1),
    ]
    for r in rows:
        best = max(STATIC, key=lambda p: r[p])
        lines.append(
            f"| {_short(r['workload'])} | {r['kv_tokens']:,} | "
            + " | ".join(f"{r[p]:.3f}" for p in cols)
            + f" | {best} |"
        )
    if "gap_to_belady_points" in s:
        g = s["gap_to_belady_points"]
        for stat in ("mean", "worst"):
            cells = " | ".join(f"{g[p][stat]:.2f}" for p in cols if p in g)
            lines.append(f"| **{stat} gap to Belady (points)** | | {cells} | | |")
    return "\n".join([*lines, "", summary_lines(s)])


def summary_lines(s: dict[str, Any], title: str = "") -> str:
    """The gaps, adaptive vs LRU and vs the best static policy, and the eviction targets' verdicts of one summary."""
    d = s["adaptive_minus_lru_points"]
    b = s["adaptive_below_best_static_points"]
    lines = [f"{s['model']}, {title}:"] if title else []
    if title and "gap_to_belady_points" in s:
        g = s["gap_to_belady_points"]
        lines.append(
            "gap to Belady, mean / worst (points): "
            + ", ".join(f"{p} {g[p]['mean']:.2f} / {g[p]['worst']:.2f}" for p in g)
        )
    lines += [
        f"adaptive - LRU: {d['mean']:+.2f} points, 95% interval ±{d['ci95']:.2f} (n = {d['n']} workload x KV cells); "
        f"adaptive's largest shortfall against the best static policy: {b['worst']:.2f} points ({b['where']}).",
        "targets: " + ", ".join(f"{k} {v}" for k, v in s["done_when"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="wakman-mixes,revisit", help="comma list (a family expands)")
    ap.add_argument("--kv", default="100000,400000", help="per-node KV sizes in tokens, comma list")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds run: first-seed .. first-seed + seeds - 1")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--qps", type=float, default=40.0)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals per run")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the arrival window not measured")
    ap.add_argument(
        "--gossip-delay",
        type=float,
        default=None,
        help="seconds until a gossip round is heard (default: the simulator's, the agent's measured lag; "
        "docs/results-history.md's eviction tables were measured with the one-hop delay, 1.5 s at 8 nodes)",
    )
    ap.add_argument("--closed-loop", action="store_true", help="also run the mesh once per policy")
    ap.add_argument("--candidates", help="replay: adaptive's candidates, comma list (default: config's)")
    ap.add_argument("--half-life", type=int, help="replay: the selector's half-life in requests (default: config's)")
    ap.add_argument("--confirm", type=int, help="replay: decisions in a row before a switch (default: config's)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--from", dest="from_file", help="summarise the runs of an earlier --out instead of running")
    args = ap.parse_args(argv)
    if args.from_file:
        with open(args.from_file) as f:
            earlier = json.load(f)
        return _report(earlier["runs"], earlier["command"], earlier["wall_s"], args)
    workloads = [w.name for name in args.workloads.split(",") for w in get_workloads(name)]
    kvs = [int(k) for k in args.kv.split(",")]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(w, s, kv, args) for kv in kvs for w in workloads for s in seeds]
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for i, r in enumerate(pool.map(evaluate, jobs)):
                runs.append(r)
                print(
                    f"[{i + 1}/{len(jobs)}] {r['workload']} kv={r['kv_tokens']} seed={r['seed']} {r['wall_s']}s",
                    file=sys.stderr,
                )
    else:
        for i, job in enumerate(jobs):
            r = evaluate(job)
            runs.append(r)
            print(
                f"[{i + 1}/{len(jobs)}] {r['workload']} kv={r['kv_tokens']} seed={r['seed']} {r['wall_s']}s",
                file=sys.stderr,
            )
    command = "python scripts/eviction_eval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return _report(runs, command, round(time.perf_counter() - t0, 1), args)


def _report(runs: list[dict[str, Any]], command: str, wall_s: float, args: argparse.Namespace) -> int:
    """Summaries over every workload and over the 21 WAKMan mixes alone, as a table or JSON (and ``--out``)."""
    mixes = [r for r in runs if r["workload"].startswith("wakman-mixes/")]
    closed = any("closed_loop" in r for r in runs)
    result = {
        "command": command,
        "wall_s": wall_s,
        "replay": summarise(runs, "replay"),
        "replay_wakman_only": summarise(mixes, "replay") if len(mixes) < len(runs) else None,
        "closed_loop": summarise(runs, "closed_loop") if closed else None,
        "closed_loop_wakman_only": summarise(mixes, "closed_loop") if closed and len(mixes) < len(runs) else None,
        "runs": runs,
    }
    if args.out and not args.from_file:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"`{command}` ({wall_s:.0f} s)\n")
    print(table(result["replay"]))
    for key, title in (
        ("replay_wakman_only", "the 21 WAKMan mixes alone"),
        ("closed_loop", None),
        ("closed_loop_wakman_only", "the 21 WAKMan mixes alone"),
    ):
        s = result[key]
        if s is None:
            continue
        print()
        print(table(s) if title is None else summary_lines(s, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
