#!/usr/bin/env python3
"""Write the production workloads as Mooncake-format trace files, for ``p2pnode sim --trace`` and other replayers.

    python scripts/make_traces.py [--out traces] [--qps 8] [--duration 3600] [--seed 0] [--workload NAME ...]

One JSONL file per workload (``platform-chat``, ``platform-chat-long``, ``tool-agent`` by default), in Mooncake's
format: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id per full 512-token block of
the prompt, each id naming its whole prefix (ids numbered in order of first appearance, as Mooncake remaps them).

A trace has no completions, so a closed-loop step (an agent's next call, released when the previous one finishes)
gets a fixed timestamp: the previous step's arrival, plus its service time on an idle node of the default profile
(its prefill, then its output at one step per token), plus its think time. A replay under load therefore keeps the
steps' spacing of an idle mesh; the workloads themselves (``p2pnode sim --workload``) keep the closed loop.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from p2pnode.cost import DEFAULT_PROFILE, get_profile
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads import Limit, get_workloads

DEFAULT_WORKLOADS = ("platform-chat", "platform-chat-long", "tool-agent")


def service_time_s(r: SimRequest) -> float:
    """A request's time on an idle node of the default profile: its prefill, then one step per output token."""
    p = get_profile(DEFAULT_PROFILE)
    prefill = p.step_time(r.prompt_tokens, r.prompt_tokens * r.prompt_tokens * 0.5, 0, 0)
    step = p.step_time(0, 0.0, 1, r.prompt_tokens)
    return prefill + max(0, r.output_tokens - 1) * step


def timed(requests: Iterator[SimRequest]) -> Iterator[SimRequest]:
    """Every request, closed-loop followers included, in timestamp order (followers get fixed times)."""
    heap: list[tuple[float, int, SimRequest]] = []
    for r in requests:
        while heap and heap[0][0] <= r.arrival:
            yield _release(heapq.heappop(heap)[2], heap)
        heapq.heappush(heap, (r.arrival, r.rid, r))
    while heap:
        yield _release(heapq.heappop(heap)[2], heap)


def _release(r: SimRequest, heap: list[tuple[float, int, SimRequest]]) -> SimRequest:
    f = r.follow
    if f is not None:
        f.arrival = r.arrival + service_time_s(r) + r.follow_gap_s
        heapq.heappush(heap, (f.arrival, f.rid, f))
    return r


def write_trace(name: str, qps: float, duration_s: float, seed: int, path: Path) -> int:
    """Write one workload's trace; returns the number of records."""
    workload = get_workloads(name)[0]
    space = BlockSpace(workload.block_size)
    ids: dict[int, int] = {}
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for r in timed(workload.requests(qps, seed, space, Limit(duration_s=duration_s))):
            hash_ids = [ids.setdefault(h, len(ids)) for h in r.chain[: r.n_prompt_blocks]]
            record = {
                "timestamp": round(r.arrival * 1000),
                "input_length": r.prompt_tokens,
                "output_length": r.output_tokens,
                "hash_ids": hash_ids,
            }
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("traces"))
    ap.add_argument("--qps", type=float, default=8.0, help="mean request rate")
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of arrivals (Mooncake's traces: 3600)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", action="append", help="a workload to write (default: the production shapes)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.workload or DEFAULT_WORKLOADS:
        path = args.out / f"{name}.jsonl"
        n = write_trace(name, args.qps, args.duration, args.seed, path)
        print(f"{path}: {n} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
