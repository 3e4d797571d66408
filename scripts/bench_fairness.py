#!/usr/bin/env python3
"""Tenants, priorities and overload in the simulator: is the mesh fair, work-conserving and quick for the urgent?

On a production shape (``platform-chat`` unless told), 16 simulated nodes (Llama-3.1-8B on H100, gossip at the
real agent's measured lag, as ``bench_routing.py``): first the default policy's SLO capacity C without flow control
(the last rung of the workload's ladder before p99 TTFT first exceeds its SLO), then, with flow control at every node
(an admission queue ahead of each engine: the node's ``FairQueue``, shedding at the queue limit; vLLM's priority
scheduling in the engine; ``sim/admission.py``), five runs at 1.5 C:

- ``polite alone``: the polite tenant's own requests only (a fifth of the sessions: it sends a quarter of what the
  greedy one sends, i.e. the greedy one sends 4x the polite one's share);
- ``polite + greedy``: both; the polite tenant's p99 TTFT should stay within 1.2x of what it got alone, and the
  greedy one should be served everything the polite one leaves: its served token rate against the mesh's when it
  is saturated by one tenant (the next run) minus the polite one's, with no node idle while its queue holds
  requests;
- ``one tenant``: every session from one tenant (the mesh's served token rate when saturated);
- ``equal demand, weights 2:1``: two tenants sending alike, one weighted twice the other; each one's share of the
  token work served while arrivals came should be within 10% of its weighted share (2/3, 1/3);
- ``10% high priority``: one tenant, a tenth of requests at high priority; their p99 TTFT within the SLO.
In every run no request waits in an admission queue beyond its limit, and every request is answered (served or
shed).

What-ifs (docs/results.md, "Flow control"): ``--long-prefill-token-threshold N`` runs every engine with vLLM's cap on
one prefill's tokens a step; ``--polite-priority P`` sends every request of the polite tenant at priority P (-1: ahead
of the greedy one's in every queue, and preempting them -- the most any rule ranking a tenant under its share ahead
could give it).

    python scripts/bench_fairness.py                       # a table (platform-chat, 600 s runs)
    python scripts/bench_fairness.py --duration 300        # shorter runs
    python scripts/bench_fairness.py --capacity 20         # skip the capacity search
    python scripts/bench_fairness.py --json                # one JSON object
    python scripts/bench_fairness.py --capacity 20 --long-prefill-token-threshold 4096 --polite-priority -1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_routing as br

from p2pnode.config import DEFAULT_ROUTING_POLICY, DEFAULT_SIM_MAX_QUEUE_S
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.staleness import default_delay
from p2pnode.sim.workloads import Limit, get_workloads
from p2pnode.sim.workloads.tenants import HIGH_PRIORITY, Tenant, TenantMix

#: Load of the scenarios, in multiples of the default policy's SLO capacity.
OVERLOAD = 1.5
POLITE, GREEDY = Tenant("polite", 1.0), Tenant("greedy", 4.0)
HEAVY, LIGHT = Tenant("heavy", 1.0, 2.0), Tenant("light", 1.0, 1.0)
HIGH_PRIORITY_FRAC = 0.1
#: Targets: the polite tenant's p99 TTFT against its own alone; a weighted share's tolerance; the greedy tenant's
#: served rate against what the polite one leaves of a saturated mesh's (a tolerance for the two runs' noise: the
#: done-when says "all").
POLITE_P99_RATIO = 1.2
SHARE_TOLERANCE = 0.10
LEFTOVER_SERVED = 0.95
WARMUP_FRAC = 0.2


def _config(nodes: int, slo_s: float, duration_s: float, max_queue_s: float, mesh_shares: bool,
            long_prefill_token_threshold: int | None = None) -> SimConfig:
    """``bench_routing``'s mesh, with flow control at every node."""
    return SimConfig(
        nodes=nodes, policy_ttft_slo_s=slo_s, gossip_delay_s=default_delay(DEFAULT_GOSSIP_INTERVAL_S, nodes),
        admission_queue=True, warmup_s=WARMUP_FRAC * duration_s, max_queue_s=max_queue_s, mesh_shares=mesh_shares,
        long_prefill_token_threshold=long_prefill_token_threshold,
    ).with_routing(cost_profile=br.PROFILE, policy=DEFAULT_ROUTING_POLICY)


def capacity(workload: str, nodes: int, duration_s: float) -> tuple[float, dict[str, Any]]:
    """The default policy's SLO capacity without flow control, up the workload's ladder (``bench_routing``: seed 0)."""
    case = replace(next(c for c in br.CASES if c.workload == workload), duration_s=duration_s)
    result = br.run_case(case, [DEFAULT_ROUTING_POLICY], seeds=1, nodes=nodes, jobs=1)
    row = result["rows"][0]
    return float(row["capacity_mean"] or 0.0), {"ladder": result["ladder"], "capacity": row["capacity"],
                                                "by_qps": row["by_qps"], "wall_s": result["wall_s"]}


def _with_priority(requests: Iterator[SimRequest], tenant: str, priority: int) -> Iterator[SimRequest]:
    """``requests`` with every one of ``tenant``'s at ``priority``, a conversation's later turns (``follow``) too."""
    for head in requests:
        r: SimRequest | None = head
        while r is not None:
            if r.tenant == tenant:
                r.priority = priority
            r = r.follow
        yield head


def run(mix: TenantMix, qps: float, cfg: SimConfig, seed: int, duration_s: float,
        polite_priority: int | None = None) -> dict[str, Any]:
    cfg = replace(cfg, seed=seed, block_size=mix.block_size, tenant_weights=mix.tenant_weights)
    t0 = time.perf_counter()
    cluster = Cluster(cfg)
    requests = mix.requests(qps, seed, cluster.space, Limit(duration_s=duration_s))
    if polite_priority is not None:
        requests = _with_priority(requests, POLITE.name, polite_priority)
    s = cluster.run(requests)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    return s


def scenarios(workload: str, cap: float, nodes: int, slo_s: float, seed: int, duration_s: float,
              max_queue_s: float, mesh_shares: bool, long_prefill_token_threshold: int | None = None,
              polite_priority: int | None = None) -> dict[str, Any]:
    wl = get_workloads(workload)[0]
    qps = round(OVERLOAD * cap, 3)
    cfg = _config(nodes, slo_s, duration_s, max_queue_s, mesh_shares, long_prefill_token_threshold)
    mixes = {
        "polite alone": TenantMix(wl, (POLITE, GREEDY), only=POLITE.name),
        "polite + greedy": TenantMix(wl, (POLITE, GREEDY)),
        "one tenant": TenantMix(wl, (Tenant("all", 1.0),)),
        "equal demand, weights 2:1": TenantMix(wl, (HEAVY, LIGHT)),
        "10% high priority": TenantMix(wl, (), high_priority_frac=HIGH_PRIORITY_FRAC),
    }
    runs = {}
    for name, mix in mixes.items():
        runs[name] = run(mix, qps, cfg, seed, duration_s, polite_priority if name.startswith("polite") else None)
        print(f"  {name}: {runs[name]['wall_s']} s", file=sys.stderr)
    return {"qps": qps, "runs": runs}


def figures(runs: dict[str, Any], slo_s: float, max_queue_s: float) -> list[dict[str, Any]]:
    """Each done-when figure beside its target."""
    alone = runs["polite alone"]["by_tenant"][POLITE.name]
    mixed = runs["polite + greedy"]
    polite, greedy = mixed["by_tenant"][POLITE.name], mixed["by_tenant"][GREEDY.name]
    saturated = runs["one tenant"]["served_tokens_per_s"]
    leftover = saturated - polite["served_tokens_per_s"]
    weighted = runs["equal demand, weights 2:1"]["by_tenant"]
    total_weight = HEAVY.weight + LIGHT.weight
    high = runs["10% high priority"]["by_priority"].get(str(HIGH_PRIORITY), {})
    rows = [
        {"figure": "polite p99 TTFT with greedy / alone", "value": polite["ttft_p99_s"] / alone["ttft_p99_s"],
         "target": f"<= {POLITE_P99_RATIO}", "met": polite["ttft_p99_s"] <= POLITE_P99_RATIO * alone["ttft_p99_s"],
         "detail": f"{polite['ttft_p99_s']:.2f} s / {alone['ttft_p99_s']:.2f} s"},
        {"figure": "greedy served / what polite leaves of a saturated mesh",
         "value": greedy["served_tokens_per_s"] / leftover if leftover > 0 else float("nan"),
         "target": f">= {LEFTOVER_SERVED}", "met": greedy["served_tokens_per_s"] >= LEFTOVER_SERVED * leftover,
         "detail": f"{greedy['served_tokens_per_s']:,.0f} / ({saturated:,.0f} - {polite['served_tokens_per_s']:,.0f}) "
                   f"tokens/s"},
        {"figure": "node idle while its queue held requests (share of samples), polite + greedy",
         "value": mixed["queue_idle_frac"], "target": "0", "met": mixed["queue_idle_frac"] == 0.0, "detail": ""},
    ]
    for t in (HEAVY, LIGHT):
        share = weighted[t.name]["served_tokens_share"]
        want = t.weight / total_weight
        rows.append({
            "figure": f"{t.name} (weight {t.weight:g}) served share / weighted share, equal demand",
            "value": share / want, "target": f"1 ± {SHARE_TOLERANCE}", "met": abs(share / want - 1) <= SHARE_TOLERANCE,
            "detail": f"{share:.3f} / {want:.3f}",
        })
    rows.append({
        "figure": "high-priority p99 TTFT (s), 10% high priority", "value": high.get("ttft_p99_s", float("nan")),
        "target": f"<= {slo_s:g}", "met": high.get("ttft_p99_s", float("inf")) <= slo_s,
        "detail": f"normal priority p99 {runs['10% high priority']['by_priority']['0']['ttft_p99_s']:.2f} s",
    })
    waits = max(r["queue_wait_max_s"] for r in runs.values())
    unanswered = sum(r["requests"] - r["completed"] for r in runs.values())
    rows.append({
        "figure": "longest admission-queue wait, any run (s)", "value": waits, "target": f"<= {max_queue_s:g}",
        "met": waits <= max_queue_s + 1e-6 and unanswered == 0,
        "detail": f"{unanswered} requests unanswered; shed: "
                  + ", ".join(f"{name} {r['shed']}" for name, r in runs.items()),
    })
    return rows


def table(out: dict[str, Any]) -> str:
    lines = [
        f"{out['workload']}, {out['nodes']} nodes, default policy's SLO capacity {out['capacity_qps']:g} QPS "
        f"(p99 TTFT <= {out['slo_p99_ttft_s']:g} s), scenarios at {OVERLOAD:g}x = {out['qps']:g} QPS, "
        f"{out['duration_s']:g} s of arrivals, seed {out['seed']}, queue limit {out['max_queue_s']:g} s, fair shares "
        f"{'over the mesh' if out['mesh_shares'] else 'per node'}"
        + (f", long prefills capped at {out['long_prefill_token_threshold']} tokens a step"
           if out["long_prefill_token_threshold"] else "")
        + (f", polite requests at priority {out['polite_priority']}" if out["polite_priority"] is not None else ""),
        "",
        "| figure | value | target | met | detail |", "|---|---:|---|---|---|",
    ]
    for r in out["figures"]:
        lines.append(f"| {r['figure']} | {r['value']:.3f} | {r['target']} | {'yes' if r['met'] else 'NO'} "
                     f"| {r['detail']} |")
    lines += ["", "| run | group | measured | TTFT p50 (s) | TTFT p99 (s) | served share | shed | tokens/s |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["runs"].items():
        groups = [(f"tenant {t}", g) for t, g in r["by_tenant"].items()]
        groups += [(f"priority {p}", g) for p, g in r["by_priority"].items() if len(r["by_priority"]) > 1]
        for group, g in groups:
            lines.append(f"| {name} | {group} | {g['measured']} | {g['ttft_p50_s']:.2f} | {g['ttft_p99_s']:.2f} "
                         f"| {g['served_tokens_share']:.3f} | {g['shed']} | {g['served_tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="platform-chat",
                        help="a production shape: platform-chat, platform-chat-long or tool-agent")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default: the workload's "
                        "bench_routing case, 600 s for the chats)")
    parser.add_argument("--capacity", type=float, default=None, help="the default policy's SLO capacity, QPS "
                        "(default: found up the workload's ladder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-queue-seconds", type=float, default=DEFAULT_SIM_MAX_QUEUE_S)
    parser.add_argument("--mesh-shares", action=argparse.BooleanOptionalAction, default=True,
                        help="tenants' fair shares over the mesh (each node's queue charged what the others served, "
                        "every gossip round), as a node does (default); --no-mesh-shares: per node")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                        help="what-if: vLLM's cap on one prefill's tokens a step on every engine (default: none)")
    parser.add_argument("--polite-priority", type=int, default=None, metavar="P",
                        help="what-if: every polite request at priority P (-1: ahead of and preempting the greedy one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.long_prefill_token_threshold is not None and args.long_prefill_token_threshold < 0:
        parser.error("--long-prefill-token-threshold: must be >= 0")
    case = next((c for c in br.CASES if c.workload == args.workload), None)
    if case is None or case.slo_s != 15.0:
        parser.error("--workload: one of the production shapes (platform-chat, platform-chat-long, tool-agent)")
    duration = args.duration or case.duration_s
    t0 = time.perf_counter()
    out: dict[str, Any] = {"workload": args.workload, "nodes": args.nodes, "slo_p99_ttft_s": case.slo_s,
                           "duration_s": duration, "seed": args.seed, "max_queue_s": args.max_queue_seconds,
                           "mesh_shares": args.mesh_shares,
                           "long_prefill_token_threshold": args.long_prefill_token_threshold,
                           "polite_priority": args.polite_priority}
    if args.capacity is None:
        print("capacity search ...", file=sys.stderr)
        cap, out["capacity_search"] = capacity(args.workload, args.nodes, duration)
    else:
        cap = args.capacity
    out["capacity_qps"] = cap
    if cap <= 0:
        print(f"no SLO capacity on {args.workload}'s ladder: nothing to overload", file=sys.stderr)
        return 1
    print(f"scenarios at {OVERLOAD:g} x {cap:g} QPS ...", file=sys.stderr)
    sc = scenarios(args.workload, cap, args.nodes, case.slo_s, args.seed, duration, args.max_queue_seconds,
                   args.mesh_shares, args.long_prefill_token_threshold, args.polite_priority)
    out["qps"] = sc["qps"]
    out["runs"] = {name: {k: r[k] for k in ("requests", "completed", "measured", "ttft_p99_s", "shed",
                                             "queue_wait_max_s", "queue_idle_frac", "preemptions",
                                             "served_tokens_per_s", "by_tenant", "by_priority", "wall_s")}
                   for name, r in sc["runs"].items()}
    out["figures"] = figures(out["runs"], case.slo_s, args.max_queue_seconds)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1, default=str) if args.json else table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
