"""What a relay's transport adds to one hop, p2pnode's code left out: a gRPC call per request, or one long-lived stream.

    python scripts/bench_relay_transport.py [--json] [--requests 2000] [--rounds 3] [--tokens 4096]

A forwarded request crosses a relay: the client calls node A, A calls node B, B answers through A. docs/results.md
("forwarding") breaks p2pnode's hop down: most of it is the second gRPC call, and a relay with empty handlers already
adds ~0.5 ms on this host. This measures that floor for two transports, with no p2pnode code on the path (bytes in,
bytes out, grpc.aio with uvloop as a node runs):

- ``unary``: the relay makes one server-streaming call to B per request (what a node does today);
- ``stream``: the relay keeps one bidirectional stream to B open and multiplexes requests on it (an 8-byte request id
  before each frame; the answer is routed back by it) -- the design a hop under 0.5 ms would need.

Three processes (B, A, the client) on one host; the client sends ``--requests`` requests one at a time (a prompt of
``--tokens`` x 4 bytes, a 32-byte answer) straight to B, through A by a call, and through A's stream, in turn, for
``--rounds`` rounds; reported: each way's median per round and what the relay adds over the direct call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

SERVICE = "relaybench.S"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
WARMUP = 200
ID_BYTES = 8


def _same(b: bytes) -> bytes:
    return b


async def _serve(port: int, methods: dict[str, grpc.RpcMethodHandler]) -> None:
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def upstream(port: int) -> None:
    """Node B: answers the first 32 bytes of what it is sent, per call or per stream frame."""

    async def generate(request: bytes, _: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield request[:32]

    async def frames(requests: AsyncIterator[bytes], _: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for frame in requests:
            yield frame[: ID_BYTES + 32]

    await _serve(port, {
        "Generate": grpc.unary_stream_rpc_method_handler(generate, _same, _same),
        "Frames": grpc.stream_stream_rpc_method_handler(frames, _same, _same),
    })


async def relay(port: int, upstream_port: int) -> None:
    """Node A: relays each call to B by a call of its own (``Generate``) or over its one stream (``GenerateStream``)."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream_port}", options=OPTIONS)
    call_upstream = channel.unary_stream(f"/{SERVICE}/Generate", _same, _same)
    outgoing: asyncio.Queue[bytes] = asyncio.Queue()
    answers: dict[bytes, asyncio.Future[bytes]] = {}
    next_id = 0

    async def sent() -> AsyncIterator[bytes]:
        while True:
            yield await outgoing.get()

    stream = channel.stream_stream(f"/{SERVICE}/Frames", _same, _same)(sent())

    async def route_answers() -> None:
        async for frame in stream:
            waiter = answers.pop(frame[:ID_BYTES], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(frame[ID_BYTES:])

    reader = asyncio.ensure_future(route_answers())

    async def by_call(request: bytes, _: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for answer in call_upstream(request):
            yield answer

    async def by_stream(request: bytes, _: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        nonlocal next_id
        next_id += 1
        key = next_id.to_bytes(ID_BYTES, "little")
        waiter = asyncio.get_running_loop().create_future()
        answers[key] = waiter
        outgoing.put_nowait(key + request)
        yield await waiter

    try:
        await _serve(port, {
            "Generate": grpc.unary_stream_rpc_method_handler(by_call, _same, _same),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(by_stream, _same, _same),
        })
    finally:
        reader.cancel()


async def measure(upstream_port: int, relay_port: int, requests: int, rounds: int, tokens: int) -> dict[str, Any]:
    prompt = os.urandom(4 * tokens)
    ways = (("direct", upstream_port, "Generate"), ("unary", relay_port, "Generate"),
            ("stream", relay_port, "GenerateStream"))
    medians: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    for _ in range(rounds):
        for name, port, method in ways:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
                call = channel.unary_stream(f"/{SERVICE}/{method}", _same, _same)
                times = []
                for i in range(WARMUP + requests):
                    t0 = time.perf_counter()
                    async for _ in call(prompt):
                        pass
                    if i >= WARMUP:
                        times.append(time.perf_counter() - t0)
                medians[name].append(statistics.median(times) * 1e3)
    added = {way: [round(m - d, 3) for m, d in zip(medians[way], medians["direct"], strict=True)]
             for way in ("unary", "stream")}
    return {"requests": requests, "rounds": rounds, "tokens": tokens,
            "p50_ms": {k: [round(v, 3) for v in vs] for k, vs in medians.items()}, "added_p50_ms": added,
            "added_p50_ms_median": {k: round(statistics.median(v), 3) for k, v in added.items()}}


def _start(role: str, *ports: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, __file__, "--role", role, *map(str, ports)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the {role} process did not start")
    return proc


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per way and round (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three ways in turn (default 3)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt size in tokens, 4 bytes each (default 4096)")
    parser.add_argument("--upstream-port", type=int, default=50471)
    parser.add_argument("--relay-port", type=int, default=50472)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)  # children: upstream PORT / relay PORT UP
    args = parser.parse_args()
    _install_uvloop()
    if args.role:
        role, *ports = args.role
        asyncio.run(upstream(int(ports[0])) if role == "upstream" else relay(int(ports[0]), int(ports[1])))
        return 0
    if args.requests < 1 or args.rounds < 1 or args.tokens < 0:
        parser.error("--requests and --rounds must be >= 1, --tokens >= 0")
    children = [_start("upstream", args.upstream_port)]
    try:
        children.append(_start("relay", args.relay_port, args.upstream_port))
        out = asyncio.run(measure(args.upstream_port, args.relay_port, args.requests, args.rounds, args.tokens))
    finally:
        for child in children:
            child.kill()
            child.wait()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.tokens}-token prompts, {args.requests} requests one at a time per way and round, medians (ms)")
    print(f"{'way':<8}" + "".join(f"{'round ' + str(i + 1):>10}" for i in range(args.rounds)) + f"{'added':>10}")
    for way, values in out["p50_ms"].items():
        added = "" if way == "direct" else f"{out['added_p50_ms_median'][way]:>+10.3f}"
        print(f"{way:<8}" + "".join(f"{v:>10.3f}" for v in values) + added)
    return 0


if __name__ == "__main__":
    sys.exit(main())
