"""Gossip benchmark on the in-memory transport (simulated time): bandwidth, dissemination, failure detection, and how
well the cache summary predicts the real prefix match. Not a test: it prints numbers (``--json``: one JSON object).

    python scripts/bench_gossip.py                 # 10, 40, 100, 200 nodes (a few minutes on 2 cores)
    python scripts/bench_gossip.py --sizes 10,40 --json
    python scripts/bench_gossip.py --sizes 500,1000 --sizes-only   # 40 observers keep views (~30 min at 1,000)
    python scripts/bench_gossip.py --cold-start 1000 --spread 60 --horizon 70   # a mesh started within a minute

Per mesh size N (gossip interval 1 s, fanout 3, defaults everywhere else; 1-10 ms message delay, no loss):

- every node runs a real GossipAgent with a real PrefixIndex (block size 16) fed with BlockStored/BlockRemoved
  events: 16 cluster-wide system prompts of 4 blocks, and per node 12 documents of 20 blocks, each continuing one
  system prompt (~290 cached blocks, ~70 published hashes at stride 4);
- **quiet**: bytes/s sent per node (requests and replies, envelopes included) while each node's load changes every
  second (so one "load" update per node per round is always in flight) and its cache does not change;
- **dissemination**: during the quiet phase one node per second publishes a new key; rounds until every node has
  it = (time the last node got it - time it was written) / interval; p50 and p99 over all updates;
- **churn**: bytes/s per node while every node stores 100 new blocks per second (5 documents of 20 blocks) and evicts
  its 100 oldest (the 5 oldest documents), i.e. ~25 published hashes added and ~25 withdrawn per node per second;
- **accuracy**: requests (a cached document cut at a random depth, or another node's document, then 2 new blocks)
  scored against the exact ``PrefixIndex.match_blocks`` of the node they are estimated for, by a random other node's
  ClusterView; "routing agreement": the node with the highest estimate also has the highest exact match (up to the
  stride);
- **failure detection**: a node is killed (no "left"); seconds until the first, the median and the last survivor
  declares it dead;
- with ``--host-tier M``: each node also has a host KV tier of M x its engine's documents, which takes every document
  the engine evicts (as vLLM's offloading stores it) and evicts its own oldest when full; its index is published as a
  summary of its own beside the engine's (``peering.peer(tiers=...)``), so quiet and churn bytes include both.

Simulated seconds (quiet / churn warm-up + measured): 20 / 5 + 20 below 100 nodes, 15 / 3 + 8 at 100, 8 / 2 + 4 at
200, 4 / 1 + 3 at 500, 3 / 1 + 2 at 1,000 -- simulating N nodes in one process costs ~N^2 per simulated second, and
the rates are steady-state ones. From 500 members only 40 of them (``--observers``) keep a ClusterView and are asked
the accuracy questions; the others publish the same load and summary and read none (1,000 views of 1,000 summaries
would cost the simulation gigabytes, and bytes and timings do not depend on them). The summary's accuracy under
churn is measured separately on 20 nodes with 2000-block caches (see ``run_accuracy_under_churn``), where documents
live long enough to be requested at every age.
Separately, the ClusterView lookup: ``estimate_all`` over 64 peers for a 128-block chain (p50/p99 microseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import random
import resource
import statistics
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, replace

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockRemoved, BlockStored
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, SummaryPublisher, encode_meta
from p2pnode.cache.summary_log import SummaryWriter, summary_key
from p2pnode.cache.tiers import Medium
from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, MemberState, SimClock
from p2pnode.gossip.codec import encode
from p2pnode.gossip.config import DEFAULT_DIGEST_MAX_MEMBERS, DEFAULT_SUMMARY_STRIDE, NEWCOMER_ROUNDS
from p2pnode.gossip.digest import digest_shards
from p2pnode.gossip.exchange import make_syn
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LoadPublisher, NodeLoad
from p2pnode.peering import Peering, peer
from p2pnode.routing.cluster_view import ClusterView

BS = 16
SYSTEM_PROMPTS = 16
SYSTEM_BLOCKS = 4
DOC_BLOCKS = 20
DOCS_PER_NODE = 12
CHURN_DOCS_PER_S = 5  # x 20 blocks = 100 blocks stored and 100 evicted per node per second
SECRET = b"benchmark cluster secret, 32 B.."
#: Simulated seconds per phase, by mesh size (from this size up): (quiet, churn warm-up, churn measured). The
#: simulation costs ~N^2 per simulated second under churn (every node applies every node's changes), so large
#: meshes get shorter phases; the rates they measure are steady-state ones.
PHASES_S = {1: (20, 5, 20), 100: (15, 3, 8), 200: (8, 2, 4), 500: (4, 1, 3), 1000: (3, 1, 2)}
#: Members that keep a ClusterView (and are asked the accuracy questions) from this mesh size up, when
#: ``--observers`` does not say: every member of a larger mesh keeping a view of every other costs memory and CPU
#: ~N^2 (1,000 views of 1,000 summaries), and the view is not what gossip's bytes or timings depend on.
OBSERVERS_FROM = 500
#: Simulated seconds a mesh started at once is given to converge before the phases start anyway (its join time is
#: then reported as infinite).
JOIN_LIMIT_S = 90.0
DEFAULT_OBSERVERS = 40


class Workload:
    """One node's engine, as far as its prefix index can tell: system prompts, then documents that continue them;
    and, with a host tier (``host_docs`` > 0), what the engine evicted, in a host index of its own."""

    def __init__(
        self, index: PrefixIndex, rng: random.Random, systems: list[list[int]], clock: SimClock, host_docs: int = 0
    ) -> None:
        self.index = index
        self.rng = rng
        self.systems = systems
        self.clock = clock
        self.system_engine: dict[int, tuple[int, ...]] = {}
        # (tokens, engine hashes, time stored), oldest first
        self.docs: deque[tuple[list[int], tuple[int, ...], float]] = deque()
        self.system_of: dict[tuple[int, ...], int] = {}  # a document's engine hashes -> its system prompt
        self.host = PrefixIndex(block_size=BS) if host_docs else None
        self.host_docs = host_docs
        self.host_system: dict[int, tuple[int, ...]] = {}
        self.host_chains: deque[tuple[int, ...]] = deque()  # oldest first

    def _hashes(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.getrandbits(63) for _ in range(n))

    def add_doc(self) -> None:
        sid = self.rng.randrange(len(self.systems))
        system = self.systems[sid]
        if sid not in self.system_engine:
            self.system_engine[sid] = self._hashes(SYSTEM_BLOCKS)
            self.index.apply(BlockStored(self.system_engine[sid], None, tuple(system), BS))
        body = [self.rng.randrange(100_000) for _ in range(DOC_BLOCKS * BS)]
        engine = self._hashes(DOC_BLOCKS)
        self.index.apply(BlockStored(engine, self.system_engine[sid][-1], tuple(body), BS))
        self.docs.append((system + body, engine, self.clock.now()))
        self.system_of[engine] = sid

    def evict_oldest(self) -> None:
        tokens, engine, _ = self.docs.popleft()
        self.index.apply(BlockRemoved(tuple(reversed(engine))))  # vLLM frees a request's blocks tail first
        sid = self.system_of.pop(engine)
        if self.host is not None:
            self._offload(sid, tokens)

    def _offload(self, sid: int, tokens: list[int]) -> None:
        """The evicted document into the host tier (its system prompt too, once); the tier's oldest out when full."""
        assert self.host is not None
        if sid not in self.host_system:
            self.host_system[sid] = self._hashes(SYSTEM_BLOCKS)
            self.host.apply(BlockStored(self.host_system[sid], None, tuple(self.systems[sid]), BS))
        chain = self._hashes(DOC_BLOCKS)
        self.host.apply(BlockStored(chain, self.host_system[sid][-1], tuple(tokens[SYSTEM_BLOCKS * BS :]), BS))
        self.host_chains.append(chain)
        if len(self.host_chains) > self.host_docs:
            self.host.apply(BlockRemoved(tuple(reversed(self.host_chains.popleft()))))


@dataclass(frozen=True)
class Publishing:
    """What a member that is no observer runs: the same load and summary publishers as ``peer`` wires, no view."""

    load: LoadPublisher
    summary: SummaryPublisher
    tiers: dict[Medium, SummaryPublisher]

    def notify(self) -> None:
        self.summary.notify()
        for tier in self.tiers.values():
            tier.notify()


def publish_only(agent: GossipAgent, index: PrefixIndex, tiers: dict[Medium, PrefixIndex] | None) -> Publishing:
    """``peering.peer`` without the ClusterView: the member publishes as a node does and reads nobody's summary."""
    config = agent.config

    def attached(tier_index: PrefixIndex, medium: Medium = Medium.GPU) -> SummaryPublisher:
        summary = SummaryPublisher(tier_index, config.summary_stride, config.summary_max_hashes, "", medium)
        summary.attach(agent, config.summary_min_gap_s)
        return summary

    load = LoadPublisher(agent, agent.config.load_updates_per_s)
    return Publishing(load, attached(index), {m: attached(t, m) for m, t in (tiers or {}).items()})


#: Simulated seconds between a mesh's convergence and its measurements: a member is new to its peers for
#: ``NEWCOMER_ROUNDS`` rounds after they first hear of it (in a mesh cut into digest shards, their Syns name it
#: meanwhile), so the steady state begins a little after that.
SETTLE_S = NEWCOMER_ROUNDS * 1.0 + 1.0


class Bench:
    def __init__(
        self,
        n: int,
        seed: int,
        docs_per_node: int = DOCS_PER_NODE,
        host_tier: int = 0,
        observers: int | None = None,
        digest_max_members: int = DEFAULT_DIGEST_MAX_MEMBERS,
        summary_stride: int = DEFAULT_SUMMARY_STRIDE,
    ) -> None:
        self.n = n
        #: Indexes of the members that keep a ClusterView (all of them unless ``observers`` says how many, spread
        #: evenly); the others publish the same load and summary but read nobody's.
        k = n if observers is None else max(2, min(n, observers))
        self.observers = sorted({round(i * n / k) for i in range(k)})
        self.observer_set = set(self.observers)
        self.docs_per_node = docs_per_node
        self.host_tier = host_tier
        self.rng = random.Random(seed)
        self.clock = SimClock()
        self.net = InMemoryNetwork(self.clock, seed=seed)
        self.config = GossipConfig(
            cluster_secret=SECRET, digest_max_members=digest_max_members, summary_stride=summary_stride
        )
        self.systems = [[self.rng.randrange(100_000) for _ in range(SYSTEM_BLOCKS * BS)] for _ in range(SYSTEM_PROMPTS)]
        self.agents: list[GossipAgent] = []
        self.peerings: list[Peering | Publishing] = []
        self.workloads: list[Workload] = []
        self.arrivals: dict[str, dict[str, float]] = {}
        self.churn = False
        self.loads = True
        #: CPU milliseconds per member per simulated second, over the last quiet / measure_bytes phase (the whole
        #: process: protocol, publishers, the observers' views and the workload; one core).
        self.cpu_quiet_ms = math.nan
        self.cpu_bytes_ms = math.nan

    async def start(self) -> None:
        seeds = [f"10.0.0.{i}:7000" for i in range(min(3, self.n))]
        for i in range(self.n):
            address = f"10.0.0.{i}:7000"
            agent = GossipAgent(
                self.config, f"n{i:03d}", address, self.net.transport(address), self.clock, seeds=seeds,
                rng=random.Random(self.rng.getrandbits(64)),
            )  # fmt: skip
            index = PrefixIndex(block_size=BS)
            workload = Workload(
                index, random.Random(self.rng.getrandbits(64)), self.systems, self.clock,
                host_docs=self.host_tier * self.docs_per_node,
            )
            for _ in range(self.docs_per_node * (1 + self.host_tier)):  # the tier full from the start
                workload.add_doc()
                if len(workload.docs) > self.docs_per_node:
                    workload.evict_oldest()
            tiers = {Medium.HOST: workload.host} if workload.host is not None else None
            observing = i in self.observer_set
            self.peerings.append(peer(agent, index, tiers=tiers) if observing else publish_only(agent, index, tiers))
            agent.watch("rates/bench/", self._watcher(agent.self_id))
            self.agents.append(agent)
            self.workloads.append(workload)
            self.clock.call_later(self.rng.random(), self._ticker(i))
            await agent.start()
            self.clock.advance(1.0 / self.n)  # staggered starts: rounds at random phases

    def _watcher(self, viewer: str):
        def seen(owner: str, key: str, value: bytes | None) -> None:
            self.arrivals.setdefault(key, {}).setdefault(viewer, self.clock.now())

        return seen

    def _ticker(self, i: int):
        """Once a simulated second per node: a new load, and with churn on, 100 blocks in and 100 out."""

        def tick() -> None:
            agent = self.agents[i]
            if not agent.running:
                return
            r = self.rng
            if self.loads:
                load = NodeLoad(running=r.randrange(64), waiting=r.randrange(16), kv_usage=r.random())
                self.peerings[i].load.set(replace(load, in_flight=r.randrange(32)))
            if self.churn:
                workload = self.workloads[i]
                for _ in range(CHURN_DOCS_PER_S):
                    workload.add_doc()
                    workload.evict_oldest()
                self.peerings[i].notify()  # as the node does after each batch of its engine's cache events
            self.clock.call_later(1.0, tick)

        return tick

    def converged(self) -> bool:
        live = [a for a in self.agents if a.running]
        viewers = [self.agents[i] for i in self.observers if self.agents[i].running]
        for viewer in viewers:
            for owner in live:
                copy = viewer.state.node(owner.self_id)
                own = owner.state.self_node
                if copy is None or copy.max_version < own.max_version - 10:  # loads move every second
                    return False
        return True

    def bytes_total(self) -> int:
        return sum(self.net.bytes_sent.values())

    def measure_quiet(self, seconds: int) -> tuple[float, float, list[float]]:
        """Bytes/s per node (mean, max) over ``seconds``, while one random node per second publishes a new key;
        then the rounds each key took to reach every node."""
        before = dict(self.net.bytes_sent)
        keys = []
        cpu = time.process_time()
        for k in range(seconds):
            owner = self.agents[self.rng.randrange(self.n)]
            key = f"rates/bench/{k}"
            owner.publish(key, b"1")
            keys.append((key, self.clock.now()))
            self.clock.advance(1.0)
        self.cpu_quiet_ms = 1000 * (time.process_time() - cpu) / (seconds * self.n)
        deltas = [self.net.bytes_sent[a.address] - before.get(a.address, 0) for a in self.agents]
        deadline = self.clock.now() + 30.0
        while self.clock.now() < deadline and any(len(self.arrivals.get(k, ())) < self.n for k, _ in keys):
            self.clock.advance(0.5)
        rounds = []
        for key, t0 in keys:
            seen = self.arrivals.get(key, {})
            complete = len(seen) == self.n
            rounds.append((max(seen.values()) - t0) / self.config.interval_s if complete else math.inf)
        return statistics.mean(deltas) / seconds, max(deltas) / seconds, rounds

    def measure_bytes(self, seconds: float) -> tuple[float, float]:
        before = dict(self.net.bytes_sent)
        cpu = time.process_time()
        self.clock.advance(seconds)
        self.cpu_bytes_ms = 1000 * (time.process_time() - cpu) / (seconds * self.n)
        deltas = [self.net.bytes_sent[a.address] - before.get(a.address, 0) for a in self.agents]
        return statistics.mean(deltas) / seconds, max(deltas) / seconds

    def lag(self, versions_before: list[int], seconds: float) -> dict[str, float]:
        """How far the observers' copies are behind their owners now, in seconds of the owners' writes (versions
        behind / the owner's versions per second over the last ``seconds``): whether the exchanges keep up."""
        rates = [
            (a.state.self_node.max_version - v) / seconds for a, v in zip(self.agents, versions_before, strict=True)
        ]
        behind = []
        for i in self.observers:
            state = self.agents[i].state
            for owner, rate in zip(self.agents, rates, strict=True):
                copy = state.node(owner.self_id)
                if owner is self.agents[i] or rate <= 0:
                    continue
                missing = owner.state.self_node.max_version - (copy.max_version if copy is not None else 0)
                behind.append(missing / rate)
        return {
            "owner_versions_per_s": round(statistics.mean(rates), 1),
            "behind_s_p50": round(pct(behind, 0.5), 2),
            "behind_s_p99": round(pct(behind, 0.99), 2),
            "behind_s_max": round(max(behind), 2),
        }

    def sample_requests(self, samples: int) -> list[dict[str, float]]:
        """Requests scored against the exact index of the node they are estimated for (see the module docstring)."""
        out = []
        stride = self.config.summary_stride
        for s in range(samples):
            owner_i = self.rng.randrange(self.n)
            source = self.workloads[owner_i if s % 2 == 0 else self.rng.randrange(self.n)]
            tokens, _, stored_at = self.rng.choice(source.docs)
            cut = self.rng.randrange(1, SYSTEM_BLOCKS + DOC_BLOCKS + 1)
            request = tokens[: cut * BS] + [self.rng.randrange(100_000) for _ in range(2 * BS)]
            chain = block_hashes(request, BS)
            if len(self.observers) == self.n:
                viewer_i = (owner_i + 1 + self.rng.randrange(self.n - 1)) % self.n
            else:
                viewer_i = self.rng.choice([o for o in self.observers if o != owner_i])
            viewer = self.peerings[viewer_i].view
            exact = self.workloads[owner_i].index.match_blocks(chain)
            est = viewer.estimate_match_blocks(self.agents[owner_i].self_id, chain)
            estimates = viewer.estimate_all(chain)
            truth = {a.self_id: w.index.match_blocks(chain) for a, w in zip(self.agents, self.workloads, strict=True)}
            best = max(estimates, key=lambda k: (estimates[k], k))
            out.append(
                {
                    "age_s": self.clock.now() - stored_at,
                    "exact": exact,
                    "error": est - exact,
                    "agree": truth[best] >= max(truth.values()) - (stride - 1),
                }
            )
        return out

    def accuracy(self, samples: int) -> dict[str, float]:
        return score(self.sample_requests(samples), self.config.summary_stride)

    async def detect_death(self) -> dict[str, float]:
        return await detect_death(self.clock, self.agents)


async def detect_death(clock: SimClock, agents: list[GossipAgent]) -> dict[str, float]:
    """The last member is killed (no "left"): seconds until the first, the median and the last survivor declares it
    dead."""
    victim = agents[-1]
    await victim.stop(leave=False)
    t0 = clock.now()
    declared: dict[str, float] = {}
    others = [a for a in agents if a is not victim]
    while len(declared) < len(others) and clock.now() - t0 < 60:
        clock.advance(0.1)
        for a in others:
            if a.self_id not in declared and a.membership.state(victim.self_id) is MemberState.DEAD:
                declared[a.self_id] = clock.now() - t0
    times = sorted(declared.values())
    return {
        "first_s": round(times[0], 1),
        "median_s": round(statistics.median(times), 1),
        "last_s": round(times[-1], 1) if len(times) == len(others) else float("inf"),
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def score(rows: list[dict[str, float]], stride: int) -> dict[str, float]:
    errors = [abs(r["error"]) for r in rows]
    return {
        "samples": len(rows),
        "mean_exact_match_blocks": round(statistics.mean(r["exact"] for r in rows), 2),
        "mean_abs_error_blocks": round(statistics.mean(errors), 3),
        "p99_abs_error_blocks": pct(errors, 0.99),
        "exact_pct": round(100 * sum(e == 0 for e in errors) / len(rows), 1),
        "within_stride_pct": round(100 * sum(0 <= -r["error"] < stride for r in rows) / len(rows), 1),
        "over_estimate_pct": round(100 * sum(r["error"] > 0 for r in rows) / len(rows), 2),
        "routing_agreement_pct": round(100 * sum(r["agree"] for r in rows) / len(rows), 1),
    }


#: Age buckets (seconds since the requested document was stored) of the churn accuracy run.
AGE_BUCKETS = [(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, math.inf)]


async def run_accuracy_under_churn(seed: int, n: int = 20, docs: int = 100, seconds: float = 30.0) -> dict[str, object]:
    """Summary accuracy while caches churn at 100 blocks/s per node, by age of the requested document.

    Each node caches ~2000 blocks (100 documents), so a document lives ~20 s at this churn: requests hit documents
    of every age, and the buckets show how quickly a new prefix becomes visible to the other nodes.
    """
    bench = Bench(n, seed, docs_per_node=docs)
    await bench.start()
    while not bench.converged():
        bench.clock.advance(1.0)
    bench.churn = True
    bench.clock.advance(seconds)
    rows = []
    for _ in range(40):  # 4,000 requests: ~200 of documents under a second old
        rows += bench.sample_requests(100)
        bench.clock.advance(1.3)
    stride = bench.config.summary_stride
    buckets = {}
    for lo, hi in AGE_BUCKETS:
        inside = [r for r in rows if lo <= r["age_s"] < hi]
        if inside:
            buckets[f"{lo:g}-{hi:g}s"] = score(inside, stride)
    return {"nodes": n, "cached_blocks_per_node": docs * DOC_BLOCKS, "all": score(rows, stride), "by_age": buckets}


async def run_size(
    n: int,
    seed: int,
    host_tier: int = 0,
    observers: int | None = None,
    digest_max_members: int = DEFAULT_DIGEST_MAX_MEMBERS,
    summary_stride: int = DEFAULT_SUMMARY_STRIDE,
) -> dict[str, object]:
    wall = time.perf_counter()
    quiet_s, churn_warm_s, churn_s = PHASES_S[max(k for k in PHASES_S if k <= n)]
    if observers is None and n >= OBSERVERS_FROM:
        observers = DEFAULT_OBSERVERS
    bench = Bench(
        n, seed, host_tier=host_tier, observers=observers, digest_max_members=digest_max_members,
        summary_stride=summary_stride,
    )
    await bench.start()
    t0 = bench.clock.now()
    while not bench.converged() and bench.clock.now() - t0 < JOIN_LIMIT_S:
        bench.clock.advance(1.0)
    join_s = bench.clock.now() - t0 if bench.converged() else math.inf
    bench.clock.advance(SETTLE_S)
    join_phi_max = max(a.stats.established_phi_max_milli for a in bench.agents) / 1000  # the join and the settling
    for agent in bench.agents:
        agent.stats.established_phi_max_milli = 0  # from here on: the steady state's
    probes_from, steady_from = sum(a.stats.stale_probes for a in bench.agents), bench.clock.now()
    quiet_mean, quiet_max, rounds = bench.measure_quiet(quiet_s)
    acc_quiet = bench.accuracy(400)
    bench.churn = True
    bench.clock.advance(churn_warm_s)
    versions_before = [a.state.self_node.max_version for a in bench.agents]
    churn_mean, churn_max = bench.measure_bytes(churn_s)
    cpu_churn_ms = bench.cpu_bytes_ms
    churn_lag = bench.lag(versions_before, churn_s)
    bench.churn = False
    bench.loads = False  # detection does not depend on the traffic; without load updates it simulates faster
    steady_phi_max = max(a.stats.established_phi_max_milli for a in bench.agents) / 1000  # before anyone dies
    probes = sum(a.stats.stale_probes for a in bench.agents) - probes_from
    probes_per_node_s = probes / n / (bench.clock.now() - steady_from)
    death = await bench.detect_death()
    shards = digest_shards(len(bench.agents[0].state.nodes), bench.agents[0].config.digest_max_members)
    gc.collect()
    return {
        "nodes": n,
        "summary_stride": bench.config.summary_stride,
        "simulated_s": {"quiet": quiet_s, "churn_warm_up": churn_warm_s, "churn": churn_s},
        "join_converged_s": join_s,
        "quiet_bytes_per_s_per_node": round(quiet_mean),
        "quiet_bytes_per_s_max_node": round(quiet_max),
        "churn_bytes_per_s_per_node": round(churn_mean),
        "churn_bytes_per_s_max_node": round(churn_max),
        "dissemination_rounds_p50": round(pct(rounds, 0.5), 2),
        "dissemination_rounds_p99": round(pct(rounds, 0.99), 2),
        "dissemination_target_rounds": round(math.log2(n) + 3, 2),
        "published_hashes_per_node": round(statistics.mean(len(p.summary.published) for p in bench.peerings)),
        "published_host_hashes_per_node": round(
            statistics.mean(sum(len(t.published) for t in p.tiers.values()) for p in bench.peerings)
        ),
        "accuracy_quiet": acc_quiet,
        "dead_detection": death,
        # the highest phi any node saw of a live member it had spoken with (suspect > 4), over the run and from the
        # steady state on (quiet and churn)
        "live_phi_max": max(join_phi_max, steady_phi_max),
        "live_phi_max_steady": steady_phi_max,
        "stale_probes_per_node_s": round(probes_per_node_s, 2),  # from the steady state on (quiet and churn)
        "churn_lag": churn_lag,
        "observers": len(bench.observers),
        "cpu_ms_per_member_s_quiet": round(bench.cpu_quiet_ms, 2),
        "cpu_ms_per_member_s_churn": round(cpu_churn_ms, 2),
        "syn_bytes": len(encode(make_syn(bench.agents[0].state))),  # the whole digest
        "shard_syn_bytes": len(encode(make_syn(bench.agents[0].state, (0, shards)))) if shards > 1 else None,
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "wall_s": round(time.perf_counter() - wall, 1),
    }


class _RefusalLog(logging.Handler):
    """Counts the gossip WARNING lines an operator would read about refused members (rate-limited as logged)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = str(record.msg)
        if "max_vouched_members" in text:
            self.lines["vouch"] += 1
        elif "max_members" in text:
            self.lines["member_cap"] += 1
        else:
            self.lines["other"] += 1


async def run_cold_start(
    n: int,
    seed: int,
    spread_s: float = 60.0,
    horizon_s: float = 120.0,
    seed_count: int = 3,
    progress: bool = False,
    digest_max_members: int = DEFAULT_DIGEST_MAX_MEMBERS,
) -> dict[str, object]:
    """A mesh started all at once: ``seed_count`` seeds at t = 0, the other members at uniform random times within
    ``spread_s``, every one joining through the seeds, default config; its load changes every second, no cache.

    Sampled every simulated second: the (viewer, member) pairs of started members where the viewer holds the member
    alive. Reports when every member first held every other alive, the pairs held at ``spread_s`` and at the end,
    how long after its start each member was held alive by every member started, and what the flood
    protections refused on the way (counters and the WARNING lines logged); then, all started, the rounds three keys
    take to reach every member, and how long the survivors take to declare the last member dead once it is killed.
    """
    wall = time.perf_counter()
    rng = random.Random(seed)
    clock = SimClock()
    net = InMemoryNetwork(clock, seed=seed)
    config = GossipConfig(cluster_secret=SECRET, digest_max_members=digest_max_members)
    seeds = [f"10.1.{i // 250}.{i % 250}:7000" for i in range(seed_count)]
    starts = sorted([0.1 * rng.random() for _ in range(seed_count)]) + sorted(
        spread_s * rng.random() for _ in range(n - seed_count)
    )
    refusals = _RefusalLog()
    gossip_log = logging.getLogger("p2pnode.gossip")
    gossip_log.addHandler(refusals)
    agents: list[GossipAgent] = []
    loads: list[LoadPublisher] = []
    started_at: list[float] = []

    def ticker(i: int):
        def tick() -> None:
            if agents[i].running:
                r = rng
                loads[i].set(NodeLoad(running=r.randrange(64), waiting=r.randrange(16), kv_usage=r.random()))
                clock.call_later(1.0, tick)

        return tick

    arrivals: dict[str, dict[str, float]] = {}

    def arrived(viewer: str):
        def seen(owner: str, key: str, value: bytes | None) -> None:
            arrivals.setdefault(key, {}).setdefault(viewer, clock.now())

        return seen

    published: list[tuple[str, float]] = []  # after the last start, one key a second for 3 s: dissemination
    seen_by_all_at: dict[int, float] = {}
    coverage: dict[float, float] = {}
    converged_at = math.inf
    before = None
    cpu = time.process_time()
    next_start = 0
    for second in range(1, int(horizon_s) + 1):
        while next_start < n and starts[next_start] < second:
            clock.run_until(starts[next_start])
            i = next_start
            address = f"10.1.{i // 250}.{i % 250}:7000"
            agent = GossipAgent(
                config, f"m{i:04d}", address, net.transport(address), clock, seeds=seeds,
                rng=random.Random(rng.getrandbits(64)),
            )  # fmt: skip
            agent.watch("rates/bench/", arrived(agent.self_id))
            agents.append(agent)
            loads.append(LoadPublisher(agent, agent.config.load_updates_per_s))
            started_at.append(clock.now())
            clock.call_later(rng.random(), ticker(i))
            await agent.start()
            next_start += 1
        if spread_s + 1 < second <= spread_s + 4:
            key = f"rates/bench/{second}"
            rng.choice(agents).publish(key, b"1")
            published.append((key, clock.now()))
        clock.run_until(float(second))
        if progress:
            print(f"  ... {second} s, {len(agents)} members started", file=sys.stderr, flush=True)
        if second == int(spread_s):
            before = sum(net.bytes_sent.values())
        ids = [a.self_id for a in agents]
        held = 0
        held_by: Counter[str] = Counter()
        for viewer in agents:
            states = viewer.membership.states()
            for node_id in ids:
                if node_id != viewer.self_id and states.get(node_id) is MemberState.ALIVE:
                    held += 1
                    held_by[node_id] += 1
        started = len(agents)
        pairs = started * (started - 1)
        coverage[float(second)] = held / pairs if pairs else 1.0
        for i, node_id in enumerate(ids):
            if i not in seen_by_all_at and held_by[node_id] == started - 1:
                seen_by_all_at[i] = clock.now() - started_at[i]
        if started == n and held == pairs and converged_at == math.inf:
            converged_at = float(second)
    cpu_s = time.process_time() - cpu
    total_bytes = sum(net.bytes_sent.values())
    gossip_log.removeHandler(refusals)
    rounds = [
        (max(arrivals[key].values()) - t0) / config.interval_s if len(arrivals.get(key, ())) == n else math.inf
        for key, t0 in published
    ]
    death = await detect_death(clock, agents)
    lags = sorted(seen_by_all_at.values())
    stats = [a.stats for a in agents]
    return {
        "members": n,
        "seeds": seed_count,
        "spread_s": spread_s,
        "horizon_s": horizon_s,
        "all_see_all_alive_at_s": converged_at,
        "alive_pairs_pct_at_spread": round(100 * coverage.get(float(int(spread_s)), 0.0), 2),
        "alive_pairs_pct_at_horizon": round(100 * coverage.get(float(int(horizon_s)), 0.0), 2),
        "alive_pairs_pct_by_10s": {f"{t:g}": round(100 * c, 2) for t, c in coverage.items() if t % 10 == 0},
        "held_alive_by_all_after_start_s": {
            "members": len(lags),
            "p50": round(pct(lags, 0.5), 1) if lags else None,
            "p99": round(pct(lags, 0.99), 1) if lags else None,
            "max": round(lags[-1], 1) if lags else None,
        },
        "vouches_refused": sum(s.vouches_refused for s in stats),
        "vouches_deferred": sum(getattr(s, "vouches_deferred", 0) for s in stats),
        "members_refused_at_cap": sum(s.members_refused for s in stats),
        "members_refusing_vouches": sum(s.vouches_refused > 0 for s in stats),
        "warning_lines": dict(refusals.lines),
        "bytes_per_s_per_member_whole_run": round(total_bytes / horizon_s / n),
        "bytes_per_s_per_member_after_spread": round((total_bytes - before) / (horizon_s - spread_s) / n)
        if before is not None and horizon_s > spread_s
        else None,
        "dissemination_rounds_after_spread": [round(r, 2) for r in rounds],
        "dead_detection": death,
        "cpu_ms_per_member_s": round(1000 * cpu_s / horizon_s / n, 2),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "wall_s": round(time.perf_counter() - wall, 1),
    }


def bench_lookup(peers: int = 64, chain_blocks: int = 128, calls: int = 20_000, seed: int = 0) -> dict[str, object]:
    """estimate_all / per-peer estimates over ``peers`` peers holding ~2k published hashes each."""
    rng = random.Random(seed)
    config = GossipConfig(cluster_secret=SECRET)
    state = ClusterState("router", 1)
    membership = Membership("router", config)
    view = ClusterView(state, membership, SimClock(), block_size=BS)
    docs = [[rng.randrange(100_000) for _ in range(chain_blocks * BS)] for _ in range(32)]
    chains = [block_hashes(d, BS) for d in docs]
    stride = config.summary_stride
    for p in range(peers):
        node = f"p{p:02d}"
        view.on_node_added(node, 1)
        membership.on_node(node, 1, 0.0)
        view.on_key_changed(node, ADDRESS_KEY, f"{node}:1".encode())
        view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(stride, BS)))
        published = []
        for chain in chains:  # each peer holds a random prefix of every document: hits at every depth
            depth = rng.randrange(0, chain_blocks + 1)
            published += [chain[d - 1] for d in range(stride, depth + 1, stride)]
        published += [rng.getrandbits(64) for _ in range(1000)]  # and unrelated hashes
        for key, value in SummaryWriter().update([summary_key(h) for h in published], []):
            view.on_key_changed(node, key, value)
    cold = [block_hashes([rng.randrange(100_000) for _ in range(chain_blocks * BS)], BS) for _ in range(8)]

    def timed(fn, inputs: list[list[int]]) -> tuple[float, float]:
        samples = []
        for i in range(calls):
            chain = inputs[i % len(inputs)]
            t = time.perf_counter_ns()
            fn(chain)
            samples.append(time.perf_counter_ns() - t)
        return pct(samples, 0.5) / 1000, pct(samples, 0.99) / 1000

    def per_peer(chain: list[int]) -> dict[str, int]:
        return {p.node_id: p.estimate_match_blocks(chain) for p in view.usable_peers()}

    assert all(view.estimate_all(c) == per_peer(c) for c in chains + cold)
    gc.collect()
    gc.disable()  # a collection pause is not the lookup's cost (a node's loop pays it whatever it runs)
    try:
        warm_all = timed(view.estimate_all, chains)
        cold_all = timed(view.estimate_all, cold)
        warm_each = timed(per_peer, chains)
    finally:
        gc.enable()
    return {
        "peers": peers,
        "chain_blocks": chain_blocks,
        "published_hashes_per_peer": round(statistics.mean(len(p.hashes) for p in view.peers())),
        "estimate_all_us_p50": round(warm_all[0], 1),
        "estimate_all_us_p99": round(warm_all[1], 1),
        "estimate_all_cold_us_p50": round(cold_all[0], 1),
        "estimate_all_cold_us_p99": round(cold_all[1], 1),
        "per_peer_loop_us_p50": round(warm_each[0], 1),
        "per_peer_loop_us_p99": round(warm_each[1], 1),
    }


def kb(x: float) -> str:
    return f"{x / 1000:.1f}"


def print_table(results: list[dict], churn: dict | None, lookup: dict | None) -> None:
    strides = "/".join(str(s) for s in sorted({r["summary_stride"] for r in results}))
    print(f"gossip interval 1 s, fanout 3, stride {strides}; churn = 100 blocks stored + 100 evicted per node per "
          "second")
    print(
        f"{'nodes':>5} {'join s':>6} {'quiet KB/s':>10} {'(max)':>6} {'churn KB/s':>10} {'(max)':>6} "
        f"{'rounds p50':>10} {'p99':>5} {'target':>6} {'dead first/med/last s':>22} {'cpu ms q/c':>10} "
        f"{'syn KB':>6} {'phi max/steady':>14} {'wall s':>6}"
    )
    for r in results:
        d = r["dead_detection"]
        print(
            f"{r['nodes']:>5} {r['join_converged_s']:>6.0f} {kb(r['quiet_bytes_per_s_per_node']):>10} "
            f"{kb(r['quiet_bytes_per_s_max_node']):>6} {kb(r['churn_bytes_per_s_per_node']):>10} "
            f"{kb(r['churn_bytes_per_s_max_node']):>6} {r['dissemination_rounds_p50']:>10.1f} "
            f"{r['dissemination_rounds_p99']:>5.1f} {r['dissemination_target_rounds']:>6.1f} "
            f"{d['first_s']:>8.1f}/{d['median_s']:>5.1f}/{d['last_s']:>5.1f} "
            f"{r['cpu_ms_per_member_s_quiet']:>5.1f}/{r['cpu_ms_per_member_s_churn']:<4.1f} "
            f"{kb(r['syn_bytes']):>6} {r['live_phi_max']:>7.2f}/{r['live_phi_max_steady']:<6.2f} {r['wall_s']:>6.0f}"
        )
    hashes = ", ".join(
        f"{r['nodes']}: {r['published_hashes_per_node']} + {r['published_host_hashes_per_node']}" for r in results
    )
    print(f"published hashes per node (engine + host tier): {hashes}")
    print()
    print("summary prediction vs exact PrefixIndex.match_blocks (blocks), quiet caches (converged summaries)")
    header = (
        f"{'':>12} {'mean match':>10} {'mean |err|':>10} {'p99 |err|':>9} {'exact %':>7} {'<stride %':>9} "
        f"{'over %':>6} {'routing agree %':>15}"
    )

    def row(label: str, a: dict) -> str:
        return (
            f"{label:>12} {a['mean_exact_match_blocks']:>10.2f} {a['mean_abs_error_blocks']:>10.3f} "
            f"{a['p99_abs_error_blocks']:>9} {a['exact_pct']:>7.1f} {a['within_stride_pct']:>9.1f} "
            f"{a['over_estimate_pct']:>6.2f} {a['routing_agreement_pct']:>15.1f}"
        )

    print(header)
    for r in results:
        label = f"{r['nodes']} nodes" if r["observers"] == r["nodes"] else f"{r['nodes']}/{r['observers']} obs"
        print(row(label, r["accuracy_quiet"]))
    print()
    if churn is None or lookup is None:
        return
    print(
        f"under churn ({churn['nodes']} nodes, {churn['cached_blocks_per_node']} cached blocks each, 100 blocks/s "
        "in and out), by age of the requested document"
    )
    print(header)
    print(row("all", churn["all"]))
    for label, a in churn["by_age"].items():
        print(row(label, a))
    print()
    print(
        f"ClusterView.estimate_all, {lookup['peers']} peers x {lookup['published_hashes_per_peer']} hashes, "
        f"{lookup['chain_blocks']}-block chain: p50 {lookup['estimate_all_us_p50']} us, "
        f"p99 {lookup['estimate_all_us_p99']} us (cold chain: p99 {lookup['estimate_all_cold_us_p99']} us; "
        f"per-peer loop: p99 {lookup['per_peer_loop_us_p99']} us)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,40,100,200", help="comma-separated mesh sizes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--host-tier", type=int, default=0, metavar="M",
                        help="each node also has a host KV tier of M x its engine's documents (default 0: none)")
    parser.add_argument("--digest-max-members", type=int, default=DEFAULT_DIGEST_MAX_MEMBERS, metavar="N",
                        help="cut digests into shards of N members (GossipConfig.digest_max_members; 0: never; "
                        f"default {DEFAULT_DIGEST_MAX_MEMBERS})")
    parser.add_argument("--summary-stride", type=int, default=DEFAULT_SUMMARY_STRIDE, metavar="S",
                        help=f"--sizes runs: publish every S-th block's hash (GossipConfig.summary_stride; default "
                        f"{DEFAULT_SUMMARY_STRIDE}): a coarser summary, fewer bytes")
    parser.add_argument("--observers", type=int, default=None, metavar="K",
                        help=f"members keeping a ClusterView (default: all below {OBSERVERS_FROM} members, "
                        f"{DEFAULT_OBSERVERS} from there)")
    parser.add_argument("--sizes-only", action="store_true",
                        help="skip the accuracy-under-churn run and the lookup benchmark")
    parser.add_argument("--cold-start", type=int, default=0, metavar="N",
                        help="instead: N members started within --spread seconds, joining through 3 seeds")
    parser.add_argument("--spread", type=float, default=60.0, help="--cold-start: seconds over which members start")
    parser.add_argument("--horizon", type=float, default=120.0, help="--cold-start: simulated seconds in all")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()
    if args.cold_start:
        cold = asyncio.run(run_cold_start(
            args.cold_start, args.seed, args.spread, args.horizon, progress=True,
            digest_max_members=args.digest_max_members,
        ))  # fmt: skip
        print(json.dumps(cold, indent=None if args.json else 2))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    results = []
    for n in sizes:
        results.append(asyncio.run(run_size(
            n, args.seed, args.host_tier, args.observers, args.digest_max_members, args.summary_stride
        )))  # fmt: skip
        print(f"  ... {n} nodes done in {results[-1]['wall_s']} s: {json.dumps(results[-1])}", file=sys.stderr)
    churn = None if args.sizes_only else asyncio.run(run_accuracy_under_churn(args.seed))
    lookup = None if args.sizes_only else bench_lookup()
    if args.json:
        print(json.dumps({"sizes": results, "accuracy_under_churn": churn, "lookup": lookup}, indent=2))
    else:
        print_table(results, churn, lookup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
