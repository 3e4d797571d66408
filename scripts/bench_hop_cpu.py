"""Where a forwarding hop's time goes, by process: CPU per request of the ingress, the serving node and the client.

    python scripts/bench_hop_cpu.py [--json] [--requests 1000] [--rounds 2] [--max-tokens 1] [--gossip-profile local]

On a 2-core host, three busy processes share two cores, so what a hop adds to time to first token follows the CPU
each process spends per request. Two ``p2pnode serve`` processes on the simulated engine (gossip with a cluster
secret, as ``bench_forward.py`` starts them): B holds a 256-token prefix; requests continuing it go to B directly
("local") and to A, which forwards them to B ("forwarded"), in blocks of ``--requests`` one at a time, the two ways
in turn for ``--rounds`` rounds. Reported per way and round: each process's CPU time per request (``/proc``, whole
process: its gossip included, ``--gossip-profile`` sets its rate), the wall time per request and the client's TTFT
p50. A forwarded request's cost at A beside a local one's at B is what the hop's ingress spends: its own call in, the
decision, the sealed ``Forward`` call out and the relayed answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from p2pnode.client import build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_forward import heard_of_summary, start_pair  # its node pair and its wait, as it runs them

WARMUP = 50


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(a: NodeProcess, b: NodeProcess, requests: int, rounds: int, max_tokens: int) -> dict[str, object]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(256)]
    pids = {"A": a.proc.pid, "B": b.proc.pid}  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(b.address or "") as channel:
        await collect(node_pb2_grpc.NodeStub(channel), build_request([*prefix, 1], max_tokens=1))
    if not await heard_of_summary(a.address or ""):
        raise SystemExit("A never heard of B's cache summary")
    rows: list[dict[str, object]] = []
    async with grpc.aio.insecure_channel(a.address or "") as ca, grpc.aio.insecure_channel(b.address or "") as cb:
        for round_no in range(rounds):
            for way, channel in (("local", cb), ("forwarded", ca)):
                stub = node_pb2_grpc.NodeStub(channel)
                for i in range(WARMUP):
                    await collect(stub, build_request([*prefix, 2 + i], max_tokens=max_tokens, ignore_eos=True))
                before = {name: process_cpu_s(pid) for name, pid in pids.items()}
                client0, wall0 = time.process_time(), time.perf_counter()
                ttft = []
                for i in range(requests):
                    request = build_request([*prefix, 2 + i % 400], max_tokens=max_tokens, ignore_eos=True)
                    r = await collect(stub, request)
                    if r.served_by != "B":
                        raise SystemExit(f"{way} request served by {r.served_by}, expected B")
                    ttft.append(r.client_ttft_s)
                wall = time.perf_counter() - wall0
                row: dict[str, object] = {"round": round_no + 1, "way": way}
                for name, pid in pids.items():
                    row[f"{name}_cpu_ms"] = round(1e3 * (process_cpu_s(pid) - before[name]) / requests, 3)
                row["client_cpu_ms"] = round(1e3 * (time.process_time() - client0) / requests, 3)
                row["wall_ms"] = round(1e3 * wall / requests, 3)
                row["ttft_ms_p50"] = round(1e3 * statistics.median(ttft), 3)
                rows.append(row)
    return {"requests": requests, "rounds": rounds, "max_tokens": max_tokens, "prompt_tokens": 257, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per way and round (default 1000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two ways in turn (default 2)")
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (default 1)")
    parser.add_argument("--gossip-profile", default="local", help="the nodes' gossip profile (default local: 0.2 s)")
    parser.add_argument("--no-peer-links", action="store_true",
                        help="the nodes forward by a call per request (serve --no-peer-links), not over a link")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--requests, --rounds and --max-tokens must be >= 1")
    if not Path("/proc/self/stat").exists():
        parser.error("needs /proc (Linux) to read each process's CPU time")
    model = ["--engine", "sim", "--model", "sim", "--max-model-len", "2048"]
    if args.no_peer_links:
        model.append("--no-peer-links")
    a, b = start_pair(model, Path(tempfile.mkdtemp(prefix="bench-hop-cpu-")), args.gossip_profile)
    try:
        out = asyncio.run(measure(a, b, args.requests, args.rounds, args.max_tokens))
    finally:
        a.terminate()
        b.terminate()
    out["gossip_profile"] = args.gossip_profile
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"CPU per request by process, ms ({args.requests} requests of 257 prompt and {args.max_tokens} output tokens "
          f"per way and round, one at a time; gossip profile {args.gossip_profile})")
    print(f"{'round':>5} {'way':<10}{'A cpu':>8}{'B cpu':>8}{'client':>8}{'wall':>8}{'ttft p50':>10}")
    for row in out["rows"]:  # type: ignore[union-attr]
        print(f"{row['round']:>5} {row['way']:<10}{row['A_cpu_ms']:>8.3f}{row['B_cpu_ms']:>8.3f}"
              f"{row['client_cpu_ms']:>8.3f}{row['wall_ms']:>8.3f}{row['ttft_ms_p50']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
