#!/usr/bin/env python3
"""KV tiers in the simulator: a host-memory tier under every node's engine, routed by where each prefix is.

Everything is ``bench_routing.py``'s (16 nodes, Llama-3.1-8B on H100, each production shape's SLO and run length,
gossip at the agent's measured lag, LRU in the engine, 3 seeds) and the simulator's runner; the tiers are the
simulator's model of vLLM's offloading (``engine/simulated/tiers.py``), loading at the profile's host-to-device rate
(PCIe Gen5 x16, ~50 GB/s achieved: ``cost/profiles.py``), every node's whatever the policy.

**targets** (``--section targets``), per production shape, at a quarter of the profile's KV per node:
- the default policy without a tier, with a host tier of ``--tier-multiple`` (4) times that KV per node, and every
  baseline with the same tier: SLO capacity up a 1-QPS ladder on the chats (5 QPS on ``tool-agent``), and the KV hit
  at the reference rate (``kv_pull_opportunity.RATES_16``: the default's capacity there without a tier), split by tier;
- the free tier oracle (``kv_pull_opportunity.py --oracle tier4``: one pooled LRU tier of 4x the mesh's KV, every
  finished request stored in it, loaded free and at once at the request's target): its capacity and its hit at the
  same rate, the same seeds;
- at the full KV (the working set fits), the default without and with the same tier (in tokens): capacity up
  ``bench_routing.py``'s ladder, hit at its lowest rung.
The checks under each table: hit >= 0.9 of the oracle's; on the chats, capacity >= the oracle's minus one rung; on
``tool-agent``, >= 1.3x its own without a tier; at the full KV, not a rung lower and the hit within 1 point of no tier;
the default with the tier >= every baseline with it.

**grid** (``--section grid``): the default at the reference rate at a quarter of the KV, host tiers of 0 / 1x / 4x /
16x that KV per node x KV pulls at 0 / 10 / 100 Gb/s: KV hit split by tier (gpu, host, disk, pulled), bytes stored to
and loaded from the tiers and pulled per request, p99 TTFT.

    python scripts/bench_kv_tier.py --jobs 2 --json-out kv_tier.json    # both sections (hours on 2 cores)
    python scripts/bench_kv_tier.py --quick                             # 8 nodes, short runs, 2 seeds: a smoke test
    python scripts/bench_kv_tier.py --section grid --only platform-chat --seeds 1
    python scripts/bench_kv_tier.py --section targets --seeds 2 --ladder platform-chat=12:20:1 \
        --full-ladder platform-chat=16:26:2                             # fewer rungs: a ladder per workload
    python scripts/bench_kv_tier.py --from-json kv_tier.json            # the tables again, no runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_routing as br  # its own import puts the repo on sys.path
import kv_pull_opportunity as kpo

from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.sim.report import seed_capacity, t_interval

#: The production shapes.
WORKLOADS = ("platform-chat", "platform-chat-long", "tool-agent")
#: KV per node in the targets and the grid, as a fraction of the profile's.
KV_FRACTION = 0.25
#: The host tier per node, in multiples of that KV (the targets'), and the grid's multiples and link figures.
TIER_MULTIPLE = 4.0
GRID_MULTIPLES = (0.0, 1.0, 4.0, 16.0)
GRID_LINKS = (0.0, 10.0, 100.0)
#: The quarter-KV ladders (START, STOP, STEP): 1 QPS on the chats, as the targets are stated; 5 on tool-agent.
LADDERS = {"platform-chat": (10, 24, 1), "platform-chat-long": (8, 22, 1), "tool-agent": (30, 120, 5)}
#: The oracle the targets compare with (``kv_pull_opportunity.ORACLES``).
ORACLE = "tier4"
HIT_OF_ORACLE, TOOL_AGENT_GAIN, FULL_KV_HIT_POINTS = 0.9, 1.3, 0.01


def ladder(start: float, stop: float, step: float) -> tuple[float, ...]:
    return tuple(round(start + i * step, 6) for i in range(round((stop - start) / step) + 1))


def quarter_case(workload: str, quick: bool, rungs: tuple[float, ...] | None = None) -> br.Case:
    """The quarter-KV case; ``rungs``: a ladder of its own instead of ``LADDERS``' (``--ladder``)."""
    base = next(c for c in br.CASES if c.workload == workload)
    case = replace(base, ladder=ladder(*LADDERS[workload]))
    if quick:
        case = replace(case, ladder=tuple(q / 2 for q in case.ladder), duration_s=case.duration_s / 10)
    return replace(case, ladder=rungs) if rungs else case


def full_case(workload: str, quick: bool, rungs: tuple[float, ...] | None = None) -> br.Case:
    """The full-KV case (``bench_routing.py``'s); ``rungs``: a ladder of its own (``--full-ladder``)."""
    base = next(c for c in br.CASES if c.workload == workload)
    case = br.quick(base) if quick else base
    return replace(case, ladder=rungs) if rungs else case


def parse_ladders(specs: list[str] | None, flag: str) -> dict[str, tuple[float, ...]]:
    """``WORKLOAD=START:STOP:STEP`` per workload, as ``--ladder`` and ``--full-ladder`` take them."""
    out = {}
    for spec in specs or ():
        workload, sep, rungs = spec.partition("=")
        parts = rungs.split(":")
        if not sep or workload not in WORKLOADS or len(parts) != 3:
            raise SystemExit(f"{flag}: WORKLOAD=START:STOP:STEP, a workload of {', '.join(WORKLOADS)}; got {spec!r}")
        out[workload] = ladder(*(float(x) for x in parts))
    return out


def reference_rate(workload: str, nodes: int) -> float:
    return kpo.RATES_16[workload] * nodes / 16


def tier_tokens(multiple: float, kv_fraction: float = KV_FRACTION) -> int:
    """Host tier tokens per node: ``multiple`` x the KV at ``kv_fraction`` of the profile's."""
    return round(multiple * br.kv_capacity_tokens(kv_fraction))


# --- the oracle: kv_pull_opportunity's, up the same ladder ----------------------------------------------------------


def _oracle_series(workload: str, ladder_: tuple[float, ...], slo_s: float, seed: int, nodes: int,
                   duration_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """One seed of the oracle up the ladder until ``kpo.PATIENCE`` rungs in a row miss (kpo.capacity's rule)."""
    runs, streak = [], 0
    for q in ladder_:
        row = kpo.run(workload, q, nodes, seed, KV_FRACTION, 0.0, duration_s, DEFAULT_ROUTING_POLICY, ORACLE)
        met = row["ttft_p99_s"] <= slo_s
        runs.append({"qps": q, "seed": seed, "slo_met": met, "kv_hit": row["kv_hit"], "p99_ttft_s": row["ttft_p99_s"],
                     "pulled_frac": row["pulled"]})  # fmt: skip
        streak = 0 if met else streak + 1
        if streak >= kpo.PATIENCE:
            break
    return runs


def oracle(case: br.Case, seeds: int, nodes: int, jobs: int) -> dict[str, Any]:
    args = [(case.workload, case.ladder, case.slo_s, s, nodes, case.duration_s) for s in range(seeds)]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            series = list(pool.map(_oracle_series, *zip(*args, strict=True)))
    else:
        series = [_oracle_series(*a) for a in args]
    caps = [seed_capacity(runs)[0] for runs in series]
    by_qps: dict[str, list[dict[str, Any]]] = {}
    for runs in series:
        for r in runs:
            by_qps.setdefault(f"{r['qps']:g}", []).append(r)
    mean, ci = t_interval(caps)
    return {"capacity_per_seed": caps, "capacity_mean": mean, "capacity_ci95": ci, "by_qps": {
        q: {"kv_hit": sum(r["kv_hit"] for r in rs) / len(rs), "p99_ttft_s": max(r["p99_ttft_s"] for r in rs),
            "seeds": len(rs)} for q, rs in by_qps.items()}}  # fmt: skip


# --- the targets --------------------------------------------------------------------------------------------------


def _row(result: dict[str, Any], policy: str) -> dict[str, Any]:
    return next(r for r in result["rows"] if r["policy"] == policy)


def _at(row: dict[str, Any], qps: float) -> dict[str, Any]:
    return row["by_qps"].get(f"{qps:g}", {})


def targets(workload: str, args: argparse.Namespace, nodes: int, seeds: int) -> dict[str, Any]:
    """Every run of the targets for one workload (module docstring) and the checks on them."""
    t0 = time.perf_counter()
    case = quarter_case(workload, args.quick, args.ladders.get(workload))
    full = full_case(workload, args.quick, args.full_ladders.get(workload))
    tier = {"host_kv_tokens": tier_tokens(args.tier_multiple)}
    policies = [DEFAULT_ROUTING_POLICY, *([] if args.no_baselines else args.baselines)]
    run = br.run_case
    out = {
        "workload": workload, "slo_p99_ttft_s": case.slo_s, "reference_qps": reference_rate(workload, nodes),
        "ladder": list(case.ladder), "full_ladder": list(full.ladder), "nodes": nodes, "seeds": seeds,
        "kv_capacity_tokens": br.kv_capacity_tokens(KV_FRACTION), "host_kv_tokens": tier["host_kv_tokens"],
        "link_gbps": args.link,
        "no_tier": run(case, [DEFAULT_ROUTING_POLICY], seeds, nodes, args.jobs, kv_fraction=KV_FRACTION,
                       kv_link_gbps=args.link),
        "tier": run(case, policies, seeds, nodes, args.jobs, kv_fraction=KV_FRACTION, kv_link_gbps=args.link,
                    sim=tier),
        "oracle": oracle(case, seeds, nodes, args.jobs),
        "full_no_tier": run(full, [DEFAULT_ROUTING_POLICY], seeds, nodes, args.jobs, kv_link_gbps=args.link),
        "full_tier": run(full, [DEFAULT_ROUTING_POLICY], seeds, nodes, args.jobs, kv_link_gbps=args.link, sim=tier),
    }  # fmt: skip
    out["checks"] = checks(out)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def checks(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each with its figures and whether it is met."""
    me = DEFAULT_ROUTING_POLICY
    ref, step = res["reference_qps"], res["ladder"][1] - res["ladder"][0]
    tiered, plain, orc = _row(res["tier"], me), _row(res["no_tier"], me), res["oracle"]
    hit, orc_hit = _at(tiered, ref).get("kv_hit"), orc["by_qps"].get(f"{ref:g}", {}).get("kv_hit")
    out = []
    if hit is not None and orc_hit:
        out.append({"check": f"KV hit at {ref:g} QPS >= {HIT_OF_ORACLE:g} of the free tier oracle's",
                    "figure": f"{hit:.3f} / {orc_hit:.3f} = {hit / orc_hit:.2f}",
                    "met": hit >= HIT_OF_ORACLE * orc_hit})
    cap, cap_plain, cap_orc = tiered["capacity_mean"], plain["capacity_mean"], orc["capacity_mean"]
    if res["workload"] == "tool-agent":
        out.append({"check": f"SLO capacity >= {TOOL_AGENT_GAIN:g}x its own without a tier",
                    "figure": f"{cap:.1f} / {cap_plain:.1f} = {cap / max(cap_plain, 1e-9):.2f}x",
                    "met": cap >= TOOL_AGENT_GAIN * cap_plain})
    else:
        out.append({"check": f"SLO capacity >= the oracle's minus one rung ({step:g} QPS)",
                    "figure": f"{cap:.1f} against {cap_orc:.1f}", "met": cap >= cap_orc - step - 1e-9})
    full, full_plain = _row(res["full_tier"], me), _row(res["full_no_tier"], me)
    full_step = res["full_ladder"][1] - res["full_ladder"][0]
    out.append({"check": "full KV: SLO capacity not a rung lower than without a tier",
                "figure": f"{full['capacity_mean']:.1f} against {full_plain['capacity_mean']:.1f}",
                "met": full["capacity_mean"] >= full_plain["capacity_mean"] - full_step + 1e-9})
    low_t, low_p = full.get("kv_hit_lowest"), full_plain.get("kv_hit_lowest")
    if low_t is not None and low_p is not None:
        out.append({"check": "full KV: KV hit within 1 point of no tier (lowest rung)",
                    "figure": f"{low_t:.3f} against {low_p:.3f}", "met": low_t >= low_p - FULL_KV_HIT_POINTS})
    rivals = [r for r in res["tier"]["rows"] if r["policy"] in br.BASELINES]
    if rivals:
        best = max(rivals, key=lambda r: r["capacity_mean"])
        out.append({"check": "with the tier: the default's SLO capacity >= every baseline's with it",
                    "figure": f"{cap:.1f} against {best['policy']} {best['capacity_mean']:.1f}",
                    "met": cap >= best["capacity_mean"] - 1e-9})
    return out  # fmt: skip


def _capacity(mean: float | None, ci: float, censored: bool = False, infeasible: bool = False) -> str:
    """A capacity to one decimal (a 1-QPS ladder's means fall between rungs), '>=' when no rung missed."""
    if mean is None:
        return "-"
    if infeasible:
        return "0 (infeasible)"
    return f"{'>= ' if censored else ''}{mean:.1f}" + (f" ± {ci:.1f}" if ci else "")


def _split(m: dict[str, Any]) -> str:
    if "kv_hit_host" not in m:
        return "-"
    return (f"{m['kv_hit_gpu']:.3f} / {m['kv_hit_host']:.3f} / {m['kv_hit_disk']:.3f} / "
            f"{m.get('pulled_frac', 0.0):.3f}")  # fmt: skip


def targets_table(res: dict[str, Any]) -> str:
    ref = res["reference_qps"]
    lines = [
        f"### {res['workload']} (p99 TTFT <= {res['slo_p99_ttft_s']:g} s; {res['nodes']} nodes, {res['seeds']} "
        f"seeds; {res['kv_capacity_tokens']:,} KV tokens per node, host tier {res['host_kv_tokens']:,} tokens"
        + (f"; KV pulls at {res['link_gbps']:g} Gb/s" if res["link_gbps"] else "") + ")",
        "",
        f"| run | SLO capacity (QPS) | KV hit at {ref:g} QPS | of it gpu / host / disk / pulled | p99 TTFT at "
        f"{ref:g} QPS (s) |",
        "|---|---:|---:|---|---:|",
    ]
    me = DEFAULT_ROUTING_POLICY

    def line(label: str, row: dict[str, Any]) -> str:
        m = _at(row, ref)
        hit, p99 = m.get("kv_hit"), m.get("p99_ttft_s")
        cap = _capacity(row["capacity_mean"], row["capacity_ci95"], row["censored"], row["infeasible"])
        return f"| {label} | {cap} | {br._num(hit, '.3f')} | {_split(m)} | {br._num(p99, '.2f')} |"

    lines.append(line(f"{me}, no tier", _row(res["no_tier"], me)))
    for r in res["tier"]["rows"]:
        lines.append(line(f"{r['policy']}, tier", r))
    orc = res["oracle"]
    cap = _capacity(orc["capacity_mean"], orc["capacity_ci95"])
    om = orc["by_qps"].get(f"{ref:g}", {})
    lines.append(f"| oracle {ORACLE} (free, pooled) | {cap} | {br._num(om.get('kv_hit'), '.3f')} | - "
                 f"| {br._num(om.get('p99_ttft_s'), '.2f')} |")  # fmt: skip
    low = res["full_ladder"][0]
    for label, key in (("no tier", "full_no_tier"), ("tier", "full_tier")):
        r = _row(res[key], me)
        cap = _capacity(r["capacity_mean"], r["capacity_ci95"], r["censored"], r["infeasible"])
        lines.append(f"| full KV, {me}, {label} | {cap} | {br._num(r.get('kv_hit_lowest'), '.3f')} at "
                     f"{low:g} QPS | {_split(_at(r, low))} | - |")  # fmt: skip
    lines.append("")
    for c in res["checks"]:
        lines.append(f"- {c['check']}: {c['figure']} -- {'met' if c['met'] else 'NOT MET'}")
    return "\n".join(lines) + "\n"


# --- the grid ------------------------------------------------------------------------------------------------------


def grid(workload: str, args: argparse.Namespace, nodes: int, seeds: int) -> dict[str, Any]:
    """The default at the reference rate over tier sizes x link figures (module docstring)."""
    t0 = time.perf_counter()
    case = quarter_case(workload, args.quick, args.ladders.get(workload))
    q = reference_rate(workload, nodes)
    cells = []
    for multiple in GRID_MULTIPLES:
        for link in GRID_LINKS:
            sim = {"host_kv_tokens": tier_tokens(multiple)} if multiple else None
            res = br.run_case(replace(case, ladder=(q,)), [DEFAULT_ROUTING_POLICY], seeds, nodes, args.jobs,
                              kv_fraction=KV_FRACTION, kv_link_gbps=link, sim=sim)  # fmt: skip
            row = res["rows"][0]
            m = _at(row, q)
            cells.append({"tier_multiple": multiple, "link_gbps": link, "kv_hit": m.get("kv_hit"),
                          "p99_ttft_s": m.get("p99_ttft_s"), "pulled_frac": row.get("pulled_frac"),
                          "pull_bytes_per_req": row.get("pull_bytes_per_req"),
                          **{k: row.get(k) for k in br.TIER_FIELDS}})  # fmt: skip
    return {"workload": workload, "qps": q, "nodes": nodes, "seeds": seeds, "cells": cells,
            "kv_capacity_tokens": br.kv_capacity_tokens(KV_FRACTION), "wall_s": round(time.perf_counter() - t0, 1)}


def grid_table(res: dict[str, Any]) -> str:
    lines = [
        f"### {res['workload']} at {res['qps']:g} QPS ({res['nodes']} nodes, {res['seeds']} seeds, "
        f"{res['kv_capacity_tokens']:,} KV tokens per node)",
        "",
        "| host tier (x KV) | link (Gb/s) | KV hit | gpu | host | pulled | MB stored / req | MB loaded / req "
        "| MB pulled / req | tier load mean (ms) | p99 TTFT (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        tiered = c.get("kv_hit_host") is not None
        gpu = c["kv_hit_gpu"] if tiered else c["kv_hit"] - (c.get("pulled_frac") or 0.0)

        def mb(v: float | None) -> str:
            return "-" if v is None else f"{v / 1e6:,.0f}"

        lines.append(
            f"| {c['tier_multiple']:g} | {c['link_gbps']:g} | {br._num(c['kv_hit'], '.3f')} | {gpu:.3f} "
            f"| {br._num(c.get('kv_hit_host'), '.3f')} | {br._num(c.get('pulled_frac'), '.3f')} "
            f"| {mb(c.get('tier_host_store_bytes_per_req'))} | {mb(c.get('tier_host_load_bytes_per_req'))} "
            f"| {mb(c.get('pull_bytes_per_req'))} "
            f"| {br._num(c['tier_load_s_mean'] * 1e3 if tiered else None, '.1f')} "
            f"| {br._num(c['p99_ttft_s'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("targets", "grid", "all"), default="all")
    parser.add_argument("--only", help=f"comma list of workloads (default: {', '.join(WORKLOADS)})")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (default %(default)s)")
    parser.add_argument("--tier-multiple", type=float, default=TIER_MULTIPLE,
                        help="the targets' host tier per node, x the quarter KV (default %(default)s)")
    parser.add_argument("--link", type=float, default=0.0, help="the targets' KV pulls, Gb/s (default 0: none)")
    parser.add_argument("--no-baselines", action="store_true", help="targets without the baselines' runs")
    parser.add_argument("--baselines", default=",".join(br.BASELINES),
                        help="comma list: the baselines the targets run (default: every one)")
    parser.add_argument("--ladder", action="append", metavar="WORKLOAD=START:STOP:STEP",
                        help="a quarter-KV ladder instead of the default (LADDERS); it must hold the reference rate")
    parser.add_argument("--full-ladder", action="append", metavar="WORKLOAD=START:STOP:STEP",
                        help="a full-KV ladder instead of bench_routing.py's")
    parser.add_argument("--quick", action="store_true", help="8 nodes, short runs, 2 seeds: a smoke test")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--json-out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--from-json", type=Path, help="print the tables of a saved --json-out file (no runs)")
    args = parser.parse_args()
    args.ladders = parse_ladders(args.ladder, "--ladder")
    args.baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if any(b not in br.BASELINES for b in args.baselines):
        parser.error(f"--baselines: of {', '.join(br.BASELINES)}")
    args.full_ladders = parse_ladders(args.full_ladder, "--full-ladder")
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for res in saved.get("targets", []):
            res["checks"] = checks(res)
            print(targets_table(res))
        for res in saved.get("grid", []):
            print(grid_table(res))
        return 0
    wanted = [w.strip() for w in (args.only or ",".join(WORKLOADS)).split(",") if w.strip()]
    if any(w not in WORKLOADS for w in wanted):
        parser.error(f"--only: one of {', '.join(WORKLOADS)}")
    nodes, seeds = (8, 2) if args.quick else (args.nodes, args.seeds)
    for w in wanted:  # the hit targets are read at the reference rate
        if reference_rate(w, nodes) not in quarter_case(w, args.quick, args.ladders.get(w)).ladder:
            parser.error(f"--ladder: {w}'s must hold its reference rate, {reference_rate(w, nodes):g} QPS")
    report: dict[str, Any] = {"profile": br.PROFILE, "kv_fraction": KV_FRACTION, "targets": [], "grid": []}
    for w in wanted:
        if args.section in ("targets", "all"):
            res = targets(w, args, nodes, seeds)
            report["targets"].append(res)
            if not args.json:
                print(targets_table(res), flush=True)
        if args.section in ("grid", "all"):
            res = grid(w, args, nodes, seeds)
            report["grid"].append(res)
            if not args.json:
                print(grid_table(res), flush=True)
        if args.json_out:  # after each workload, so a long run that is stopped keeps what it finished
            args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    text = json.dumps(report, indent=1)
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
