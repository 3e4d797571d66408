#!/usr/bin/env python3
"""Eviction on the real engine: cached tokens vLLM reports under each eviction policy vs the simulator's prediction.

    python scripts/eviction_engine_check.py [--requests 400] [--json]

Starts vLLM (the tiny local model, ``P2PNODE_TINY_MODEL`` or ``models/tiny``) in-process with a 64-block KV cache
(63 usable blocks of 32 tokens) and p2pnode's eviction hook, then, for each stream of ``p2pnode/sim/token_streams.py``
(``recency``, ``frequency``) and each policy (``lru``, ``s3fifo``, ``adaptive``): resets the prefix cache, sets the
policy, serves the stream one request at a time (one output token each) and sums ``num_cached_tokens``. Under
``adaptive`` the node's own ``EvictionControl`` chooses (every finished request is offered to it, as in
``p2pnode serve --eviction-policy adaptive``). The prediction is the same stream through the simulator's cache
(``token_streams.predict``) with the engine's block count. Output: a table (or ``--json``) of cached tokens per
stream and policy, engine vs simulator, their difference in % of prompt tokens, and adaptive's final choice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
KV_BLOCKS = 64  # one is vLLM's null block
KV_BLOCK_BYTES = 32 * 1024  # the tiny model: 2 layers x K,V x 2 heads x 64 dims x 32 tokens x 2 bytes
POLICIES = ("lru", "s3fifo", "adaptive")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from p2pnode.cache.prefix_index import PrefixIndex
    from p2pnode.config import EngineConfig, EvictionConfig
    from p2pnode.engine.eviction_control import EvictionControl
    from p2pnode.engine.vllm_engine import VllmEngine
    from p2pnode.launcher import tiny_model_dir
    from p2pnode.request import Request, SamplingOptions
    from p2pnode.sim.token_streams import STREAMS, predict

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = Path(args.model) if args.model else tiny_model_dir()
    cfg = EngineConfig(
        model=model,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        kv_cache_bytes=KV_BLOCKS * KV_BLOCK_BYTES,
        enforce_eager=True,
        engine_nice=0,
    )
    engine = VllmEngine(cfg)
    index = PrefixIndex(BLOCK_SIZE)
    t0 = time.perf_counter()
    await engine.start(lambda events: [index.apply(e) for e in events])
    capacity = engine.kv_capacity_blocks()
    options = SamplingOptions(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    rows = []
    n = 0
    for name, make in STREAMS.items():
        stream = make(args.requests, BLOCK_SIZE)
        prompt_tokens = sum(len(p) for p in stream)
        for policy in POLICIES:
            assert await engine.reset_prefix_cache(), "the engine must be idle to reset its cache"
            control = EvictionControl(EvictionConfig(policy=policy), engine, BLOCK_SIZE)
            await control.start()
            cached = []
            started = time.perf_counter()
            for prompt in stream:
                n += 1
                got, output = 0, []
                async for chunk in engine.generate(Request(f"r{n}", prompt, options)):
                    got = chunk.cached_tokens
                    output += chunk.token_ids
                control.observe(prompt, output)
                cached.append(got)
            await asyncio.sleep(0.2)  # let the last switch and KV events land
            predicted = predict(stream, capacity, BLOCK_SIZE, policy)
            stats = await engine.eviction_stats()
            rows.append(
                {
                    "stream": name,
                    "policy": policy,
                    "requests": len(stream),
                    "prompt_tokens": prompt_tokens,
                    "engine_cached_tokens": sum(cached),
                    "simulator_cached_tokens": sum(predicted),
                    "engine_hit": sum(cached) / prompt_tokens,
                    "simulator_hit": sum(predicted) / prompt_tokens,
                    "difference_pct_of_prompt": 100 * (sum(cached) - sum(predicted)) / prompt_tokens,
                    "requests_that_differ": sum(1 for a, b in zip(cached, predicted, strict=True) if a != b),
                    "engine_final_policy": stats["active"],
                    "engine_switches_total": stats["switches"],
                    "wall_s": round(time.perf_counter() - started, 1),
                }
            )
    idx = index.stats()
    result = {
        "command": "python scripts/eviction_engine_check.py " + " ".join(sys.argv[1:]),
        "model": str(model),
        "kv_blocks": capacity,
        "block_size": BLOCK_SIZE,
        "rows": rows,
        "index": {
            "unknown_removals": idx.unknown_removals,
            "orphaned_blocks": idx.orphaned_blocks,
            "blocks": idx.blocks,
            "engine_cached_hashes": (await engine.eviction_stats())["cached_hashes"],
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    await engine.shutdown()
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"vLLM on {result['model']}: {result['kv_blocks']} blocks of {result['block_size']} tokens",
        "",
        "| stream | policy | requests | engine cached tokens (hit) | simulator (hit) | difference | requests differing"
        " | engine's policy at the end |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['stream']} | {r['policy']} | {r['requests']} | {r['engine_cached_tokens']:,} "
            f"({r['engine_hit']:.3f}) | {r['simulator_cached_tokens']:,} ({r['simulator_hit']:.3f}) | "
            f"{r['difference_pct_of_prompt']:+.2f}% | {r['requests_that_differ']} | {r['engine_final_policy']} |"
        )
    i = result["index"]
    lines += [
        "",
        f"index: {i['blocks']} blocks (engine: {i['engine_cached_hashes']} cached hashes), "
        f"unknown removals {i['unknown_removals']}, orphaned blocks {i['orphaned_blocks']}; "
        f"{result['wall_s']} s",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per stream and policy")
    ap.add_argument("--model", help="model directory (default: the tiny test model)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
