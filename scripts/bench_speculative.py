"""Benchmark of the ingress's speculative index, the C index against its Python definition (a measurement, not a test).

    python scripts/bench_speculative.py [--json] [--tokens 1024,4096,16384] [--block-size 32]

Both in one process, in turn, on the paths an ingress runs (``routing/speculative.py``):
- ``record``: a forwarded prompt's chain, into an index already holding ~20,000 entries of other prompts (a busy
  ingress at the 5 s TTL), preceded by the send's ``expire(now, front_only=True)`` as ``Router.begin`` calls it;
- ``match_all`` (every decision): a prompt held by no peer (its first block missed), by one peer, by 8 peers each
  whole (a prompt sent again), and by 8 peers at 8 different depths (a shared prefix, diverging continuations);
- memory per entry held (tracemalloc: the C index allocates through Python's allocator, so both are seen alike).

Each figure is the median of 7 batches' mean time per call, in microseconds. Runs in a few seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from p2pnode.routing.speculative import NATIVE_SPECULATIVE_INDEX, DictSpeculativeIndex, SpeculativeIndex

FILLER_ENTRIES = 20_000
BATCHES = 7


def per_call_us(fn: Callable[[int], object], calls: int) -> float:
    """Median over batches of the mean time of ``calls`` calls of ``fn(i)``."""
    means = []
    for b in range(BATCHES):
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter_ns()
            for i in range(b * calls, (b + 1) * calls):
                fn(i)
            means.append((time.perf_counter_ns() - t) / calls / 1000)
        finally:
            gc.enable()
    return statistics.median(means)


def chains(rng: random.Random, count: int, blocks: int) -> list[tuple[int, ...]]:
    return [tuple(rng.getrandbits(64) for _ in range(blocks)) for _ in range(count)]


def filled(kind: type, rng: random.Random) -> object:
    index = kind(ttl_s=3600.0, max_entries=65_536)
    for i, chain in enumerate(chains(rng, FILLER_ENTRIES // 64, 64)):
        index.record(f"p{i % 64:02d}", chain, 0.0)
    return index


def bench(kind: type, tokens: int, block_size: int) -> dict[str, float]:
    rng = random.Random(1)
    blocks = tokens // block_size
    index = filled(kind, rng)
    prompts = chains(rng, 512, blocks)
    row: dict[str, float] = {}

    def record(i: int) -> None:  # as Router.begin: the send's expire, then the record
        index.expire(1.0, front_only=True)
        index.record(f"p{i % 64:02d}", prompts[i % len(prompts)], 1.0)

    row["record_us"] = per_call_us(record, 200)
    index = filled(kind, rng)
    cold = chains(rng, 64, blocks)
    one, whole, spread = chains(rng, 64, blocks), chains(rng, 64, blocks), chains(rng, 64, blocks)
    for i in range(64):
        index.record(f"p{i:02d}", one[i], 1.0)
        for k in range(8):
            index.record(f"p{(i + k) % 64:02d}", whole[i], 1.0)
            index.record(f"p{(i + k) % 64:02d}", spread[i][: max(1, blocks * (k + 1) // 8 - 1)], 1.0)
    for name, prompts_of in (("cold", cold), ("one_holder", one), ("8_whole", whole), ("8_depths", spread)):
        row[f"match_all_{name}_us"] = per_call_us(lambda i, p=prompts_of: index.match_all(p[i % 64], 2.0), 2000)
    return row


def bytes_per_entry(kind: type) -> float:
    rng = random.Random(2)
    prompts = chains(rng, 512, 128)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = kind(ttl_s=3600.0, max_entries=65_536)
        for i, chain in enumerate(prompts):
            index.record(f"p{i % 8}", chain, 0.0)
        held = tracemalloc.get_traced_memory()[0] - before
        return held / len(index)
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--tokens", default="1024,4096,16384", help="prompt lengths (default 1024,4096,16384)")
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    kinds = {"python": DictSpeculativeIndex}
    if NATIVE_SPECULATIVE_INDEX:
        kinds["c"] = SpeculativeIndex
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, kind in kinds.items():
            rows.append({"index": name, "tokens": tokens, **bench(kind, tokens, args.block_size)})
    memory = {name: bytes_per_entry(kind) for name, kind in kinds.items()}
    if args.json:
        print(json.dumps({"rows": rows, "bytes_per_entry": memory, "block_size": args.block_size}, indent=2))
        return
    fields = [k for k in rows[0] if k.endswith("_us")]
    print(f"speculative index, block size {args.block_size}, {FILLER_ENTRIES:,} entries held; us per call")
    print(f"{'index':7} {'tokens':>6} " + " ".join(f"{f[:-3]:>20}" for f in fields))
    for row in rows:
        print(f"{row['index']:7} {row['tokens']:>6} " + " ".join(f"{row[f]:>20.2f}" for f in fields))
    print("bytes per entry: " + ", ".join(f"{name} {b:.0f}" for name, b in memory.items()))


if __name__ == "__main__":
    main()
