#!/usr/bin/env python3
"""Reproduce the papers' findings with the simulator: one script, every experiment, a table per finding.

    python scripts/sim_findings.py [--quick] [--json] [--out DIR] [--jobs N] [--only a,b,...] [--reuse]

Findings (``--only`` takes their letters):
  a  CacheRoute aggregate: SLO capacity (95% CI over seeds), KV hit, max/mean load of every policy.
  b  Affinity without a load bound: max/mean load and p99 of pure key affinity (sticky) vs bounded/planned
     policies on ``whales`` and the aggregate.
  c  ``low-reuse``: where affinity loses to flat, and whether cacheroute's fallback keeps it safe.
  d  P2P gain vs gossip interval (0.1..5 s, one-hop delay) on the aggregate and whales: p2p vs flat vs upper-bound.
  e  WAKMan: LRU vs S3-FIFO over the 21 mixes, default and a 100k-token KV cache.
  f  CacheRoute's fallback (flat / p2p / chwbl) on the aggregate, whales and low-reuse (from a-c), and the planner's
     admission (top_k, min_rate) on the aggregate, with the warm-set size and plan bytes each gives.

Every run goes through ``p2pnode.sim.runner.run_experiment`` (the machinery behind ``p2pnode sim``); each *grid*
(one ``Experiment``) is also written to ``OUT/grids/<name>.json`` with the equivalent ``p2pnode sim`` command, and
``--reuse`` loads a grid whose stored spec equals the current one instead of re-running it (so findings can be
assembled from grids run at different times; the spec, not the code version, is what is compared). Runs are pure
functions of their configuration and seed, so everything is reproducible. ``--quick``: 8 nodes, short runs, two
seeds, a few WAKMan mixes: a smoke test of minutes, not a result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from p2pnode.config import DEFAULT_COST_PROFILE
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S
from p2pnode.plan.plan import encode_plan
from p2pnode.routing.policies import DEFAULT_POLICY, PLAN_POLICY, SPECS, Role, names_of
from p2pnode.sim import upper_bound
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.report import aggregate, t_interval
from p2pnode.sim.runner import Experiment, run_experiment
from p2pnode.sim.staleness import agent_fitted_delay, one_hop_push_delay
from p2pnode.sim.workloads import Limit, get_workloads

SLO_S = 3.5
PROFILE = DEFAULT_COST_PROFILE
AGG, WHALES, LOW = "cacheroute-aggregate", "whales", "low-reuse"
#: The papers' baselines: the registry's published algorithms.
BASELINES = list(names_of(Role.BASELINE))
_PLAN = SPECS[PLAN_POLICY]
#: The plan's policy with each fallback for its cold keys: its what-ifs, then its own default under its explicit name.
CACHEROUTES = [*_PLAN.what_ifs, *(name for name in _PLAN.named if name not in _PLAN.what_ifs)]
DEFAULT_FALLBACK = _PLAN.defaults["fallback"]
#: Policies whose result depends on the default policy (its rule or its fallback use).
P2P_DEPENDENT = {DEFAULT_POLICY, upper_bound.NAME} | {
    name for name, params in _PLAN.named.items() if DEFAULT_POLICY in params.values()
}
GOSSIP_INTERVALS = (0.1, 0.5, 1.0, 2.0, 5.0)
ADMISSION = [(128, 0.1), (512, 0.1), (2048, 0.1), (128, 0.02), (512, 0.02), (2048, 0.02)]


@dataclass(frozen=True)
class Grid:
    """One ``Experiment``: what ``p2pnode sim`` would run with the flags in ``command()``."""

    name: str
    workloads: tuple[str, ...]
    policies: tuple[str, ...]
    ladder: tuple[float, ...]
    seeds: int
    nodes: int
    duration_s: float
    evictions: tuple[str, ...] = ("lru",)
    patience: int = 2
    sim: dict[str, Any] = field(default_factory=dict)  # SimConfig overrides (gossip, kv capacity)

    def settings(self) -> dict[str, Any]:
        """``sim`` with the gossip delay pinned: these findings were measured with the one-hop push delay (the
        staleness model's default before it became the agent's measured lag), so a grid that names no delay gets
        that one and reproduces the tables in docs/results-history.md ("The papers' findings")."""
        out = dict(self.sim)
        if "gossip_delay_s" not in out:
            interval = out.get("gossip_interval_s", DEFAULT_GOSSIP_INTERVAL_S)
            out["gossip_delay_s"] = one_hop_push_delay(interval, self.nodes)
        return out

    def command(self) -> str:
        flags = {
            "gossip_interval_s": "--gossip-interval",
            "gossip_delay_s": "--gossip-delay",
            "kv_capacity_tokens": "--kv-capacity-tokens",
        }
        extra = "".join(f" {flags[k]} {v:.10g}" for k, v in sorted(self.settings().items()))
        ladder = ",".join(f"{q:g}" for q in self.ladder)
        ev = "" if self.evictions == ("lru",) else f" --eviction {','.join(self.evictions)}"
        return (
            f"p2pnode sim --workload {','.join(self.workloads)} --nodes {self.nodes} --policies "
            f"{','.join(self.policies)} --qps-ladder {ladder} --duration {self.duration_s:g} --seeds {self.seeds}"
            f" --patience {self.patience} --slo-p99-ttft {SLO_S} --profile {PROFILE}{ev}{extra}"
        )

    def spec(self) -> dict[str, Any]:
        d = asdict(self)
        d["command"] = self.command()
        return d


def _ladder(start: float, stop: float, step: float) -> tuple[float, ...]:
    n = round((stop - start) / step)
    return tuple(round(start + i * step, 6) for i in range(n + 1))


@dataclass(frozen=True)
class Scale:
    nodes: int
    duration_s: float
    seeds: int
    #: Seconds of arrivals on the single-turn workloads (whales, low-reuse: no threads to warm up, so shorter runs
    #: reach the steady state; the 2-core budget asked for it).
    short_duration_s: float
    ladder: tuple[float, ...]
    knee_ladder: tuple[float, ...]  # the aggregate's leading policies again, at a finer step around their knee
    low_ladder: tuple[float, ...]  # low-reuse: every request prefills ~2.4k tokens, the mesh saturates sooner
    sweep_qps: dict[str, tuple[float, ...]]
    wakman_seeds: int
    wakman_nodes: int
    wakman_qps: float
    wakman_duration_s: float
    wakman_mixes: tuple[str, ...] | None  # None: all 21
    admission_seeds: int


FULL = Scale(
    nodes=30,
    duration_s=120.0,
    short_duration_s=60.0,
    seeds=5,
    ladder=_ladder(50, 500, 50),
    knee_ladder=_ladder(300, 450, 25),
    low_ladder=_ladder(25, 250, 25),
    sweep_qps={AGG: (150.0,), WHALES: (250.0,)},
    wakman_seeds=3,
    wakman_nodes=8,
    wakman_qps=40.0,
    wakman_duration_s=300.0,
    wakman_mixes=None,
    admission_seeds=3,
)
QUICK = Scale(
    nodes=8,
    duration_s=30.0,
    short_duration_s=30.0,
    seeds=2,
    ladder=_ladder(20, 120, 20),
    knee_ladder=_ladder(80, 140, 10),
    low_ladder=_ladder(10, 60, 10),
    sweep_qps={AGG: (40.0,), WHALES: (80.0,)},
    wakman_seeds=2,
    wakman_nodes=4,
    wakman_qps=20.0,
    wakman_duration_s=60.0,
    wakman_mixes=("wakman-mixes/s100-c0-a0", "wakman-mixes/s20-c40-a40", "wakman-mixes/s0-c0-a100"),
    admission_seeds=2,
)


def grids(sc: Scale) -> dict[str, list[Grid]]:
    """The grids each finding needs (a grid may serve several findings)."""

    def ladder_grid(name: str, wl: str, policies: list[str], **kw: Any) -> Grid:
        ladder = sc.low_ladder if wl == LOW else sc.ladder
        dur = sc.duration_s if wl == AGG else sc.short_duration_s
        return Grid(name, (wl,), tuple(policies), ladder, sc.seeds, sc.nodes, dur, **kw)

    withp2p = ["p2p", "cacheroute-p2p", "upper-bound"]
    out: dict[str, list[Grid]] = {}
    for tag, wl in (("agg", AGG), ("whales", WHALES), ("low", LOW)):
        # every baseline on the aggregate; on whales and low-reuse the affinity/balance contrast (and dualmap, the
        # strongest baseline on the aggregate) -- the 2-core budget did not allow all of them everywhere
        base = BASELINES if wl == AGG else ["flat", "sticky", "chwbl", "dualmap"]
        nop2p = [*base, "cacheroute-flat", "cacheroute-chwbl"]
        out[tag] = [ladder_grid(f"{tag}-baselines", wl, nop2p), ladder_grid(f"{tag}-p2p", wl, withp2p)]
    knee = ("sticky", "chwbl", "dualmap", "p2p", "cacheroute-chwbl", "cacheroute-p2p", "upper-bound")
    out["knee"] = [Grid("agg-knee", (AGG,), knee, sc.knee_ladder, sc.seeds, sc.nodes, sc.duration_s)]
    sweep = []
    for wl, qps in sc.sweep_qps.items():
        tag = "agg" if wl == AGG else "whales"
        dur = sc.duration_s if wl == AGG else sc.short_duration_s
        for iv in GOSSIP_INTERVALS:
            sweep.append(
                Grid(f"gossip-{tag}-{iv:g}s", (wl,), ("flat", "p2p"), qps, sc.seeds, sc.nodes, dur,
                     patience=0, sim={"gossip_interval_s": iv})
            )
        # the real agent's measured lag at this size (docs/simulator.md, "Gossip: model vs real agent"), at 1 s
        fitted = round(agent_fitted_delay(1.0, sc.nodes), 3)
        sweep.append(Grid(f"gossip-{tag}-1s-fitted", (wl,), ("flat", "p2p"), qps, sc.seeds, sc.nodes, dur,
                          patience=0, sim={"gossip_interval_s": 1.0, "gossip_delay_s": fitted}))
        sweep.append(
            Grid(f"gossip-{tag}-upper-bound", (wl,), ("upper-bound",), qps, sc.seeds, sc.nodes, dur, patience=0)
        )
    out["sweep"] = sweep
    mixes = sc.wakman_mixes or ("wakman-mixes",)
    out["wakman"] = [
        Grid(f"wakman-{label}", mixes, ("p2p",), (sc.wakman_qps,), sc.wakman_seeds, sc.wakman_nodes,
             sc.wakman_duration_s, evictions=("lru", "s3fifo"), patience=0, sim=sim)
        for label, sim in (("default", {}), ("100k", {"kv_capacity_tokens": 100_000}))
    ]
    # the r0.1 variants with a larger top_k admit (almost) nothing more than the default (see the diagnostics)
    adm = [f"cacheroute-{fb}@k{k}@r{r:g}" for fb in ("flat", "p2p") for k, r in ADMISSION if r < 0.1]
    out["admission"] = [Grid("agg-admission", (AGG,), tuple(adm), sc.ladder, sc.admission_seeds, sc.nodes,
                             sc.duration_s)]
    return out


NEEDS = {"a": ["agg", "knee"], "b": ["agg", "whales"], "c": ["low"], "d": ["sweep"], "e": ["wakman"],
         "f": ["agg", "whales", "low", "admission"]}


# --- running --------------------------------------------------------------------------------------------------------


def run_grid(g: Grid, out: Path, jobs: int, reuse: bool, skip_p2p: bool) -> list[dict[str, Any]]:
    path = out / "grids" / f"{g.name}.json"
    if reuse and path.exists():
        stored = json.loads(path.read_text())
        if stored["spec"] == json.loads(json.dumps(g.spec())):
            print(f"[reuse] {g.name}: {len(stored['runs'])} runs from {path}", file=sys.stderr)
            return stored["runs"]
        print(f"[rerun] {g.name}: stored spec differs", file=sys.stderr)
    if skip_p2p and any(p.split("@")[0] in P2P_DEPENDENT for p in g.policies):
        print(f"[skip] {g.name}: involves p2p (--skip-p2p)", file=sys.stderr)
        return []
    workloads = [w for name in g.workloads for w in get_workloads(name)]
    base = replace(SimConfig(nodes=g.nodes).with_routing(cost_profile=PROFILE), **g.settings())
    exp = Experiment(
        workloads=workloads,
        policies=list(g.policies),
        evictions=list(g.evictions),
        qps_ladder=list(g.ladder),
        seeds=list(range(g.seeds)),
        base=base,
        limit=Limit(duration_s=g.duration_s),
        slo_p99_ttft_s=SLO_S,
        warmup_frac=0.2,
        patience=g.patience,
        jobs=jobs,
    )
    total = len(workloads) * len(g.policies) * len(g.evictions) * len(g.ladder) * g.seeds
    done = [0]
    t0 = time.perf_counter()

    def tick(n: int) -> None:
        done[0] += n
        print(f"\r[run] {g.name}: {done[0]}/{total} rungs, {time.perf_counter() - t0:.0f} s", end="",
              file=sys.stderr, flush=True)

    runs = run_experiment(exp, progress=tick)
    wall = time.perf_counter() - t0
    print(file=sys.stderr)
    for r in runs:
        r.pop("per_node", None)  # bulky; the load imbalance summarises it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"spec": g.spec(), "wall_s": round(wall, 1), "runs": runs}, default=str))
    return runs


# --- diagnostics: what the plan admits ---------------------------------------------------------------------------


def plan_diagnostics(policy: str, nodes: int, qps: float, duration_s: float, seed: int = 0) -> dict[str, Any]:
    """Warm-set size, Σk_b and encoded plan bytes of the last plan of one aggregate run (direct ``Cluster`` run)."""
    (wl,) = get_workloads(AGG)
    cfg = SimConfig(nodes=nodes, seed=seed, block_size=wl.block_size, warmup_s=0.2 * duration_s,
                    gossip_delay_s=one_hop_push_delay(DEFAULT_GOSSIP_INTERVAL_S, nodes))  # as Grid.settings()
    cfg = cfg.with_routing(policy=policy, cost_profile=PROFILE)
    cluster = Cluster(cfg)
    summary = cluster.run(wl.requests(qps, seed, cluster.space, Limit(duration_s=duration_s)))
    plan = cluster.plan
    warm = getattr(plan, "assignments", {})
    size = len(encode_plan(plan, 1 << 30)) if plan is not None else 0
    share = None
    if plan is not None and getattr(plan, "total_load", 0):
        share = sum(plan.key_load.values()) / plan.total_load
    return {"policy": policy, "qps": qps, "warm_keys": len(warm), "sum_kb": sum(len(d) for d in warm.values()),
            "plan_bytes": size, "warm_load_share": share, "kv_hit": summary["kv_hit"],
            "ttft_p99_s": summary["ttft_p99_s"]}


def reuse_ceiling(workload: str, qps: float, duration_s: float, block_size: int, seed: int = 0) -> float:
    """Token-weighted KV hit of one node with an infinite cache and no concurrency (every block ever produced stays
    cached, and a request sees the full blocks of every earlier request's prompt and output): what no policy can
    beat, measured after the same 20% warm-up as the runs."""
    (wl,) = get_workloads(workload)
    space = BlockSpace(block_size)
    seen: set[int] = set()
    hit = total = 0
    warm = 0.2 * duration_s
    for r in wl.requests(qps, seed, space, Limit(duration_s=duration_s)):
        if r.arrival >= warm:
            n = 0
            for h in r.chain[: r.n_prompt_blocks]:
                if h not in seen:
                    break
                n += 1
            hit += min(n * block_size, r.prompt_tokens - 1)
            total += r.prompt_tokens
        seen.update(r.chain[: r.n_blocks])
    return hit / total if total else float("nan")


# --- tables ----------------------------------------------------------------------------------------------------------


def _f(v: Any, d: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{d}f}" if isinstance(v, float) else str(v)


def _cap(a: dict[str, Any]) -> str:
    ci = a["capacity_ci95"]
    return f"{a['capacity_mean']:.0f}" + (f" ± {ci:.0f}" if ci else "")


def _rung(a: dict[str, Any], q: float, m: str, d: int = 3) -> str:
    v = a["ladder"].get(q, {}).get(m)
    return _f(v, d) if v is not None else "-"


def _label(p: str) -> str:
    if p in _PLAN.named and p not in _PLAN.what_ifs:
        return f"{p} (= {PLAN_POLICY})"
    return p


def table(head: list[str], rows: list[list[str]]) -> str:
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ladder_table(agg_wl: dict[str, Any], rungs: list[float]) -> tuple[str, list[dict[str, Any]]]:
    head = ["policy", "SLO capacity (QPS, 95% CI)", "per seed", "KV hit @cap", "max/mean load @cap", "p99 @cap (s)"]
    head += [f"KV hit @{q:g}" for q in rungs] + [f"p99 @{q:g}" for q in rungs]
    rows, data = [], []
    for pol, a in agg_wl.items():
        m = a["at_capacity"]
        rows.append(
            [_label(pol), _cap(a), "/".join(f"{c:g}" for c in a["capacity_per_seed"]), _f(m.get("kv_hit")),
             _f(m.get("load_imbalance"), 2), _f(m.get("ttft_p99_s"), 2)]
            + [_rung(a, q, "kv_hit") for q in rungs] + [_rung(a, q, "ttft_p99_s", 2) for q in rungs]
        )
        data.append({"policy": pol, "capacity_mean": a["capacity_mean"], "capacity_ci95": a["capacity_ci95"],
                     "capacity_per_seed": a["capacity_per_seed"], "at_capacity_qps": a["at_capacity_qps"],
                     "at_capacity": m, "ladder": a["ladder"]})
    return table(head, rows), data


def finding_ladder(title: str, runs: list[dict[str, Any]], wl: str, rungs: list[float]) -> dict[str, Any]:
    agg = aggregate(runs, SLO_S, [*BASELINES, "p2p", *CACHEROUTES, "upper-bound"]).get(wl, {})
    md, data = ladder_table(agg, rungs)
    out: dict[str, Any] = {"title": title, "table": md, "rows": data}
    if agg:
        deploy = {p: a for p, a in agg.items() if p != "upper-bound"}
        base = {p: a for p, a in deploy.items() if p in BASELINES}  # the papers' baselines: not ours (p2p)
        crs = {p: a for p, a in deploy.items() if p.startswith("cacheroute")}
        if base and crs:
            best_b = max(base, key=lambda p: base[p]["capacity_mean"])
            best_c = max(crs, key=lambda p: crs[p]["capacity_mean"])
            cb, cc = base[best_b]["capacity_mean"], crs[best_c]["capacity_mean"]
            out["best_baseline"] = {"policy": best_b, "capacity": cb}
            out["best_cacheroute"] = {"policy": best_c, "capacity": cc, "ratio": cc / cb if cb else None}
            out["summary"] = (f"strongest baseline {best_b} {cb:.0f} QPS; best cacheroute ({best_c}) {cc:.0f} QPS: "
                              f"{cc / cb:.2f}x" if cb else "")
    return out


def finding_imbalance(runs_by_wl: dict[str, list[dict[str, Any]]], rungs: dict[str, list[float]]) -> dict[str, Any]:
    pols = ["flat", "sticky", "chwbl", "p2p", "upper-bound", *CACHEROUTES]
    head = ["workload @QPS", "policy", "KV hit", "max/mean requests", "max/mean busy time", "p99 TTFT (s)",
            "SLO capacity"]
    rows, data = [], []
    for wl, runs in runs_by_wl.items():
        agg = aggregate(runs, SLO_S, pols).get(wl, {})
        for q in rungs[wl]:
            for p in pols:
                a = agg.get(p)
                if a is None:
                    continue
                m = a["ladder"].get(q)
                if m is None:
                    rows.append([f"{wl} @{q:g}", _label(p), "-", "-", "-", "(past its knee: not run)", _cap(a)])
                    continue
                rows.append([f"{wl} @{q:g}", _label(p), _f(m["kv_hit"]), _f(m["load_imbalance"], 2),
                             _f(m["work_imbalance"], 2), _f(m["ttft_p99_s"], 2), _cap(a)])
                data.append({"workload": wl, "qps": q, "policy": p, **{k: m[k] for k in (
                    "kv_hit", "load_imbalance", "work_imbalance", "ttft_p99_s")}})
    return {"title": "b. Affinity without a load bound: imbalance", "table": table(head, rows), "rows": data}


def finding_sweep(runs: list[dict[str, Any]], sc: Scale) -> dict[str, Any]:
    head = ["workload @QPS", "gossip", "p2p KV hit", "p2p p99 (s)", "p2p max/mean", "flat KV hit", "flat p99 (s)",
            "p2p est. error (tok)", "gossip B/node/s"]
    rows, data = [], []
    for wl, qs in sc.sweep_qps.items():
        for q in qs:
            for iv in (*GOSSIP_INTERVALS, "fitted", "upper-bound"):
                if iv == "upper-bound":
                    sub = [r for r in runs if r["policy"] == "upper-bound"]
                elif iv == "fitted":
                    sub = [r for r in runs if "_delay" in r]
                else:
                    sub = [r for r in runs if r.get("_interval") == iv and "_delay" not in r]
                sub = [r for r in sub if r["workload"] == wl and r["qps"] == q and not r.get("skipped")]
                if not sub:
                    continue

                def ms(pol: str, m: str, sub: list[dict[str, Any]] = sub) -> tuple[float, float]:
                    return t_interval([r[m] for r in sub if r["policy"] == pol])

                main = "upper-bound" if iv == "upper-bound" else "p2p"
                hit, hci = ms(main, "kv_hit")
                p99, pci = ms(main, "ttft_p99_s")
                imb, _ = ms(main, "load_imbalance")
                err, _ = ms(main, "est_error_tokens")
                gb, _ = ms(main, "gossip_bytes_per_node_s")
                fh, fhci = ms("flat", "kv_hit") if iv != "upper-bound" else (float("nan"), 0.0)
                fp, fpci = ms("flat", "ttft_p99_s") if iv != "upper-bound" else (float("nan"), 0.0)
                if iv == "upper-bound":
                    label = "upper-bound (exact, instant, every node)"
                elif iv == "fitted":
                    label = f"1 s rounds, delay {sub[0]['_delay']:g} s (the agent's measured lag)"
                else:
                    label = f"{iv:g} s rounds, one-hop delay ({one_hop_push_delay(iv, sc.nodes):.2f} s)"
                rows.append([f"{wl} @{q:g}", label, f"{hit:.3f} ± {hci:.3f}", f"{p99:.2f} ± {pci:.2f}", _f(imb, 2),
                             "-" if math.isnan(fh) else f"{fh:.3f} ± {fhci:.3f}",
                             "-" if math.isnan(fp) else f"{fp:.2f} ± {fpci:.2f}", _f(err, 0), _f(gb, 0)])
                data.append({"workload": wl, "qps": q, "gossip": label, "kv_hit": hit, "kv_hit_ci95": hci,
                             "ttft_p99_s": p99, "ttft_p99_ci95": pci, "load_imbalance": imb, "est_error_tokens": err,
                             "flat_kv_hit": fh, "flat_ttft_p99_s": fp})
    return {"title": "d. P2P gain vs gossip interval", "table": table(head, rows), "rows": data}


def finding_wakman(runs_by_cap: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    head = ["mix", *[f"{cap}: LRU / S3-FIFO hit, winner (margin ± CI, points)" for cap in runs_by_cap]]
    mixes: list[str] = []
    for runs in runs_by_cap.values():
        for r in runs:
            if r["workload"] not in mixes:
                mixes.append(r["workload"])
    rows, data = [], []
    wins = {cap: {"lru": 0, "s3fifo": 0, "tie": 0} for cap in runs_by_cap}
    for mix in mixes:
        row = [mix.split("/", 1)[-1]]
        for cap, runs in runs_by_cap.items():
            per = {ev: {r["seed"]: r["kv_hit"] for r in runs if r["workload"] == mix and r["eviction"] == ev}
                   for ev in ("lru", "s3fifo")}
            seeds = sorted(set(per["lru"]) & set(per["s3fifo"]))
            if not seeds:
                row.append("-")
                continue
            diffs = [100 * (per["lru"][s] - per["s3fifo"][s]) for s in seeds]
            d, ci = t_interval(diffs)
            lru = sum(per["lru"][s] for s in seeds) / len(seeds)
            s3 = sum(per["s3fifo"][s] for s in seeds) / len(seeds)
            # a winner only when the paired 95% interval excludes 0 (one seed: by sign)
            win = ("LRU" if d > 0 else "S3-FIFO") if abs(d) > ci and d != 0 else "tie"
            wins[cap]["lru" if win == "LRU" else "s3fifo" if win == "S3-FIFO" else "tie"] += 1
            row.append(f"{lru:.3f} / {s3:.3f}, {win} ({d:+.1f} ± {ci:.1f})")
            data.append({"mix": mix, "kv": cap, "lru": lru, "s3fifo": s3, "lru_minus_s3fifo_points": d,
                         "ci95": ci, "winner": win, "seeds": len(seeds)})
        rows.append(row)
    summary = "; ".join(f"{cap}: LRU {w['lru']}, S3-FIFO {w['s3fifo']}, tie {w['tie']}" for cap, w in wins.items())
    return {"title": "e. WAKMan: LRU vs S3-FIFO per mix (KV hit, p2p routing)", "table": table(head, rows),
            "rows": data, "wins": wins, "summary": summary}


def finding_fallback(ladders: dict[str, list[dict[str, Any]]], adm_runs: list[dict[str, Any]],
                     diags: list[dict[str, Any]], rungs: dict[str, list[float]]) -> dict[str, Any]:
    head = ["workload", "fallback", "SLO capacity (95% CI)", "KV hit @cap", "max/mean @cap", "p99 @cap (s)"]
    head += ["KV hit / p99 @" + "/".join(f"{q:g}" for q in rungs[AGG])]
    rows, data = [], []
    for wl, runs in ladders.items():
        agg = aggregate(runs, SLO_S, [*CACHEROUTES, "flat", "chwbl", "p2p"]).get(wl, {})
        for p in (*CACHEROUTES, "flat", "chwbl", "p2p"):
            a = agg.get(p)
            if a is None:
                continue
            m = a["at_capacity"]
            per = ", ".join(f"{_rung(a, q, 'kv_hit')} / {_rung(a, q, 'ttft_p99_s', 2)}" for q in rungs[wl])
            rows.append([wl, _label(p) if p.startswith("cacheroute") else f"({p} alone)", _cap(a),
                         _f(m.get("kv_hit")), _f(m.get("load_imbalance"), 2), _f(m.get("ttft_p99_s"), 2), per])
            data.append({"workload": wl, "policy": p, "capacity_mean": a["capacity_mean"],
                         "capacity_ci95": a["capacity_ci95"], "at_capacity": m})
    fb_md = table(head, rows)
    agg = aggregate(adm_runs, SLO_S, ()).get(AGG, {})
    ref = aggregate(ladders.get(AGG, []), SLO_S, ()).get(AGG, {})
    head2 = ["policy (fallback, top_k, min_rate)", "SLO capacity (95% CI)", "KV hit @cap", "p99 @cap (s)",
             "KV hit @" + "/".join(f"{q:g}" for q in rungs[AGG])]
    rows2 = []
    adm_rows = {**{p: a for p, a in ref.items() if p in ("cacheroute-flat", "cacheroute-p2p")}, **agg}
    for p, a in adm_rows.items():
        m = a["at_capacity"]
        name = p if "@" in p else f"{p}@k128@r0.1 (default)"
        rows2.append([name, _cap(a), _f(m.get("kv_hit")), _f(m.get("ttft_p99_s"), 2),
                      " / ".join(_rung(a, q, "kv_hit") for q in rungs[AGG])])
        data.append({"workload": AGG, "policy": name, "capacity_mean": a["capacity_mean"],
                     "capacity_ci95": a["capacity_ci95"], "at_capacity": m})
    head3 = ["policy", "QPS", "warm keys", "Σ k_b", "warm share of expected load", "plan bytes", "KV hit"]
    rows3 = [[d["policy"], f"{d['qps']:g}", str(d["warm_keys"]), str(d["sum_kb"]), _f(d["warm_load_share"]),
              str(d["plan_bytes"]), _f(d["kv_hit"])] for d in diags]
    return {"title": "f. CacheRoute fallback and admission", "table": fb_md + "\n\n" + table(head2, rows2)
            + "\n\n" + table(head3, rows3), "rows": data, "plan_diagnostics": diags}


# --- main ------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a minutes-long smoke version")
    ap.add_argument("--json", action="store_true", help="also write OUT/findings.json (every table's numbers)")
    ap.add_argument("--out", type=Path, default=Path("results/findings"), help="output directory")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="abcdef", help="findings to produce, by letter (default: all)")
    ap.add_argument("--reuse", action="store_true", help="load grids already run with the same spec")
    ap.add_argument("--skip-p2p", action="store_true",
                    help="do not run grids whose policies involve p2p (p2p, upper-bound, cacheroute-p2p)")
    args = ap.parse_args(argv)
    sc = QUICK if args.quick else FULL
    all_grids = grids(sc)
    wanted = [c for c in args.only if c in NEEDS]
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    for tag in dict.fromkeys(t for c in wanted for t in NEEDS[c]):
        rs: list[dict[str, Any]] = []
        for g in all_grids[tag]:
            got = run_grid(g, args.out, args.jobs, args.reuse, args.skip_p2p)
            for r in got:
                r["_grid"] = g.name
                if "gossip_interval_s" in g.sim:
                    r["_interval"] = g.sim["gossip_interval_s"]
                if "gossip_delay_s" in g.sim:
                    r["_delay"] = g.sim["gossip_delay_s"]
                if "kv_capacity_tokens" in g.sim:
                    r["_kv"] = g.sim["kv_capacity_tokens"]
            rs += got
        runs[tag] = rs
    lo, hi = sc.ladder[1], sc.ladder[min(len(sc.ladder) - 1, 5)]
    lr = sc.low_ladder
    rungs = {AGG: [sc.ladder[0], lo, hi], WHALES: [sc.ladder[0], lo, hi], LOW: [lr[1], lr[3], lr[5]]}
    findings: dict[str, Any] = {}
    ceilings: dict[str, dict[float, float]] = {}
    for c, wl in (("a", AGG), ("b", WHALES), ("c", LOW)):
        if c in wanted:
            dur = sc.duration_s if wl == AGG else sc.short_duration_s
            bs = get_workloads(wl)[0].block_size
            ceilings[wl] = {q: reuse_ceiling(wl, q, dur, bs) for q in rungs[wl]}
    if "a" in wanted:
        findings["a"] = finding_ladder("a. CacheRoute aggregate", runs["agg"], AGG, rungs[AGG])
    if "a" in wanted:
        kl = sc.knee_ladder
        findings["a2"] = finding_ladder("a'. CacheRoute aggregate: the leading policies' knee at a finer step",
                                        runs["knee"], AGG, [kl[1], kl[3], kl[5]])
    if "b" in wanted:
        findings["b"] = finding_imbalance({AGG: runs["agg"], WHALES: runs["whales"]},
                                          {AGG: [lo, hi], WHALES: [lo, hi]})
    if "c" in wanted:
        findings["c"] = finding_ladder("c. low-reuse", runs["low"], LOW, rungs[LOW])
    if "d" in wanted:
        findings["d"] = finding_sweep(runs["sweep"], sc)
    if "e" in wanted:
        w = runs["wakman"]
        findings["e"] = finding_wakman({"default KV": [r for r in w if "_kv" not in r],
                                        "100k-token KV": [r for r in w if "_kv" in r]})
    if "f" in wanted:
        diags = []
        dq = sc.sweep_qps[AGG][0]
        for k, r in ADMISSION:
            diags.append(plan_diagnostics(f"cacheroute-flat@k{k}@r{r:g}", sc.nodes, dq, sc.duration_s))
        findings["f"] = finding_fallback({AGG: runs["agg"], WHALES: runs["whales"], LOW: runs["low"]},
                                         runs["admission"], diags, rungs)
    for wl, cs in ceilings.items():
        line = ", ".join(f"{q:g} QPS: {v:.3f}" for q, v in cs.items())
        findings.setdefault("ceilings", {"title": "Reuse ceilings (one node, infinite cache)", "table": ""})
        findings["ceilings"]["table"] += f"- {wl}: {line}\n"
        findings["ceilings"][wl] = cs
    text: list[str] = []
    for _c, f in findings.items():
        text.append(f"\n## {f['title']}\n")
        if f.get("summary"):
            text.append(f["summary"] + "\n")
        text.append(f["table"])
    cmds = {g.name: g.command() for tag in runs for g in all_grids[tag]}
    text.append("\n## Commands (one per grid)\n")
    text += [f"- {name}: `{cmd}`" for name, cmd in cmds.items()]
    print("\n".join(text))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "findings.md").write_text("\n".join(text) + "\n")
    wall = time.perf_counter() - t0
    print(f"\n{'quick' if args.quick else 'full'} scale, {wall:.0f} s wall", file=sys.stderr)
    if args.json:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"scale": asdict(sc), "slo_p99_ttft_s": SLO_S, "profile": PROFILE, "default_fallback": DEFAULT_FALLBACK,
               "commands": cmds, "findings": findings, "wall_s": round(wall, 1)}
        (args.out / "findings.json").write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {args.out / 'findings.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
