"""``p2pnode sim``: run the cluster simulator over workloads x policies x a QPS ladder x seeds, and report.

Hook into the main CLI with ``add_sim_parser(subparsers)`` and dispatch ``args.command == "sim"`` to
``run_sim(args)``. Heavy modules are imported only when the command runs, so ``p2pnode --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pnode.config import (
    DEFAULT_ARRIVAL_CV,
    DEFAULT_COST_PROFILE,
    DEFAULT_KV_LINK_GBPS,
    DEFAULT_SEGMENT_POLICY,
    DEFAULT_SEGMENT_STORE_THRESHOLD,
    DEFAULT_SIM_DURATION_S,
    DEFAULT_SIM_EVICTION,
    DEFAULT_SIM_MAX_QUEUE_S,
    DEFAULT_SIM_NODES,
    DEFAULT_SIM_SEGMENT_STORE_SHARE,
    DEFAULT_SIM_SEGMENTS,
    DEFAULT_SIM_SLO_P99_TTFT_S,
    DEFAULT_SIM_TIER_EVICTION,
    DEFAULT_SIM_TIER_PROMPT_ONLY,
    DEFAULT_SIM_TIER_STORE_THRESHOLD,
    DEFAULT_SIM_WORKLOAD,
    EVICTION_POLICY_NAMES,
)
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S
from p2pnode.sim.workloads.production import SESSION_CV
from p2pnode.sim.workloads.segmented_trace import TIME_UNITS, TRACE_FORMATS

if TYPE_CHECKING:
    from p2pnode.cost import CostProfile
    from p2pnode.sim.cluster import SimConfig
    from p2pnode.sim.runner import Experiment
    from p2pnode.sim.workloads import Limit, Workload

__all__ = ["add_sim_parser", "parse_ladder", "run_sim"]


def parse_ladder(text: str) -> list[float]:
    """``START:STOP:STEP`` (inclusive) or a comma list, into QPS values."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if not all(map(math.isfinite, (start, stop, step))) or step <= 0 or start <= 0 or stop < start:
                raise ValueError
            n = round((stop - start) / step)
            return [round(start + i * step, 6) for i in range(n + 1) if start + i * step <= stop + 1e-9]
        values = [float(x) for x in text.split(",") if x.strip()]
        if not values or not all(map(math.isfinite, values)) or min(values) <= 0:
            raise ValueError
        return sorted(values)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected START:STOP:STEP with 0 < START <= STOP and STEP > 0, or a comma list of QPS, all finite; got "
            f"{text!r}"
        ) from None


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _positive_float(text: str) -> float:
    v = float(text)
    if not 0 < v < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def default_policies() -> list[str]:
    """Every routing policy of the node, each followed by its named what-ifs other than itself (``cacheroute`` with
    each fallback; ``cacheroute-p2p`` is ``cacheroute``), then the upper-bound reference."""
    from p2pnode.routing.policies import SPECS
    from p2pnode.sim import upper_bound

    return [*(name for spec in SPECS.values() for name in (spec.name, *spec.what_ifs)), upper_bound.NAME]


def _ttft_slo_defaults() -> str:
    """The TTFT thresholds the policies that steer by one keep unless told (``PolicySpec.ttft_slo_param``)."""
    from p2pnode.routing.policies import SPECS

    return ", ".join(
        f"{s.name}'s {s.defaults[param]:g} s" for s in SPECS.values() if (param := s.ttft_slo_param) is not None
    )


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sim",
        help="simulate a mesh: compare routing policies on workloads or a trace",
        description="Discrete-event simulation of a p2pnode mesh running the node's own routing policies, index "
        "and speculative index over a workload, up a QPS ladder, with several seeds; writes results.json, "
        "results.md and PNG plots to --out. See docs/simulator.md.",
    )
    _add_workload_args(p.add_argument_group("workload"))
    _add_flow_args(p.add_argument_group("tenants and priorities"))
    c = p.add_argument_group("cluster")
    _add_node_args(c)
    _add_tier_args(c)
    _add_kv_link_args(c)
    _add_mesh_args(c)
    _add_experiment_args(p.add_argument_group("experiment"))
    return p


def _add_workload_args(w: argparse._ArgumentGroup) -> None:
    src = w.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        default=None,
        help=f"comma list of cacheroute-aggregate, whales, wakman-mixes (21 mixes, or one as "
        f"wakman-mixes/s20-c40-a40), mmlu, low-reuse, platform-chat, platform-chat-long, tool-agent, revisit, rag "
        f"(default {DEFAULT_SIM_WORKLOAD})",
    )
    src.add_argument("--trace", type=Path,
                     help="replay a JSONL trace: Mooncake's format, or a segmented one whose prompts name reusable "
                          "segments (docs/simulator.md, \"Segmented traces\")")
    w.add_argument("--trace-format", choices=TRACE_FORMATS, default="auto",
                   help="the --trace file's format (default auto: segmented if its first line is a segmented header "
                        "or request, else mooncake)")
    w.add_argument("--trace-time-unit", choices=tuple(TIME_UNITS), default=None,
                   help="a segmented trace's timestamp unit, when its header does not say (Mooncake's: ms)")
    w.add_argument(
        "--block-size",
        type=_positive_int,
        default=None,
        help="tokens per cache block (default: 512 with a Mooncake --trace, the trace's hash_ids granularity, 64 "
        "with a segmented one; otherwise each workload's own: 256 for cacheroute-aggregate, whales and "
        "wakman-mixes, 64 for mmlu)",
    )
    w.add_argument("--arrival", choices=("poisson", "gamma"), default=None,
                   help="arrival process (default: the workload's own; not with --trace)")
    w.add_argument("--arrival-cv", type=_positive_float, default=None,
                   help=f"coefficient of variation for gamma (default {DEFAULT_ARRIVAL_CV:g}; the production "
                        f"shapes' own: {SESSION_CV:g})")
    lim = w.add_mutually_exclusive_group()
    lim.add_argument(
        "--duration", type=_positive_float, help=f"seconds of arrivals per run (default {DEFAULT_SIM_DURATION_S:.0f})"
    )
    lim.add_argument("--requests", type=_positive_int, help="requests per run (instead of --duration)")
    w.add_argument("--warmup", type=float, default=0.2, help="fraction of each run's arrival window not measured")
    w.add_argument(
        "--segments",
        default=DEFAULT_SIM_SEGMENTS,
        help=f"comma list of how requests reuse the segments they name (rag, a segmented --trace): none (prefix "
        f"caching of the prompt "
        f"as sent), exact (laid out with the cached segments first), approximate (a segment store per node); "
        f"results keyed POLICY/segments=MODE (default {DEFAULT_SIM_SEGMENTS})",
    )
    w.add_argument(
        "--segment-store-share",
        type=float,
        default=None,
        help=f"approximate only: share of each node's KV capacity its segment store holds, the rest its paged "
        f"cache (default {DEFAULT_SIM_SEGMENT_STORE_SHARE:g}: every mode holds the same KV)",
    )
    w.add_argument(
        "--segment-store-threshold",
        type=_positive_int,
        default=None,
        metavar="N",
        help="approximate only: a node's store keeps a segment once requests computed it N times, a peer holding "
        "it counting as one (1: every segment computed; the node's --segment-store-threshold; default "
        f"{DEFAULT_SEGMENT_STORE_THRESHOLD})",
    )
    w.add_argument(
        "--segment-policy",
        choices=EVICTION_POLICY_NAMES,
        default=None,
        help=f"approximate only: every node's segment store order, apart from the paged cache's --eviction (the "
        f"node's --segment-policy; default {DEFAULT_SEGMENT_POLICY})",
    )


def _add_flow_args(f: argparse._ArgumentGroup) -> None:
    """Tenants and priorities in the workload, and the nodes' flow control (``sim/admission.py``)."""
    f.add_argument("--tenants", default=None,
                   help="split the workload's sessions among tenants: NAME:SHARE[:WEIGHT],... (polite:1,greedy:4), "
                        "each weighted in the nodes' fair queues (default weight 1); turns --admission-queue on")
    f.add_argument("--high-priority-frac", type=float, default=0.0,
                   help="the share of requests sent at high priority (default 0); turns --admission-queue on")
    f.add_argument("--admission-queue", action="store_true",
                   help="flow control at every node: an admission queue ahead of the engine, fair across tenants "
                        "and strict by priority, and vLLM's priority scheduling in the engine (on with --tenants or "
                        "--high-priority-frac; off: requests go straight to an FCFS engine)")
    f.add_argument("--mesh-shares", action=argparse.BooleanOptionalAction, default=True,
                   help="tenants' fair shares over the whole mesh: each node's queue charged the work the others "
                        "served each tenant, heard every gossip round, as a node does (default); "
                        "--no-mesh-shares: each node shares its own engine alone")
    f.add_argument("--max-queue-seconds", type=_positive_float, default=None,
                   help=f"the longest a request waits in a node's admission queue before it is shed "
                        f"(default {DEFAULT_SIM_MAX_QUEUE_S:g})")


def _add_node_args(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--nodes", type=_positive_int, default=DEFAULT_SIM_NODES)
    c.add_argument("--ingresses", type=int, default=0,
                   help="nodes that take clients' requests, chosen at random among the first N (default 0: every node)")
    c.add_argument("--profile", default=None, help=f"engine cost profile (default {DEFAULT_COST_PROFILE})")
    c.add_argument("--eviction", default=DEFAULT_SIM_EVICTION,
                   help=f"comma list of KV eviction policies: lru, s3fifo, sieve, arc, adaptive (default "
                        f"{DEFAULT_SIM_EVICTION}: vLLM as it ships)")
    c.add_argument("--kv-capacity-tokens", type=_positive_int, help="override the profile's KV cache size per node")
    c.add_argument("--long-prefill-token-threshold", type=_non_negative_int, default=None,
                   help="vLLM's long_prefill_token_threshold on every engine: with more than one request in it, a "
                        "prefill takes at most N tokens a step (default: the profile's, 0: no cap, as vLLM)")


def _add_tier_args(c: argparse._ArgumentGroup) -> None:
    """KV tiers below every node's engine (``engine/simulated/tiers.py``)."""
    threshold, prompt_only = DEFAULT_SIM_TIER_STORE_THRESHOLD, DEFAULT_SIM_TIER_PROMPT_ONLY
    c.add_argument("--host-kv-tokens", type=_non_negative_int, default=0,
                   help="a host-memory KV tier of this many tokens under every node's engine, loaded at the profile's "
                        "host-to-device rate (default 0: none)")
    c.add_argument("--disk-kv-tokens", type=_non_negative_int, default=0,
                   help="a disk tier of this many tokens below the host tier of every node (default 0: none)")
    c.add_argument("--tier-store-threshold", type=_positive_int, default=threshold,
                   help=f"offers a block needs before the host tier stores it: 1 every block, 2 blocks seen twice "
                        f"(vLLM's store_threshold; default {threshold})")
    c.add_argument("--tier-store", choices=("all", "prompt"),
                   default="prompt" if prompt_only else "all",
                   help="what the host tier stores: prompts and outputs, or prompts only (vLLM's offload_prompt_only; "
                        f"default {'prompt' if prompt_only else 'all'})")
    c.add_argument("--tier-eviction", choices=("lru", "arc"), default=DEFAULT_SIM_TIER_EVICTION,
                   help=f"the tiers' eviction (vLLM's offloading offers both; default {DEFAULT_SIM_TIER_EVICTION})")


def _add_kv_link_args(c: argparse._ArgumentGroup) -> None:
    c.add_argument(
        "--kv-link-gbps",
        type=_non_negative_float,
        default=None,
        help=f"move KV: routers price pulling a cached prefix from its holder at this link figure, Gb/s, and the "
        f"simulated links run at it (default {DEFAULT_KV_LINK_GBPS:g}: no pulls; 10: a 10 GbE LAN; 100 and 400 need "
        f"RDMA, not gRPC over TCP)",
    )
    c.add_argument(
        "--kv-pull-link-gbps",
        type=_positive_float,
        default=None,
        help="what the simulated links really move, Gb/s (default: --kv-link-gbps; a measured figure, or a what-if "
        "of a link other than priced)",
    )
    c.add_argument(
        "--kv-pull-fixed",
        type=_non_negative_float,
        default=None,
        help="a pull's fixed time in seconds besides the holder's engine step (default: what the default policy "
        "prices, its pull_rtt_s; set from measured pulls)",
    )


def _add_mesh_args(c: argparse._ArgumentGroup) -> None:
    """How nodes hear of each other (gossip, the speculative index) and reach each other."""
    c.add_argument(
        "--gossip",
        choices=("model", "agent"),
        default=None,
        help="model: the staleness model (default, fast); agent: a real GossipAgent per node on the in-memory "
        "transport (~5x slower on 30 nodes)",
    )
    c.add_argument("--gossip-interval", type=_positive_float, default=None,
                   help=f"seconds between rounds ({DEFAULT_GOSSIP_INTERVAL_S:g})")
    c.add_argument(
        "--gossip-delay",
        type=_non_negative_float,
        default=None,
        help="model only: seconds until a round is heard (default: the real agent's measured lag, "
        "0.16*interval*log2(N/4); the old one-hop default was interval*log2(N)/2)",
    )
    c.add_argument(
        "--summary-stride",
        type=_positive_int,
        default=None,
        help="blocks per published summary depth (default: exact for the model, the agent's 4 for --gossip agent)",
    )
    c.add_argument("--speculative-ttl", type=_non_negative_float, default=None,
                   help="speculative index TTL, 0 = off (5.0)")
    c.add_argument("--forward-latency", type=_non_negative_float, default=None,
                   help="one hop between nodes, seconds (0.001)")


def _add_experiment_args(x: argparse._ArgumentGroup) -> None:
    x.add_argument("--policies", default=None, help="comma list (default: every policy, and upper-bound)")
    x.add_argument("--qps-ladder", type=parse_ladder, default=None, help="START:STOP:STEP (inclusive) or a list")
    x.add_argument("--slo-p99-ttft", type=_positive_float, default=DEFAULT_SIM_SLO_P99_TTFT_S,
                   help="the SLO runs are judged by, seconds (no policy reads it)")
    x.add_argument("--dualmap-ttft-slo", type=_positive_float, default=None,
                   help=f"the TTFT threshold, seconds, of the policies that trade affinity for load above one "
                   f"(default: their own, {_ttft_slo_defaults()}); give them the SLO to compare fairly on long prompts")
    x.add_argument("--seeds", type=_positive_int, default=1, help="number of seeds (0..N-1)")
    x.add_argument(
        "--patience", type=_non_negative_int, default=2,
        help="stop a series after this many SLO misses in a row (0: never)"
    )
    x.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1, help="parallel runs")
    x.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    x.add_argument("--quiet", action="store_true", help="no progress bar")


def _fail(msg: str) -> int:
    print(f"p2pnode sim: {msg}", file=sys.stderr)
    return 2


def _workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads ``--workload`` or ``--trace`` names; ValueError for arrival flags given with a trace."""
    from p2pnode.sim.workloads import (
        DEFAULT_SEGMENTED_BLOCK_SIZE,
        DEFAULT_TRACE_BLOCK_SIZE,
        SegmentedTraceWorkload,
        TraceWorkload,
        detect_trace_format,
        get_workloads,
    )

    if args.trace:
        if args.arrival is not None or args.arrival_cv is not None:
            raise ValueError("--arrival and --arrival-cv do not apply to --trace: a trace brings its own arrival times")
        fmt = detect_trace_format(args.trace) if args.trace_format == "auto" else args.trace_format
        if fmt == "mooncake":
            if args.trace_time_unit not in (None, "ms"):
                raise ValueError(f"--trace-time-unit {args.trace_time_unit}: a Mooncake trace's timestamps are ms")
            return _with_tenants(args, [TraceWorkload(args.trace, args.block_size or DEFAULT_TRACE_BLOCK_SIZE)])
        return _with_tenants(args, [SegmentedTraceWorkload(args.trace, args.block_size or DEFAULT_SEGMENTED_BLOCK_SIZE,
                                                           args.trace_time_unit)])
    if args.trace_format != "auto" or args.trace_time_unit is not None:
        raise ValueError("--trace-format and --trace-time-unit apply to --trace only")
    workloads: list[Workload] = []
    for name in _csv(args.workload or DEFAULT_SIM_WORKLOAD):
        workloads += get_workloads(name, arrival=args.arrival, cv=args.arrival_cv)
    return _with_tenants(args, workloads)


def _with_tenants(args: argparse.Namespace, workloads: list[Workload]) -> list[Workload]:
    """The workloads tagged with ``--tenants`` and ``--high-priority-frac`` (as they are without either)."""
    from p2pnode.sim.workloads.tenants import TenantMix, parse_tenants

    if not 0 <= args.high_priority_frac <= 1:
        raise ValueError(f"--high-priority-frac must be in [0, 1], got {args.high_priority_frac}")
    tenants = parse_tenants(args.tenants) if args.tenants else ()
    if not tenants and not args.high_priority_frac:
        return workloads
    return [TenantMix(w, tenants, args.high_priority_frac) for w in workloads]


def _check_grid(args: argparse.Namespace, policies: list[str], profile: CostProfile) -> tuple[list[str], list[str]]:
    """The eviction policies and segment modes asked for, once every name in the grid is known to be valid;
    ValueError naming the first that is not."""
    from p2pnode.cache.eviction import get_eviction
    from p2pnode.sim.cluster import policy_spec

    if not policies:
        raise ValueError("--policies names no policy")
    for pol in policies:
        policy_spec(pol, profile, args.dualmap_ttft_slo)
    evictions = _csv(args.eviction)
    if not evictions:
        raise ValueError("--eviction names no policy")
    for ev in evictions:
        get_eviction(ev)
    modes = _csv(args.segments)
    if not modes:
        raise ValueError("--segments names no mode")
    if args.gossip_delay is not None and args.gossip == "agent":
        raise ValueError("--gossip-delay applies to --gossip model only (the agents' own rounds set their lag)")
    valid_modes = ("none", "exact", "approximate")
    for mode in modes:
        if mode not in valid_modes:
            raise ValueError(f"--segments: unknown mode {mode!r}; valid: {', '.join(valid_modes)}")
    if args.segment_store_share is not None and not 0 < args.segment_store_share < 1:
        raise ValueError(f"--segment-store-share must be in (0, 1), got {args.segment_store_share}")
    return evictions, modes


def _check_trace_segments(workloads: list[Workload], modes: list[str]) -> None:
    """ValueError when a trace that names no segments is asked to reuse them: the run would be ``none`` under
    another name."""
    reuse = [m for m in modes if m != "none"]
    if not reuse:
        return
    for w in workloads:
        if not getattr(w, "has_segments", False):
            raise ValueError(
                f"--segments {','.join(reuse)}: {w.name} names no segments (a Mooncake trace never does; a "
                f'segmented trace marks them "segment": true), so that reuse would replay as --segments none; '
                f"give --segments none"
            )


def _base_config(args: argparse.Namespace, profile: CostProfile, workloads: Sequence[Workload] = ()) -> SimConfig:
    """The settings every run shares: the defaults, overridden by the flags given (flow control with tenants or
    priorities in ``workloads``)."""
    from p2pnode.sim.cluster import SimConfig

    routing = {
        "cost_profile": profile.name,
        "speculative_ttl_s": args.speculative_ttl,
        "kv_link_gbps": args.kv_link_gbps,
    }
    sim = {
        "gossip": args.gossip,
        "gossip_interval_s": args.gossip_interval,
        "gossip_delay_s": args.gossip_delay,
        "summary_stride": args.summary_stride,
        "forward_latency_s": args.forward_latency,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "kv_pull_link_gbps": args.kv_pull_link_gbps,
        "kv_pull_fixed_s": args.kv_pull_fixed,
        "policy_ttft_slo_s": args.dualmap_ttft_slo,
        "ingresses": args.ingresses,
        "segment_store_share": args.segment_store_share,
        "segment_store_threshold": args.segment_store_threshold,
        "segment_policy": args.segment_policy,
        "host_kv_tokens": args.host_kv_tokens,
        "disk_kv_tokens": args.disk_kv_tokens,
        "tier_store_threshold": args.tier_store_threshold,
        "tier_prompt_only": args.tier_store == "prompt",
        "tier_eviction": args.tier_eviction,
        "max_queue_s": args.max_queue_seconds,
    }
    weights = next((w.tenant_weights for w in workloads if hasattr(w, "tenant_weights")), ())
    tagged = any(hasattr(w, "tenant_weights") or getattr(w, "has_flow", False) for w in workloads)
    if args.admission_queue or tagged:
        sim["admission_queue"] = True
        sim["tenant_weights"] = weights
        sim["mesh_shares"] = args.mesh_shares
    from p2pnode.sim.cluster import check_config

    base = SimConfig(nodes=args.nodes).with_routing(**{k: v for k, v in routing.items() if v is not None})
    return check_config(replace(base, **{k: v for k, v in sim.items() if v is not None}))


def _ladder_and_limit(args: argparse.Namespace, workloads: list[Workload]) -> tuple[list[float | None], Limit]:
    """The QPS ladder (a trace alone runs at its own rate) and each run's length; ValueError when a synthetic
    workload has no ladder."""
    from p2pnode.sim.workloads import Limit

    if args.qps_ladder:
        ladder: list[float | None] = list(args.qps_ladder)
    elif args.trace:
        ladder = [None]
    else:
        raise ValueError("--qps-ladder is required for synthetic workloads (e.g. --qps-ladder 20:200:20)")
    if args.requests:
        return ladder, Limit(max_requests=args.requests)
    if args.duration:
        return ladder, Limit(duration_s=args.duration)
    if args.trace:
        return ladder, Limit(max_requests=len(workloads[0].records))  # type: ignore[attr-defined]
    return ladder, Limit(duration_s=DEFAULT_SIM_DURATION_S)


def run_sim(args: argparse.Namespace) -> int:
    from p2pnode.cost import DEFAULT_PROFILE, get_profile
    from p2pnode.sim.report import infeasible_warnings, write_report
    from p2pnode.sim.runner import Experiment
    from p2pnode.sim.workloads import TraceFormatError

    try:
        workloads = _workloads(args)
        policies = _csv(args.policies) if args.policies else default_policies()
        profile = get_profile(args.profile or DEFAULT_PROFILE)
        evictions, modes = _check_grid(args, policies, profile)
        if args.trace:
            _check_trace_segments(workloads, modes)
    except TraceFormatError as e:
        return _fail(f"bad trace: {e}")
    except (ValueError, OSError) as e:
        return _fail(str(e))
    if args.ingresses < 0:
        return _fail(f"--ingresses must be >= 0 (0: every node), got {args.ingresses}")
    if not 0 <= args.warmup < 1:
        return _fail(f"--warmup must be in [0, 1), got {args.warmup}")
    try:
        base = _base_config(args, profile, workloads)  # the configuration's own checks, one line too
        ladder, limit = _ladder_and_limit(args, workloads)
    except ValueError as e:
        return _fail(str(e))
    exp = Experiment(
        workloads=workloads,
        policies=policies,
        evictions=evictions,
        qps_ladder=ladder,
        seeds=list(range(args.seeds)),
        base=base,
        limit=limit,
        slo_p99_ttft_s=args.slo_p99_ttft,
        warmup_frac=args.warmup,
        patience=args.patience,
        jobs=args.jobs,
        block_size=args.block_size,
        segments=modes,
    )
    t0 = time.perf_counter()
    runs = _run_with_progress(exp, args.quiet)
    config = _echo(args, exp, profile, round(time.perf_counter() - t0, 1))
    agg = write_report(runs, args.slo_p99_ttft, config, args.out)
    print(f"wrote {args.out}/results.json, results.md and plots ({len(runs)} runs, {config['wall_s']} s)")
    for line in infeasible_warnings(agg, args.slo_p99_ttft):
        print(f"p2pnode sim: warning: {line}", file=sys.stderr)
    _print_capacities(agg)
    return 0


def _run_with_progress(exp: Experiment, quiet: bool) -> list[dict[str, Any]]:
    """Every run of ``exp``, with a progress bar unless ``quiet`` (or tqdm is missing)."""
    from p2pnode.sim.runner import run_experiment

    total = len(exp.workloads) * len(exp.policies) * len(exp.evictions) * len(exp.segments) * len(exp.qps_ladder)
    total *= len(exp.seeds)
    bar = None
    if not quiet:
        try:
            from tqdm import tqdm
        except ImportError:  # a declared dependency, but the simulator does not need it to run
            print(f"p2pnode sim: {total} runs (install tqdm for a progress bar)", file=sys.stderr)
        else:
            bar = tqdm(total=total, unit="run", desc="p2pnode sim", dynamic_ncols=True)
    try:
        return run_experiment(
            exp,
            progress=bar.update if bar is not None else None,
            describe=(lambda s: bar.set_postfix_str(s, refresh=False)) if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()


def _echo(args: argparse.Namespace, exp: Experiment, profile: CostProfile, wall_s: float) -> dict[str, Any]:
    """The configuration results.json records beside the runs."""
    return {
        "workloads": [w.name for w in exp.workloads],
        "policies": list(exp.policies),
        "evictions": list(exp.evictions),
        "segments": list(exp.segments),
        "qps_ladder": list(exp.qps_ladder),
        "seeds": args.seeds,
        "limit": asdict(exp.limit),
        "slo_p99_ttft_s": args.slo_p99_ttft,
        "warmup_frac": args.warmup,
        "patience": args.patience,
        "block_size": args.block_size or {w.name: w.block_size for w in exp.workloads},
        "sim": {k: v for k, v in asdict(exp.base).items() if k != "block_size"},
        "profile": asdict(profile),
        "wall_s": wall_s,
    }


def _print_capacities(agg: dict[str, dict[str, Any]]) -> None:
    """Each policy's SLO capacity per workload, and what it did there."""
    from p2pnode.sim.report import capacity_text

    for wl, pols in agg.items():
        print(f"{wl}:")
        for label, a in pols.items():
            m = a["at_capacity"]
            print(
                f"  {label:<16} capacity {capacity_text(a):>12} QPS"
                + (f"  KV hit {m['kv_hit']:.3f}  p99 TTFT {m['ttft_p99_s']:.2f}s" if m else "")
                + (f"  pulled {m['pulled_frac']:.3f}, {m['pull_bytes_per_req'] / 1e6:.0f} MB/request" if m and
                   m.get("pulled_frac") else "")
                + (f"  idle nodes {m['idle_nodes']:.0f}" if m and m.get("idle_nodes") else "")
            )


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m p2pnode.sim.cli``) until the main CLI hooks ``sim`` in."""
    parser = argparse.ArgumentParser(prog="p2pnode")
    sub = parser.add_subparsers(dest="command", required=True)
    add_sim_parser(sub)
    return run_sim(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
