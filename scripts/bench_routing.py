#!/usr/bin/env python3
"""Routing on every workload the project models: the default policy against every baseline.

For each workload (the production shapes -- a platform prompt shared by every request, long growing conversations,
bursty sessions, agentic tool loops -- and the papers' workloads), every policy runs up a QPS ladder in the
simulator (16 nodes, Llama-3.1-8B on H100, gossip at 1 s heard after the real agent's measured lag, several seeds);
the table gives each policy's SLO capacity (the last rung before p99 TTFT first exceeds the workload's SLO, mean ±
95% interval over seeds, '>=' when no rung missed) and, at that rung, KV hit, p99 TTFT, max/mean work per node and
nodes left idle while others queued. The last line of each table says whether the default holds the most load
(within the interval).

    python scripts/bench_routing.py                     # every workload, every policy (~1 h on 2 cores)
    python scripts/bench_routing.py --only platform-chat,tool-agent --seeds 2
    python scripts/bench_routing.py --policies p2p,p2p@w1,p2p@w8,dualmap   # what-ifs (p2pnode sim --help)
    python scripts/bench_routing.py --quick             # minutes: 8 nodes, short runs (a smoke test, not a result)
    python scripts/bench_routing.py --gossip-delay 2    # the one-hop delay, the model's default before 5609e91
    python scripts/bench_routing.py --json              # one JSON object
    python scripts/bench_routing.py --kv-fraction 0.25 --kv-link-gbps 100   # a quarter of the KV, KV pulls priced
                                                        # at 100 Gb/s (scripts/bench_kv_pull.py runs the grid)

The production workloads' SLO is 15 s: their prompts are long (median 2k tokens, growing 800 a turn) and their
arrivals bursty (gamma, CV 2), and at 3.5 s even an idle mesh misses under bursts; the papers' workloads keep the
papers' 3.5 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.config import DEFAULT_COST_PROFILE, DEFAULT_KV_LINK_GBPS, DEFAULT_ROUTING_POLICY
from p2pnode.cost import get_profile
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S
from p2pnode.routing.policies import Role, names_of
from p2pnode.sim import upper_bound
from p2pnode.sim.cluster import SimConfig
from p2pnode.sim.report import aggregate, capacity_text
from p2pnode.sim.runner import Experiment, run_experiment
from p2pnode.sim.staleness import default_delay
from p2pnode.sim.workloads import Limit, get_workloads

#: The built-in baselines the default is judged against: the registry's published algorithms.
BASELINES = names_of(Role.BASELINE)
#: Also shown, not rivals: our other policies (the rate plan's) and the default rule on exact state (a bound on what
#: better gossip could give).
OURS = tuple(name for name in names_of(Role.OURS) if name != DEFAULT_ROUTING_POLICY)
REFERENCE = upper_bound.NAME
#: Every policy a run compares unless told: the default first, its rivals, ours, the reference.
POLICIES = (DEFAULT_ROUTING_POLICY, *BASELINES, *OURS, REFERENCE)
PROFILE = DEFAULT_COST_PROFILE
#: The KV pulls' figures each row gives at its capacity rung (``sim/metrics.py``; 0 without a link figure), and the
#: share of every node's KV held by running requests and of the time it queued.
PULL_FIELDS = (
    "kv_hit_local", "pulled_frac", "pulls_per_req", "pulls_failed_frac", "pulls_partial_frac", "pull_bytes_per_req",
    "pull_wait_p99_s", "pull_s_mean", "kv_running_frac", "waiting_frac",
)
#: With KV tiers below the engines (``SimConfig.host_kv_tokens``): the hit split by where its tokens came from and
#: the tiers' bytes moved, at the capacity rung and at every rung (``sim/metrics.py``); absent without tiers.
TIER_FIELDS = (
    "kv_hit_gpu", "kv_hit_host", "kv_hit_disk", "tier_load_s_mean", "tier_load_s_p99", "tier_host_store_bytes_per_req",
    "tier_host_load_bytes_per_req", "tier_disk_store_bytes_per_req", "tier_disk_load_bytes_per_req",
)


@dataclass(frozen=True)
class Case:
    workload: str
    slo_s: float
    ladder: tuple[float, ...]
    duration_s: float


def _ladder(start: float, stop: float, step: float) -> tuple[float, ...]:
    return tuple(round(start + i * step, 6) for i in range(round((stop - start) / step) + 1))


CASES = (
    Case("platform-chat", 15.0, _ladder(10, 30, 2), 600.0),
    Case("platform-chat-long", 15.0, _ladder(10, 30, 2), 600.0),
    Case("tool-agent", 15.0, _ladder(40, 160, 10), 300.0),
    Case("cacheroute-aggregate", 3.5, _ladder(100, 400, 25), 60.0),
    Case("whales", 3.5, _ladder(100, 400, 20), 60.0),
    Case("low-reuse", 3.5, _ladder(30, 200, 10), 60.0),
    Case("mmlu", 3.5, _ladder(200, 1200, 100), 60.0),
)


def quick(case: Case) -> Case:
    """8 nodes carry half of what 16 do: the ladder halves; runs are a tenth as long."""
    return replace(case, ladder=tuple(q / 2 for q in case.ladder[::2]), duration_s=case.duration_s / 10)


def kv_capacity_tokens(fraction: float) -> int:
    """KV tokens per node at ``fraction`` of the profile's."""
    return round(get_profile(PROFILE).kv_capacity_tokens * fraction)


def run_case(
    case: Case,
    policies: list[str],
    seeds: int,
    nodes: int,
    jobs: int,
    gossip_delay_s: float | None = None,
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS,
    kv_fraction: float = 1.0,
    ingresses: int = 0,
    sim: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every policy up the case's ladder; ``kv_link_gbps``: KV pulls priced and run at this figure (0: none);
    ``kv_fraction``: of the profile's KV cache per node; ``ingresses``: nodes clients send to (0: every node);
    ``sim``: other simulator settings (``SimConfig`` fields: KV tiers, ``host_kv_tokens``...)."""
    if gossip_delay_s is None:  # resolved here, so the JSON names the delay the runs had
        gossip_delay_s = default_delay(DEFAULT_GOSSIP_INTERVAL_S, nodes)
    kv_tokens = kv_capacity_tokens(kv_fraction)
    base = SimConfig(
        nodes=nodes, policy_ttft_slo_s=case.slo_s, gossip_delay_s=gossip_delay_s,
        kv_capacity_tokens=None if kv_fraction == 1.0 else kv_tokens, ingresses=ingresses,
    ).with_routing(cost_profile=PROFILE, kv_link_gbps=kv_link_gbps)
    if sim:
        base = replace(base, **sim)
    exp = Experiment(
        workloads=get_workloads(case.workload),
        policies=policies,
        evictions=["lru"],
        qps_ladder=list(case.ladder),
        seeds=list(range(seeds)),
        base=base,
        limit=Limit(duration_s=case.duration_s),
        slo_p99_ttft_s=case.slo_s,
        jobs=jobs,
    )
    t0 = time.perf_counter()
    runs = run_experiment(exp)
    agg = aggregate(runs, case.slo_s, order=policies)[case.workload]
    rows = []
    for label, a in agg.items():
        at = a["at_capacity"]
        rows.append({
            "policy": label, "capacity": capacity_text(a), "capacity_mean": a["capacity_mean"],
            "capacity_ci95": a["capacity_ci95"], "censored": a["capacity_censored"], "infeasible": a["infeasible"],
            "at_qps": a["at_capacity_qps"], "kv_hit": at.get("kv_hit"), "p99_ttft_s": at.get("ttft_p99_s"),
            "work_max_mean": at.get("work_imbalance"), "idle_nodes": at.get("idle_nodes"),
            "kv_hit_lowest": a["ladder"].get(case.ladder[0], {}).get("kv_hit"),
            "idle_nodes_lowest": a["ladder"].get(case.ladder[0], {}).get("idle_nodes"),
            "by_qps": {f"{q:g}": {"kv_hit": m["kv_hit"], "p99_ttft_s": m["ttft_p99_s"], "idle_nodes": m["idle_nodes"],
                                  **{k: m[k] for k in ("pulled_frac", *TIER_FIELDS) if k in m and "kv_hit_host" in m}}
                       for q, m in a["ladder"].items()},
            **{k: at.get(k) for k in PULL_FIELDS},
            **{k: at[k] for k in TIER_FIELDS if k in at},
        })  # fmt: skip
    return {
        "workload": case.workload, "slo_p99_ttft_s": case.slo_s, "ladder": list(case.ladder),
        "duration_s": case.duration_s, "seeds": seeds, "nodes": nodes, "rows": rows,
        "gossip_delay_s": gossip_delay_s, "kv_link_gbps": kv_link_gbps, "kv_capacity_tokens": kv_tokens,
        "verdict": verdict(rows), "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def verdict(rows: list[dict[str, Any]]) -> str:
    """Whether the default holds the most load among the policies a mesh can run (the reference excluded)."""
    by = {r["policy"]: r for r in rows}
    me = by.get(DEFAULT_ROUTING_POLICY)
    rivals = [r for r in rows if r["policy"] in BASELINES]
    if me is None or not rivals or me["capacity_mean"] is None:
        return "n/a"
    best = max(rivals, key=lambda r: r["capacity_mean"])
    mine, theirs = me["capacity_mean"], best["capacity_mean"]
    if mine > theirs + best["capacity_ci95"] + me["capacity_ci95"]:
        word = "beats"
    elif mine >= theirs:
        word = "above" if mine > theirs else "ties"
    elif theirs - mine <= best["capacity_ci95"] + me["capacity_ci95"]:
        word = "within the interval of"
    else:
        word = "LOSES to"
    best_text = f"{best['policy']} {best['capacity']}"
    return f"{DEFAULT_ROUTING_POLICY} {me['capacity']} QPS: {word} the best baseline, {best_text}"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def kv_text(result: dict[str, Any]) -> str:
    """The KV settings of a result when not the defaults (older results name none)."""
    parts = []
    tokens = result.get("kv_capacity_tokens")
    if tokens is not None and tokens != kv_capacity_tokens(1.0):
        parts.append(f"{tokens:,} KV tokens per node")
    if result.get("kv_link_gbps"):
        parts.append(f"KV pulls at {result['kv_link_gbps']:g} Gb/s")
    return "".join(f", {p}" for p in parts)


def table(result: dict[str, Any]) -> str:
    lines = [
        f"### {result['workload']} (p99 TTFT <= {result['slo_p99_ttft_s']:g} s; {result['nodes']} nodes, "
        f"{result['seeds']} seeds, {result['duration_s']:g} s per run{kv_text(result)})",
        "",
        f"| policy | SLO capacity (QPS) | at QPS | KV hit | p99 TTFT (s) | work max/mean | idle nodes | KV hit at "
        f"{result['ladder'][0]:g} QPS | idle nodes at {result['ladder'][0]:g} QPS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['capacity']} | {_num(r['at_qps'], 'g')} | {_num(r['kv_hit'], '.3f')} | "
            f"{_num(r['p99_ttft_s'], '.2f')} | {_num(r['work_max_mean'], '.2f')} | {_num(r['idle_nodes'], '.1f')} | "
            f"{_num(r.get('kv_hit_lowest'), '.3f')} | {_num(r.get('idle_nodes_lowest'), '.1f')} |"
        )
    lines += ["", result["verdict"], ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma list of workloads (default: all)")
    parser.add_argument("--policies", help=f"comma list (default: {', '.join(POLICIES)})")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (default %(default)s)")
    parser.add_argument(
        "--gossip-delay",
        type=float,
        help="seconds until a gossip round is heard (default: the agent's measured lag; 2 is the old one-hop default)",
    )
    parser.add_argument("--quick", action="store_true", help="8 nodes, short runs, 2 seeds: a smoke test")
    parser.add_argument(
        "--kv-link-gbps",
        type=float,
        default=DEFAULT_KV_LINK_GBPS,
        help="KV pulls priced and run at this link figure, Gb/s (default %(default)s: no pulls)",
    )
    parser.add_argument(
        "--kv-fraction",
        type=float,
        default=1.0,
        help="KV cache per node, as a fraction of the profile's (default %(default)s)",
    )
    parser.add_argument(
        "--lowest-only",
        action="store_true",
        help="run each ladder's lowest rung only (KV hit at a load every policy serves)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--json-out", type=Path, help="also write the JSON object to this file")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="print the tables of saved --json-out files (no "
        "runs); a later file's lowest-rung KV hits and idle nodes fill in an earlier one's",
    )
    args = parser.parse_args()
    if not 0 < args.kv_fraction <= 1 or args.kv_link_gbps < 0:
        parser.error("--kv-fraction must be in (0, 1] and --kv-link-gbps >= 0")
    if args.from_json:
        first, *more = (json.loads(p.read_text())["workloads"] for p in args.from_json)
        for result in first:
            for extra in (r for m in more for r in m if r["workload"] == result["workload"]):
                if extra.get("gossip_delay_s") != result.get("gossip_delay_s"):
                    print(
                        f"warning: {result['workload']}: merging runs of different gossip delays "
                        f"({result.get('gossip_delay_s')} s and {extra.get('gossip_delay_s')} s)",
                        file=sys.stderr,
                    )
                lowest = {r["policy"]: r for r in extra["rows"]}
                for row in result["rows"]:
                    if extra["ladder"][0] != result["ladder"][0] or row["policy"] not in lowest:
                        continue
                    other = lowest[row["policy"]]
                    if row.get("kv_hit_lowest") is None:
                        row["kv_hit_lowest"] = other.get("kv_hit_lowest")
                    if row.get("idle_nodes_lowest") is None:  # a --lowest-only run's one rung is its capacity rung
                        row["idle_nodes_lowest"] = other.get("idle_nodes_lowest", other.get("idle_nodes"))
            result["verdict"] = verdict(result["rows"])
            print(table(result))
        return 0
    cases = list(CASES)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {c.workload for c in CASES})
        if unknown:
            valid = ", ".join(c.workload for c in CASES)
            parser.error(f"--only: unknown workload(s) {', '.join(unknown)}; valid: {valid}")
        cases = [c for c in cases if c.workload in wanted]
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    nodes, seeds = args.nodes, args.seeds
    if args.quick:
        cases, nodes, seeds = [quick(c) for c in cases], 8, 2
    if args.lowest_only:
        cases = [replace(c, ladder=c.ladder[:1]) for c in cases]
    results = []
    for case in cases:
        result = run_case(
            case, policies, seeds, nodes, args.jobs, args.gossip_delay, args.kv_link_gbps, args.kv_fraction
        )
        results.append(result)
        if not args.json:
            print(table(result), flush=True)
    report = json.dumps({"profile": PROFILE, "workloads": results}, indent=2)
    if args.json_out:
        args.json_out.write_text(report + "\n")
    if args.json:
        print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
