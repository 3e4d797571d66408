"""The main job on a fresh machine (``make demo``): start a node on the tiny local model, send it requests, and
print what happened — completions, prefix-cache hits as the engine reported them beside the local index's
estimate, a rejected bad request, the node's status — then drain it with SIGTERM.

    python scripts/demo.py [--model models/tiny] [--keep-running]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

from p2pnode.client import build_request, collect
from p2pnode.launcher import NodeProcess, tiny_model_dir
from p2pnode.v1 import node_pb2, node_pb2_grpc

SYSTEM_PROMPT = (
    "You are a helpful assistant for the p2pnode serving mesh. Answer briefly, cite the node that served you, "
    "and never invent facts about the cluster. Every node keeps a radix tree of its cached prefixes. "
)
QUESTIONS = ["What is a prefix cache?", "Why route by the longest match?", "What does gossip spread?"]


async def wait_for_index(stub: node_pb2_grpc.NodeStub, version: int) -> node_pb2.NodeStatus:
    """KV events reach the index asynchronously; wait (briefly) until it has moved past ``version``."""
    for _ in range(100):
        status = await stub.GetStatus(node_pb2.GetStatusRequest())
        if status.index.version > version:
            return status
        await asyncio.sleep(0.05)
    return status


async def run_requests(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        print(f"\n{'request':<40} {'prompt':>6} {'cached':>6} {'index':>6} {'ttft ms':>8} {'served_by':>9}")
        version = 0
        for question in [QUESTIONS[0], *QUESTIONS]:
            result = await collect(stub, build_request(SYSTEM_PROMPT + question, max_tokens=16, seed=1))
            print(
                f"{question:<40} {result.prompt_tokens:>6} {result.cached_tokens:>6} {result.index_match_tokens:>6}"
                f" {result.timings['ttft_s'] * 1e3:>8.1f} {result.served_by:>9}"
            )
            version = (await wait_for_index(stub, version)).index.version
        print("\n'cached' is the engine's own prefix-cache hit; 'index' is what the node's radix index predicted.")
        try:
            await collect(stub, build_request("hello", temperature=-1.0))
        except grpc.aio.AioRpcError as e:
            print(f"\nbad request (temperature=-1) -> {e.code().name}: {e.details()}")
        status = await stub.GetStatus(node_pb2.GetStatusRequest())
        print(
            f"\nstatus: index {status.index.blocks} blocks (~{status.index.approx_bytes} B), "
            f"{status.kv_events.batches} KV-event batches, {status.requests_total} requests "
            f"({status.requests_rejected} rejected), kv usage {status.load.kv_usage:.1%}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=tiny_model_dir())
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--keep-running", action="store_true", help="leave the node up until Ctrl-C")
    args = parser.parse_args()
    print(f"starting node n1 on {args.model} (vLLM engine start takes ~30 s on 2 CPU cores)...")
    started = time.monotonic()
    node = NodeProcess(
        ["--model", str(args.model), "--listen", args.listen, "--node-id", "n1", "--enforce-eager",
         "--max-model-len", "1024", "--kv-cache-bytes", str(16 * 1024 * 1024)]
    ).start()
    print(f"node n1 ready on {node.address} after {time.monotonic() - started:.0f} s")
    try:
        asyncio.run(run_requests(node.address or ""))
        if args.keep_running:
            print(f"\nnode running: p2pnode generate --target {node.address} \"your prompt\"  (Ctrl-C stops)")
            node.proc.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        pass
    finally:
        code = node.terminate()
        print(f"\nSIGTERM -> node drained and exited with code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
