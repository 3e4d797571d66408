#!/usr/bin/env python
"""What approximate segment reuse changes in a real engine's output, and what moving a segment costs.

A mechanics check, not a quality measurement: the tiny local model has random weights, so how far its output moves
says nothing about answers a trained model would give (KV-Repurpose and CacheBlend measure quality: kept on
single-document tasks, lost on cross-document reasoning). What it does show: how far reusing segments computed after
other contexts moves the output, that re-rotating their keys matters (the same run with the rotation skipped), and
that the load itself is cheap.

For each segment count k: P prompts ``[BOS][system][doc1][sep][doc2]...[question]``, each document first computed
(approximate mode) after another system prompt, at another position; then the prompt is served
- as a plain prompt (a full prefill: the reference),
- in approximate mode (the documents loaded from the store, keys re-rotated),
- in approximate mode on an engine that skips the re-rotation.
Reported per k: first-token agreement with the reference, the greedy tokens' positional agreement over the first
``--tokens`` tokens, the mean KL divergence KL(reference || approximate) of the first generated position's full
next-token distribution (all 512 tokens of the tiny model), the tokens loaded, and the phases. And the cost: keys
re-rotated and written into the KV cache, microseconds per token (CPU, in-process, no engine).

    python scripts/segment_divergence.py            # the table
    python scripts/segment_divergence.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.cache.segments import SegmentReuse, SegmentSpans, segment_key
from p2pnode.config import EngineConfig, KvSetup, SegmentConfig
from p2pnode.engine.base import GenerationChunk
from p2pnode.launcher import tiny_model_dir
from p2pnode.request import Request, SamplingOptions

BLOCK_SIZE = 32
VOCAB = 512
BOS = 1


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Runner:
    """One engine, with a request counter."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.n = 0

    async def run(
        self, prompt: list[int], options: SamplingOptions, spans: list[tuple[int, int]] | None = None
    ) -> tuple[list[GenerationChunk], float]:
        self.n += 1
        segments = None
        if spans is not None:
            keys = tuple(segment_key("", prompt[s:e]) for s, e in spans)
            segments = SegmentSpans(SegmentReuse.APPROXIMATE, tuple(spans), keys)
        started = time.perf_counter()
        chunks = [c async for c in self.engine.generate(Request(f"d{self.n}", prompt, options, segments=segments))]
        return chunks, time.perf_counter() - started


def _layout(rng: random.Random, docs: list[list[int]], system: int, question: int) -> tuple[list[int], list]:
    prompt = [BOS, *_tokens(rng, system)]
    spans = []
    for i, doc in enumerate(docs):
        if i:
            prompt += _tokens(rng, 3)  # a separator between documents
        spans.append((len(prompt), len(prompt) + len(doc)))
        prompt += doc
    return prompt + _tokens(rng, question), spans


def _distribution(chunks: list[GenerationChunk]) -> dict[int, float]:
    first = next(p for c in chunks for p in c.logprobs)
    return {t.token_id: t.logprob for t in first.top}


def _kl(p_log: dict[int, float], q_log: dict[int, float]) -> float:
    floor = min(q_log.values()) - 10.0  # a token q did not list: far below its least likely
    return sum(math.exp(lp) * (lp - q_log.get(t, floor)) for t, lp in p_log.items())


def _agreement(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    return sum(x == y for x, y in zip(a[:n], b[:n], strict=True)) / n if n else 0.0


async def _start(rotate: bool, tmp: Path) -> Runner:
    from p2pnode.engine.vllm_engine import VllmEngine

    config = EngineConfig(
        model=tiny_model_dir(), block_size=BLOCK_SIZE, max_model_len=4096, kv_cache_bytes=64 << 20,
        enforce_eager=True, engine_nice=0, engine_args=(("max_logprobs", VOCAB),),
    )
    engine = VllmEngine(config, run_dir=tmp / ("rot" if rotate else "norot"),
                        kv=KvSetup(segments=SegmentConfig(store_bytes=256 << 20, rotate=rotate)))
    await engine.start(lambda events: None)
    return Runner(engine)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    greedy = SamplingOptions(max_tokens=args.tokens, temperature=0.0, top_p=1.0, top_k=0, logprobs=VOCAB)
    rows = []
    with tempfile.TemporaryDirectory(prefix="segdiv-") as tmp:
        runners = {True: await _start(True, Path(tmp)), False: await _start(False, Path(tmp))}
        try:
            for k in args.counts:
                stats: dict[str, list[float]] = {m: [] for m in (
                    "first_rot", "first_norot", "agree_rot", "agree_norot", "kl_rot", "kl_norot", "loaded",
                    "phases", "full_s", "approx_s")}
                for p in range(args.prompts):
                    rng = random.Random(f"segdiv-{k}-{p}")
                    docs = [_tokens(rng, rng.randint(args.doc_min, args.doc_max)) for _ in range(k)]
                    prompt, spans = _layout(rng, docs, rng.randint(30, 90), 12)
                    outputs = {}
                    for rotate, runner in runners.items():
                        for doc in docs:  # each document computed elsewhere first: another context, another place
                            other, other_spans = _layout(rng, [doc], rng.randint(20, 120), 8)
                            await runner.run(other, greedy, other_spans)
                        outputs[rotate] = await runner.run(prompt, greedy, spans)
                    reference, full_s = await runners[True].run(prompt, greedy)
                    ref_tokens = [t for c in reference for t in c.token_ids]
                    ref_dist = _distribution(reference)
                    for rotate, (chunks, seconds) in outputs.items():
                        tag = "rot" if rotate else "norot"
                        got = [t for c in chunks for t in c.token_ids]
                        stats[f"first_{tag}"].append(float(got[:1] == ref_tokens[:1]))
                        stats[f"agree_{tag}"].append(_agreement(got, ref_tokens))
                        stats[f"kl_{tag}"].append(_kl(ref_dist, _distribution(chunks)))
                        if rotate:
                            outcome = chunks[-1].segments
                            stats["loaded"].append(outcome.loaded_tokens if outcome else 0)
                            stats["phases"].append(outcome.phases if outcome else 0)
                            stats["approx_s"].append(seconds)
                    stats["full_s"].append(full_s)
                mean = {m: sum(v) / len(v) for m, v in stats.items()}
                rows.append({"segments": k, "prompts": args.prompts, **{m: round(v, 4) for m, v in mean.items()}})
        finally:
            for runner in runners.values():
                await runner.engine.shutdown()
    return {"rows": rows, "rotation_cost": rotation_cost(), "model": "tiny (random weights)", "tokens": args.tokens}


def rotation_cost(tokens: int = 2048, repeats: int = 20) -> dict[str, float]:
    """Microseconds per token to re-rotate a segment's keys and write its K/V into a KV-cache layer (the tiny
    model's shapes: 2 KV heads x 64, bf16; times its 2 layers for a whole load), on one thread like the engines
    here (on a host shared with other work, torch's spinning threads cost 100x more)."""
    import torch

    torch.set_num_threads(1)
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from p2pnode.kv.plain import TokenCodec, slots_of
    from p2pnode.kv.rope import Rerotation

    rotation = Rerotation.for_model(VllmConfig(model_config=ModelConfig(model=str(tiny_model_dir()))))
    heads, head = 2, 64
    isa = _get_attn_isa(torch.bfloat16, BLOCK_SIZE, head)
    codec = TokenCodec.probe(isa, torch.bfloat16, BLOCK_SIZE, head)
    blocks = tokens // BLOCK_SIZE + 1
    layer = torch.zeros(blocks, heads, BLOCK_SIZE, 2 * head, dtype=torch.bfloat16)
    keys = torch.randn(tokens, heads, head).to(torch.bfloat16)
    values = torch.randn(tokens, heads, head).to(torch.bfloat16)
    slots = slots_of(list(range(blocks)), 0, tokens, BLOCK_SIZE)
    timings = {}
    for name, fn in (
        ("rotate_us_per_token", lambda: rotation.shift(keys, 1234)),
        ("write_us_per_token", lambda: codec.write(layer, slots, keys, values)),
        ("read_us_per_token", lambda: codec.read(layer, slots)),
    ):
        fn()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        timings[name] = round((time.perf_counter() - started) / repeats / tokens * 1e6, 3)
    return timings


def print_table(result: dict[str, Any]) -> None:
    print(f"approximate segments vs a full prefill, model {result['model']}, greedy, {result['tokens']} tokens")
    print("| segments | prompts | tokens loaded | phases | first token agrees (rotated / not) | "
          "greedy agreement (rotated / not) | KL first position, nats (rotated / not) | full prefill s | approx s |")
    print("|---:|---:|---:|---:|---|---|---|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['segments']} | {r['prompts']} | {r['loaded']:.0f} | {r['phases']:.1f} | "
              f"{r['first_rot']:.2f} / {r['first_norot']:.2f} | {r['agree_rot']:.2f} / {r['agree_norot']:.2f} | "
              f"{r['kl_rot']:.4f} / {r['kl_norot']:.4f} | {r['full_s']:.3f} | {r['approx_s']:.3f} |")
    c = result["rotation_cost"]
    print(f"moving a segment, per token per layer: rotate {c['rotate_us_per_token']} us, write "
          f"{c['write_us_per_token']} us, read {c['read_us_per_token']} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per segment count")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens generated per prompt")
    parser.add_argument("--doc-min", type=int, default=150)
    parser.add_argument("--doc-max", type=int, default=400)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two engines on a shared host, as in the tests
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
