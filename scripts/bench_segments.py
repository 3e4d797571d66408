#!/usr/bin/env python3
"""Reuse beyond prefixes in the simulator: the RAG workload (``p2pnode sim --workload rag``) with prefix caching only,
``exact`` and ``approximate`` segment reuse, at equal KV capacity per node -- one node, and 16 nodes under every
routing policy -- and the 16-node mesh against one node holding the whole mesh's KV.

    python scripts/bench_segments.py                    # docs/results.md, "Reuse beyond prefixes" (~2 h, 2 cores)
    python scripts/bench_segments.py --quick            # minutes: short runs, a few policies (a smoke test)
    python scripts/bench_segments.py --json             # one JSON object
    python scripts/bench_segments.py --policies p2p,flat --seeds 2
    python scripts/bench_segments.py --kv-link-gbps 10,25,100   # section 5's link figures
    python scripts/bench_segments.py --sections 5               # only the mesh moving segments (and its reference)
    python scripts/bench_segments.py --segment-store-threshold 2    # the stores keep a document computed twice

Sections (Llama-3.1-8B on an H100: 403,916 tokens of KV per node; 64-token blocks; SLO p99 TTFT <= 3.5 s):
1. **one node**: each mode up a QPS ladder: SLO capacity, and at the lowest rung and at capacity the token hit
   and p99 TTFT; the hit ratios against prefix caching at the lowest rung (the target: ">= 10x").
2. **16 nodes**: every policy x mode up the ladder, the same figures.
3. **one node holding the mesh's KV**: each mode on one node with 16x the KV, fed the very requests the mesh's lowest
   rung gets (the workload draws its prompts apart from its arrival times) at 1/16 of the rate, so that it is not
   overloaded: the mesh's hit at its lowest rung as a share of it (the target: ">= 90%").
4. **the store's share** (approximate, one node): the hit with 1/4, 1/2 and 3/4 (the default) of the KV in the store.
5. **the mesh moving segments** (approximate, 16 nodes, at each link figure of ``--kv-link-gbps``): a serving node
   pulls a document its store lacks from a peer whose gossiped keys hold it when the link figure says that is cheaper
   than computing it (``routing/segments.segment_pulls``; the simulator's links, ``sim/pulls.py``). Every policy up
   the ladder: the token hit (what was not recomputed), of it the node's own (``kv_hit_local``) and the pulled share,
   the bytes moved per request, p99 TTFT, SLO capacity, and the hit as a share of section 3's one big node; plus,
   at the fastest link, the what-if of storing every pulled segment at the puller too (``segment_store_pulled``).

Each run is a fixed number of requests (``--requests``, per node for the mesh), of which the first 30% warm the
caches up and are not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.config import DEFAULT_KV_LINK_GBPS, DEFAULT_SEGMENT_STORE_THRESHOLD, DEFAULT_SIM_SEGMENT_STORE_SHARE
from p2pnode.cost import get_profile
from p2pnode.routing.policies import CACHE_BLIND_POLICY, DEFAULT_POLICY, Role, names_of
from p2pnode.sim import upper_bound
from p2pnode.sim.cluster import SimConfig
from p2pnode.sim.report import aggregate, capacity_text
from p2pnode.sim.runner import Experiment, run_experiment
from p2pnode.sim.workloads import Limit, get_workloads

MODES = ("none", "exact", "approximate")
#: The default first, the registry's published baselines, our other policies, the reference (bench_routing.py's).
POLICIES = (
    DEFAULT_POLICY,
    *names_of(Role.BASELINE),
    *(name for name in names_of(Role.OURS) if name != DEFAULT_POLICY),
    upper_bound.NAME,
)
PROFILE = "llama-3.1-8b-h100"
SLO_S = 3.5
WARMUP = 0.3
MESH = 16
#: QPS per node of the ladders (the mesh's are these times its nodes).
LADDER_PER_NODE = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
#: The store's shares section 4 compares (the default among them).
SHARES = tuple(sorted({0.25, 0.5, DEFAULT_SIM_SEGMENT_STORE_SHARE, 0.75}))


def experiment(
    nodes: int, policies: list[str], modes: list[str], ladder: list[float], requests: int, seeds: int, jobs: int,
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS, **sim: Any,
) -> list[dict[str, Any]]:
    base = SimConfig(nodes=nodes, policy_ttft_slo_s=SLO_S, **sim).with_routing(
        cost_profile=PROFILE, kv_link_gbps=kv_link_gbps
    )
    exp = Experiment(
        workloads=get_workloads("rag"), policies=policies, evictions=["lru"], qps_ladder=ladder,
        seeds=list(range(seeds)), base=base, limit=Limit(max_requests=requests), slo_p99_ttft_s=SLO_S,
        warmup_frac=WARMUP, jobs=jobs, segments=modes,
    )
    return run_experiment(exp)


def rows_of(runs: list[dict[str, Any]], policies: list[str], lowest: float) -> list[dict[str, Any]]:
    if not runs:  # a section not run
        return []
    agg = aggregate(runs, SLO_S, order=policies)["rag"]
    rows = []
    for label, a in agg.items():
        at, low = a["at_capacity"], a["ladder"].get(lowest, {})
        rows.append({
            "label": label, "policy": a["policy"], "segments": a["segments"], "capacity": capacity_text(a),
            "capacity_mean": a["capacity_mean"], "capacity_ci95": a["capacity_ci95"], "at_qps": a["at_capacity_qps"],
            "kv_hit_lowest": low.get("kv_hit"), "p99_lowest_s": low.get("ttft_p99_s"),
            "loaded_lowest": low.get("segment_loaded_frac"), "phases_lowest": low.get("segment_phases"),
            "kv_hit_local_lowest": low.get("kv_hit_local"), "pulled_lowest": low.get("pulled_frac"),
            "pull_bytes_lowest": low.get("pull_bytes_per_req"), "pull_wait_p99_lowest_s": low.get("pull_wait_p99_s"),
            "kv_hit": at.get("kv_hit"), "p99_ttft_s": at.get("ttft_p99_s"),
        })  # fmt: skip
    by = {(r["policy"], r["segments"]): r for r in rows}
    for r in rows:
        prefix = by.get((r["policy"], "none"), {}).get("kv_hit_lowest")
        r["x_prefix"] = r["kv_hit_lowest"] / prefix if prefix and r["kv_hit_lowest"] is not None else None
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    measure = partial(experiment, segment_store_threshold=args.segment_store_threshold)
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    modes = list(MODES)
    ladder = list(LADDER_PER_NODE if not args.quick else LADDER_PER_NODE[:3])
    sections = {int(x) for x in args.sections.split(",")}
    one = measure(1, [DEFAULT_POLICY], modes, ladder, args.requests, args.seeds, args.jobs) if 1 in sections else []
    mesh_ladder = [q * MESH for q in ladder]
    mesh = []
    if 2 in sections:
        mesh = measure(MESH, policies, modes, mesh_ladder, args.requests * MESH // 2, args.seeds, args.jobs)
    capacity = get_profile(PROFILE).kv_capacity_tokens
    big = measure(  # section 5 is measured against it too
        1, [DEFAULT_POLICY], modes if 3 in sections else ["approximate"], [mesh_ladder[0] / MESH],
        args.requests * MESH // 2, args.seeds, args.jobs, kv_capacity_tokens=MESH * capacity,
    )
    shares = []
    for share in SHARES if 4 in sections else ():
        runs = measure(1, [DEFAULT_POLICY], ["approximate"], [ladder[0]], args.requests, args.seeds, args.jobs,
                          segment_store_share=share)
        shares.append({"share": share, "kv_hit": sum(r["kv_hit"] for r in runs) / len(runs)})
    big_rows = rows_of(big, [DEFAULT_POLICY], mesh_ladder[0] / MESH)
    mesh_rows = rows_of(mesh, policies, mesh_ladder[0])
    whole = {r["segments"]: r["kv_hit_lowest"] for r in big_rows}
    for r in mesh_rows:
        r["of_one_node"] = r["kv_hit_lowest"] / whole[r["segments"]] if whole.get(r["segments"]) else None
    moving = []
    links = [float(g) for g in args.kv_link_gbps.split(",") if float(g) > 0] if 5 in sections else []
    for gbps in links:
        runs = measure(MESH, policies, ["approximate"], mesh_ladder, args.requests * MESH // 2, args.seeds,
                          args.jobs, kv_link_gbps=gbps)
        for r in rows_of(runs, policies, mesh_ladder[0]):
            r["kv_link_gbps"] = gbps
            r["of_one_node"] = r["kv_hit_lowest"] / whole["approximate"] if whole.get("approximate") else None
            moving.append(r)
    if links:
        runs = measure(MESH, [DEFAULT_POLICY], ["approximate"], mesh_ladder[:1], args.requests * MESH // 2,
                          args.seeds, args.jobs, kv_link_gbps=max(links), segment_store_pulled=True)
        for r in rows_of(runs, [DEFAULT_POLICY], mesh_ladder[0]):
            r["kv_link_gbps"], r["store_pulled"] = max(links), True
            r["of_one_node"] = r["kv_hit_lowest"] / whole["approximate"] if whole.get("approximate") else None
            moving.append(r)
    return {
        "profile": PROFILE, "kv_tokens_per_node": capacity, "block_size": 64, "slo_p99_ttft_s": SLO_S,
        "requests_per_run": {"one_node": args.requests, "mesh": args.requests * MESH // 2}, "warmup": WARMUP,
        "seeds": args.seeds, "ladder_per_node": ladder, "nodes": MESH,
        "segment_store_threshold": args.segment_store_threshold,
        "one_node": rows_of(one, [DEFAULT_POLICY], ladder[0]), "mesh": mesh_rows, "one_node_mesh_kv": big_rows,
        "store_share": shares, "moving_segments": moving, "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def _n(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def tables(result: dict[str, Any]) -> str:
    lines = []
    low = result["ladder_per_node"][0]
    head = (
        "| {} | SLO capacity (QPS) | KV hit at {} QPS | x prefix caching | p99 TTFT at {} QPS (s) "
        "| KV hit at capacity | p99 TTFT at capacity (s) | loaded / phases |"
    )
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|"

    def row(r: dict[str, Any], name: str) -> str:
        loaded = "-"
        if r["segments"] == "approximate":
            loaded = f"{_n(r['loaded_lowest'], '.3f')} / {_n(r['phases_lowest'], '.2f')}"
        return (
            f"| {name} | {r['capacity']} | {_n(r['kv_hit_lowest'], '.4f')} | {_n(r['x_prefix'], '.1f')} | "
            f"{_n(r['p99_lowest_s'], '.2f')} | {_n(r['kv_hit'], '.4f')} | {_n(r['p99_ttft_s'], '.2f')} | {loaded} |"
        )

    mesh_low = low * result["nodes"]
    if result["one_node"]:
        lines += [f"One node ({result['kv_tokens_per_node']:,} KV tokens):", "", head.format("segments", low, low),
                  sep, *(row(r, r["segments"]) for r in result["one_node"]), ""]  # fmt: skip
    if result["mesh"]:
        lines += [f"{result['nodes']} nodes:", "",
                  head.format("policy / segments", mesh_low, mesh_low) + " of one node with the mesh's KV |",
                  sep + "---:|"]  # fmt: skip
        for r in result["mesh"]:
            lines.append(row(r, f"{r['policy']} / {r['segments']}") + f" {_n(r.get('of_one_node'), '.2f')} |")
        lines.append("")
    lines += [f"One node with the mesh's KV ({result['nodes']}x), the mesh's lowest-rung requests at 1/"
              f"{result['nodes']} of the rate: "
              + ", ".join(f"{r['segments']} {_n(r['kv_hit_lowest'], '.4f')}" for r in result["one_node_mesh_kv"])]
    if result["store_share"]:
        lines += ["", "Approximate, one node, the store's share of the KV -> KV hit: "
                  + ", ".join(f"{s['share']:g} -> {s['kv_hit']:.4f}" for s in result["store_share"])]  # fmt: skip
    if result.get("moving_segments"):
        title = f"{result['nodes']} nodes moving segments (approximate; all but the capacity at {mesh_low:g} QPS):"
        lines += ["", title, "",
                  "| link (Gb/s) | policy | KV hit | of it local | pulled | MB moved per request | p99 TTFT (s) "
                  "| pull wait p99 (s) | SLO capacity (QPS) | of one node with the mesh's KV |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["moving_segments"]:
            name = r["policy"] + (" (pulled segments stored too)" if r.get("store_pulled") else "")
            mb = None if r["pull_bytes_lowest"] is None else r["pull_bytes_lowest"] / 1e6
            lines.append(
                f"| {r['kv_link_gbps']:g} | {name} | {_n(r['kv_hit_lowest'], '.4f')} | "
                f"{_n(r['kv_hit_local_lowest'], '.4f')} | {_n(r['pulled_lowest'], '.4f')} | {_n(mb, '.1f')} | "
                f"{_n(r['p99_lowest_s'], '.2f')} | {_n(r['pull_wait_p99_lowest_s'], '.3f')} | "
                f"{r['capacity'] if not r.get('store_pulled') else '-'} | {_n(r['of_one_node'], '.2f')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="short runs, the default and the cache-blind policy, three rungs (a smoke test)")
    ap.add_argument("--policies", default=None, help=f"comma list (default: {','.join(POLICIES)})")
    ap.add_argument("--requests", type=int, default=None, help="requests per one-node run (default 8000; the "
                    "mesh's runs get 8x as many)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--kv-link-gbps", default="10,100", help="section 5's link figures, comma list")
    ap.add_argument("--sections", default="1,2,3,4,5", help="which sections to run (module docstring; 5 runs 3's "
                    "approximate one-node run too)")
    ap.add_argument("--segment-store-threshold", type=int, default=DEFAULT_SEGMENT_STORE_THRESHOLD,
                    help="offers a computed document needs before a store keeps it (default "
                    f"{DEFAULT_SEGMENT_STORE_THRESHOLD})")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = args.requests or 600
        args.policies = args.policies or f"{DEFAULT_POLICY},{CACHE_BLIND_POLICY}"
    args.requests = args.requests or 8000
    result = run(args)
    print(json.dumps(result, indent=1) if args.json else tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
