#!/usr/bin/env python3
"""One cache's bounds on a segmented workload (``p2pnode/sim/segment_bounds.py``): the token hit an LRU over pieces of
a given size reaches with prefix caching and with segment reuse, per node and for the whole mesh's KV -- what a run's
hit is read against.

    python scripts/segment_bounds.py --workload ragpulse-shaped                      # 7,000 requests, seed 0
    python scripts/segment_bounds.py --trace ragpulse.jsonl --kv-tokens 200000,404000,1000000 --nodes 16
    python scripts/segment_bounds.py --workload rag --requests 8000 --warmup 0.3 --json
    python scripts/segment_bounds.py --workload ragpulse-shaped --requests 16000 --kv-tokens 403916 --routed

Sources: a segmented trace (``--trace``, docs/simulator.md "Segmented traces"), or a generated workload whose prompts
name their pieces (``ragpulse-shaped``, ``ragpulse-shaped-history``, ``rag``: its documents are the segments) at
``--seed``, as ``p2pnode sim`` generates it. ``--warmup``: the share of requests, first in arrival order, that fill the
cache unmeasured (``p2pnode sim``'s default 0.2; ``scripts/bench_segments.py`` measures after 0.3). ``--routed``: also
the reference of a mesh that moves no KV (``segment_bounds.routed``: ``--nodes`` caches of the size, every request
routed to the one holding most of it under a load bound) -- what a mesh without pulls is read against; ~1 minute per
size at 16 nodes and 16,000 requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.sim.segment_bounds import bounds, routed
from p2pnode.sim.workloads import Limit, Rag, RagPulseShaped, SegmentedTraceWorkload, get_workloads
from p2pnode.sim.workloads.segmented_trace import SegmentedPiece, SegmentedRecord

DEFAULT_KV_TOKENS = "200000,403916,1000000"
DEFAULT_REQUESTS = 7000


def records(args: argparse.Namespace) -> Iterator[SegmentedRecord]:
    """The requests of the source the flags name, in arrival order."""
    limit = Limit(max_requests=args.requests)
    if args.trace:
        trace = SegmentedTraceWorkload(args.trace, time_unit=args.trace_time_unit)
        yield from (rec for _, rec in trace.records_for(None, args.seed, limit))
        return
    (workload,) = get_workloads(args.workload)
    if isinstance(workload, RagPulseShaped):
        yield from (rec for _, rec in workload.records_for(1.0, args.seed, limit))
    elif isinstance(workload, Rag):
        for prompt in workload.prompts(1.0, args.seed, limit):
            pieces = tuple(SegmentedPiece(p.kind, str(p.ident), p.tokens, p.kind == "doc") for p in prompt.prompt)
            yield SegmentedRecord(prompt.arrival * 1000.0, pieces, prompt.answer.tokens)
    else:
        raise ValueError(f"{args.workload} names no pieces; give ragpulse-shaped, ragpulse-shaped-history or rag")


def run(args: argparse.Namespace) -> dict:
    sizes = [int(float(x)) for x in args.kv_tokens.split(",")]
    mesh_sizes = [args.nodes * n for n in sizes] if args.nodes > 1 else []
    recs = list(records(args))
    found = bounds(recs, sizes + mesh_sizes, args.warmup)
    one, mesh = found[: len(sizes)], found[len(sizes) :]
    moved_none = [routed(recs, args.nodes, n, args.warmup) for n in sizes] if args.routed and mesh_sizes else []
    return {
        "source": args.trace or args.workload,
        "seed": None if args.trace else args.seed,
        "requests": len(recs),
        "warmup": args.warmup,
        "nodes": args.nodes,
        "one_cache": [asdict(b) for b in one],
        "mesh": [asdict(b) for b in mesh],
        "routed": moved_none,
    }


def table(result: dict) -> str:
    mesh = result["mesh"]
    head = "| KV tokens per node | prefix caching bound | segment reuse bound |"
    sep = "|---:|---:|---:|"
    if mesh:
        head += f" mesh KV ({result['nodes']} nodes) | mesh prefix bound | mesh segment bound |"
        sep += "---:|---:|---:|"
    if result["routed"]:
        head += " routed, no KV moved |"
        sep += "---:|"
    lines = [
        f"{result['source']}: {result['requests']:,} requests, the first {result['warmup']:g} unmeasured",
        "",
        head,
        sep,
    ]
    for i, b in enumerate(result["one_cache"]):
        row = f"| {b['kv_tokens']:,} | {b['prefix']:.4f} | {b['segments']:.4f} |"
        if mesh:
            m = mesh[i]
            row += f" {m['kv_tokens']:,} | {m['prefix']:.4f} | {m['segments']:.4f} |"
        if result["routed"]:
            row += f" {result['routed'][i]:.4f} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a segmented JSONL trace")
    src.add_argument("--workload", help="ragpulse-shaped, ragpulse-shaped-history or rag")
    ap.add_argument("--trace-time-unit", choices=("s", "ms"), default=None, help="when the trace's header says none")
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests (a workload's default {DEFAULT_REQUESTS:,}; a trace's: all)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-tokens", default=DEFAULT_KV_TOKENS, help="comma list of KV sizes per node, in tokens")
    ap.add_argument("--nodes", type=int, default=16, help="the mesh's nodes, for the mesh-wide bound (1: none)")
    ap.add_argument("--warmup", type=float, default=0.2)
    ap.add_argument("--routed", action="store_true", help="also the reference of a mesh that moves no KV (slow)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.requests is None and not args.trace:
        args.requests = DEFAULT_REQUESTS
    if args.requests is None:
        args.requests = sys.maxsize
    try:
        result = run(args)
    except ValueError as e:
        print(f"segment_bounds: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
