"""The main job on a fresh machine (``make demo``): a local three-node mesh on the tiny model.

It starts three ``p2pnode serve`` processes (real vLLM engines) that join through the first one with a shared
cluster secret, waits until gossip has converged, then sends questions that share a long system prompt to
*different* nodes and prints who served each one, which policy chose it, the routing estimate and the engine's own
prefix-cache hit. Then the same through the OpenAI-compatible HTTP API (what the openai client and vllm bench serve
call), a rejected bad request, the mesh as one node sees it, and a clean SIGTERM drain of every node.

    python scripts/demo.py [--model models/tiny] [--nodes 3] [--keep-running]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from p2pnode.client import build_request, collect, wait_for_members
from p2pnode.launcher import NodeProcess, tiny_model_dir
from p2pnode.v1 import node_pb2, node_pb2_grpc

SYSTEM_PROMPT = (
    "You are a helpful assistant for the p2pnode serving mesh. Answer briefly, cite the node that served you, "
    "and never invent facts about the cluster. Every node keeps a radix tree of its cached prefixes, gossips a "
    "summary of it to its peers, and routes each request to the peer with the longest estimated match. "
)
QUESTIONS = [
    "What is a prefix cache?",
    "Why route by the longest match?",
    "What does gossip spread?",
    "What happens when a node dies?",
    "How is load kept in balance?",
]


async def stub_call(address: str, fn):
    async with grpc.aio.insecure_channel(address) as channel:
        return await fn(node_pb2_grpc.NodeStub(channel))


async def status(address: str) -> node_pb2.NodeStatus:
    return await stub_call(address, lambda s: s.GetStatus(node_pb2.GetStatusRequest(), timeout=5))


async def run(nodes: dict[str, NodeProcess]) -> None:
    ids = list(nodes)
    addresses = [nodes[i].address or "" for i in ids]
    try:
        await wait_for_members(addresses, timeout_s=30, poll_s=0.1)
    except TimeoutError as e:
        raise SystemExit(str(e)) from None
    print(f"\nmesh converged: {', '.join(f'{i}@{nodes[i].address}' for i in ids)}")

    print(f"\n{'question':<34} {'ingress':>7} {'served_by':>9} {'policy':>6} {'estimated':>9} {'cached':>6} "
          f"{'prompt':>6} {'ttft ms':>8}")
    for k, question in enumerate(QUESTIONS):
        ingress = ids[k % len(ids)]
        request = build_request(SYSTEM_PROMPT + question, max_tokens=16, seed=1)
        result = await stub_call(nodes[ingress].address or "", lambda s, r=request: collect(s, r, timeout=60))
        print(f"{question:<34} {result.ingress:>7} {result.served_by:>9} {result.policy:>6} "
              f"{result.estimated_match_tokens:>9} {result.cached_tokens:>6} {result.prompt_tokens:>6} "
              f"{result.timings['ttft_s'] * 1e3:>8.1f}")
        if k == 0:
            # Give gossip a moment to spread the first node's new cache summary (a few 0.2 s rounds).
            await asyncio.sleep(1.0)
    print("\n'estimated' is the ingress's routing estimate of the serving node's cached prefix (from gossip);")
    print("'cached' is what that node's engine actually reused. The questions share the system prompt, so after")
    print("the first one they go to the node that holds it, whichever node the client called, while that is the")
    print("cheaper place; a node that holds nothing yet may be given one instead (p2p fills empty nodes).")

    print("\nthe OpenAI-compatible HTTP API, chat completions (the model's chat template) to two different nodes:")
    for ingress, question in ((ids[0], "What is gossip?"), (ids[-1], "Who holds the prefix?")):
        reply = await asyncio.to_thread(chat, nodes[ingress].http_address or "", question)
        info, usage = reply["choices"][0]["p2pnode"], reply["usage"]
        print(f"  POST http://{nodes[ingress].http_address}/v1/chat/completions -> served by {info['served_by']} "
              f"({info['policy']}), cached {usage['prompt_tokens_details']['cached_tokens']} of "
              f"{usage['prompt_tokens']} prompt tokens")
        await asyncio.sleep(1.0)  # gossip spreads the new cache summary

    try:
        await stub_call(addresses[-1], lambda s: collect(s, build_request("hello", top_p=1.5)))
    except grpc.aio.AioRpcError as e:
        print(f"\nbad request (top_p=1.5) -> {e.code().name}: {e.details()}")

    s = await status(addresses[-1])
    print(f"\nthe mesh as {s.node_id} sees it:")
    print(f"  {'member':<8} {'state':<7} {'running':>7} {'kv':>6} {'summary hashes':>14} {'info age s':>10}")
    for m in s.members:
        print(f"  {m.node_id:<8} {m.state:<7} {m.running:>7} {m.kv_usage:>6.1%} {m.summary_hashes:>14} "
              f"{max(m.info_age_s, 0):>10.2f}")
    r = s.routing
    print(f"  routing at {s.node_id}: policy {r.policy}, {r.served_locally} served here, {r.forwarded} forwarded, "
          f"{r.retries} retries; gossip sent {s.gossip_counters.get('bytes_sent', 0)} bytes")


def chat(http_address: str, question: str) -> dict:
    """One chat completion over plain HTTP (the model is the node's only one)."""
    models = json.load(urllib.request.urlopen(f"http://{http_address}/v1/models", timeout=10))
    body = {"model": models["data"][0]["id"], "max_tokens": 16,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]}
    request = urllib.request.Request(f"http://{http_address}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=60))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=tiny_model_dir())
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--keep-running", action="store_true", help="leave the mesh up until Ctrl-C")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="p2pnode-demo-"))
    secret = tmp / "cluster-secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    common = ["--model", str(args.model), "--enforce-eager", "--max-model-len", "1024",
              "--kv-cache-bytes", str(16 * 1024 * 1024), "--cluster-secret-file", str(secret),
              "--gossip-profile", "local", "--http-listen", "127.0.0.1:0"]  # HTTP on a port the kernel picks: the
    # one derived from n1's gRPC port (+1000) may be in the ephemeral range, taken by the nodes starting beside it
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    print(f"starting {args.nodes} nodes on {args.model} (each vLLM engine takes ~20-40 s to start on 2 cores)...")
    started = time.monotonic()
    nodes: dict[str, NodeProcess] = {}
    try:
        seed = f"127.0.0.1:{free_port()}"  # n1's address, known up front so that all nodes start at once
        for i in range(1, args.nodes + 1):
            where = ["--listen", seed] if i == 1 else ["--listen", "127.0.0.1:0", "--seeds", seed]
            nodes[f"n{i}"] = NodeProcess([*common, *where, "--node-id", f"n{i}"], env=env, log_path=tmp / f"n{i}.log")
        threads = [threading.Thread(target=n.start) for n in nodes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(n.address is None for n in nodes.values()):
            raise SystemExit(f"a node failed to start; logs in {tmp}")
        print(f"{len(nodes)} nodes ready after {time.monotonic() - started:.0f} s (logs in {tmp})")
        asyncio.run(run(nodes))
        if args.keep_running:
            print(f"\nmesh running: p2pnode generate --target {nodes['n1'].address} --json \"...\"  (Ctrl-C stops)")
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        codes = {k: n.terminate() for k, n in nodes.items()}
        print(f"\nSIGTERM -> every node drained, left the mesh and exited: {codes}")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
