#!/usr/bin/env python3
"""What eviction costs: the selector per replayed block, and the engine's free-block queue against vLLM's own.

    python scripts/bench_eviction.py [--json]

1. ``PolicySelector.observe`` on a WAKMan mix's recorded node stream (8 nodes, p2p, 100k-token KV, 300 s): CPU
   per request and per block replayed (the default candidates), and the shadows' Python memory (tracemalloc).
2. One random allocate / hit / free workload (tests/unit/test_eviction_hook.py's driver, 20,000 steps on 400
   blocks) on vLLM's ``FreeKVCacheBlockQueue`` and on ``PolicyFreeBlockQueue`` (LRU active, four candidates
   tracking): CPU per step, driver included (the difference is the queue's overhead).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.cache.eviction.replay import Access
from p2pnode.cache.eviction.selector import PolicySelector
from p2pnode.config import EvictionConfig
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, get_workloads


def selector_cost() -> dict[str, float]:
    w = get_workloads("wakman-mixes/s20-c40-a40")[0]
    cluster = Cluster(SimConfig(nodes=8, kv_capacity_tokens=100_000, block_size=w.block_size))  # the default policy
    trace: list[Access] = []
    cluster.engines[0].cache.observe = lambda b, lookup, pb: trace.append(Access(tuple(b), lookup, pb))
    cluster.run(w.requests(40.0, 0, cluster.space, Limit(duration_s=300)))
    capacity = cluster.engines[0].cache.num_blocks
    tracemalloc.start()
    sel = PolicySelector(capacity, EvictionConfig(policy="adaptive"))
    t0 = time.process_time()
    for a in trace:
        sel.observe(a.blocks, a.lookup, a.prompt_blocks)
    cpu = time.process_time() - t0
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    blocks = sum(len(a.blocks) for a in trace)
    return {
        "requests": len(trace),
        "blocks": blocks,
        "capacity_blocks": capacity,
        "us_per_request": 1e6 * cpu / len(trace),
        "us_per_block": 1e6 * cpu / blocks,
        "shadow_memory_bytes": mem,
        "shadows": len(sel.shadows),
        "memory_bytes_per_shadow_block": mem / (len(sel.shadows) * capacity),
    }


def queue_cost() -> dict[str, float]:
    from tests.unit.test_eviction_hook import Pool, _drive

    out = {}
    for name, ours in (("vllm_queue", False), ("p2pnode_queue", True)):
        pool = Pool(400, ours=ours)
        t0 = time.process_time()
        _drive([pool], 1, 20_000)
        out[f"{name}_us_per_step"] = 1e6 * (time.process_time() - t0) / 20_000
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = {"selector": selector_cost(), "queue": queue_cost()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    s, q = result["selector"], result["queue"]
    print(
        f"selector: {s['us_per_request']:.0f} us per request, {s['us_per_block']:.2f} us per block "
        f"({s['requests']} requests, {s['blocks']} blocks, {s['shadows']} shadows of {s['capacity_blocks']} blocks: "
        f"{s['shadow_memory_bytes'] / 1e6:.1f} MB, {s['memory_bytes_per_shadow_block']:.0f} B per shadow block)"
    )
    print(
        f"free-block queue, per simulated engine step (hits, allocation, frees; driver included): "
        f"vLLM's {q['vllm_queue_us_per_step']:.1f} us, p2pnode's {q['p2pnode_queue_us_per_step']:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
