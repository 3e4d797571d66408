"""Forwarding cost and routing-decision latency.

    python scripts/bench_forward.py [--json] [--requests 200] [--engine sim|vllm] [--prompt-tokens 257]
    python scripts/bench_forward.py --decisions-only --peers 64,256,1000 --tokens 4096

1. **Forwarding over loopback**: two real ``p2pnode serve`` processes (gossip with a cluster secret). Node B holds a
   prefix; the same requests are sent to B directly (served locally) and to A (routed to B and relayed). Reported:
   client-side time to first token and tokens/s (p50/p99) both ways, and the difference — what a hop adds. The
   default engine is the simulated one, whose generation costs ~nothing, so the difference is the forwarding path
   alone; ``--engine vllm`` uses the tiny model instead.
2. **Routing decision** (``Router.route``: block hashing, the ClusterView's estimates for every peer, the speculative
   index, the p2p policy) at 8/64/256 peers (``--peers``: the three spreads at each count given) for 1k/4k/16k-token
   prompts (``--tokens``): a few peers caching a prefix, every peer caching one at its own depth, or a quarter of the
   prompt cached mesh-wide plus a few deeper holders; with and without tokenization (the tiny model's tokenizer on a
   text of the same token count), and from the prompt's wire bytes ("wire": a client's token ids as admission keeps
   them, ``Request.packed_tokens``). ``--sends N``: as a busy ingress decides, with N sends in flight from it to
   every peer since that peer's last report (each such peer is handed to the policy with its sends counted: the retry
   order ranks by them). ``--speculative K``: each prompt was just forwarded to K peers (the speculative index
   believes they hold it: a busy ingress's recent sends). ``--prompts N``: the distinct prompts every spread caches
   and the requests cycle through (8 by default: a working set that stays in the CPU's caches; a few hundred or more:
   each decision's lookups -- the summaries' inverted index, the remembered levels and snapshot variants -- reach
   memory, as over a production mesh's many prefixes). Targets: forwarding adds <= 0.5 ms p50 to TTFT; a decision <=
   50 us p99 at 64 peers and <= 100 us at 1,000 for 4k tokens, tokenization excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from p2pnode.cache.block_hash import block_hashes, token_buffer
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, encode_meta
from p2pnode.cache.summary_log import SummaryWriter, summary_key
from p2pnode.client import build_request, collect
from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.gossip import GossipConfig, SimClock
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.launcher import NodeProcess, tiny_model_dir
from p2pnode.load import LOAD_KEY, NodeLoad, encode_load
from p2pnode.request import Request, SamplingOptions
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.router import Router
from p2pnode.routing.speculative import SpeculativeIndex
from p2pnode.v1 import node_pb2, node_pb2_grpc

BS = 32
SECRET = b"bench-forward-cluster-secret"
#: The routed requests' sampling (routing reads only max_tokens).
SAMPLING = SamplingOptions(16, 1.0, 1.0, 0)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


# --- 1. forwarding over loopback ---------------------------------------------------------------------------------


async def _status(address: str) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        return await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=5)


async def heard_of_summary(a: str) -> bool:
    """Whether node A hears of B's cache summary within ~10 s (its requests for B's prefix are then forwarded)."""
    for _ in range(200):
        s = await _status(a)
        if any(m.node_id == "B" and m.summary_hashes > 0 for m in s.members):
            return True
        await asyncio.sleep(0.05)
    return False


def start_pair(model: list[str], tmp: Path, gossip_profile: str = "local",
               env: dict[str, str] | None = None) -> tuple[NodeProcess, NodeProcess]:
    """Nodes A and B (``p2pnode serve`` with ``model``'s flags), A joined through B, gossip sealed with ``SECRET``
    and logs under ``tmp``; B is terminated if A fails to start."""
    (tmp / "secret").write_bytes(SECRET)
    common = [*model, "--listen", "127.0.0.1:0", "--cluster-secret-file", str(tmp / "secret"),
              "--gossip-profile", gossip_profile]
    b = NodeProcess([*common, "--node-id", "B"], env=env, log_path=tmp / "B.log").start()
    try:
        a = NodeProcess([*common, "--node-id", "A", "--seeds", b.address or ""], env=env,
                        log_path=tmp / "A.log").start()
    except BaseException:
        b.terminate()
        raise
    return a, b


async def _measure(a: str, b: str, requests: int, max_tokens: int, prompt_tokens: int) -> dict[str, object]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(prompt_tokens - 1)]
    async with grpc.aio.insecure_channel(b) as channel:
        await collect(node_pb2_grpc.NodeStub(channel), build_request([*prefix, 1], max_tokens=1))
    await heard_of_summary(a)  # (if not, the check below that B served each request says so)
    results: dict[str, dict[str, list[float]]] = {}
    async with grpc.aio.insecure_channel(a) as ca, grpc.aio.insecure_channel(b) as cb:
        stubs = {"local": node_pb2_grpc.NodeStub(cb), "forwarded": node_pb2_grpc.NodeStub(ca)}
        for i in range(requests + 20):  # the first 20 of each warm up channels and caches
            for mode, stub in stubs.items():
                r = await collect(stub, build_request([*prefix, 2 + i % 400], max_tokens=max_tokens, ignore_eos=True))
                if i < 20:
                    continue
                if r.served_by != "B":
                    raise SystemExit(f"{mode} request served by {r.served_by}, expected B: {r}")
                if mode == "forwarded" and r.attempts != 1:
                    raise SystemExit(f"forwarded request needed {r.attempts} attempts")
                m = results.setdefault(mode, {"ttft_ms": [], "tok_s": []})
                m["ttft_ms"].append(r.client_ttft_s * 1e3)
                m["tok_s"].append(r.completion_tokens / max(r.client_total_s - r.client_ttft_s, 1e-9))
    out: dict[str, object] = {}
    for mode, m in results.items():
        out[mode] = {
            "ttft_ms_p50": round(pct(m["ttft_ms"], 0.5), 3),
            "ttft_ms_p99": round(pct(m["ttft_ms"], 0.99), 3),
            "tokens_per_s_p50": round(pct(m["tok_s"], 0.5)),
        }
    local, fwd = results["local"], results["forwarded"]
    out["added_ttft_ms_p50"] = round(pct(fwd["ttft_ms"], 0.5) - pct(local["ttft_ms"], 0.5), 3)
    out["added_ttft_ms_p99"] = round(pct(fwd["ttft_ms"], 0.99) - pct(local["ttft_ms"], 0.99), 3)
    return out


def bench_forwarding(
    requests: int, engine: str, max_tokens: int, prompt_tokens: int, peer_links: bool = True
) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-forward-"))
    if engine == "vllm":
        model = ["--model", str(tiny_model_dir()), "--enforce-eager", "--kv-cache-bytes", str(16 << 20),
                 "--max-model-len", "1024"]
    else:
        model = ["--engine", "sim", "--model", "sim", "--max-model-len", str(max(2048, prompt_tokens + max_tokens))]
    if not peer_links:
        model.append("--no-peer-links")
    a, b = start_pair(model, tmp, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    try:
        result = asyncio.run(_measure(a.address or "", b.address or "", requests, max_tokens, prompt_tokens))
    finally:
        a.terminate()
        b.terminate()
    return {"engine": engine, "requests": requests, "max_tokens": max_tokens, "prompt_tokens": prompt_tokens,
            "peer_links": peer_links, **result}


# --- 2. routing decision --------------------------------------------------------------------------------------------


def build_router(
    peers: int,
    docs: list[list[int]],
    rng: random.Random,
    holders: int | None = None,
    shared_tokens: int = 0,
    policy: str = DEFAULT_ROUTING_POLICY,
) -> Router:
    """A router whose ClusterView holds ``peers`` peers. Each document is cached (a random prefix of it) by
    ``holders`` random peers, or by every peer when None (the worst case: every peer is a candidate at its own
    depth). With ``shared_tokens``, every peer also caches each document's first ``shared_tokens`` tokens (a
    system prompt cached mesh-wide)."""
    config = GossipConfig(cluster_secret=SECRET)
    state = ClusterState("self", 1)
    membership = Membership("self", config)
    view = ClusterView(state, membership, SimClock(), block_size=BS)
    stride = config.summary_stride
    chains = [block_hashes(d, BS) for d in docs]
    for p in range(peers):
        node = f"p{p:03d}"
        view.on_node_added(node, 1)
        membership.on_node(node, 1, 0.0)
        view.on_key_changed(node, ADDRESS_KEY, f"10.0.{p // 250}.{p % 250}:50051".encode())
        load = NodeLoad(running=rng.randrange(8), waiting=rng.randrange(4), kv_usage=rng.random())
        view.on_key_changed(node, LOAD_KEY, encode_load(load))
        view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(stride, BS)))
        published = []
        for c, chain in enumerate(chains):
            for d in range(stride, shared_tokens // BS + 1, stride):
                published.append(chain[d - 1])
            if holders is not None and (p + c) % peers >= holders:
                continue
            depth = rng.randrange(0, len(chain) + 1)
            for d in range(stride, depth + 1, stride):
                published.append(chain[d - 1])
        published += [rng.getrandbits(64) for _ in range(500)]
        for key, value in SummaryWriter().update([summary_key(h) for h in published], []):
            view.on_key_changed(node, key, value)
    index = PrefixIndex(block_size=BS)
    return Router(
        "self", "127.0.0.1:1", index, lambda: NodeLoad(), view, policy=policy,
        speculative=SpeculativeIndex(),
    )


def decision_cells(peers: list[int] | None, tokens: int) -> list[tuple[int, int | None, int]]:
    """The (peers, holders -- None: every peer --, tokens every peer caches) cells timed for ``tokens``-token prompts:
    the default ones, or the three spreads (every peer caching at its own depth, four holders, four holders over a
    quarter cached mesh-wide) at each of ``peers``."""
    if peers is None:
        return [(8, None, 0), (64, None, 0), (64, 4, 0), (64, 4, tokens // 4), (256, None, 0), (256, 4, 0)]
    return [cell for p in peers for cell in ((p, None, 0), (p, 4, 0), (p, 4, tokens // 4))]


def bench_decisions(
    calls: int,
    peers: list[int] | None = None,
    prompt_tokens: tuple[int, ...] = (1024, 4096, 16384),
    sends: int = 0,
    policy: str = DEFAULT_ROUTING_POLICY,
    prompts: int = 8,
    speculative: int = 0,
) -> list[dict[str, object]]:
    rng = random.Random(1)
    tokenizer = None
    model = tiny_model_dir()
    if (model / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "routers", "gossip"]
    rows = []
    for tokens in prompt_tokens:
        docs = [[rng.randrange(3, 500) for _ in range(tokens)] for _ in range(prompts)]
        text = " ".join(rng.choice(words) for _ in range(tokens))
        if tokenizer is not None:  # trim the text to about ``tokens`` tokens
            ids = tokenizer.encode(text).ids
            text = tokenizer.decode(ids[:tokens])
        for n_peers, holders, shared in decision_cells(peers, tokens):
            router = build_router(n_peers, docs, rng, holders, shared, policy)
            now = router.clock()
            for node_id in router.peer_table(now).by_id:  # a busy ingress: sends since every peer's report, dated
                for _ in range(sends):  # after every report the run's table refreshes (each second) will read
                    router.ledger.begin(node_id, now + 3600.0, 1024)
            if speculative and router.speculative is not None:  # each prompt just forwarded to that many peers
                ids = sorted(router.peer_table(now).by_id)
                for i, doc in enumerate(docs):
                    hashes = block_hashes(doc, BS)
                    for k in range(speculative):  # recorded as of an hour on: unexpired through the run
                        router.speculative.record(ids[(i * speculative + k) % len(ids)], hashes, now + 3600.0)
            n = max(2000, calls * 1024 // tokens)  # p99 from at least 20 samples above it
            gc.collect()
            gc.disable()
            try:
                samples, cpu = [], []
                requests = [Request(f"r{i}", docs[i % len(docs)], SAMPLING) for i in range(n)]
                for request in requests:
                    c, t = time.thread_time_ns(), time.perf_counter_ns()
                    router.route(request)
                    samples.append((time.perf_counter_ns() - t) / 1000)
                    cpu.append((time.thread_time_ns() - c) / 1000)
                # the same prompts as a node holds a client's token ids: with their wire bytes (Request.packed_tokens)
                # Three passes over them: the first is the wire's figure; each request's median of its three (apart
                # by a whole pass, so a periodic interrupt of the host -- this VM's 4 ms tick costs ~30 us -- seldom
                # hits the same request twice) says how much of the p99 is the code's and how much the host's.
                packed = [dataclasses.replace(r, packed_tokens=bytes(token_buffer(r.tokens))) for r in requests]
                passes: list[list[float]] = []
                for _ in range(3):
                    wire = []
                    for request in packed:
                        t = time.perf_counter_ns()
                        router.route(request)
                        wire.append((time.perf_counter_ns() - t) / 1000)
                    passes.append(wire)
                wire = passes[0]
                medians = [sorted(times)[1] for times in zip(*passes, strict=True)]
                with_tok = []
                if tokenizer is not None:
                    for i in range(max(50, n // 4)):
                        t = time.perf_counter_ns()
                        ids = tokenizer.encode(text).ids
                        router.route(Request(f"t{i}", ids, SAMPLING))
                        with_tok.append((time.perf_counter_ns() - t) / 1000)
            finally:
                gc.enable()
            rows.append({
                "policy": policy,
                "peers": n_peers,
                "holders": holders or n_peers,
                "shared_prefix_tokens": shared,  # cached by every peer
                "sends_in_flight_per_peer": sends,
                "speculative_peers_per_prompt": speculative,
                "prompts": prompts,  # distinct, each cached by the spread's holders
                "prompt_tokens": tokens,
                "decision_us_p50": round(pct(samples, 0.5), 1),
                "decision_us_p99": round(pct(samples, 0.99), 1),
                "decision_wire_us_p50": round(pct(wire, 0.5), 1),
                "decision_wire_us_p99": round(pct(wire, 0.99), 1),
                # the p99 over requests of each one's median of three passes (above): the host's interrupts left out
                "decision_wire_us_p99_of_medians": round(pct(medians, 0.99), 1),
                # CPU time of this thread: what the decision costs when other processes share the cores.
                "decision_cpu_us_p50": round(pct(cpu, 0.5), 1),
                "decision_cpu_us_p99": round(pct(cpu, 0.99), 1),
                "with_tokenize_us_p50": round(pct(with_tok, 0.5), 1) if with_tok else None,
                "with_tokenize_us_p99": round(pct(with_tok, 0.99), 1) if with_tok else None,
            })
    return rows


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--calls", type=int, default=2000, help="decisions timed per cell at 1k tokens")
    parser.add_argument("--prompt-tokens", type=int, default=8 * BS + 1,
                        help="forwarded prompts' length (a cached prefix and one token more)")
    parser.add_argument("--decisions-only", action="store_true", help="skip the forwarding part (no processes)")
    parser.add_argument("--no-peer-links", action="store_true",
                        help="the nodes forward by a call per request (serve --no-peer-links), not over a link")
    parser.add_argument("--peers", type=_int_list, default=None,
                        help="peer counts, comma-separated (e.g. 64,256,1000): time the three spreads at each "
                             "instead of the default cells")
    parser.add_argument("--tokens", type=_int_list, default=[1024, 4096, 16384],
                        help="prompt lengths, comma-separated (default 1024,4096,16384)")
    parser.add_argument("--sends", type=int, default=0,
                        help="sends in flight from this ingress to every peer since its report (default 0: idle)")
    parser.add_argument("--speculative", type=int, default=0,
                        help="peers each prompt was just forwarded to, in the speculative index (default 0)")
    parser.add_argument("--prompts", type=int, default=8,
                        help="distinct prompts cached and routed in turn (default 8: a working set the CPU caches "
                             "hold; more: lookups reach memory, as over a production mesh's many prefixes)")
    parser.add_argument("--policy", default=DEFAULT_ROUTING_POLICY,
                        help=f"the routing policy decided with (default {DEFAULT_ROUTING_POLICY}; no plan: every key "
                             "cold under cacheroute)")
    args = parser.parse_args()
    started = time.perf_counter()
    forwarding = (
        None if args.decisions_only
        else bench_forwarding(args.requests, args.engine, args.max_tokens, args.prompt_tokens, not args.no_peer_links)
    )
    decisions = bench_decisions(args.calls, args.peers, tuple(args.tokens), args.sends, args.policy, args.prompts,
                                args.speculative)
    result = {"forwarding": forwarding, "decisions": decisions, "wall_s": round(time.perf_counter() - started, 1)}
    if args.json:
        print(json.dumps(result))
        return 0
    if forwarding is not None:
        print_forwarding(forwarding)
    busy = f", {args.sends} sends in flight to every peer" if args.sends else ""
    busy += f", each just forwarded to {args.speculative} peers" if args.speculative else ""
    busy += f", {args.prompts} distinct prompts"
    print(f"\nrouting decision (Router.route, {args.policy} policy; wall clock and this thread's CPU time{busy}):")
    print(f"  {'peers':>5} {'holders':>7} {'shared':>6} {'tokens':>6} {'p50 us':>8} {'p99 us':>8} {'cpu p50':>8} "
          f"{'cpu p99':>8} {'wire p50':>8} {'wire p99':>8} {'p99 med3':>8} {'+tokenize p50':>13} {'+tokenize p99':>13}")
    for r in decisions:
        print(f"  {r['peers']:>5} {r['holders']:>7} {r['shared_prefix_tokens']:>6} {r['prompt_tokens']:>6} "
              f"{r['decision_us_p50']:>8} "
              f"{r['decision_us_p99']:>8} {r['decision_cpu_us_p50']:>8} {r['decision_cpu_us_p99']:>8} "
              f"{r['decision_wire_us_p50']:>8} {r['decision_wire_us_p99']:>8} "
              f"{r['decision_wire_us_p99_of_medians']:>8} "
              f"{r['with_tokenize_us_p50']!s:>13} {r['with_tokenize_us_p99']!s:>13}")
    print("  target: p99 <= 50 us at 64 peers and <= 100 us at 1,000, 4096 tokens, tokenization excluded")
    print("  (p99 med3: the p99 over requests of each one's median of three passes from the wire, where a periodic "
          "interrupt of the host seldom hits one request twice)")
    print(f"({result['wall_s']} s)")
    return 0


def print_forwarding(f: dict[str, Any]) -> None:
    transport = "a link per peer" if f["peer_links"] else "a call per request"
    print(f"forwarding over loopback ({f['engine']} engine, {f['requests']} requests of {f['prompt_tokens']} prompt "
          f"and {f['max_tokens']} output tokens; {transport}):")
    print(f"  {'':<10} {'ttft p50 ms':>11} {'ttft p99 ms':>11} {'tokens/s p50':>12}")
    for mode in ("local", "forwarded"):
        m = f[mode]
        print(f"  {mode:<10} {m['ttft_ms_p50']:>11} {m['ttft_ms_p99']:>11} {m['tokens_per_s_p50']:>12}")
    added = f"p50 {f['added_ttft_ms_p50']} ms, p99 {f['added_ttft_ms_p99']} ms"
    print(f"  added by the hop: {added} (target <= 0.5 ms p50)")


if __name__ == "__main__":
    sys.exit(main())
