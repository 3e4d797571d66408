"""Measure the host KV tier on a real engine (vLLM, the tiny model by default): what a load costs, and its knobs.

    python scripts/measure_host_tier.py loads               # a tier load's tokens, bytes and seconds
    python scripts/measure_host_tier.py knobs               # store threshold 1 vs 2, outputs stored or not, LRU vs ARC
    python scripts/measure_host_tier.py export              # a holder's export of a prefix from its tier vs its engine

``loads``: prompts of 4-24 blocks computed, pushed out of the engine's cache by others, and served again from the tier;
per load, the bytes and seconds vLLM's offloading connector counted for the copy (the figure a cost profile's
``host_load_bytes_per_s`` is), and the request's time to first token against the same prompt computed and served from
the engine's own cache; in the summary, the stores' bytes and seconds too (every block the run computed).

``knobs``: a chat workload under KV pressure -- conversations whose next turn is the last prompt plus its answer plus a
new question, between one-off prompts nobody repeats -- run once per setting of the tier's admission (``store
threshold``) and of whether outputs are stored, and once with ARC in place of LRU; the prompt tokens served from the
tier and from the engine.

``export``: what lending a prefix costs its holder (``engine.export``, the one-token request a peer's pull starts with):
the prefix in the engine's cache, then the same prefix only in the tier (loaded back first).

Each measurement is a line on stdout, then a summary (``--json``: one JSON object per line, the summary's ``measure``
ending in ``_summary``); vLLM's own logs go to stderr. The engine runs in this process, as a node embeds it; the KV
cache is small (64 blocks) so that prefixes leave it quickly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from p2pnode.config import EngineConfig, KvPullConfig, KvSetup, SegmentConfig, TierConfig
from p2pnode.engine.vllm_engine import VllmEngine
from p2pnode.kv.params import ExportAsk
from p2pnode.launcher import tiny_model_dir
from p2pnode.request import Request, SamplingOptions

BLOCK = 32
KV_BLOCKS = 64
BLOCK_BYTES = 32 * 1024  # the tiny model: 2 layers x K,V x 2 heads x 64 dims x 32 tokens x 2 bytes
VOCAB = 500


class Report:
    """Where results go: stdout as it was before vLLM started (its logs, and its processes', go to stderr)."""

    def __init__(self, as_json: bool) -> None:
        sys.stdout.flush()
        self.out: TextIO = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # fd 1 of this process, and of every process it starts from now on, is stderr
        self.as_json = as_json

    def line(self, record: dict[str, Any]) -> None:
        text = json.dumps(record) if self.as_json else "  ".join(f"{k}={v}" for k, v in record.items())
        print(text, file=self.out, flush=True)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else 0.0


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Bench:
    """An engine with a host tier, and requests that say what they reused."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.n = 0

    async def serve(self, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
        self.n += 1
        options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0)
        started = time.perf_counter()
        first = None
        out: list[int] = []
        last = None
        async for chunk in self.engine.generate(Request(f"m{self.n}", prompt, options)):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - started
            out.extend(chunk.token_ids)
            last = chunk
        assert last is not None
        return {"ttft_s": first, "cached": last.cached_tokens, "host": last.host_tier_tokens, "output": out}


async def start(model: Path, tier: TierConfig, pulls: bool = False) -> Bench:
    config = EngineConfig(
        model=model, block_size=BLOCK, max_model_len=1024, kv_cache_bytes=KV_BLOCKS * BLOCK_BYTES, enforce_eager=True,
        engine_nice=0,
    )
    kv = KvSetup(KvPullConfig() if pulls else None, "127.0.0.1" if pulls else "", SegmentConfig(store_bytes=0), tier)
    engine = VllmEngine(config, kv=kv)
    await engine.start(lambda events: None)
    return Bench(engine)


async def evict(bench: Bench, rng: random.Random) -> None:
    for _ in range(4):  # 4 x 20 blocks through a 63-block cache
        await bench.serve(tokens(rng, 20 * BLOCK + 1))


async def loads(model: Path, repeats: int, report: Report) -> None:
    bench = await start(model, TierConfig(host_bytes=64 << 20))
    rng = random.Random(1)
    rows: list[dict[str, Any]] = []
    try:
        for blocks in (4, 8, 16, 24):
            for _ in range(repeats):
                prompt = tokens(rng, blocks * BLOCK + 1)
                computed = await bench.serve(prompt)
                cached = await bench.serve(prompt)  # from the engine's own cache
                await evict(bench, rng)
                before = bench.engine.tier_status()
                assert before is not None
                io0 = (before.io.load_bytes, before.io.load_seconds)
                loaded = await bench.serve(prompt)  # from the tier
                after = bench.engine.tier_status()
                assert after is not None
                moved, seconds = after.io.load_bytes - io0[0], after.io.load_seconds - io0[1]
                row = {
                    "measure": "load", "blocks": blocks, "tokens": loaded["host"], "bytes": moved,
                    "copy_s": round(seconds, 6), "bytes_per_s": round(moved / seconds) if seconds else None,
                    "ttft_computed_s": round(computed["ttft_s"], 4), "ttft_engine_hit_s": round(cached["ttft_s"], 4),
                    "ttft_tier_hit_s": round(loaded["ttft_s"], 4),
                    "same_tokens": loaded["output"] == computed["output"],
                }
                rows.append(row)
                report.line(row)
        stores = bench.engine.tier_status()
    finally:
        await bench.engine.shutdown()
    moved = sum(r["bytes"] for r in rows)
    seconds = sum(r["copy_s"] for r in rows)
    report.line({
        "measure": "load_summary", "loads": len(rows), "tier_tokens": sum(r["tokens"] for r in rows),
        "bytes": moved, "copy_s": round(seconds, 6), "bytes_per_s": round(moved / seconds) if seconds else None,
        "median_copy_s_per_block": median([r["copy_s"] / r["blocks"] for r in rows]),
        "median_ttft_computed_s": median([r["ttft_computed_s"] for r in rows]),
        "median_ttft_engine_hit_s": median([r["ttft_engine_hit_s"] for r in rows]),
        "median_ttft_tier_hit_s": median([r["ttft_tier_hit_s"] for r in rows]),
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "store_bytes": stores.io.store_bytes if stores else 0,
        "store_s": round(stores.io.store_seconds, 6) if stores else 0.0,
        "store_bytes_per_s": round(stores.io.store_bytes / stores.io.store_seconds)
        if stores and stores.io.store_seconds else None,
    })


async def knobs(model: Path, conversations: int, turns: int, one_offs: int, report: Report) -> None:
    settings = [(threshold, outputs, "lru") for threshold in (1, 2) for outputs in (True, False)] + [(1, True, "arc")]
    for threshold, outputs, eviction in settings:
        tier = TierConfig(  # 256 blocks
            host_bytes=8 << 20, store_threshold=threshold, store_outputs=outputs, eviction=eviction
        )
        bench = await start(model, tier)
        rng = random.Random(7)
        served = cached = host = 0
        try:
            history = [tokens(rng, 3 * BLOCK) for _ in range(conversations)]
            for _ in range(turns):
                for c in range(conversations):
                    prompt = history[c] + tokens(rng, BLOCK)  # a new question after everything said so far
                    got = await bench.serve(prompt, max_tokens=2 * BLOCK)
                    served += len(prompt)
                    cached += got["cached"]
                    host += got["host"]
                    history[c] = prompt + got["output"]
                    for _ in range(one_offs):  # traffic nobody repeats, between the turns
                        await bench.serve(tokens(rng, 6 * BLOCK + 1), max_tokens=2 * BLOCK)
            status = bench.engine.tier_status()
            report.line({
                "measure": "knobs", "store_threshold": threshold, "store_outputs": outputs, "eviction": eviction,
                "conversation_prompt_tokens": served, "cached": cached, "from_tier": host,
                "from_engine": cached - host, "hit": round(cached / served, 3),
                "tier_stored_blocks": status.stored_blocks if status else 0,
                "tier_evicted_blocks": status.evicted_blocks if status else 0,
            })
        finally:
            await bench.engine.shutdown()


async def export(model: Path, repeats: int, report: Report) -> None:
    bench = await start(model, TierConfig(host_bytes=64 << 20), pulls=True)
    rng = random.Random(3)
    rows: list[dict[str, Any]] = []
    try:
        for blocks in (8, 24):
            for r in range(repeats):
                prompt = tokens(rng, blocks * BLOCK + 1)
                await bench.serve(prompt)
                for where in ("engine", "tier"):
                    if where == "tier":
                        await evict(bench, rng)
                    started = time.perf_counter()
                    lease = await bench.engine.export(f"x{blocks}-{r}-{where}", prompt, ExportAsk("l", blocks, 0.01))
                    row = {
                        "measure": "export", "blocks": blocks, "from": where, "leased": len(lease.block_ids),
                        "error": lease.error, "seconds": round(time.perf_counter() - started, 4),
                    }
                    rows.append(row)
                    report.line(row)
                    await asyncio.sleep(0.05)  # the lease expires unpulled: its blocks are free again
    finally:
        await bench.engine.shutdown()
    for blocks in sorted({r["blocks"] for r in rows}):
        of = {where: [r for r in rows if r["blocks"] == blocks and r["from"] == where] for where in ("engine", "tier")}
        report.line({
            "measure": "export_summary", "blocks": blocks,
            "leased_whole": {where: sum(r["leased"] == blocks for r in got) for where, got in of.items()},
            "exports": {where: len(got) for where, got in of.items()},
            "median_s": {where: median([r["seconds"] for r in got]) for where, got in of.items()},
        })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("loads", "knobs", "export"))
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--one-offs", type=int, default=2, help="one-off prompts after each conversation turn")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    model = args.model or tiny_model_dir()
    report = Report(args.json)
    if args.what == "loads":
        asyncio.run(loads(model, args.repeats, report))
    elif args.what == "knobs":
        asyncio.run(knobs(model, args.conversations, args.turns, args.one_offs, report))
    else:
        asyncio.run(export(model, args.repeats, report))


if __name__ == "__main__":
    main()
