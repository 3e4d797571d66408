#!/usr/bin/env python3
"""Several ingresses, one cache: the hit and SLO capacity when clients send to 1, 2, 4, ... N of the mesh's nodes.

Every node of a p2pnode mesh is an ingress with its own router and no shared index: each routes with gossip's picture
of the others and the exact picture of itself. One ingress is the best case a central router has (one router that
sees every request it sent); N ingresses is the mesh's claim. SGLang's gateway measured 8 independent gateways at 0.66
of one shared index's hit rate. This runs the same workload, seeds and ladder through 1, 2, 4, ... N ingresses
(``p2pnode sim --ingresses K``; clients pick one of the first K nodes at random) for the default policy, cacheroute and
the upper bound, with everything else ``bench_routing.py``'s (Llama-3.1-8B on H100, the workload's ladder, SLO and run
length, gossip at the agent's measured lag). The table gives each row's SLO capacity, and the KV hit at the ladder's
lowest rung and at capacity, each beside the 1-ingress figure of the same policy.

    python scripts/bench_ingresses.py                       # 16 nodes, the production shapes, 3 seeds (hours)
    python scripts/bench_ingresses.py --quick               # 8 nodes, short runs, 2 seeds
    python scripts/bench_ingresses.py --short --seeds 2      # 16 nodes, every other rung, runs a tenth as long
    python scripts/bench_ingresses.py --only tool-agent --ingresses 1,16 --json
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

WORKLOADS = ("platform-chat", "platform-chat-long", "tool-agent")
POLICIES = (DEFAULT_ROUTING_POLICY, *br.OURS, br.REFERENCE)
#: The target: the hit with every node an ingress at least this share of one ingress's.
HIT_SHARE_TARGET = 0.95


def run(case: br.Case, policies: list[str], counts: list[int], seeds: int, nodes: int, jobs: int) -> dict[str, Any]:
    by_count = {k: br.run_case(case, policies, seeds, nodes, jobs, ingresses=k) for k in counts}
    rows = []
    for policy in policies:
        one = next(r for r in by_count[counts[0]]["rows"] if r["policy"] == policy)
        for k in counts:
            row = next(r for r in by_count[k]["rows"] if r["policy"] == policy)
            rows.append({
                "policy": policy, "ingresses": k, "capacity": row["capacity"], "capacity_mean": row["capacity_mean"],
                "kv_hit_lowest": row["kv_hit_lowest"], "kv_hit": row["kv_hit"], "p99_ttft_s": row["p99_ttft_s"],
                "hit_share_lowest": _share(row["kv_hit_lowest"], one["kv_hit_lowest"]),
                "hit_share_at_capacity": _share(row["kv_hit"], one["kv_hit"]),
                "capacity_share": _share(row["capacity_mean"], one["capacity_mean"]),
            })  # fmt: skip
    return {"workload": case.workload, "nodes": nodes, "seeds": seeds, "ladder": list(case.ladder),
            "duration_s": case.duration_s, "rows": rows}  # fmt: skip


def _share(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(result: dict[str, Any]) -> str:
    lines = [
        f"### {result['workload']} ({result['nodes']} nodes, {result['seeds']} seeds)",
        "",
        "| policy | ingresses | SLO capacity | vs 1 | KV hit, lowest rung | vs 1 | KV hit at capacity | vs 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['ingresses']} | {r['capacity']} | {_num(r['capacity_share'], '.2f')} "
            f"| {_num(r['kv_hit_lowest'], '.3f')} | {_num(r['hit_share_lowest'], '.2f')} "
            f"| {_num(r['kv_hit'], '.3f')} | {_num(r['hit_share_at_capacity'], '.2f')} |"
        )
    worst = [r for r in result["rows"] if r["policy"] == DEFAULT_ROUTING_POLICY and r["ingresses"] == result["nodes"]]
    for r in worst:
        share = r["hit_share_lowest"]
        met = share is not None and share >= HIT_SHARE_TARGET
        lines += ["", f"{DEFAULT_ROUTING_POLICY}, every node an ingress: hit {_num(share, '.2f')} of one ingress's at "
                  f"the lowest rung (target >= {HIT_SHARE_TARGET}): {'met' if met else 'NOT met'}"]  # fmt: skip
    return "\n".join([*lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma list of workloads (default: {', '.join(WORKLOADS)})")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma list (default %(default)s)")
    parser.add_argument("--ingresses", help="comma list of ingress counts (default 1, 2, 4, ... nodes)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="8 nodes, short runs, 2 seeds")
    parser.add_argument("--short", action="store_true",
                        help="every other rung of the ladder, runs a tenth as long (the nodes and seeds as given)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args()
    wanted = [w.strip() for w in (args.only or ",".join(WORKLOADS)).split(",") if w.strip()]
    cases = [c for c in br.CASES if c.workload in wanted]
    if len(cases) != len(wanted):
        parser.error(f"--only: valid workloads are {', '.join(c.workload for c in br.CASES)}")
    nodes, seeds = args.nodes, args.seeds
    if args.quick:
        cases, nodes, seeds = [br.quick(c) for c in cases], 8, 2
    elif args.short:
        cases = [replace(c, ladder=c.ladder[::2], duration_s=c.duration_s / 10) for c in cases]
    if args.ingresses:
        counts = sorted({int(k) for k in args.ingresses.split(",") if k.strip()})
    else:
        counts = [1 << i for i in range(nodes.bit_length()) if 1 << i < nodes] + [nodes]
    if not counts or counts[0] < 1 or counts[-1] > nodes:
        parser.error(f"--ingresses: counts in 1..{nodes}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    t0 = time.perf_counter()
    results = []
    for case in cases:
        results.append(run(case, policies, counts, seeds, nodes, args.jobs))
        if not args.json:
            print(table(results[-1]), flush=True)
    if args.json:
        print(json.dumps({"profile": br.PROFILE, "ingresses": counts, "cases": results,
                          "wall_s": round(time.perf_counter() - t0, 1)}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
