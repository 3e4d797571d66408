"""Simulator throughput: simulated requests per second of wall (and CPU) time.

Target: one million requests on 32 nodes in under 5 minutes on the project's 2-core machine, i.e.
>= 3,334 requests per second of wall time, routing included. The default run is exactly that: 1,000,000 requests
of ``cacheroute-aggregate`` on 32 nodes with the default policy (p2p: gossip staleness model, speculative index,
real PrefixIndex per node), at a load the mesh sustains. ``--requests`` runs a smaller one (say so when you
extrapolate).

    python scripts/bench_sim.py [--json] [--requests N] [--nodes 32] [--policy p2p] [--qps 150]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time

from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, get_workloads

TARGET_REQUESTS = 1_000_000
TARGET_WALL_S = 300.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=TARGET_REQUESTS)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--policy", default=DEFAULT_ROUTING_POLICY)
    ap.add_argument("--workload", default="cacheroute-aggregate")
    ap.add_argument("--qps", type=float, default=150.0, help="offered load (32 H100s sustain ~150 on the aggregate)")
    ap.add_argument("--block-size", type=int, default=None, help="default: the workload's own (256 for the aggregate)")
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    wl = get_workloads(args.workload)[0]
    args.block_size = args.block_size or wl.block_size
    cfg = SimConfig(
        nodes=args.nodes, block_size=args.block_size, eviction=args.eviction, seed=args.seed,
        warmup_s=0.2 * args.requests / args.qps,
    ).with_routing(policy=args.policy)
    t0, c0 = time.perf_counter(), time.process_time()
    cluster = Cluster(cfg)
    summary = cluster.run(wl.requests(args.qps, args.seed, cluster.space, Limit(max_requests=args.requests)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = summary["requests"]
    out = {
        "workload": wl.name,
        "policy": args.policy,
        "nodes": args.nodes,
        "qps": args.qps,
        "block_size": args.block_size,
        "requests": n,
        "simulated_s": round(summary["sim_time_s"], 1),
        "events": summary["events"],
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "requests_per_wall_s": round(n / wall, 1),
        "requests_per_cpu_s": round(n / cpu, 1),
        "extrapolated_1m_wall_s": round(wall * TARGET_REQUESTS / n, 1),
        "target_met": n >= TARGET_REQUESTS and wall <= TARGET_WALL_S,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "kv_hit": round(summary["kv_hit"], 4),
        "ttft_p99_s": round(summary["ttft_p99_s"], 3),
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{n:,} requests of {wl.name} on {args.nodes} nodes ({args.policy}, {args.qps} QPS, "
              f"{out['simulated_s']} simulated s)")
        print(f"  wall {wall:.1f} s ({out['requests_per_wall_s']:,.0f} req/s), CPU {cpu:.1f} s "
              f"({out['requests_per_cpu_s']:,.0f} req/s), {summary['events']:,} events, peak RSS "
              f"{out['peak_rss_mb']} MB")
        if n < TARGET_REQUESTS:
            print(f"  extrapolated to 1M: {out['extrapolated_1m_wall_s']} s wall (target {TARGET_WALL_S:.0f} s)")
        else:
            print(f"  target (1M in {TARGET_WALL_S:.0f} s): {'met' if out['target_met'] else 'MISSED'}")
        print(f"  (run: KV hit {out['kv_hit']}, p99 TTFT {out['ttft_p99_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
