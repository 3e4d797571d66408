"""A small client for the Node API: used by ``p2pnode generate|status``, the demo, tests and benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterable, Sequence
from dataclasses import asdict, dataclass, field

import grpc

from p2pnode.config import DEFAULT_JOIN_POLL_S, DEFAULT_JOIN_TIMEOUT_S
from p2pnode.proto_json import to_plain
from p2pnode.token_wire import fill_tokens
from p2pnode.v1 import node_pb2, node_pb2_grpc


@dataclass
class GenerateResult:
    """A finished Generate call, collected from its stream."""

    text: str
    token_ids: list[int]
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    served_by: str
    index_match_tokens: int
    ingress: str = ""
    policy: str = ""
    estimated_match_tokens: int = 0
    attempts: int = 0
    #: Times the ingress continued it on another node after its node failed mid-stream.
    migrations: int = 0
    plan_epoch: int = 0
    plan_planner: str = ""
    plan_destinations: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: The KV pull of the prefix the serving node attempted before serving (holder, outcome, tokens, bytes,
    #: seconds), if any.
    pull: dict[str, object] | None = None
    #: The stored segments it tried to pull, one entry per holder (the same fields).
    segment_pulls: list[dict[str, object]] = field(default_factory=list)
    #: What segment reuse did (mode, segments, reused_segments, reused_tokens, order, phases, error), if asked.
    segments: dict[str, object] | None = None
    #: Where ``cached_tokens`` came from: gpu (the engine's cache), host, disk (its KV tiers), pulled (a peer).
    tier_hits: dict[str, int] = field(default_factory=dict)
    client_ttft_s: float = 0.0
    client_total_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def build_request(
    prompt: str | list[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
    routing_key: str = "",
    segments: Sequence[str | tuple[int, int]] = (),
    segment_reuse: str = "",
    segment_recompute_tokens: int = 0,
    model: str = "",
    cache_salt: str = "",
) -> node_pb2.GenerateRequest:
    """``segments``: reusable parts of the prompt (each its text, or a ``(start, end)`` token range) reused in
    ``segment_reuse`` mode, "exact" or "approximate" (docs/segments.md). ``model``: a served name or a LoRA
    adapter; ``cache_salt``: keep this request's KV apart from everyone else's (docs/lora.md)."""
    sampling = node_pb2.SamplingParams(stop=stop or [], ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    request = node_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling, routing_key=routing_key, model=model, cache_salt=cache_salt
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        fill_tokens(request.token_ids, "ids", prompt)
    for segment in segments:
        if isinstance(segment, str):
            request.segments.add(text=segment)
        else:
            request.segments.add(tokens=node_pb2.TokenRange(start=segment[0], end=segment[1]))
    if segment_reuse:
        request.segment_reuse = node_pb2.SegmentReuse.Value(f"SEGMENT_REUSE_{segment_reuse.upper()}")
    request.segment_recompute_tokens = segment_recompute_tokens
    return request


async def collect(
    stub: node_pb2_grpc.NodeStub,
    request: node_pb2.GenerateRequest,
    timeout: float | None = None,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> GenerateResult:
    """Run one Generate call to completion (raises grpc.aio.AioRpcError on an error status)."""
    return await collect_call(stub.Generate(request, timeout=timeout, metadata=metadata))


def pull_dict(p: node_pb2.KvPull) -> dict[str, object]:
    """A KvPull as JSON (the HTTP API's ``p2pnode.pull`` too)."""
    return {"holder": p.holder, "outcome": p.outcome, "tokens": p.tokens, "bytes": p.bytes, "seconds": p.seconds}


def _segments_dict(final: node_pb2.GenerateFinal) -> dict[str, object] | None:
    if not final.HasField("segments"):
        return None
    s = final.segments
    return {
        "mode": node_pb2.SegmentReuse.Name(s.mode).removeprefix("SEGMENT_REUSE_").lower(),
        "segments": s.segments,
        "reused_segments": s.reused_segments,
        "reused_tokens": s.reused_tokens,
        "order": list(s.order),
        "phases": s.phases,
        "error": s.error,
    }


async def collect_call(call: AsyncIterable[node_pb2.GenerateResponse]) -> GenerateResult:
    """Read a started Generate call to its final message; timings count from this call."""
    started = time.monotonic()
    first: float | None = None
    text: list[str] = []
    ids: list[int] = []
    final: node_pb2.GenerateFinal | None = None
    async for msg in call:
        if first is None and (msg.token_ids or msg.text):
            first = time.monotonic()
        text.append(msg.text)
        ids.extend(msg.token_ids)
        if msg.HasField("final"):
            final = msg.final
    if final is None:
        raise RuntimeError("stream ended without a final message")
    now = time.monotonic()
    return GenerateResult(
        text="".join(text),
        token_ids=ids,
        request_id=final.request_id,
        finish_reason=node_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(),
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        served_by=final.served_by,
        index_match_tokens=final.index_match_tokens,
        ingress=final.ingress,
        policy=final.policy,
        estimated_match_tokens=final.estimated_match_tokens,
        attempts=final.attempts,
        migrations=final.migrations,
        plan_epoch=final.plan_epoch,
        plan_planner=final.plan_planner,
        plan_destinations=list(final.plan_destinations),
        timings={"queue_s": final.timings.queue_s, "ttft_s": final.timings.ttft_s,
                 "total_s": final.timings.total_s},
        pull=pull_dict(final.pull) if final.HasField("pull") else None,
        segment_pulls=[pull_dict(p) for p in final.segment_pulls],
        segments=_segments_dict(final),
        tier_hits={k: getattr(final.tier_hits, k) for k in ("gpu", "host", "disk", "pulled")},
        client_ttft_s=(first or now) - started,
        client_total_s=now - started,
    )


async def wait_for_members(
    addresses: Sequence[str],
    timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    poll_s: float = DEFAULT_JOIN_POLL_S,
    api_key: str | None = None,
) -> None:
    """Until every node at ``addresses`` sees all of them alive (gossip has converged), so a run starts from a
    joined mesh; TimeoutError after ``timeout_s``, naming how many each node saw. ``api_key``: for nodes that
    authenticate their clients."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        stubs = [node_pb2_grpc.NodeStub(c) for c in channels]
        while True:
            seen = []
            for stub in stubs:
                status = await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5, metadata=auth_metadata(api_key))
                seen.append(sum(m.state == "alive" for m in status.members))
            if all(n == len(addresses) for n in seen):
                return
            if loop.time() > deadline:
                raise TimeoutError(f"the mesh did not converge in {timeout_s:.0f} s: alive members seen {seen}")
            await asyncio.sleep(poll_s)
    finally:
        for channel in channels:
            await channel.close()


def _request_from_args(args: argparse.Namespace) -> node_pb2.GenerateRequest:
    # token ids were parsed and checked by the CLI
    prompt: str | list[int] = list(args.token_ids) if args.token_ids else (args.prompt or "")
    return build_request(
        prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, request_id=args.request_id,
        routing_key=args.routing_key, segments=args.segment, segment_reuse=args.segment_reuse or "",
        model=args.model or "", cache_salt=args.cache_salt or "",
    )


def _print_error(e: grpc.aio.AioRpcError) -> int:
    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying an API key (``authorization: Bearer <key>``), or None without one."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


# --- channels to a node, mTLS included -------------------------------------------------------------------------


class ClientSetupError(Exception):
    """The client cannot even dial (unreadable certificate files...): one line for the user."""


def open_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """A channel to ``args.target``: mTLS with --tls-cert/--tls-key/--tls-ca (a node serving mTLS requires a
    client certificate its CA signed), plaintext otherwise."""
    tls = (getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None))
    if not any(tls):
        return grpc.aio.insecure_channel(args.target)
    if not all(tls):
        raise ClientSetupError("--tls-cert, --tls-key and --tls-ca go together")
    try:
        cert, key, ca = (path.read_bytes() for path in tls)
    except OSError as e:
        raise ClientSetupError(f"cannot read a TLS file: {e}") from None
    options = []
    if getattr(args, "tls_server_name", None):
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(args.target, credentials, options=options)


async def generate_command(args: argparse.Namespace) -> int:
    request = _request_from_args(args)
    metadata = auth_metadata(args.api_key)
    try:
        channel_cm = open_channel(args)
    except ClientSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    async with channel_cm as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        try:
            if args.json:
                result = await collect(stub, request, timeout=args.timeout, metadata=metadata)
                print(result.to_json())
                return 0
            final = None
            async for msg in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.HasField("final"):
                    final = msg.final
            if final is not None:
                print(
                    f"\n[{final.completion_tokens} tokens, prompt {final.prompt_tokens}, cached "
                    f"{final.cached_tokens}, served by {final.served_by} (policy {final.policy}, estimated "
                    f"{final.estimated_match_tokens}), ttft {final.timings.ttft_s * 1e3:.1f} ms]",
                    file=sys.stderr,
                )
            return 0
        except grpc.aio.AioRpcError as e:
            return _print_error(e)


#: Warm keys the text status lists (``--json`` has them all).
STATUS_WARM_KEYS = 10


def _print_plan(plan: node_pb2.PlanStatus) -> None:
    """The plan in force: epoch, planner, gate verdict, and its warmest keys with this node's split of them."""
    if not plan.epoch and not plan.planner:
        return
    verdict = plan.gate
    if plan.gate_requests:
        verdict += (f" (replay of {plan.gate_requests} requests: KV hit {plan.gate_plan_kv_hit:.2f} vs "
                    f"{plan.gate_flat_kv_hit:.2f} cache-blind, {plan.gate_age_s:.0f}s ago)")
    print(f"  plan: epoch {plan.epoch} by {plan.built_by or '-'} (planner now {plan.planner or '-'})  "
          f"affinity {'on' if plan.affinity else 'OFF'}  {plan.warm_keys} warm keys on {plan.destinations} "
          f"destinations  expected max/mean {plan.expected_imbalance:.2f}")
    print(f"  gate: {verdict}")
    if plan.loads:
        loads = ", ".join(f"{d.node_id} {d.expected:,.0f}/{d.served:,.0f}" for d in plan.loads)
        print(f"  load expected/served since it took force (x{plan.prefill_token_cost:g} per uncached prompt token, "
              f"x{plan.decode_token_cost:.3g} per generated token, per s): {loads}")
    if plan.plans_scored:
        last = plan.last_score
        print(f"  scored: epoch {last.epoch} ({last.seconds:.1f} s in force) expected max/mean "
              f"{last.expected_imbalance:.2f} ({last.period_imbalance:.2f} over such a period), served "
              f"{last.served_imbalance:.2f}; mean |error| {plan.mean_imbalance_error:.3f} over {plan.plans_scored} "
              "plans")
    for w in plan.warm[:STATUS_WARM_KEYS]:
        total = sum(w.sent)
        split = ", ".join(
            f"{d} {n / total:.0%}" if total else d for d, n in zip(w.destinations, w.sent, strict=True)
        )
        held = f" (held at {w.held_kb})" if w.held_kb else ""
        print(f"    {w.key:<24} k_b {w.kb}{held}  load {w.expected_load:,.0f}  sent {total}: {split}")
    if len(plan.warm) > STATUS_WARM_KEYS:
        print(f"    ... {len(plan.warm) - STATUS_WARM_KEYS} more (--json lists all)")


def _print_eviction(ev: node_pb2.EvictionStatus) -> None:
    """The engine's eviction policy; under adaptive, each shadow's recent hit rate and the selector's counters."""
    if not ev.policy:
        return
    line = f"  eviction: {ev.policy}"
    if ev.policy == "adaptive" or ev.active != ev.policy:
        line += f" -> {ev.active or '?'}"
    if ev.shadow_hit_rates:
        rates = "  ".join(f"{n} {r:.3f}" for n, r in sorted(ev.shadow_hit_rates.items(), key=lambda x: -x[1]))
        line += (f"  shadow hit: {rates}  ({ev.sampled_requests}/{ev.observed_requests} requests replayed, "
                 f"{ev.switches} switches, {ev.shadow_blocks} blocks per shadow)")
    print(line)


def _print_kv(kv: node_pb2.KvStatus) -> None:
    """KV pulls and exports, when the node moves KV."""
    if not kv.layout:
        return
    pulls = "  ".join(f"{k} {v}" for k, v in sorted(kv.pulls.items())) or "none"
    exports = "  ".join(f"{k} {v}" for k, v in sorted(kv.exports.items())) or "none"
    print(f"  kv pulls: {pulls}  ({kv.pulled_tokens} tokens, {kv.pulled_bytes / 1e6:.1f} MB; link {kv.link_gbps:g} "
          f"Gb/s)  exports: {exports}  block server {kv.block_server}")


def _print_tier(tier: node_pb2.TierStatus) -> None:
    """The KV tier in host memory under the engine, and the disk tier below it, when it has them."""
    if not tier.host_bytes:
        return
    outputs = "prompts and outputs" if tier.store_outputs else "prompts"
    print(f"  host kv tier: {tier.host_used_bytes / 2**20:.1f} of {tier.host_bytes / 2**20:.0f} MiB "
          f"({tier.host_blocks} blocks, {tier.host_indexed_blocks} indexed; {tier.eviction}, stores {outputs} seen "
          f"{tier.store_threshold}x)  stored {tier.stored_blocks}  evicted {tier.evicted_blocks}  store failures "
          f"{tier.store_failures}  loads {tier.loads} ({tier.loaded_tokens} tokens, {tier.load_bytes / 1e6:.1f} MB in "
          f"{tier.load_seconds:.3f} s)  exports {tier.exports}")
    if tier.disk_bytes:
        print(f"  disk kv tier: bound {tier.disk_bytes / 2**30:.1f} GiB ({tier.disk_blocks} blocks indexed)  read "
              f"{tier.disk_load_bytes / 1e6:.1f} MB  written {tier.disk_store_bytes / 1e6:.1f} MB  failures "
              f"{tier.disk_failures}")


def _print_segments(seg: node_pb2.SegmentStatus) -> None:
    """Segment reuse, when the node has a store or served requests with segments."""
    if not seg.store_bytes and not seg.requests:
        return
    requests = "  ".join(f"{m} {n} ({seg.reused_tokens.get(m, 0)} tokens cached)" for m, n in sorted(
        seg.requests.items())) or "none"
    print(f"  segments: {requests}  store {seg.held_segments} segments, {seg.held_tokens} tokens of "
          f"{seg.store_bytes / 2**20:.0f} MiB; {seg.loaded_segments} loaded in {seg.phases} phases")


async def status_command(args: argparse.Namespace) -> int:
    try:
        channel_cm = open_channel(args)
    except ClientSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    async with channel_cm as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        try:
            status = await stub.GetStatus(
                node_pb2.GetStatusRequest(), timeout=args.timeout, metadata=auth_metadata(args.api_key)
            )
        except grpc.aio.AioRpcError as e:
            return _print_error(e)
    if args.json:  # as generate --json: snake_case names, every field, 64-bit integers as numbers
        print(json.dumps(to_plain(status)))
        return 0
    load, index = status.load, status.index
    http = f" (HTTP {status.http_address})" if status.http_address else ""
    names = ", ".join(status.served_model_names) or status.model
    print(f"node {status.node_id} at {status.address}{http}  model {status.model} (served as {names})  "
          f"{'DRAINING' if status.draining else 'healthy' if load.healthy else 'ENGINE DOWN'}  "
          f"p2pnode {status.version or '?'}  vllm {status.engine_version or '-'}")
    print(f"  load: running {load.running}  waiting {load.waiting}  kv used {load.kv_usage:.1%} cached "
          f"{load.kv_cached:.1%}  prefix-cache hit {load.prefix_cache_hit_rate:.1%}  in-flight {load.in_flight}  "
          f"queued {load.queued}")
    print(f"  index: {index.blocks} blocks (~{index.approx_bytes / 1024:.0f} KiB, max {index.max_blocks})  "
          f"stored {index.stored_blocks_total}  removed {index.removed_blocks_total}  resets {index.resets}")
    print(f"  requests: {status.requests_total} total  {status.requests_succeeded} ok  "
          f"{status.requests_failed} failed  {status.requests_rejected} rejected  "
          f"{status.requests_cancelled} cancelled  uptime {status.uptime_s:.0f}s")
    r = status.routing
    print(f"  routing: policy {r.policy}  local {r.served_locally}  forwarded {r.forwarded}  retries {r.retries}  "
          f"received {r.forwards_received}  estimate error {r.estimate_abs_error_tokens} tokens over {r.served}")
    _print_eviction(status.eviction)
    _print_kv(status.kv)
    _print_tier(status.tier)
    _print_segments(status.segments)
    if status.adapters:
        served = "  ".join(
            f"{a}{' (resident)' if a in status.resident_adapters else ''} {status.adapter_requests.get(a, 0)} requests"
            for a in status.adapters
        )
        print(f"  lora adapters: {served}")
    _print_plan(status.plan)
    if status.members:
        print(f"  {'member':<12} {'state':<8} {'generation':>14} {'age s':>6} {'phi':>5} {'run':>4} {'wait':>4} "
              f"{'kv used':>7} {'cached':>6} {'hit':>6} {'summary':>7}  {'version':<8} {'vllm':<8} served  address")
        for m in status.members:
            phi = f"{m.phi:.1f}" if m.HasField("phi") else "-"
            age = f"{m.info_age_s:.1f}" if m.info_age_s >= 0 else "-"
            served = ",".join(m.served_model_names) or "-"
            adapters = f"  adapters {','.join(m.adapters)}" if m.adapters else ""
            print(f"  {m.node_id + (' *' if m.is_self else ''):<12} {m.state:<8} {m.generation:>14} {age:>6} {phi:>5} "
                  f"{m.running:>4} {m.waiting:>4} {m.kv_usage:>7.1%} {m.kv_cached:>6.1%} "
                  f"{m.prefix_cache_hit_rate:>6.1%} {m.summary_hashes:>7}  {m.version or '-':<8} "
                  f"{m.engine_version or '-':<8} {served}  {m.address}{adapters}")
    return 0
