#!/usr/bin/env python3
"""The rate plan on a live mesh: does a hot key's traffic split over its destinations by the plan's
shares, do nodes stay balanced, and does affinity stay on through a planner's ``kill -9`` and restart?

Four ``p2pnode serve`` processes (simulated engines, real gossip, real planner: ``--routing-policy cacheroute``),
joined through n1. Clients send ``--rate`` requests/s, round-robin over the ingresses; half carry routing key
``hot`` (one shared prompt prefix), the rest spread over ``--keys`` other keys. Phases:

1. ``warm``: the plan forms and the gate decides (not measured);
2. ``steady``: measured -- the hot key's split against its planned shares (``1/k_b`` each), requests served per
   node (max/mean);
3. ``planner killed``: ``kill -9`` of the planner (n1, the smallest id); n2 takes over;
4. ``planner back``: n1 restarts, hears the mesh's plan and takes the role back; measured like ``steady``.

Every node's status is read every half second throughout: a node whose plan in force has affinity off after that
node's plan had it on, or later than ``PROPAGATION_GRACE_S`` after any node's had it on, is counted
(``affinity_off``; the target is 0). Per node, because the first plan with affinity on reaches the nodes tens of
ms apart: a node still on the plan before it is not a node that turned affinity off. A restarted node counts as the
same node.

    python scripts/bench_plan_mesh.py            # a table
    python scripts/bench_plan_mesh.py --json     # one JSON object (tests/slow/test_plan_mesh.py reads it)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from google.protobuf import json_format

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc

BLOCK = 16
VOCAB = 512
PREFIX_BLOCKS = 4  # every key's shared prompt prefix
MAX_TOKENS = 8
#: KV blocks per node: room for every key's prefix (51 keys x 4 blocks) and the requests in flight, so a request's
#: cost is the same whichever key it carries and requests served per node measure the load the plan balances.
KV_BLOCKS = 1024
HOT = "hot"
#: The simulated engines' cost profile, and the one routing and the plan assume (the plan's work unit: a generated
#: token costs ~0.25 uncached prompt token on it, ``p2pnode/plan/work.py``).
PROFILE = "tiny-cpu"
NODES = ("n1", "n2", "n3", "n4")


@dataclass
class Sent:
    t: float  # seconds since the run began
    key: str
    ingress: str
    served_by: str  # "" when it failed
    code: str
    ended: float
    #: The destinations the ingress's plan in force gave the key when it routed it, as the final message reports
    #: them (empty: cold key, affinity off, or failed).
    planned: tuple[str, ...] = ()
    plan: str = ""  # "planner:epoch" of that plan
    attempts: int = 0
    tokens: int = 0  # output tokens received, a failed call's partial output included
    error: str = ""  # the status details of a failed call
    prompt_tokens: int = 0  # as the final message reports them (0 when it failed)
    cached_tokens: int = 0  # the engine-reported prefix-cache hit
    completion_tokens: int = 0
    estimated_tokens: int = 0  # the ingress's estimate of served_by's cached prefix when routing

    @property
    def work(self) -> int:
        """Token work of the request where it was served: uncached prompt + completion tokens."""
        return max(self.prompt_tokens - self.cached_tokens, 0) + self.completion_tokens

    def work_in(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        """Its work in a plan's unit (``p2pnode/plan/work.py``)."""
        return max(self.prompt_tokens - self.cached_tokens, 0) * prefill_token_cost + (
            self.completion_tokens * decode_token_cost
        )

    def lost_to_kill(self, killed: dict[str, float]) -> bool:
        """Failed because a node it depended on was killed while it was in flight: its own ingress (the client's
        connection died with it), or the node serving it once output had streamed -- the ingress names that node
        when it fails the call rather than retry and duplicate the output. No mesh can save either."""
        if self.code == "OK":
            return False
        in_flight = [n for n, t in killed.items() if self.t <= t <= self.ended]
        return self.ingress in in_flight or any(f"node {n} failed after streaming" in self.error for n in in_flight)


@dataclass
class Window:
    """One measured phase."""

    name: str
    requests: int = 0
    failed: int = 0  # not counting those lost to a kill
    lost_to_kill: int = 0
    served: dict[str, int] = field(default_factory=dict)  # per node
    max_over_mean: float = 0.0
    work: dict[str, int] = field(default_factory=dict)  # token work served per node (uncached prompt + completion)
    work_max_over_mean: float = 0.0
    hot_requests: int = 0
    #: The hot key's requests grouped by the destinations the ingress's plan in force gave it when routing it (the
    #: final message reports them; a replan may change them mid-phase); the largest group first.
    hot_segments: list[Segment] = field(default_factory=list)
    hot_kb: int = 0  # the largest segment's
    hot_destinations: list[str] = field(default_factory=list)
    hot_split: dict[str, float] = field(default_factory=dict)
    #: Max over segments of at least MIN_SEGMENT requests of their max share error.
    max_share_error: float = 0.0
    warm_keys: int = 0  # in the plan in force at the phase's end
    expected_imbalance: float = 0.0  # that plan's expected max/mean load per destination
    warm_loads: dict[str, float] = field(default_factory=dict)  # expected load placed per destination by that plan
    #: Every plan the window's requests were routed under: its expected max/mean against what was served.
    plans: list[PlanRow] = field(default_factory=list)
    #: Max over the plans scored (by the nodes, and here from the requests) of |served - expected max/mean|.
    max_imbalance_error: float = 0.0
    max_routed_imbalance_error: float = 0.0
    #: Max over the plans the nodes scored of |served - predicted for the period| (``Plan.period_imbalance``: the
    #: expected loads plus the chance of one period's arrivals).
    max_period_error: float = 0.0


@dataclass
class PlanRow:
    """One plan against the period it was in force."""

    plan: str  # "planner:epoch"
    expected_imbalance: float  # the plan's own figure
    #: max/mean of the work each destination served while the plan was in force, as the nodes scored it from their
    #: gossiped loads (``PlanStatus.last_score``); None when no node's status showed its score.
    served_imbalance: float | None
    seconds: float  # how long it was in force (the nodes' score)
    #: What the plan predicted a period of that length serves (arrivals' chance included; the nodes' score), or None.
    period_imbalance: float | None
    #: max/mean of the work of the requests the ingresses routed under this plan, per destination that served them,
    #: from their final messages (in the plan's work unit): the same question answered here, not by the nodes.
    routed_imbalance: float
    routed_requests: int


#: Seconds a plan may take to reach every node after the first shows it: a node still without affinity on this long
#: after another turned it on counts as off (a gossip round is 0.2 s here; the plan spreads in tens of ms).
PROPAGATION_GRACE_S = 5.0
#: Requests of the hot key under one set of destinations before its split is judged (the largest set is judged
#: whatever its size). Each of the 4 ingresses splits its own requests by the shares to within one request, and the
#: shares lean by up to ``cacheroute.FILL_MAX_SHIFT`` (0.05): over 100 requests that is within 0.09 of the plan's
#: shares; over the 30-40 requests of a plan change (a plan without the restarted n1, still in force for its first
#: seconds back) the rounding alone can reach 0.1.
MIN_SEGMENT = 100
#: Requests routed under a plan before its score is judged (a replan's stragglers are not a period).
MIN_PLAN_REQUESTS = 30


@dataclass
class Segment:
    destinations: list[str]
    requests: int
    split: dict[str, float]  # fraction of the segment's requests served by each node
    max_share_error: float  # max over destinations of |fraction - 1/k_b|; a non-destination's fraction counts too
    off_plan: list[str] = field(default_factory=list)  # the first few requests served by a non-destination


@dataclass
class Report:
    rate: float
    keys: int
    phases_s: dict[str, float]
    windows: list[Window]
    status_reads: int
    affinity_first_on_s: float | None
    affinity_off: int  # reads of a node whose plan in force had affinity off, after that node's had it on
    affinity_off_reads: list[str]  # the first few: when, which node, whose plan, its gate's reason
    epochs_seen: int
    planners_seen: list[str]
    failed: int
    lost_to_kill: int  # in flight through the killed planner as ingress, or streaming from it (``Sent.lost_to_kill``)
    failures: dict[str, int]  # by gRPC status code, lost ones included
    errors: list[str]  # the first few, with their details
    crashed: list[str]


def _prompt(key: str, n: int) -> list[int]:
    rng = random.Random(key)
    prefix = [rng.randrange(3, VOCAB) for _ in range(PREFIX_BLOCKS * BLOCK)]
    return [*prefix, 3 + n % (VOCAB - 3), 3 + (n // VOCAB) % (VOCAB - 3)]


class Mesh:
    def __init__(self, workdir: Path, plan_period: float, gossip_interval: float | None) -> None:
        self.workdir = workdir
        secret = workdir / "secret"
        secret.write_bytes(b"bench-plan-mesh-cluster-secret")
        self.common = [
            "--model", "sim", "--engine", "sim", "--sim-profile", PROFILE, "--cost-profile", PROFILE,
            "--sim-kv-blocks", str(KV_BLOCKS),
            "--block-size", str(BLOCK),
            "--max-model-len", "1024", "--routing-policy", "cacheroute", "--plan-period", str(plan_period),
            "--gossip-profile", "local", "--http-listen", "off", "--stats-interval", "0",
            "--peer-keepalive", "2", "--cluster-secret-file", str(secret),
        ]  # fmt: skip
        if gossip_interval is not None:
            self.common += ["--gossip-interval", str(gossip_interval)]
        self.nodes: dict[str, NodeProcess] = {}
        self.addresses: dict[str, str] = {}

    def start(self, node_id: str) -> None:
        listen = self.addresses.get(node_id, "127.0.0.1:0")  # a restarted node keeps its address
        args = [*self.common, "--node-id", node_id, "--listen", listen]
        if node_id != "n1":
            args += ["--seeds", self.addresses["n1"]]
        elif len(self.addresses) > 1:  # n1 restarting joins through the others
            args += ["--seeds", ",".join(a for n, a in self.addresses.items() if n != "n1")]
        node = NodeProcess(args, log_path=self.workdir / f"{node_id}.log").start(120)
        self.nodes[node_id] = node
        assert node.address is not None
        self.addresses[node_id] = node.address

    def kill(self, node_id: str) -> None:
        self.nodes[node_id].kill()

    def alive(self, node_id: str) -> bool:
        p = self.nodes[node_id].proc
        return p is not None and p.poll() is None

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()


class Driver:
    """Sends the load and reads every node's status, recording both."""

    def __init__(self, mesh: Mesh, rate: float, keys: int, seed: int) -> None:
        self.mesh = mesh
        self.rate = rate
        self.keys = [f"k{i}" for i in range(keys)]
        self.rng = random.Random(seed)
        self.t0 = time.monotonic()
        self.sent: list[Sent] = []
        self.killed: dict[str, float] = {}  # node -> when it was killed
        self.errors: list[str] = []  # the first failures, as the client saw them
        self.plans: list[tuple[float, str, node_pb2.PlanStatus]] = []  # (t, node, plan in force)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _stub(self, node_id: str) -> node_pb2_grpc.NodeStub:
        address = self.mesh.addresses[node_id]
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = grpc.aio.insecure_channel(address)
        return node_pb2_grpc.NodeStub(channel)

    async def _one(self, key: str, ingress: str, n: int) -> None:
        request = node_pb2.GenerateRequest(routing_key=key)
        request.token_ids.ids.extend(_prompt(key, n))
        request.sampling.max_tokens = MAX_TOKENS
        request.sampling.ignore_eos = True
        t = self.now()
        final, code, tokens, error = None, "OK", 0, ""
        try:
            async for message in self._stub(ingress).Generate(request, timeout=60):
                tokens += len(message.token_ids)
                if message.HasField("final"):
                    final = message.final
        except grpc.aio.AioRpcError as e:
            code, error = e.code().name, e.details() or ""
        if code == "OK" and final is None:
            code, error = "NO_FINAL", "the stream ended without a final message"
        if code != "OK":
            self.errors.append(f"{t:.1f}s {ingress} {key}: {code} {error}")
        final = final or node_pb2.GenerateFinal()
        plan = f"{final.plan_planner}:{final.plan_epoch}" if final.plan_epoch else ""
        self.sent.append(
            Sent(t, key, ingress, final.served_by, code, self.now(), tuple(final.plan_destinations), plan,
                 final.attempts, tokens, error, final.prompt_tokens, final.cached_tokens, final.completion_tokens,
                 final.estimated_match_tokens)
        )  # fmt: skip

    async def load(self, until_s: float) -> None:
        """Poisson arrivals at ``rate`` until ``until_s``, round-robin over the live ingresses."""
        n = len(self.sent)
        while self.now() < until_s:
            live = [i for i in NODES if self.mesh.alive(i)]
            key = HOT if self.rng.random() < 0.5 else self.rng.choice(self.keys)
            task = asyncio.create_task(self._one(key, live[n % len(live)], n))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            n += 1
            await asyncio.sleep(self.rng.expovariate(self.rate))

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for node_id in NODES:
                if not self.mesh.alive(node_id):
                    continue
                with contextlib.suppress(grpc.aio.AioRpcError):
                    s = await self._stub(node_id).GetStatus(node_pb2.GetStatusRequest(), timeout=2)
                    self.plans.append((self.now(), node_id, s.plan))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


def window(name: str, driver: Driver, start: float, end: float) -> Window:
    rows = [s for s in driver.sent if start <= s.t < end]
    lost = sum(s.lost_to_kill(driver.killed) for s in rows)
    w = Window(name, requests=len(rows), failed=sum(s.code != "OK" for s in rows) - lost, lost_to_kill=lost)
    served = Counter(s.served_by for s in rows if s.served_by)
    w.served = {n: served.get(n, 0) for n in NODES}
    live = [c for c in w.served.values() if c]
    if live:
        w.max_over_mean = max(live) / (sum(live) / len(NODES))
    work: Counter[str] = Counter()
    for s in rows:
        if s.served_by:
            work[s.served_by] += s.work
    w.work = {n: work.get(n, 0) for n in NODES}
    if sum(w.work.values()):
        w.work_max_over_mean = max(w.work.values()) / (sum(w.work.values()) / len(NODES))
    hot_rows = [s for s in rows if s.key == HOT and s.served_by]
    w.hot_requests = len(hot_rows)
    groups: dict[tuple[str, ...], list[Sent]] = {}
    for s in hot_rows:
        if s.planned:
            groups.setdefault(tuple(sorted(s.planned)), []).append(s)
    for dests, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        count = Counter(s.served_by for s in group)
        split = {n: count[n] / len(group) for n in sorted(count)}
        errors = [abs(split.get(d, 0.0) - 1.0 / len(dests)) for d in dests]
        errors += [f for n, f in split.items() if n not in dests]
        off = [f"{s.t:.1f}s {s.ingress}->{s.served_by} (plan {s.plan}, attempts {s.attempts})" for s in group
               if s.served_by not in dests]  # fmt: skip
        w.hot_segments.append(Segment(sorted(dests), len(group), split, max(errors), off[:5]))
    w.plans = plan_rows(driver, rows)
    scored = [r for r in w.plans if r.served_imbalance is not None and r.routed_requests >= MIN_PLAN_REQUESTS]
    w.max_imbalance_error = max((abs(r.served_imbalance - r.expected_imbalance) for r in scored), default=0.0)
    w.max_period_error = max(
        (abs(r.served_imbalance - r.period_imbalance) for r in scored if r.period_imbalance is not None), default=0.0
    )
    routed = [r for r in w.plans if r.routed_requests >= MIN_PLAN_REQUESTS]
    w.max_routed_imbalance_error = max((abs(r.routed_imbalance - r.expected_imbalance) for r in routed), default=0.0)
    last = [p for t, _, p in driver.plans if t <= end and p.epoch]
    if last:
        w.warm_keys, w.expected_imbalance = last[-1].warm_keys, round(last[-1].expected_imbalance, 3)
        loads: Counter[str] = Counter()
        for k in last[-1].warm:
            for d in k.destinations:
                loads[d] += k.expected_load / k.kb
        w.warm_loads = {n: round(loads[n], 1) for n in NODES}
    if w.hot_segments:
        top = w.hot_segments[0]
        w.hot_kb, w.hot_destinations, w.hot_split = len(top.destinations), top.destinations, top.split
        w.max_share_error = max(g.max_share_error for g in w.hot_segments if g.requests >= MIN_SEGMENT or g is top)
    return w


def plan_rows(driver: Driver, rows: list[Sent]) -> list[PlanRow]:
    """Each plan the rows were routed under, with its expected max/mean, the nodes' score of it, and the work its
    requests cost where they were served."""
    status: dict[str, node_pb2.PlanStatus] = {}  # "planner:epoch" -> a status read showing that plan in force
    scores: dict[str, node_pb2.PlanScore] = {}
    for _, _, p in driver.plans:
        if p.epoch:
            status.setdefault(f"{p.built_by}:{p.epoch}", p)
        if p.plans_scored:
            scores.setdefault(f"{p.last_score.built_by}:{p.last_score.epoch}", p.last_score)
    out = []
    for name in sorted({s.plan for s in rows if s.plan}, key=lambda n: (int(n.split(":")[1]), n)):
        p = status.get(name)
        if p is None:
            continue
        work: Counter[str] = Counter({d.node_id: 0.0 for d in p.loads})
        routed = [s for s in rows if s.plan == name and s.served_by]
        for s in routed:
            work[s.served_by] += s.work_in(p.prefill_token_cost, p.decode_token_cost)
        score = scores.get(name)
        out.append(PlanRow(
            name, round(p.expected_imbalance, 3), round(score.served_imbalance, 3) if score is not None else None,
            round(score.seconds, 2) if score is not None else 0.0,
            round(score.period_imbalance, 3) if score is not None else None,
            round(max_over_mean(work.values()), 3), len(routed),
        ))  # fmt: skip
    return out


def max_over_mean(values: Iterable[float]) -> float:
    v = list(values)
    return max(v) / (sum(v) / len(v)) if v and sum(v) > 0 else 1.0


async def run(args: argparse.Namespace, workdir: Path) -> Report:
    mesh = Mesh(workdir, args.plan_period, args.gossip_interval)
    phases = {"warm": args.warm, "steady": args.steady}
    if args.killed > 0 or args.back > 0:  # both 0: no kill, the steady window only
        phases |= {"planner killed": args.killed, "planner back": args.back}
    try:
        mesh.start("n1")
        for node_id in NODES[1:]:
            mesh.start(node_id)
        driver = Driver(mesh, args.rate, args.keys, args.seed)
        stop = asyncio.Event()
        watcher = asyncio.create_task(driver.watch(stop))
        marks: dict[str, tuple[float, float]] = {}
        t = 0.0
        for name, seconds in phases.items():
            if name == "planner killed":
                driver.killed["n1"] = driver.now()
                mesh.kill("n1")
            if name == "planner back":
                await asyncio.to_thread(mesh.start, "n1")
            start = driver.now()
            await driver.load(start + seconds)
            marks[name] = (start, driver.now())
            t += seconds
        await driver.drain()
        stop.set()
        await watcher
        await driver.close()
        crashed = [n for n in NODES if not mesh.alive(n)]
    finally:
        mesh.stop()

    with (workdir / "requests.jsonl").open("w") as out:  # every request, for a look at a failed run (--logs)
        out.writelines(json.dumps(asdict(s)) + "\n" for s in driver.sent)
    with (workdir / "plans.jsonl").open("w") as out:  # every status read's plan in force
        out.writelines(
            json.dumps({"t": t, "node": node, **json_format.MessageToDict(p, preserving_proto_field_name=True)}) + "\n"
            for t, node, p in driver.plans
        )
    first_on = next((t for t, _, p in driver.plans if p.epoch and p.affinity), None)
    on_at: dict[str, float] = {}  # node -> its first read with affinity on
    for t, node, p in driver.plans:
        if p.epoch and p.affinity:
            on_at.setdefault(node, t)
    off = [
        f"{t:.1f}s {node}: plan {p.built_by}:{p.epoch}, gate {p.gate!r}"
        for t, node, p in driver.plans
        if p.epoch and not p.affinity and first_on is not None
        and ((node in on_at and t > on_at[node]) or t > first_on + PROPAGATION_GRACE_S)
    ]
    return Report(
        rate=args.rate, keys=args.keys, phases_s=phases,
        windows=[window(name, driver, *marks[name]) for name in ("steady", "planner back") if name in marks],
        status_reads=len(driver.plans), affinity_first_on_s=first_on, affinity_off=len(off), affinity_off_reads=off[:5],
        epochs_seen=len({(p.built_by, p.epoch) for _, _, p in driver.plans if p.epoch}),
        planners_seen=sorted({p.built_by for _, _, p in driver.plans if p.epoch}),
        failed=sum(s.code != "OK" and not s.lost_to_kill(driver.killed) for s in driver.sent),
        lost_to_kill=sum(s.lost_to_kill(driver.killed) for s in driver.sent),
        failures=dict(Counter(s.code for s in driver.sent if s.code != "OK")), errors=driver.errors[:10],
        crashed=crashed,
    )  # fmt: skip


def table(report: Report) -> str:
    lines = [
        f"4 nodes, {report.rate:g} req/s (half on key '{HOT}', the rest over {report.keys} keys), phases "
        + ", ".join(f"{k} {v:g} s" for k, v in report.phases_s.items()),
        "",
        "| window | requests | failed | served n1/n2/n3/n4 | max/mean | token work n1/n2/n3/n4 | max/mean | hot k_b |"
        " hot destinations (its requests) | hot split | max share error |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---|---:|",
    ]
    for w in report.windows:
        for i, g in enumerate(w.hot_segments or [Segment([], 0, {}, 0.0)]):
            split = ", ".join(f"{n} {f:.2f}" for n, f in g.split.items())
            head = (
                f"| {w.name} | {w.requests} | {w.failed} | {'/'.join(str(w.served[n]) for n in NODES)} | "
                f"{w.max_over_mean:.2f} | {'/'.join(f'{w.work[n]:,}' for n in NODES)} | {w.work_max_over_mean:.2f} |"
                if i == 0
                else "| | | | | | | |"
            )
            lines.append(
                f"{head} {len(g.destinations)} | {', '.join(g.destinations)} ({g.requests} req) | {split} | "
                f"{g.max_share_error:.3f} |"
            )
    lines += [
        "",
        "Each plan's expected max/mean destination load against what was served while it was in force: as the nodes "
        "scored it from their gossiped served work, and from the work of the requests routed under it (their final "
        "messages), both in the plan's work unit; \"for the period\" is what the plan predicted one period of that "
        "length serves (its expected loads plus the chance of the period's arrivals); plans with fewer than "
        f"{MIN_PLAN_REQUESTS} requests are listed, not judged.",
        "",
        "| window | plan | in force (s) | requests | expected | for the period | served (nodes' score) |"
        " served (its requests) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in report.windows:
        for r in w.plans:
            served = "-" if r.served_imbalance is None else f"{r.served_imbalance:.3f}"
            period = "-" if r.period_imbalance is None else f"{r.period_imbalance:.3f}"
            lines.append(f"| {w.name} | {r.plan} | {r.seconds:.1f} | {r.routed_requests} | {r.expected_imbalance:.3f} "
                         f"| {period} | {served} | {r.routed_imbalance:.3f} |")
        lines.append(f"| {w.name} | max abs error against expected | | | | | {w.max_imbalance_error:.3f} | "
                     f"{w.max_routed_imbalance_error:.3f} |")
        lines.append(f"| {w.name} | max abs error against the period's prediction | | | | | "
                     f"{w.max_period_error:.3f} | |")
    first = "never" if report.affinity_first_on_s is None else f"{report.affinity_first_on_s:.1f} s"
    lines += [
        "",
        f"affinity first on at {first}; reads with affinity off after that: {report.affinity_off} of "
        f"{report.status_reads}; plans seen: {report.epochs_seen} from {', '.join(report.planners_seen)}; "
        f"failed requests: {report.failed}, lost to the kill: {report.lost_to_kill} "
        f"{report.failures or ''}; nodes down at the end: {report.crashed or 'none'}",
        *(f"  {e}" for e in report.errors),
        *(f"  affinity off: {r}" for r in report.affinity_off_reads),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=30.0, help="requests per second (default %(default)s)")
    parser.add_argument("--keys", type=int, default=50, help="keys sharing the other half (default %(default)s)")
    parser.add_argument("--plan-period", type=float, default=2.0)
    parser.add_argument("--gossip-interval", type=float, default=None,
                        help="seconds between gossip rounds (default: the local profile's, 0.2)")
    parser.add_argument("--warm", type=float, default=75.0,
                        help="seconds before measuring (default %(default)s: all keys warm)")
    parser.add_argument("--steady", type=float, default=30.0, help="seconds measured (default %(default)s)")
    parser.add_argument("--killed", type=float, default=15.0, help="seconds without the planner (default %(default)s)")
    parser.add_argument("--back", type=float, default=30.0, help="seconds after its restart (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, help="keep the nodes' logs in this directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pnode-plan-mesh-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(run(args, workdir))
    print(json.dumps(asdict(report), indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
