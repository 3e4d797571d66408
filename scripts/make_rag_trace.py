#!/usr/bin/env python3
"""Write the RAG workload (``p2pnode sim --workload rag``, ``p2pnode/sim/workloads/rag.py``) as a JSONL trace with each
request's segments, for replaying against a real mesh (or ``p2pnode sim --trace``, prefix caching only).

    python scripts/make_rag_trace.py --out rag.jsonl [--qps 4] [--duration 600 | --requests N] [--seed 0]
        [--block-size 64] [--vocab-size 32000]

One JSON object per request, in arrival order:
- ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``: Mooncake's format (one id per full block of
  ``--block-size`` tokens, each naming its whole prefix), so the simulator replays it as it replays any trace;
- ``pieces``: the prompt as ``[kind, ident, tokens]`` runs in order -- ``prefix`` (the fixed 512-token prefix),
  ``system`` (one of 1,000 system prompts), ``history``, ``doc`` (document ``ident`` of 10,000), ``question`` --
  from which ``Piece(kind, ident, tokens).token_ids(vocab_size)`` rebuilds the prompt's token ids for any model's
  vocabulary (the same document has the same ids in every prompt);
- ``segments``: the documents' token ranges ``[start, end)`` in the prompt, in prompt order -- what a replayer names
  as ``GenerateRequest.segments`` (``tokens`` ranges) with the segment reuse mode it measures;
- ``class``: ``fixed-prefix``, ``system-prompt`` or ``history``;
- ``prompt_token_ids``, only with ``--vocab-size``: the rebuilt ids themselves (~6,000 per request: for short traces).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads import Limit
from p2pnode.sim.workloads.rag import BLOCK_SIZE, Rag


def write_trace(
    path: Path, qps: float, limit: Limit, seed: int, block_size: int = BLOCK_SIZE, vocab_size: int | None = None
) -> int:
    """Write the trace; returns the number of records."""
    workload = Rag()
    space = BlockSpace(block_size)
    ids: dict[int, int] = {}
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for rid, prompt in enumerate(workload.prompts(qps, seed, limit)):
            r = workload.request(rid, prompt, space.block_size)
            assert r.segments is not None
            record = {
                "timestamp": round(r.arrival * 1000, 3),
                "input_length": r.prompt_tokens,
                "output_length": r.output_tokens,
                "hash_ids": [ids.setdefault(h, len(ids)) for h in r.chain[: r.n_prompt_blocks]],
                "pieces": [[p.kind, p.ident, p.tokens] for p in prompt.prompt],
                "segments": [list(span) for span in r.segments.spans],
                "class": prompt.cls,
            }
            if vocab_size is not None:
                record["prompt_token_ids"] = [t for p in prompt.prompt for t in p.token_ids(vocab_size)]
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("rag.jsonl"))
    ap.add_argument("--qps", type=float, default=4.0, help="mean request rate (Poisson)")
    lim = ap.add_mutually_exclusive_group()
    lim.add_argument("--duration", type=float, help="seconds of arrivals (default 600)")
    lim.add_argument("--requests", type=int, help="requests (instead of --duration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per hash_ids block (default 64)")
    ap.add_argument("--vocab-size", type=int, default=None, help="also write each prompt's token ids for this vocab")
    args = ap.parse_args(argv)
    if args.vocab_size is not None and args.vocab_size < 1024:
        ap.error(f"--vocab-size must be >= 1024, got {args.vocab_size}")
    limit = Limit(max_requests=args.requests) if args.requests else Limit(duration_s=args.duration or 600.0)
    n = write_trace(args.out, args.qps, limit, args.seed, args.block_size, args.vocab_size)
    print(f"{args.out}: {n} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
