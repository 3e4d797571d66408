"""The shadow-replay gate: affinity (the plan's warm keys pinned to destinations) only when replaying recent traffic
through the simulator predicts it pays.

CacheRoute loses to cache-blind balancing where reuse is rare, so before a plan's affinity is switched on — and
again at every replan — the planner replays its recent request log (block hashes and lengths only, bounded)
through ``p2pnode.sim`` twice: with the ``cacheroute`` policy and with ``flat`` (cache-blind least loaded), on
as many simulated nodes as the mesh has live destinations. Affinity is enabled when the plan's predicted KV hit
is at least ``min_hit_gain`` above flat's and its p99 TTFT is no worse than ``p99_tolerance``; otherwise the plan
is published with ``affinity=False`` and every router balances all keys cache-blind.

The planner only sees the requests it accepted as an ingress: the replay treats them as a sample of the mesh's
traffic and scales their rate by the number of destinations (the mesh's clients spread over its ingresses). The
replay runs on a worker thread, at most one at a time, so the node's event loop never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from p2pnode.config import (
    DEFAULT_GATE_PERIOD_S,
    DEFAULT_GATE_PROFILE,
    DEFAULT_LOG_MAX_BLOCKS,
    DEFAULT_LOG_MAX_REQUESTS,
    DEFAULT_MIN_HIT_GAIN,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_P99_TOLERANCE,
)

log = logging.getLogger("p2pnode.gate")

#: Plans built within one replay (its plan period is the replayed span divided by this, at most the live period).
REPLAY_PLANS = 8
REPLAY_MAX_PLAN_PERIOD_S = 10.0


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    arrival_s: float
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class GateReport:
    """One replay's verdict and the numbers behind it."""

    enabled: bool
    reason: str
    requests: int
    destinations: int
    plan_kv_hit: float = 0.0
    flat_kv_hit: float = 0.0
    plan_p99_ttft_s: float = 0.0
    flat_p99_ttft_s: float = 0.0
    at: float = 0.0


class RequestLog:
    """The recent requests an ingress routed: hashes and lengths only, bounded."""

    def __init__(self, max_requests: int = DEFAULT_LOG_MAX_REQUESTS, max_blocks: int = DEFAULT_LOG_MAX_BLOCKS):
        self.max_blocks = max_blocks
        self.entries: deque[LoggedRequest] = deque(maxlen=max_requests)

    def __len__(self) -> int:
        return len(self.entries)

    def record(self, now: float, block_hashes: Sequence[int], prompt_tokens: int, output_tokens: int) -> None:
        self.entries.append(
            LoggedRequest(now, tuple(block_hashes[: self.max_blocks]), prompt_tokens, output_tokens)
        )


def _records(entries: Sequence[LoggedRequest], block_size: int, speedup: float) -> list:
    """The log as Mooncake-style trace records (what the simulator's trace replay takes)."""
    from p2pnode.sim.workloads.trace import TraceRecord

    t0 = entries[0].arrival_s
    out = []
    for e in entries:
        blocks = len(e.block_hashes)
        # Only the logged (possibly truncated) full blocks are replayed: the prompt length follows them.
        prompt = max(1, min(e.prompt_tokens, blocks * block_size + block_size - 1))
        out.append(TraceRecord((e.arrival_s - t0) * 1000.0 / speedup, prompt, e.output_tokens, e.block_hashes))
    return out


def replay(
    entries: Sequence[LoggedRequest],
    destinations: int,
    block_size: int,
    *,
    profile: str = DEFAULT_GATE_PROFILE,
    min_hit_gain: float = DEFAULT_MIN_HIT_GAIN,
    p99_tolerance: float = DEFAULT_P99_TOLERANCE,
) -> GateReport:
    """Replay ``entries`` with the plan (``cacheroute``) and cache-blind (``flat``); decide. Pure CPU work."""
    from p2pnode.engine.simulated.cost import get_profile
    from p2pnode.sim.blocks import BlockSpace
    from p2pnode.sim.cluster import Cluster, SimConfig, decode_token_cost
    from p2pnode.sim.plan import provider_for
    from p2pnode.sim.workloads.base import Limit
    from p2pnode.sim.workloads.trace import TraceWorkload

    class LogWorkload(TraceWorkload):
        def __init__(self, records: list) -> None:  # the log is already validated: no file to load
            self.path = Path("request-log")
            self.block_size = block_size
            self.records = records
            self.name = "shadow-replay"
            span = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
            self.native_qps = len(records) / max(1e-3, span)

    ordered = sorted(entries, key=lambda e: e.arrival_s)
    records = _records(ordered, block_size, speedup=max(1, destinations))
    workload = LogWorkload(records)
    # Replan several times within the replayed span (the live period would not fire once in a short log).
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    period_s = max(0.05, min(REPLAY_MAX_PLAN_PERIOD_S, span_s / REPLAY_PLANS))
    results = {}
    for policy in ("cacheroute", "flat"):
        cfg = SimConfig(nodes=max(1, destinations), policy=policy, block_size=block_size, profile=profile)
        provider = provider_for(policy, decode_token_cost(get_profile(profile)), period_s=period_s)
        requests = workload.requests(None, 0, BlockSpace(block_size), Limit(max_requests=len(ordered)))
        results[policy] = Cluster(cfg, plan_provider=provider).run(requests)
    plan, flat = results["cacheroute"], results["flat"]
    gain = plan["kv_hit"] - flat["kv_hit"]
    p99_ok = plan["ttft_p99_s"] <= flat["ttft_p99_s"] * (1 + p99_tolerance) + 1e-9
    enabled = gain >= min_hit_gain and p99_ok
    if enabled:
        reason = f"affinity gains {gain:+.1%} KV hit at p99 TTFT {plan['ttft_p99_s']:.3f}s"
    elif gain < min_hit_gain:
        reason = f"too little reuse: affinity gains {gain:+.1%} KV hit (< {min_hit_gain:.0%})"
    else:
        reason = f"affinity hurts tail: p99 TTFT {plan['ttft_p99_s']:.3f}s vs {flat['ttft_p99_s']:.3f}s"
    return GateReport(
        enabled=enabled,
        reason=reason,
        requests=len(ordered),
        destinations=destinations,
        plan_kv_hit=plan["kv_hit"],
        flat_kv_hit=flat["kv_hit"],
        plan_p99_ttft_s=plan["ttft_p99_s"],
        flat_p99_ttft_s=flat["ttft_p99_s"],
        at=time.time(),
    )


class ShadowGate:
    """Runs ``replay`` periodically on a worker thread and keeps the latest verdict (affinity off until one)."""

    def __init__(
        self,
        block_size: int,
        *,
        period_s: float = DEFAULT_GATE_PERIOD_S,
        min_requests: int = DEFAULT_MIN_REQUESTS,
        profile: str = DEFAULT_GATE_PROFILE,
        log: RequestLog | None = None,
    ) -> None:
        self.block_size = block_size
        self.period_s = period_s
        self.min_requests = min_requests
        self.profile = profile
        self.log = log or RequestLog()
        self.report: GateReport | None = None
        self._future: Future[GateReport] | None = None
        self._started_at = float("-inf")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-replay")

    @property
    def affinity(self) -> bool:
        return self.report is not None and self.report.enabled

    def poll(self, now: float, destinations: int) -> None:
        """Collect a finished replay; start a new one when due and there is enough evidence."""
        if self._future is not None and self._future.done():
            try:
                self.report = self._future.result()
                log.info("shadow replay: %s", self.report.reason)
            except Exception:
                log.exception("shadow replay failed; keeping the previous decision")
            self._future = None
        if self._future is not None or now - self._started_at < self.period_s or len(self.log) < self.min_requests:
            return
        self._started_at = now
        entries = list(self.log.entries)
        self._future = self._executor.submit(replay, entries, destinations, self.block_size, profile=self.profile)

    async def evaluate_now(self, destinations: int) -> GateReport:
        """Replay immediately (tests, operators) and adopt the verdict."""
        entries = list(self.log.entries)
        self.report = await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: replay(entries, destinations, self.block_size, profile=self.profile)
        )
        return self.report

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
