#!/usr/bin/env python3
"""Flow control's live scene: does a flood from one API key leave another key's first token alone, and is a key over
its rate limit refused by every node soon after it is over mesh-wide?

Three ``p2pnode serve --engine sim`` processes (the ``tiny-cpu`` cost profile, so that steps take real time and a
node's engine is a resource to queue for; real gossip, routing and forwarding), a small ``--max-in-flight`` so that
requests wait in the nodes' fair queues, and three keys: ``polite``, ``flood`` and ``limited`` (``rps`` set).

(a) ``polite`` sends ``--polite-rps`` requests per second, each to the next node in turn, for ``--seconds`` alone,
    then again while ``flood`` keeps ``--flood-factor`` times the mesh's engine slots busy with requests of the same
    shape through all nodes (a closed loop: whatever the mesh serves, the flood has that many times as much waiting).
    Reported: polite's p50/p99 time to first token (as its client sees it) alone and under the flood, their ratio,
    what the flood got served and refused.
(b) ``limited`` (``--limit-rps`` requests per second mesh-wide) sends ``--over`` times its limit through all three
    nodes. The moment it is over mesh-wide is when the requests the mesh admitted first exceed the bucket's burst
    plus its rate times the time since the first; reported per node: its first 429 (RESOURCE_EXHAUSTED
    ``rate limit`` with a ``retry-after``) after that moment, in gossip rounds, and the requests admitted beyond the
    limit over the run.

    python scripts/bench_flow_mesh.py            # a table
    python scripts/bench_flow_mesh.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.client import auth_metadata, collect, wait_for_members
from p2pnode.launcher import NodeProcess
from p2pnode.serving.forward import retry_after_of
from p2pnode.v1 import node_pb2, node_pb2_grpc

BLOCK = 16
VOCAB = 512
NODES = ("n1", "n2", "n3")
KEYS = {"polite": "sk-polite", "flood": "sk-flood", "limited": "sk-limited"}
#: The rate-limited key's requests: as small as a request gets (the limit counts requests).
LIMITED_PROMPT, LIMITED_MAX_TOKENS = 8, 1


@dataclass
class Latencies:
    requests: int = 0
    failed: int = 0
    p50_ttft_s: float = 0.0
    p99_ttft_s: float = 0.0
    errors: list[str] = field(default_factory=list)


@dataclass
class FloodResult:
    served: int = 0
    refused: int = 0  # overloaded (503 / RESOURCE_EXHAUSTED), as a flood beyond the queues' bound is
    failed: int = 0  # any other error


@dataclass
class FairnessResult:
    alone: Latencies
    flooded: Latencies
    flood: FloodResult
    #: The same requests under the flood sent with the flood's key: one tenant, first come first served.
    same_key: Latencies | None = None
    p50_ratio: float = 0.0
    p99_ratio: float = 0.0


@dataclass
class LimitResult:
    limit_rps: float
    sent: int = 0
    admitted: int = 0
    rate_limited: int = 0
    without_retry_after: int = 0
    other_errors: int = 0
    #: Seconds after the first request when the mesh's admissions first exceeded the limit.
    over_at_s: float | None = None
    #: Per node: gossip rounds from that moment to the node's first 429 (None: it never answered one).
    first_429_rounds: dict[str, float | None] = field(default_factory=dict)
    #: Admitted beyond burst + rate x duration over the whole run.
    admitted_over_limit: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Mesh:
    """Three nodes joined through n1, the three keys configured on each."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        secret = workdir / "secret"
        secret.write_bytes(b"bench-flow-mesh-cluster-secret")
        self.common = [
            "--model", "sim", "--engine", "sim", "--sim-profile", args.profile, "--cost-profile", args.profile,
            "--sim-kv-blocks", str(args.kv_blocks), "--block-size", str(BLOCK), "--max-model-len", "4096",
            "--max-in-flight", str(args.max_in_flight), "--gossip-interval", str(args.gossip_interval),
            "--http-listen", "off", "--stats-interval", "0", "--cluster-secret-file", str(secret),
            "--tenant", f"polite={KEYS['polite']}", "--tenant", f"flood={KEYS['flood']}",
            "--tenant", f"limited={KEYS['limited']},rps={args.limit_rps:g}",
        ]  # fmt: skip
        self.workdir = workdir
        self.nodes: dict[str, NodeProcess] = {}

    def start(self) -> None:
        for node_id in NODES:
            args = [*self.common, "--node-id", node_id, "--listen", "127.0.0.1:0"]
            if node_id != NODES[0]:
                args += ["--seeds", str(self.nodes[NODES[0]].address)]
            self.nodes[node_id] = NodeProcess(args, log_path=self.workdir / f"{node_id}.log").start(120)

    def addresses(self) -> dict[str, str]:
        return {n: str(p.address) for n, p in self.nodes.items()}

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()


class Client:
    """One stub per node; requests of random tokens (distinct prompts: no cache hit shortens one)."""

    def __init__(self, addresses: dict[str, str], seed: int) -> None:
        self.channels = {n: grpc.aio.insecure_channel(a) for n, a in addresses.items()}
        self.stubs = {n: node_pb2_grpc.NodeStub(c) for n, c in self.channels.items()}
        self.rng = random.Random(seed)

    def request(self, prompt_tokens: int, max_tokens: int) -> node_pb2.GenerateRequest:
        request = node_pb2.GenerateRequest()
        request.token_ids.ids.extend(self.rng.randrange(3, VOCAB) for _ in range(prompt_tokens))
        request.sampling.max_tokens = max_tokens
        request.sampling.ignore_eos = True
        return request

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


async def polite_run(args: argparse.Namespace, client: Client, key: str = "polite") -> Latencies:
    """``polite``'s requests at a steady rate, each to the next node in turn, for ``--seconds``, sent with ``key``'s
    API key."""
    out = Latencies()
    ttfts: list[float] = []
    metadata = auth_metadata(KEYS[key])

    async def one(node: str) -> None:
        out.requests += 1
        try:
            result = await collect(client.stubs[node], client.request(args.prompt, args.max_tokens), 60, metadata)
        except (grpc.aio.AioRpcError, RuntimeError) as e:
            out.failed += 1
            if len(out.errors) < 3:
                out.errors.append(f"{node}: {e}")
            return
        ttfts.append(result.client_ttft_s)

    tasks = []
    nodes = itertools.cycle(NODES)
    start = time.monotonic()
    for i in range(int(args.seconds * args.polite_rps)):
        await asyncio.sleep(max(start + i / args.polite_rps - time.monotonic(), 0.0))
        tasks.append(asyncio.create_task(one(next(nodes))))
    await asyncio.gather(*tasks)
    out.p50_ttft_s = round(percentile(ttfts, 0.5), 4)
    out.p99_ttft_s = round(percentile(ttfts, 0.99), 4)
    return out


async def flood_loop(args: argparse.Namespace, client: Client, node: str, result: FloodResult) -> None:
    """One of the flood's closed-loop senders, through ``node``; refused: it tries again after a short pause."""
    metadata = auth_metadata(KEYS["flood"])
    while True:
        try:
            await collect(client.stubs[node], client.request(args.prompt, args.max_tokens), 60, metadata)
            result.served += 1
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                result.refused += 1
            else:
                result.failed += 1
            await asyncio.sleep(0.05)
        except RuntimeError:
            result.failed += 1


async def fairness(args: argparse.Namespace, client: Client) -> FairnessResult:
    alone = await polite_run(args, client)
    flood = FloodResult()
    senders = args.flood_factor * args.max_in_flight * len(NODES)
    workers = [asyncio.create_task(flood_loop(args, client, NODES[i % len(NODES)], flood)) for i in range(senders)]
    try:
        await asyncio.sleep(args.settle)  # the queues fill
        served_before = flood.served
        flooded = await polite_run(args, client)
        flood.served -= served_before
        served_while_measured = flood.served
        same_key = await polite_run(args, client, "flood") if args.same_key else None
        flood.served = served_while_measured
    finally:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    result = FairnessResult(alone, flooded, flood, same_key)
    if alone.p50_ttft_s:
        result.p50_ratio = round(flooded.p50_ttft_s / alone.p50_ttft_s, 3)
        result.p99_ratio = round(flooded.p99_ttft_s / alone.p99_ttft_s, 3)
    return result


async def rate_limit(args: argparse.Namespace, client: Client) -> LimitResult:
    """``limited`` at ``--over`` times its limit through all three nodes for ``--limit-seconds``."""
    out = LimitResult(args.limit_rps)
    metadata = auth_metadata(KEYS["limited"])
    admitted_at: list[float] = []
    refused_at: dict[str, list[float]] = {n: [] for n in NODES}
    rate = args.over * args.limit_rps
    start = time.monotonic()

    async def one(node: str) -> None:
        out.sent += 1
        sent = time.monotonic() - start  # the ingress decides as the call arrives
        try:
            await collect(client.stubs[node], client.request(LIMITED_PROMPT, LIMITED_MAX_TOKENS), 30, metadata)
            admitted_at.append(sent)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (e.details() or "").startswith("rate limit"):
                out.rate_limited += 1
                refused_at[node].append(sent)
                out.without_retry_after += retry_after_of(e) is None
            else:
                out.other_errors += 1

    tasks = []
    nodes = itertools.cycle(NODES)
    for i in range(int(args.limit_seconds * rate)):
        await asyncio.sleep(max(start + i / rate - time.monotonic(), 0.0))
        tasks.append(asyncio.create_task(one(next(nodes))))
    await asyncio.gather(*tasks)
    duration = args.limit_seconds
    burst = max(args.limit_rps, 1.0)  # a bucket holds one second of its rate, at least one request
    out.admitted = len(admitted_at)
    out.admitted_over_limit = max(0, out.admitted - int(burst + args.limit_rps * duration))
    admitted_at.sort()
    for count, at in enumerate(admitted_at, 1):
        if count > burst + args.limit_rps * at:
            out.over_at_s = round(at, 3)
            break
    if out.over_at_s is not None:
        for node in NODES:
            after = [t for t in refused_at[node] if t >= out.over_at_s]
            out.first_429_rounds[node] = (
                round((min(after) - out.over_at_s) / args.gossip_interval, 2) if after else None
            )
    return out


def table(fair: FairnessResult, limit: LimitResult, args: argparse.Namespace) -> str:
    a, f = fair.alone, fair.flooded
    lines = [
        f"3 nodes (simulated {args.profile} engines, --max-in-flight {args.max_in_flight}, gossip every "
        f"{args.gossip_interval:g} s); requests of {args.prompt} prompt tokens and {args.max_tokens} output tokens",
        "",
        f"(a) polite at {args.polite_rps:g} req/s for {args.seconds:g} s, round robin over the nodes; the flood: "
        f"{args.flood_factor} x the mesh's {args.max_in_flight * len(NODES)} engine slots in closed-loop senders",
        "",
        "| polite key | requests | failed | p50 TTFT | p99 TTFT |",
        "|---|---:|---:|---:|---:|",
        f"| alone | {a.requests} | {a.failed} | {a.p50_ttft_s * 1e3:.0f} ms | {a.p99_ttft_s * 1e3:.0f} ms |",
        f"| under the flood | {f.requests} | {f.failed} | {f.p50_ttft_s * 1e3:.0f} ms | {f.p99_ttft_s * 1e3:.0f} ms |",
        f"| ratio | | | **{fair.p50_ratio:.2f}** | {fair.p99_ratio:.2f} |",
        *(
            [
                f"| under the flood, sent with the flood's key (no fair share) | {s.requests} | {s.failed} | "
                f"{s.p50_ttft_s * 1e3:.0f} ms | {s.p99_ttft_s * 1e3:.0f} ms |"
            ]
            if (s := fair.same_key) is not None
            else []
        ),
        "",
        f"flood while polite was measured: {fair.flood.served} served, {fair.flood.refused} refused as overload, "
        f"{fair.flood.failed} failed",
        *(f"  {e}" for e in a.errors + f.errors),
        "",
        f"(b) limited: rps={limit.limit_rps:g} mesh-wide, sent at {args.over:g} x that for {args.limit_seconds:g} s, "
        "round robin over the nodes",
        "",
        "| sent | admitted | admitted beyond the limit | 429 | 429 without retry-after | other errors | over at |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {limit.sent} | {limit.admitted} | {limit.admitted_over_limit} | {limit.rate_limited} | "
        f"{limit.without_retry_after} | {limit.other_errors} | "
        f"{'-' if limit.over_at_s is None else f'{limit.over_at_s:.2f} s'} |",
        "",
        "| node | first 429 after the mesh was over (gossip rounds) |",
        "|---|---:|",
        *(f"| {n} | {'never' if r is None else f'{r:.2f}'} |" for n, r in limit.first_429_rounds.items()),
    ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace, workdir: Path) -> tuple[FairnessResult, LimitResult]:
    mesh = Mesh(args, workdir)
    try:
        await asyncio.to_thread(mesh.start)
        await wait_for_members(list(mesh.addresses().values()), api_key=KEYS["polite"])
        client = Client(mesh.addresses(), args.seed)
        try:
            fair = await fairness(args, client)
            await asyncio.sleep(2 * args.gossip_interval)
            limit = await rate_limit(args, client)
        finally:
            await client.close()
    finally:
        mesh.stop()
    return fair, limit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="tiny-cpu", help="the engines' cost profile (default %(default)s)")
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per node (default %(default)s)")
    parser.add_argument("--max-in-flight", type=int, default=4, help="per node (default %(default)s)")
    parser.add_argument("--gossip-interval", type=float, default=0.5, help="seconds (default %(default)s)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default %(default)s)")
    parser.add_argument("--polite-rps", type=float, default=3.0, help="(default %(default)s)")
    parser.add_argument("--seconds", type=float, default=15.0, help="each polite window (default %(default)s)")
    parser.add_argument("--flood-factor", type=int, default=4, help="senders per engine slot (default %(default)s)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of flood before measuring")
    parser.add_argument(
        "--same-key",
        action="store_true",
        help="also send polite's requests under the flood with the flood's key (one tenant, FIFO)",
    )
    parser.add_argument("--limit-rps", type=float, default=4.0, help="the limited key's rps (default %(default)s)")
    parser.add_argument("--over", type=float, default=3.0, help="it sends this many times its limit")
    parser.add_argument("--limit-seconds", type=float, default=5.0, help="(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, help="keep the nodes' logs in this directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pnode-flow-mesh-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        fair, limit = asyncio.run(main_async(args, workdir))
    if args.json:
        report = {"args": vars(args) | {"logs": str(args.logs)}, "fairness": asdict(fair), "rate_limit": asdict(limit)}
        print(json.dumps(report, indent=2))
    else:
        print(table(fair, limit, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
