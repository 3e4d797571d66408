#!/usr/bin/env python3
"""Where a mesh's approximate-segment hit goes: one simulated RAG run (approximate mode, the lowest rung of
scripts/bench_segments.py: 1 QPS per node), counting for each measured request, when it is admitted at its serving
node, its documents' tokens held by that node's store, only by another node's store, or by none; and at the end how
many entries the stores hold and how many distinct documents (the copies per document).

    python scripts/segment_placement.py                         # 16 nodes, p2p, 16,000 requests, no link
    python scripts/segment_placement.py --kv-link-gbps 100      # the serving node pulls segments (docs/segments.md)
    python scripts/segment_placement.py --nodes 1 --big         # one node holding the 16-node mesh's KV
    python scripts/segment_placement.py --json

A measuring tool: it wraps ``SimSegments.admit`` of this process to look at every store at that moment (a real node
cannot); the run itself is the simulator's, unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.cost import get_profile
from p2pnode.engine.simulated import segments as sim_segments
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, get_workloads

PROFILE = "llama-3.1-8b-h100"
MESH = 16
WARMUP = 0.3


def measure(args: argparse.Namespace) -> dict[str, Any]:
    qps = 1.0 * args.nodes
    extra: dict[str, Any] = {}
    if args.big:
        extra["kv_capacity_tokens"] = MESH * get_profile(PROFILE).kv_capacity_tokens
        qps = 1.0
    workload = get_workloads("rag")[0]
    limit = Limit(max_requests=args.requests)
    cfg = SimConfig(
        nodes=args.nodes, policy_ttft_slo_s=3.5, eviction="lru", seed=args.seed, segments="approximate",
        warmup_s=WARMUP * limit.window_s(qps), block_size=workload.block_size, segment_store_pulled=args.store_pulled,
        **extra,
    ).with_routing(policy=args.policy, cost_profile=PROFILE, kv_link_gbps=args.kv_link_gbps)  # fmt: skip
    cluster = Cluster(cfg)
    tokens = {"local": 0, "elsewhere": 0, "nowhere": 0}
    admit = sim_segments.SimSegments.admit

    def counting(self: sim_segments.SimSegments, r: SimRequest) -> None:
        seg = r.segments
        if seg is not None and r.arrival >= cfg.warmup_s:
            for (start, end), key in zip(seg.spans, seg.keys, strict=True):
                if self.holds(key):
                    where = "local"
                elif any(e.segments is not None and e.segments.holds(key) for e in cluster.engines):
                    where = "elsewhere"
                else:
                    where = "nowhere"
                tokens[where] += end - start
        admit(self, r)

    sim_segments.SimSegments.admit = counting  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        summary = cluster.run(workload.requests(qps, args.seed, cluster.space, limit))
    finally:
        sim_segments.SimSegments.admit = admit  # type: ignore[method-assign]
    held = [set(e.segments.holdings()) for e in cluster.engines if e.segments is not None]
    entries, distinct = sum(len(h) for h in held), len(set().union(*held))
    total = sum(tokens.values()) or 1
    return {
        "nodes": args.nodes, "policy": args.policy, "seed": args.seed, "requests": args.requests,
        "kv_link_gbps": args.kv_link_gbps, "big": args.big, "store_pulled": args.store_pulled,
        "kv_hit": summary["kv_hit"], "kv_hit_local": summary["kv_hit_local"], "pulled_frac": summary["pulled_frac"],
        "pull_bytes_per_req": summary["pull_bytes_per_req"], "ttft_p99_s": summary["ttft_p99_s"],
        **{f"doc_tokens_{k}": v / total for k, v in tokens.items()},
        "store_entries": entries, "distinct_documents": distinct, "copies_per_document": entries / max(1, distinct),
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=MESH)
    ap.add_argument("--big", action="store_true", help=f"one node's KV is {MESH}x the profile's (with --nodes 1)")
    ap.add_argument("--policy", default=DEFAULT_ROUTING_POLICY)
    ap.add_argument("--requests", type=int, default=16_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-link-gbps", type=float, default=0.0)
    ap.add_argument("--store-pulled", action="store_true", help="a node stores the segments it pulled too")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = measure(args)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(
        f"KV hit {r['kv_hit']:.4f} (local {r['kv_hit_local']:.4f}, pulled {r['pulled_frac']:.4f}, "
        f"{r['pull_bytes_per_req'] / 1e6:.1f} MB moved per request), p99 TTFT {r['ttft_p99_s']:.2f} s\n"
        f"documents' tokens at admission: in the serving node's store {r['doc_tokens_local']:.3f}, only in another "
        f"node's {r['doc_tokens_elsewhere']:.3f}, in none {r['doc_tokens_nowhere']:.3f}\n"
        f"stores: {r['store_entries']} entries, {r['distinct_documents']} distinct documents "
        f"({r['copies_per_document']:.2f} copies each); {r['wall_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
