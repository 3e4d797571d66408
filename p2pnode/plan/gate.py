"""The shadow-replay gate: affinity (the plan's warm keys pinned to destinations) only when replaying recent traffic
through the simulator predicts it pays.

CacheRoute loses to cache-blind balancing where reuse is rare, so before a plan's affinity is switched on -- and
again at every replan -- the planner replays its recent request log (block hashes and lengths only, bounded) through
the simulator twice (a ``Replayer`` the node injects: ``p2pnode.sim.replay.replay_log``): with the ``cacheroute``
policy and with ``flat`` (cache-blind least loaded), on as many simulated nodes as the mesh has live destinations.
Affinity is enabled when the plan's predicted KV hit is at least ``min_hit_gain`` above flat's and its p99 TTFT is no
worse than ``p99_tolerance`` (or ``p99_slack_s``); once on, it stays on while the gain is at least
``keep_gain_fraction`` of that (hysteresis against noise: a short log's replay starts with cold caches and
underestimates the gain); otherwise the plan is published with ``affinity=False`` and every router balances all
keys cache-blind. The replay runs on a worker thread, at most one at a time, so the node's event loop never waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from p2pnode.config import (
    DEFAULT_GATE_PERIOD_S,
    DEFAULT_GATE_PROFILE,
    DEFAULT_KEEP_GAIN_FRACTION,
    DEFAULT_LOG_MAX_BLOCKS,
    DEFAULT_LOG_MAX_REQUESTS,
    DEFAULT_MIN_HIT_GAIN,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_P99_SLACK_S,
    DEFAULT_P99_TOLERANCE,
)
from p2pnode.plan.plan import GateReport

log = logging.getLogger("p2pnode.gate")

@dataclass(frozen=True, slots=True)
class LoggedRequest:
    arrival_s: float
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int


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


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What one replay of the log predicts for one routing policy."""

    kv_hit: float
    p99_ttft_s: float


class Replayer(Protocol):
    """Replays a request log on ``destinations`` simulated nodes, once with the plan (``cacheroute``) and once
    cache-blind (``flat``); the simulator implements it (``p2pnode.sim.replay.replay_log``) and the node injects it,
    so nothing here imports the simulator. Pure CPU work, run on a worker thread."""

    def __call__(
        self, entries: Sequence[LoggedRequest], destinations: int, block_size: int, profile: str
    ) -> tuple[ReplayOutcome, ReplayOutcome]: ...


def judge(
    entries: Sequence[LoggedRequest],
    destinations: int,
    block_size: int,
    replayer: Replayer,
    *,
    profile: str = DEFAULT_GATE_PROFILE,
    min_hit_gain: float = DEFAULT_MIN_HIT_GAIN,
    p99_tolerance: float = DEFAULT_P99_TOLERANCE,
    currently_on: bool = False,
    keep_gain_fraction: float = DEFAULT_KEEP_GAIN_FRACTION,
    p99_slack_s: float = DEFAULT_P99_SLACK_S,
) -> GateReport:
    """Replay ``entries`` with the plan and cache-blind, and decide whether affinity pays. ``currently_on``: the
    verdict in force has affinity on, so the lower bar (``keep_gain_fraction`` x ``min_hit_gain``) keeps it on."""
    plan, flat = replayer(entries, destinations, block_size, profile)
    gain = plan.kv_hit - flat.kv_hit
    need = min_hit_gain * (keep_gain_fraction if currently_on else 1.0)
    p99_ok = plan.p99_ttft_s <= max(flat.p99_ttft_s * (1 + p99_tolerance), flat.p99_ttft_s + p99_slack_s) + 1e-9
    enabled = gain >= need and p99_ok
    if enabled:
        reason = f"affinity gains {gain:+.1%} KV hit at p99 TTFT {plan.p99_ttft_s:.3f}s (flat {flat.p99_ttft_s:.3f}s)"
    elif gain < need:
        reason = f"too little reuse: affinity gains {gain:+.1%} KV hit (< {need:.1%})"
    else:
        reason = f"affinity hurts tail: p99 TTFT {plan.p99_ttft_s:.3f}s vs {flat.p99_ttft_s:.3f}s"
    return GateReport(
        enabled=enabled,
        reason=reason,
        requests=len(entries),
        destinations=destinations,
        plan_kv_hit=plan.kv_hit,
        flat_kv_hit=flat.kv_hit,
        plan_p99_ttft_s=plan.p99_ttft_s,
        flat_p99_ttft_s=flat.p99_ttft_s,
        at=time.time(),
    )


class ShadowGate:
    """Runs ``replay`` periodically on a worker thread and keeps the latest verdict (affinity off until one)."""

    def __init__(
        self,
        block_size: int,
        replayer: Replayer,
        *,
        period_s: float = DEFAULT_GATE_PERIOD_S,
        min_requests: int = DEFAULT_MIN_REQUESTS,
        profile: str = DEFAULT_GATE_PROFILE,
        log: RequestLog | None = None,
    ) -> None:
        self.block_size = block_size
        self.replayer = replayer
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

    def poll(self, now: float, destinations: int, currently_on: bool = False) -> None:
        """Collect a finished replay; start a new one when due and there is enough evidence. ``currently_on``: the
        verdict in force (this gate's or the one the plan carries) has affinity on."""
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
        self._future = self._executor.submit(
            judge, entries, destinations, self.block_size, self.replayer, profile=self.profile,
            currently_on=currently_on,
        )  # fmt: skip

    async def evaluate_now(self, destinations: int) -> GateReport:
        """Replay immediately (tests, operators) and adopt the verdict."""
        entries = list(self.log.entries)
        self.report = await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: judge(entries, destinations, self.block_size, self.replayer, profile=self.profile)
        )
        return self.report

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
