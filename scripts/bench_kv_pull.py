#!/usr/bin/env python3
"""KV pulls in the simulator: the default policy moving cached prefixes between nodes at several link figures,
against every baseline, on the production shapes, at the default KV cache per node and at a quarter of it.

For each workload and KV size: every baseline once (they never pull -- no ``Decision.pull`` -- so the link figure
changes nothing for them, which ``tests/unit/test_sim_pulls.py`` checks), and the default policy at each link figure
(0: no pulls). Everything else is ``bench_routing.py``'s (16 nodes, Llama-3.1-8B on H100, the workload's ladder, SLO
and run length, gossip at the agent's measured lag, 3 seeds). The table gives each row's SLO capacity (mean ± 95%
interval over seeds) and, at that rung, the KV hit split into tokens the serving node held and tokens it pulled,
p99 TTFT, bytes moved per request, pulls per request (and the share that moved nothing: the holder had evicted
the blocks), the p99 wait for a holder's link, and the share of every node's KV cache held by running requests (not
evictable) and of the time nodes had a queue: what bounds a mesh whose KV is short. The lines under it say whether
the targets are met: at a quarter of the KV and 100 Gb/s, the default >= 1.3x the best baseline and >= 1.2x itself
without pulls; at 10 Gb/s, never below itself without pulls.

    python scripts/bench_kv_pull.py --json-out kv_pull.json   # the whole grid (hours on 2 cores: --jobs 1)
    python scripts/bench_kv_pull.py --quick                   # 8 nodes, short runs, 2 seeds: a smoke test
    python scripts/bench_kv_pull.py --only tool-agent --kv-fractions 0.25 --links 0,100
    python scripts/bench_kv_pull.py --policy p2p@f1 --baselines ''   # a what-if of the default rule, no baselines
    python scripts/bench_kv_pull.py --from-json kv_pull.json  # the tables again, no runs

Link figures: 10 Gb/s is a 10 GbE LAN, what gRPC over TCP sustains between hosts; 100 and 400 Gb/s are what-ifs
that need RDMA (GPUDirect, NIXL), not the node's gRPC transport.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_routing as br  # its own import puts the repo on sys.path

from p2pnode.config import DEFAULT_ROUTING_POLICY

#: The production shapes (``p2pnode/sim/workloads/production.py``): long prompts whose prefixes are worth moving.
WORKLOADS = ("platform-chat", "platform-chat-long", "tool-agent")
#: Link figures, Gb/s (0: no pulls).
LINKS = (0.0, 10.0, 100.0, 400.0)
#: KV cache per node, as fractions of the profile's.
KV_FRACTIONS = (1.0, 0.25)
#: A link this fast or faster needs RDMA: gRPC over TCP does not sustain it (a what-if).
RDMA_GBPS = 100.0
#: The targets: at ``TARGET_FRACTION`` of the KV and ``TARGET_GBPS``, the default's capacity against the best
#: baseline's and against its own without pulls; at ``SLOW_GBPS`` it is never below its own without pulls.
TARGET_FRACTION, TARGET_GBPS, SLOW_GBPS = 0.25, 100.0, 10.0
TARGET_VS_BASELINE, TARGET_VS_NO_PULLS = 1.3, 1.2


def link_label(policy: str, gbps: float) -> str:
    if not gbps:
        return f"{policy}, no pulls"
    return f"{policy}, {gbps:g} Gb/s" + (" (what-if: RDMA)" if gbps >= RDMA_GBPS else "")


def run_grid_case(
    case: br.Case, fraction: float, policy: str, links: list[float], baselines: list[str], seeds: int, nodes: int,
    jobs: int,
) -> dict[str, Any]:
    """One workload at one KV size: the baselines once, ``policy`` at every link figure."""
    t0 = time.perf_counter()
    base = br.run_case(case, baselines, seeds, nodes, jobs, kv_fraction=fraction) if baselines else None
    mine = {f"{g:g}": br.run_case(case, [policy], seeds, nodes, jobs, kv_link_gbps=g, kv_fraction=fraction)
            for g in links}  # fmt: skip
    out = {
        "workload": case.workload, "kv_fraction": fraction, "kv_capacity_tokens": br.kv_capacity_tokens(fraction),
        "slo_p99_ttft_s": case.slo_s, "ladder": list(case.ladder), "duration_s": case.duration_s, "seeds": seeds,
        "nodes": nodes, "policy": policy, "baselines": base, "by_link": mine,
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    out["targets"] = targets(out)
    return out


def _rows(result: dict[str, Any]) -> list[tuple[str, float, dict[str, Any]]]:
    """(label, link, row) for the default at each link, then the baselines."""
    rows = [(link_label(result["policy"], float(g)), float(g), r["rows"][0]) for g, r in result["by_link"].items()]
    if result["baselines"]:
        rows += [(r["policy"], 0.0, r) for r in result["baselines"]["rows"]]
    return rows


def _cap(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row["capacity_mean"]


def targets(result: dict[str, Any]) -> list[str]:
    """The target lines (module docstring) this workload and KV size can judge."""
    lines = []
    by_link = {float(g): r["rows"][0] for g, r in result["by_link"].items()}
    none = by_link.get(0.0)
    best = None
    if result["baselines"]:
        rivals = [r for r in result["baselines"]["rows"] if r["policy"] in br.BASELINES]
        best = max(rivals, key=lambda r: r["capacity_mean"]) if rivals else None
    quarter = abs(result["kv_fraction"] - TARGET_FRACTION) < 1e-9
    for gbps, row in sorted(by_link.items()):
        if not gbps or none is None:
            continue
        mine, own = _cap(row), _cap(none)
        parts = [f"{link_label(result['policy'], gbps)}: {row['capacity']} QPS"]
        if own:
            verdict = ""
            if gbps == SLOW_GBPS:
                verdict = "; target: never below it: " + ("met" if mine >= own else "NOT met")
            elif quarter and gbps == TARGET_GBPS:
                verdict = f"; target >= {TARGET_VS_NO_PULLS:g}x: " + (
                    "met" if mine >= TARGET_VS_NO_PULLS * own else "NOT met")
            parts.append(f"{mine / own:.2f}x itself without pulls ({none['capacity']}){verdict}")
        if best is not None and best["capacity_mean"]:
            verdict = ""
            if quarter and gbps == TARGET_GBPS:
                verdict = f"; target >= {TARGET_VS_BASELINE:g}x: " + (
                    "met" if mine >= TARGET_VS_BASELINE * best["capacity_mean"] else "NOT met")
            parts.append(f"{mine / best['capacity_mean']:.2f}x the best baseline ({best['policy']} "
                         f"{best['capacity']}){verdict}")  # fmt: skip
        lines.append(", ".join(parts))
    return lines


def _num(v: Any, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v / scale, fmt)


def table(result: dict[str, Any]) -> str:
    kv = result["kv_capacity_tokens"]
    lines = [
        f"### {result['workload']}, {kv:,} KV tokens per node ({result['kv_fraction']:g} of the profile's; p99 TTFT "
        f"<= {result['slo_p99_ttft_s']:g} s; {result['nodes']} nodes, {result['seeds']} seeds, "
        f"{result['duration_s']:g} s per run)",
        "",
        "| policy | SLO capacity (QPS) | at QPS | KV hit (local / pulled) | p99 TTFT (s) | MB moved / request "
        "| pulls / request (failed) | link wait p99 (s) | KV running / time queued |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, _gbps, r in _rows(result):
        hit = "-"
        if r.get("kv_hit") is not None:
            local = r.get("kv_hit_local", r["kv_hit"])
            hit = f"{r['kv_hit']:.3f} ({local:.3f} / {r.get('pulled_frac') or 0.0:.3f})"
        pulls, failed = r.get("pulls_per_req") or 0.0, r.get("pulls_failed_frac") or 0.0
        lines.append(
            f"| {label} | {r['capacity']} | {_num(r['at_qps'], 'g')} | {hit} | {_num(r['p99_ttft_s'], '.2f')} "
            f"| {_num(r.get('pull_bytes_per_req') or 0.0, '.1f', 1e6)} "
            f"| {pulls:.3f} ({failed:.2f}) | {_num(r.get('pull_wait_p99_s') or 0.0, '.2f')} "
            f"| {_num(r.get('kv_running_frac'), '.2f')} / {_num(r.get('waiting_frac'), '.2f')} |"
        )
    lines += ["", *result["targets"], ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma list of workloads (default: {', '.join(WORKLOADS)})")
    parser.add_argument("--links", default=",".join(f"{g:g}" for g in LINKS), help="comma list of Gb/s (0: none)")
    parser.add_argument("--kv-fractions", default=",".join(f"{f:g}" for f in KV_FRACTIONS),
                        help="comma list of KV cache sizes per node, as fractions of the profile's")  # fmt: skip
    parser.add_argument("--policy", default=DEFAULT_ROUTING_POLICY, help="the policy run at every link figure")
    parser.add_argument("--baselines", default=",".join(br.BASELINES), help="comma list ('' for none)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="8 nodes, short runs, 2 seeds: a smoke test")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--json-out", type=Path, help="also write the JSON object to this file (after every case)")
    parser.add_argument("--from-json", type=Path, help="print the tables of a saved --json-out file (no runs)")
    args = parser.parse_args()
    if args.from_json:
        for result in json.loads(args.from_json.read_text())["cases"]:
            print(table(result))
        return 0
    wanted = [w.strip() for w in (args.only or ",".join(WORKLOADS)).split(",") if w.strip()]
    cases = [c for c in br.CASES if c.workload in wanted]
    if len(cases) != len(wanted):
        parser.error(f"--only: valid workloads are {', '.join(c.workload for c in br.CASES)}")
    links = [float(g) for g in args.links.split(",") if g.strip()]
    fractions = [float(f) for f in args.kv_fractions.split(",") if f.strip()]
    if any(g < 0 for g in links) or any(not 0 < f <= 1 for f in fractions):
        parser.error("--links must be >= 0 and --kv-fractions in (0, 1]")
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    nodes, seeds = args.nodes, args.seeds
    if args.quick:
        cases, nodes, seeds = [br.quick(c) for c in cases], 8, 2
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for case in cases:
        for fraction in fractions:
            result = run_grid_case(
                replace(case), fraction, args.policy, links, baselines, seeds, nodes, args.jobs
            )
            results.append(result)
            report = {"profile": br.PROFILE, "links": links, "kv_fractions": fractions, "cases": results,
                      "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
            if args.json_out:
                args.json_out.write_text(json.dumps(report, indent=1) + "\n")
            if not args.json:
                print(table(result), flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
