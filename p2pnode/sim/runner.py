"""The experiment runner: every (workload, policy, eviction, segments, seed) series climbs the QPS ladder, in parallel.

A *series* is one workload x policy x eviction x segment reuse mode x seed; its runs go up the ladder. Once
``patience`` consecutive rungs miss the SLO (p99 TTFT above it) the series stops: the knee has been passed and the
rest would only be slower, overloaded runs (``patience`` 0 runs every rung). Skipped rungs count as SLO misses. Runs
go to a process pool (``jobs`` workers; 1 runs in this process), at most one run of a series at a time unless there
are fewer series than workers. A progress bar counts rungs, run or skipped.

Each run is deterministic (its seed drives the workload, the ingress choices and the gossip phases), so a run's
result does not depend on ``jobs`` or on scheduling order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from p2pnode.config import DEFAULT_SIM_SEGMENTS
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, Workload

__all__ = ["MAX_DROPPED_FRAC", "Experiment", "RunSpec", "run_experiment", "run_one"]

#: The most of a rung's measured requests that may be dropped (larger than a node's whole KV cache) for it to meet
#: the SLO: a dropped request never gets a first token, so more than 1% of them puts p99 TTFT past any bound.
MAX_DROPPED_FRAC = 0.01


@dataclass(frozen=True)
class RunSpec:
    workload: Workload
    policy: str
    eviction: str
    qps: float | None
    seed: int
    #: How requests reuse their segments (``SimConfig.segments``).
    segments: str = DEFAULT_SIM_SEGMENTS


@dataclass(frozen=True)
class Experiment:
    workloads: Sequence[Workload]
    policies: Sequence[str]
    evictions: Sequence[str]
    qps_ladder: Sequence[float | None]  # [None]: a trace at its own rate
    seeds: Sequence[int]
    base: SimConfig
    limit: Limit
    slo_p99_ttft_s: float = 3.5
    warmup_frac: float = 0.2
    patience: int = 2
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    #: Block size for every workload; None: each workload's own (``Workload.block_size``).
    block_size: int | None = None
    #: Segment reuse modes (``SimConfig.segments``), each a series of its own.
    segments: Sequence[str] = (DEFAULT_SIM_SEGMENTS,)


def run_one(
    spec: RunSpec, base: SimConfig, limit: Limit, warmup_frac: float, slo_s: float, block_size: int | None = None
) -> dict[str, Any]:
    """One simulated run; its summary plus what identifies it and what it cost."""
    qps = spec.qps
    native = getattr(spec.workload, "native_qps", None)
    window = limit.window_s(qps if qps is not None else native or 1.0)
    cfg = replace(
        base.with_routing(policy=spec.policy),
        eviction=spec.eviction,
        seed=spec.seed,
        segments=spec.segments,
        warmup_s=warmup_frac * window,
        block_size=block_size or getattr(spec.workload, "block_size", base.block_size),
    )
    t0, c0 = time.perf_counter(), time.process_time()
    cluster = Cluster(cfg)
    summary = cluster.run(spec.workload.requests(qps, spec.seed, cluster.space, limit))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    summary.update(
        workload=spec.workload.name,
        policy=spec.policy,
        eviction=spec.eviction,
        segments=spec.segments,
        qps=qps if qps is not None else round(native or 0.0, 3),
        seed=spec.seed,
        block_size=cfg.block_size,
        wall_s=round(wall, 3),
        cpu_s=round(cpu, 3),
        sim_requests_per_cpu_s=round(summary["requests"] / cpu, 1) if cpu > 0 else None,
        slo_met=bool(summary["ttft_p99_s"] <= slo_s and summary["dropped_frac"] <= MAX_DROPPED_FRAC),
    )
    return summary


class _Series:
    def __init__(self, key: tuple[Workload, str, str, str, int], ladder: Sequence[float | None]) -> None:
        self.key = key
        self.ladder = list(ladder)
        self.next = 0
        self.in_flight = 0
        self.results: dict[int, dict[str, Any]] = {}
        self.stopped = False

    def miss_streak(self, slo: float) -> int:
        """Consecutive SLO misses at the end of the completed prefix of the ladder."""
        streak = 0
        i = 0
        while i in self.results:
            streak = 0 if self.results[i]["slo_met"] else streak + 1
            i += 1
        return streak


def run_experiment(
    exp: Experiment, progress: Callable[[int], None] | None = None, describe: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """All runs of ``exp``; skipped rungs appear with ``skipped: True``. ``progress(n)`` is told of finished rungs."""
    runs = _Runs(exp, progress or (lambda _n: None), describe or (lambda _s: None))
    if exp.jobs <= 1:
        runs.in_order()
    else:
        runs.in_pool()
    return runs.out


class _Runs:
    """One experiment's series and the results they gave, in the order they came."""

    def __init__(self, exp: Experiment, tick: Callable[[int], None], say: Callable[[str], None]) -> None:
        self.exp = exp
        self.tick = tick
        self.say = say
        self.series = [
            _Series((w, p, e, m, s), exp.qps_ladder)
            for w in exp.workloads
            for p in exp.policies
            for e in exp.evictions
            for m in exp.segments
            for s in exp.seeds
        ]
        self.out: list[dict[str, Any]] = []

    def _next_spec(self, sr: _Series) -> tuple[int, RunSpec]:
        """The series' next rung, taken."""
        i = sr.next
        sr.next += 1
        return i, _spec_of(sr, i)

    def _run_args(self) -> tuple[SimConfig, Limit, float, float, int | None]:
        exp = self.exp
        return exp.base, exp.limit, exp.warmup_frac, exp.slo_p99_ttft_s, exp.block_size

    def _done(self, sr: _Series, i: int, res: dict[str, Any]) -> None:
        sr.results[i] = res
        self.out.append(res)
        self.tick(1)
        self._settle(sr)

    def _settle(self, sr: _Series) -> None:
        """Past ``patience`` SLO misses in a row, the series' remaining rungs are skipped."""
        exp = self.exp
        if exp.patience and not sr.stopped and sr.miss_streak(exp.slo_p99_ttft_s) >= exp.patience:
            sr.stopped = True
            for i in range(sr.next, len(sr.ladder)):
                self.out.append(_skipped(_spec_of(sr, i)))
            self.tick(len(sr.ladder) - sr.next)
            sr.next = len(sr.ladder)

    def _runnable(self) -> _Series | None:
        """The first series with a rung to run: one rung at a time each, unless there are fewer series than jobs."""
        per_series = 1 if len(self.series) >= self.exp.jobs else self.exp.jobs
        for sr in self.series:
            if not sr.stopped and sr.next < len(sr.ladder) and sr.in_flight < per_series:
                return sr
        return None

    def in_order(self) -> None:
        """Every series in this process, one rung after another."""
        for sr in self.series:
            while not sr.stopped and sr.next < len(sr.ladder):
                i, sp = self._next_spec(sr)
                self.say(
                    f"{sp.workload.name} {_label(sp.policy, sp.eviction, sp.segments)} qps={sp.qps} seed={sp.seed}"
                )
                self._done(sr, i, run_one(sp, *self._run_args()))

    def in_pool(self) -> None:
        """Every series in a pool of ``jobs`` worker processes, each series climbing its ladder as results come."""
        jobs = self.exp.jobs
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            in_flight: dict[Future[dict[str, Any]], tuple[_Series, int]] = {}
            while True:
                while len(in_flight) < jobs and (sr := self._runnable()) is not None:
                    i, sp = self._next_spec(sr)
                    sr.in_flight += 1
                    in_flight[pool.submit(run_one, sp, *self._run_args())] = (sr, i)
                if not in_flight:
                    break
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for fut in done:
                    sr, i = in_flight.pop(fut)
                    sr.in_flight -= 1
                    res = fut.result()
                    self.say(
                        f"{res['workload']} {_label(res['policy'], res['eviction'], res['segments'])} "
                        f"qps={res['qps']} seed={res['seed']}"
                    )
                    self._done(sr, i, res)
        self._as_in_order()

    def _as_in_order(self) -> None:
        """The results a run in order gives: with fewer series than jobs a series runs several rungs at once, and
        those past where ``patience`` stops it in order are reported skipped (they changed the rungs' tables and
        means by a seed's runs), every series' rungs in ladder order."""
        exp = self.exp
        out: list[dict[str, Any]] = []
        for sr in self.series:
            streak, stop = 0, len(sr.ladder)
            for i in range(len(sr.ladder)):
                res = sr.results.get(i)
                if i >= stop or res is None:
                    out.append(_skipped(_spec_of(sr, i)))
                    continue
                out.append(res)
                streak = 0 if res["slo_met"] else streak + 1
                if exp.patience and streak >= exp.patience:
                    stop = i + 1
        self.out = out


def _spec_of(sr: _Series, i: int) -> RunSpec:
    w, p, e, m, s = sr.key
    return RunSpec(w, p, e, sr.ladder[i], s, m)


def _label(policy: str, eviction: str, segments: str) -> str:
    return f"{policy}/{eviction}" + (f"/segments={segments}" if segments != DEFAULT_SIM_SEGMENTS else "")


def _skipped(sp: RunSpec) -> dict[str, Any]:
    return {
        "workload": sp.workload.name,
        "policy": sp.policy,
        "eviction": sp.eviction,
        "segments": sp.segments,
        "qps": sp.qps,
        "seed": sp.seed,
        "skipped": True,
        "slo_met": False,
    }
