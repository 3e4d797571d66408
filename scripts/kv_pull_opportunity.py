#!/usr/bin/env python3
"""Why KV pulls add little in the simulator: for every routed request, how much of its prompt the mesh held at
routing time, how much its serving node held, how much was pulled, and why the rest was neither.

One simulated run per workload (the production shapes, ``bench_routing.py``'s settings: Llama-3.1-8B on H100, gossip
at the agent's measured lag), at a given rate, KV per node and link figure, with the default policy. The cluster is
hooked, never changed: each node's router is wrapped to read, at the moment it routes a request, every node's exact
cache (the deepest exact cached prefix on any node: *mesh-held*), the estimates the router had, the candidates it was
handed and, through a wrapper of ``p2p._with_pulls``, the price of a pull at each candidate; the request's fate
(cached and pulled tokens at admission) is read when it finishes. Sums are fractions of prompt tokens of the requests
measured (arrived after the warm-up, as ``sim/metrics.py`` counts them):

- ``local``: prompt tokens the serving node held at admission (not pulled); ``pulled``: tokens pulled;
- ``mesh_held``: the longest exact cached prefix on any node at routing time (capped at the prompt's last token:
  an engine never serves it from cache);
- ``gap`` = mesh-held - local - pulled (where positive), split by reason:
  - ``unseen``: the part of mesh-held deeper than any candidate's estimate (the gossiped summary or the speculative
    index did not show the holder deep enough, or the deepest holder was not among the candidates): no rule on those
    estimates could pull it; split into ``unseen_not_candidate`` (a true deepest holder was not handed to the
    policy) and ``unseen_short`` (it was, with a shorter estimate);
  - ``price_declined``: a pull from the deepest candidate was priced at the target and cost more than computing;
  - ``target_looked_deep``: the target's own estimate (or the prefix counted as common, ``p2p``'s
    ``common_match_blocks``) was already as deep as the deepest candidate holder's, so no pull was priced for it;
  - ``holder_evicted``: a holder was chosen (or a pull taken), and its copy was evicted before the request was
    admitted (queued at the holder) or before the pull started (the pull moved less);
  - ``other``: the rest (a holder's copy landed, then was evicted at the target before admission, and the like).
- ``chose_holder``: share of mesh-held tokens of requests routed to a node that held the whole mesh-held prefix.

- ``no_link``: without a link figure, the rest (nothing could be pulled).

What bounds the mesh instead (the second table):
- ceilings on the hit, by replaying the run's requests in order (looked up when routed, stored when finished) through
  one LRU cache shared by the whole mesh: ``pooled, evictable KV`` (the size of the mesh's mean evictable KV),
  ``pooled, all KV`` (every node's whole KV: running requests holding none of it), and 4x and 16x that; ``ever
  computed``: every block some request computed before (an infinite cache: finished requests' blocks and every block
  cached anywhere when a request is routed);
- KV memory (sampled every second after the warm-up): the share of every node's blocks held by running requests
  (pinned cached + reserved: not evictable), cached but evictable, free; the mesh's distinct cached blocks as a
  multiple of one node's (what "the mesh holds 16x one node's cache" means at that moment); the share of node samples
  with a queue, and of those whose first waiting request does not fit in the node's free + evictable blocks
  (admission waits for KV, not compute);
- per request: the share of its KV-time (blocks reserved x seconds admitted) spent before its first token -- all a
  higher hit can shorten -- the mean seconds from admission to first token and from there to the end, and the
  prefill compute the measured requests needed per node-second.

``--ladder START:STOP:STEP`` gives SLO capacity (p99 TTFT within the workload's SLO) up a QPS ladder instead, each
seed until two rungs in a row miss. ``--oracle`` makes it a what-if bound, never a policy: ``mesh`` loads, free
and at once, the longest prefix any node holds when a request reaches its target (perfect pulls); ``ever`` loads
every block ever computed (an infinite free tier); ``tier<M>`` loads from a shared LRU tier of M x the mesh's KV
that every finished request is stored into (host memory under the mesh, free to load). Every oracle keeps the KV a
request reserves while it runs.

    python scripts/kv_pull_opportunity.py --quick                      # 8 nodes, short runs: a minute
    python scripts/kv_pull_opportunity.py --seeds 2                    # 16 nodes, at the capacity rungs (minutes)
    python scripts/kv_pull_opportunity.py --seeds 2 --kv-fraction 1 --link 0   # the same rates at the full KV
    python scripts/kv_pull_opportunity.py --only platform-chat --ladder 12:22:1 --oracle ever --link 0 --seeds 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_routing as br  # its own import puts the repo on sys.path

from p2pnode.config import DEFAULT_ROUTING_POLICY
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import PULL_FAILED, PULL_FULL, PULL_NONE, PULL_PARTIAL, PULL_UNNEEDED
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S
from p2pnode.routing.policies import p2p
from p2pnode.routing.router import Router
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.report import seed_capacity
from p2pnode.sim.runner import Experiment
from p2pnode.sim.staleness import default_delay
from p2pnode.sim.workloads import Limit, get_workloads

#: The production shapes and the default's SLO capacity at a quarter of the KV on 16 nodes, 100 Gb/s, QPS (``python
#: scripts/bench_kv_pull.py --kv-fractions 0.25 --links 0,100 --baselines '' --seeds 2``; scaled for other sizes).
RATES_16 = {"platform-chat": 14.0, "platform-chat-long": 12.0, "tool-agent": 40.0}
WARMUP_FRAC = 0.2
OUTCOMES = {PULL_NONE: "none", PULL_FULL: "full", PULL_PARTIAL: "partial", PULL_FAILED: "failed",
            PULL_UNNEEDED: "unneeded"}  # fmt: skip
#: What-if bounds: ``mesh``, every request finds, free and at once, the longest prefix any node holds when it reaches
#: its target (pulls at no cost, never declined, never missed); ``ever``, every block any request ever computed (an
#: infinite free tier under the mesh). Both keep the KV a request reserves while it runs.
#: ``tier<M>``: a shared LRU tier under the mesh (host memory, say) of M x the mesh's KV blocks, every finished
#: request's blocks stored into it, loaded free (a pooled tier, so a bound on per-node tiers with pulls between them).
ORACLES = ("none", "mesh", "ever", "tier<M>")
REASONS = (
    "unseen_not_candidate",
    "unseen_short",
    "price_declined",
    "target_looked_deep",
    "holder_evicted",
    "no_link",
    "other",
)


@dataclass(slots=True)
class Routed:
    """What the router had and decided for one request (read at routing time)."""

    usable: int  # blocks an engine may serve from cache
    mesh: int  # deepest exact cached prefix on any alive node, blocks
    holders: frozenset[str]  # the nodes holding it
    ever: int = 0  # deepest prefix any request computed before (an infinite mesh cache), blocks
    target: str = ""
    target_exact: int = 0  # the target's exact cached prefix then
    seen: int = 0  # deepest estimate among the candidates (what a pull could have brought), blocks
    holder_candidate: bool = False  # a true deepest holder was handed to the policy
    target_eff: int = 0  # the target's effective match as the policy saw it (estimate, or common)
    priced: bool = False  # a pull to the target was priced
    compute_cost: float = 0.0
    pull_cost: float = 0.0
    pull_blocks: int = 0  # the decision's pull (0: none)


@dataclass
class Totals:
    prompt: int = 0
    local: int = 0
    pulled: int = 0
    mesh: int = 0
    chose_holder: int = 0
    gap: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    pulls: Counter[str] = field(default_factory=Counter)
    pull_wait: list[float] = field(default_factory=list)
    declined_ratio: list[float] = field(default_factory=list)  # pull cost / compute cost where declined
    negative: int = 0  # tokens served beyond mesh-held (computed meanwhile by another request)
    ever: int = 0
    block_s: float = 0.0  # KV blocks a request reserved x seconds from admission to its end
    block_s_prefill: float = 0.0  # of it, from admission to its first token
    admit_to_first: float = 0.0
    last_arrival: float = 0.0
    first_to_done: float = 0.0


class Probe:
    """The read-only hooks (module docstring)."""

    def __init__(self, cluster: ProbedCluster) -> None:
        self.cluster = cluster
        self.routed: dict[Any, Routed] = {}
        self.pull_ctx: tuple[Any, ...] | None = None
        self.totals = Totals()
        self.kv_samples: list[tuple[float, float, float, float]] = []  # running, evictable, free, distinct/node
        self.queued = 0  # node samples with a waiting request
        self.kv_blocked = 0  # of them, the first waiting request's blocks do not fit (admission waits for KV)
        self.node_samples = 0
        #: Every block some request computed (an infinite cache), and the stream a pooled cache is replayed on
        #: (``pooled_hit``): (chain, usable blocks, prompt tokens or 0 when not measured) looked up at routing,
        #: (chain, blocks, None) stored at the end.
        self.ever: set[int] = set()
        self.stream: list[tuple[list[int], int, int | None]] = []
        self.admitted: dict[Any, float] = {}

    def wrap(self, router: Router, j: int) -> Any:
        inner = router.policy
        cluster = self.cluster

        def policy(request: Any, peers: Any, plan: Any = None) -> Any:
            hashes = list(request.block_hashes)
            usable = min((request.prompt_tokens - 1) // request.block_size, len(hashes))
            exact = {
                nid: eng.cache.match_blocks(hashes, usable)
                for nid, eng in zip(cluster.node_ids, cluster.engines, strict=True)
            }
            mesh = max(exact.values())
            holders = frozenset(n for n, m in exact.items() if m == mesh) if mesh else frozenset()
            ever_set = self.ever
            ever_set.update(hashes[:mesh])  # cached now, so computed before (maybe by a request still running)
            ever = 0
            while ever < usable and hashes[ever] in ever_set:
                ever += 1
            r = cluster.current
            self.stream.append((r.chain, usable, request.prompt_tokens if r.arrival >= cluster.cfg.warmup_s else 0))
            self.pull_ctx = None
            decision = inner(request, peers, plan)
            rec = Routed(usable, mesh, holders, ever, decision.target, exact[decision.target])
            rec.holder_candidate = any(p.node_id in holders for p in peers)
            common = min(request.common_match_blocks, usable)
            ests = [min(max(p.est_match_blocks, 0), usable) for p in peers if p.alive]
            rec.seen = max([*ests, 0])
            tgt = next((p for p in peers if p.node_id == decision.target), None)
            rec.target_eff = max(min(max(tgt.est_match_blocks, 0), usable) if tgt else 0, common)
            if decision.pull is not None:
                rec.pull_blocks = decision.pull.blocks
            ctx = self.pull_ctx
            if ctx is not None:
                costs_in, costs_out, pulls, source = ctx
                before = {p.node_id: c for c, _, p in costs_in}
                after = {p.node_id: c for c, _, p in costs_out}
                # priced: the target was a candidate without the source's depth (``_with_pulls`` changed its cost or
                # took its pull), or its pull cost was computed and declined; recomputed here for the declined case
                if source and decision.target in before and decision.target != source:
                    rec.compute_cost = before[decision.target]
                    rec.pull_cost = after[decision.target]
                    rec.priced = decision.target in pulls or self._declined_cost(request, peers, rec, source)
            self.routed[cluster.current] = rec
            return decision

        return policy

    def _declined_cost(self, request: Any, peers: Any, rec: Routed, source: str) -> bool:
        """For a target ``_with_pulls`` left alone: was a pull priced for it (it lacked the source's depth) and
        declined? Sets ``rec.pull_cost`` to that price."""
        src = next(p for p in peers if p.node_id == source)
        tgt = next(p for p in peers if p.node_id == rec.target)
        depth = min(src.est_match_blocks, rec.usable)
        if tgt.kv_layout != src.kv_layout or rec.target_eff >= depth:
            return False
        spec = self.cluster.spec.effective
        bs, prompt = request.block_size, request.prompt_tokens
        uncached = prompt - depth * bs
        b = tgt.load.prefill_backlog_tokens
        backlog = (tgt.load.waiting + tgt.in_flight) * uncached if b is None else b
        c = p2p.cost(uncached, backlog, tgt.requests, spec["uncached_weight"])
        moved = depth - min(max(tgt.est_match_blocks, 0), depth)
        c += p2p.pull_tokens(moved, bs, src, spec["kv_bytes_per_token"], spec["prefill_s_per_token"],
                             spec["pull_rtt_s"])  # fmt: skip
        rec.pull_cost = c
        return True

    def finish(self, r: Any) -> None:
        rec = self.routed.pop(r, None)
        admitted = self.admitted.pop(r, None)
        if not r.dropped:
            self.ever.update(r.chain[: r.n_blocks])
            self.stream.append((r.chain, r.n_blocks, None))
        if rec is None or r.arrival < self.cluster.cfg.warmup_s or r.dropped:
            return
        t = self.totals
        bs = self.cluster.cfg.block_size
        if admitted is not None:
            need = -(-(r.prompt_tokens + r.output_tokens) // bs)
            t.block_s += need * (r.t_done - admitted)
            t.block_s_prefill += need * (r.t_first - admitted)
            t.admit_to_first += r.t_first - admitted
            t.first_to_done += r.t_done - r.t_first
        t.ever += rec.ever * bs
        t.last_arrival = max(t.last_arrival, r.arrival)
        t.requests += 1
        t.prompt += r.prompt_tokens
        pulled = r.pulled_tokens
        local = r.cached_tokens - pulled
        t.local += local
        t.pulled += pulled
        mesh = rec.mesh * bs
        t.mesh += mesh
        if r.pull_holder >= 0:
            t.pulls[OUTCOMES[r.pull_outcome]] += 1
            t.pull_wait.append(r.pull_wait_s)
        served = local + pulled
        if served > mesh:
            t.negative += served - mesh
        if rec.target in rec.holders:
            t.chose_holder += mesh
        gap = mesh - served
        if gap <= 0:
            return
        # the part deeper than any candidate's estimate: no rule on those estimates could have pulled it
        seen = max(rec.seen * bs, served)
        unseen = max(0, mesh - seen)
        if unseen:
            t.gap["unseen_short" if rec.holder_candidate else "unseen_not_candidate"] += unseen
        rest = gap - unseen
        if rest <= 0:
            return
        if rec.target in rec.holders or rec.pull_blocks:
            t.gap["holder_evicted"] += rest
        elif rec.priced and rec.pull_cost >= rec.compute_cost:
            t.gap["price_declined"] += rest
            t.declined_ratio.append(rec.pull_cost / max(rec.compute_cost, 1e-9))
        elif rec.target_eff * bs >= seen:
            t.gap["target_looked_deep"] += rest
        elif self.cluster.pulls is None:
            t.gap["no_link"] += rest
        else:
            t.gap["other"] += rest

    def sample(self) -> None:
        c = self.cluster
        if c.loop.now < c.cfg.warmup_s:
            return
        running = evictable = free = 0
        distinct: set[int] = set()
        total = 0
        for eng in c.engines:
            cache = eng.cache
            self.node_samples += 1
            if eng.waiting:
                self.queued += 1
                r = eng.waiting[0]
                m = cache.match_blocks(r.chain, (r.prompt_tokens - 1) // cache.block_size)
                need = -(-(r.prompt_tokens + r.output_tokens) // cache.block_size) - m
                if need > cache.free + cache.evictable:
                    self.kv_blocked += 1
            total += cache.num_blocks
            running += cache.used_blocks
            evictable += cache.evictable
            free += cache.free
            distinct.update(cache.refs)
        per_node = c.engines[0].cache.num_blocks
        self.kv_samples.append((running / total, evictable / total, free / total, len(distinct) / per_node))


class PooledLru:
    """One LRU cache of ``capacity`` blocks shared by the whole mesh (a pooled cache, or a tier under it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()

    def store(self, chain: list[int], n: int) -> None:
        """Blocks ``chain[:n]`` were computed. Tail first, so a chain's head is the most recently used and evicted
        last, as a node's cache unpins (``kvcache._unpin``): eviction shortens a cached prefix, never breaks it."""
        lru = self.lru
        for h in reversed(chain[:n]):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, chain: list[int], n: int) -> int:
        """The cached prefix of ``chain[:n]``, in blocks, touched."""
        lru = self.lru
        m = 0
        while m < n and chain[m] in lru:
            m += 1
        for h in reversed(chain[:m]):
            lru.move_to_end(h)
        return m


def pooled_hit(stream: list[tuple[list[int], int, int | None]], capacity: int, block_size: int) -> float:
    """Prompt tokens served from one LRU cache of ``capacity`` blocks that every request reads and every finished
    request stores into: the mesh's cache pooled, as perfect pulls without copies would make it (a ceiling), of the
    measured requests' prompt tokens."""
    pool = PooledLru(capacity)
    hit = prompt = 0
    for chain, n, tokens in stream:
        if tokens is None:
            pool.store(chain, n)
            continue
        m = pool.match(chain, n)
        if tokens:
            hit += m * block_size
            prompt += tokens
    return hit / prompt if prompt else 0.0


class _TimedCache(PagedPrefixCache):
    """A node's cache that tells the probe when each request is admitted (same layout: set as ``__class__``)."""

    __slots__ = ()
    probe: Probe | None = None

    def admit(self, r: Any) -> bool:
        ok = super().admit(r)
        if ok and self.probe is not None:
            self.probe.admitted[r] = self.probe.cluster.loop.now
        return ok


class ProbedCluster(Cluster):
    """The simulated mesh with the probe's hooks: routers wrapped, requests' fates read as they finish."""

    def __init__(self, cfg: SimConfig, oracle: str = "none") -> None:
        super().__init__(cfg)
        self.tier: PooledLru | None = None
        if oracle.startswith("tier"):
            try:
                multiple = float(oracle[4:])
            except ValueError:
                multiple = -1.0
            if multiple <= 0:
                raise ValueError(f"oracle tier<M> needs a positive multiple M, got {oracle!r}")
            self.tier = PooledLru(round(multiple * sum(e.cache.num_blocks for e in self.engines)))
        elif oracle not in ORACLES:
            raise ValueError(f"oracle must be one of {', '.join(ORACLES)}, got {oracle!r}")
        self.oracle = oracle
        self.probe = Probe(self)
        self.current: Any = None
        _TimedCache.probe = self.probe
        for eng in self.engines:
            eng.cache.__class__ = _TimedCache

    def _router(self, j: int) -> Router:
        router = super()._router(j)
        router.policy = self.probe.wrap(router, j)
        return router

    def _arrive(self, r: Any) -> None:
        self.current = r
        super()._arrive(r)

    def _deliver(self, r: Any) -> None:
        """With an oracle (a what-if bound, ``ORACLES``), a request that pulls nothing has the prefix the oracle
        holds loaded at its target for free when it joins the queue (as a pull's blocks are: ``kvcache.admit``)."""
        if self.oracle != "none" and r.pull_holder < 0:
            chain = r.chain
            usable = (r.prompt_tokens - 1) // self.cfg.block_size
            if self.oracle == "mesh":
                depth = max(eng.cache.match_blocks(chain, usable) for eng in self.engines)
            elif self.tier is not None:
                depth = self.tier.match(chain, usable)
            else:
                ever = self.probe.ever
                mesh = max(eng.cache.match_blocks(chain, usable) for eng in self.engines)
                ever.update(chain[:mesh])  # cached now, so computed before (maybe by a request still running)
                depth = 0
                while depth < usable and chain[depth] in ever:
                    depth += 1
            r.pull_lo, r.pull_hi = 0, depth
        super()._deliver(r)

    def _on_finish(self, r: Any) -> None:
        if self.tier is not None and not r.dropped:
            self.tier.store(r.chain, r.n_blocks)
        self.probe.finish(r)
        super()._on_finish(r)

    def _sample(self, _: object) -> None:
        if not self.done:
            self.probe.sample()
        super()._sample(_)


@contextmanager
def pulls_observed(probe_of: list[Probe]):
    """Wrap ``p2p._with_pulls`` (route looks it up at call time) to hand its inputs and outputs to the probe."""
    original = p2p._with_pulls

    def observed(costs, *args, **kwargs):  # type: ignore[no-untyped-def]
        out, pulls, source = original(costs, *args, **kwargs)
        probe_of[0].pull_ctx = (costs, out, pulls, source)
        return out, pulls, source

    p2p._with_pulls = observed  # type: ignore[assignment]
    try:
        yield
    finally:
        p2p._with_pulls = original  # type: ignore[assignment]


def run(workload: str, qps: float, nodes: int, seed: int, kv_fraction: float, link: float, duration: float,
        policy: str, oracle: str = "none") -> dict[str, Any]:  # fmt: skip
    w = get_workloads(workload)[0]
    limit = Limit(duration_s=duration)
    kv_tokens = br.kv_capacity_tokens(kv_fraction)
    cfg = SimConfig(
        nodes=nodes, seed=seed, kv_capacity_tokens=None if kv_fraction == 1.0 else kv_tokens, block_size=w.block_size,
        gossip_delay_s=default_delay(DEFAULT_GOSSIP_INTERVAL_S, nodes), warmup_s=WARMUP_FRAC * limit.window_s(qps),
    ).with_routing(policy=policy, cost_profile=br.PROFILE, kv_link_gbps=link)  # fmt: skip
    t0 = time.perf_counter()
    cluster = ProbedCluster(cfg, oracle)
    holder = [cluster.probe]
    with pulls_observed(holder):
        summary = cluster.run(w.requests(qps, seed, cluster.space, limit))
    p = cluster.probe
    t = p.totals
    prompt = max(t.prompt, 1)
    waits = sorted(t.pull_wait)
    ratios = sorted(t.declined_ratio)
    kv = p.kv_samples

    def mean(i: int) -> float:
        return sum(s[i] for s in kv) / len(kv) if kv else 0.0

    gap = {k: t.gap.get(k, 0) / prompt for k in REASONS}
    blocks = cluster.engines[0].cache.num_blocks
    evictable_blocks = round(mean(1) * nodes * blocks)
    block_s = t.block_s / max(t.requests, 1)
    return {
        "workload": workload, "qps": qps, "nodes": nodes, "seed": seed, "kv_fraction": kv_fraction,
        "kv_capacity_tokens": kv_tokens, "link_gbps": link, "duration_s": duration, "policy": policy,
        "oracle": oracle,
        "requests": t.requests, "prompt_tokens_mean": t.prompt / max(t.requests, 1),
        "local": t.local / prompt, "pulled": t.pulled / prompt, "mesh_held": t.mesh / prompt,
        "gap": sum(t.gap.values()) / prompt, "gap_by_reason": gap, "beyond_mesh_held": t.negative / prompt,
        "chose_holder": t.chose_holder / max(t.mesh, 1),
        "pulls": dict(t.pulls), "pulls_per_req": sum(t.pulls.values()) / max(t.requests, 1),
        "pull_wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
        "pull_wait_p99_s": waits[int(0.99 * (len(waits) - 1))] if waits else 0.0,
        "declined_price_ratio_median": ratios[len(ratios) // 2] if ratios else None,
        "kv_running_frac": mean(0), "kv_evictable_frac": mean(1), "kv_free_frac": mean(2),
        "mesh_distinct_blocks_per_node": mean(3),
        "ever_computed": t.ever / prompt,
        "pooled_hit_evictable": pooled_hit(p.stream, evictable_blocks, cfg.block_size),
        "pooled_hit_all": pooled_hit(p.stream, nodes * blocks, cfg.block_size),
        # the same pool with 4x and 16x the mesh's KV (at a quarter of the profile's: the full KV, and 4x it)
        "pooled_hit_x4": pooled_hit(p.stream, 4 * nodes * blocks, cfg.block_size),
        "pooled_hit_x16": pooled_hit(p.stream, 16 * nodes * blocks, cfg.block_size),
        "blocks_per_node": blocks, "block_s_per_req": block_s,
        "block_s_prefill_share": t.block_s_prefill / max(t.block_s, 1e-9),
        "admit_to_first_mean_s": t.admit_to_first / max(t.requests, 1),
        "first_to_done_mean_s": t.first_to_done / max(t.requests, 1),
        "queued_frac": p.queued / max(p.node_samples, 1),
        "kv_blocked_frac_of_queued": p.kv_blocked / max(p.queued, 1),
        # the prefill the measured requests needed (prompt tokens not cached), at the profile's linear rate, per node
        # and second of their arrivals: the compute a higher hit would save
        "prefill_compute_frac": (t.prompt - t.local - t.pulled)
        * cluster.profile.prefill_s_per_token
        / max(nodes * (t.last_arrival - cfg.warmup_s), 1e-9),
        "kv_hit": summary["kv_hit"], "ttft_p99_s": summary["ttft_p99_s"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | QPS | KV/node | link | local | pulled | mesh-held | gap | unseen (not cand. / short) "
        "| price declined | target looked deep | holder evicted | no link | other | chose holder "
        "| pulls/req (full/part/fail) | KV running / evictable / free | mesh distinct / node | p99 TTFT |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        g = r["gap_by_reason"]
        pulls = r["pulls"]
        lines.append(
            f"| {r['workload']} | {r['qps']:g} | {r['kv_capacity_tokens']:,} | {r['link_gbps']:g} "
            f"| {r['local']:.3f} | {r['pulled']:.3f} | {r['mesh_held']:.3f} | {r['gap']:.3f} "
            f"| {g['unseen_not_candidate']:.3f} / {g['unseen_short']:.3f} | {g['price_declined']:.3f} "
            f"| {g['target_looked_deep']:.3f} | {g['holder_evicted']:.3f} | {g['no_link']:.3f} | {g['other']:.3f} "
            f"| {r['chose_holder']:.2f} | {r['pulls_per_req']:.3f} ({pulls.get('full', 0)}/{pulls.get('partial', 0)}"
            f"/{pulls.get('failed', 0)}) "
            f"| {r['kv_running_frac']:.2f} / {r['kv_evictable_frac']:.2f} / {r['kv_free_frac']:.2f} "
            f"| {r['mesh_distinct_blocks_per_node']:.1f} | {r['ttft_p99_s']:.2f} |"
        )
    return "\n".join(lines)


def mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of several seeds' runs: numbers averaged, pull outcomes summed."""
    out = dict(rows[0])
    out["seeds"] = [r["seed"] for r in rows]
    for k, v in rows[0].items():
        if isinstance(v, float) and k != "qps":
            vals = [r[k] for r in rows if r[k] is not None]
            out[k] = sum(vals) / len(vals) if vals else None
    out["requests"] = sum(r["requests"] for r in rows)
    out["gap_by_reason"] = {k: sum(r["gap_by_reason"][k] for r in rows) / len(rows) for k in REASONS}
    pulls: Counter[str] = Counter()
    for r in rows:
        pulls.update(r["pulls"])
    out["pulls"] = dict(pulls)
    return out


#: Rungs in a row that miss the SLO before a seed's ladder stops: the simulator's default.
PATIENCE = Experiment.patience


def capacity(workload: str, ladder: list[float], slo_s: float, seeds: int, run_at: Any) -> dict[str, Any]:
    """Each seed up ``ladder`` until ``PATIENCE`` rungs in a row miss the SLO; a seed's capacity is the last rung met
    before its first miss (``sim/report.seed_capacity``). Its own ladder, not ``run_experiment``'s: each rung runs
    through the hooks."""
    caps, by_qps = [], {}
    for seed in range(seeds):
        runs, streak = [], 0
        for q in ladder:
            row = run_at(workload, q, seed)
            met = row["ttft_p99_s"] <= slo_s
            by_qps.setdefault(f"{q:g}", []).append(
                {"seed": seed, "kv_hit": round(row["kv_hit"], 4), "pulled": round(row["pulled"], 4),
                 "p99_ttft_s": round(row["ttft_p99_s"], 2), "met": met}
            )  # fmt: skip
            runs.append({"qps": q, "slo_met": met})
            streak = 0 if met else streak + 1
            if streak >= PATIENCE:
                break
        caps.append(seed_capacity(runs)[0])
    return {"workload": workload, "capacities": caps, "capacity_mean": sum(caps) / len(caps), "by_qps": by_qps}


def memory_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | QPS | KV/node | link | oracle | hit (local + pulled) | mesh-held | pooled, evictable KV "
        "| pooled, all KV (x4 / x16) | ever computed | KV running | queued | of it KV-blocked "
        "| prefill share of KV-time | admit->first / first->done (s) | prefill compute | p99 TTFT |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        pooled = f"{r['pooled_hit_all']:.3f} ({r['pooled_hit_x4']:.3f} / {r['pooled_hit_x16']:.3f})"
        lines.append(
            f"| {r['workload']} | {r['qps']:g} | {r['kv_capacity_tokens']:,} | {r['link_gbps']:g} | {r['oracle']} "
            f"| {r['local'] + r['pulled']:.3f} | {r['mesh_held']:.3f} | {r['pooled_hit_evictable']:.3f} "
            f"| {pooled} | {r['ever_computed']:.3f} | {r['kv_running_frac']:.2f} "
            f"| {r['queued_frac']:.2f} | {r['kv_blocked_frac_of_queued']:.2f} | {r['block_s_prefill_share']:.2f} "
            f"| {r['admit_to_first_mean_s']:.2f} / {r['first_to_done_mean_s']:.2f} | {r['prefill_compute_frac']:.2f} "
            f"| {r['ttft_p99_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma list of workloads (default: {', '.join(RATES_16)})")
    parser.add_argument("--qps", help="comma list, one per workload (default: near capacity, RATES_16 scaled)")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, averaged")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="KV per node, of the profile's")
    parser.add_argument("--link", type=float, default=100.0, help="Gb/s (0: no pulls)")
    parser.add_argument("--duration", type=float, help="seconds of arrivals (default: bench_routing's case)")
    parser.add_argument("--policy", default=DEFAULT_ROUTING_POLICY)
    parser.add_argument("--oracle", default="none", help=f"a what-if bound: {', '.join(ORACLES)} (ORACLES)")
    parser.add_argument("--ladder", help="START:STOP:STEP QPS: SLO capacity up this ladder instead of one rate")
    parser.add_argument("--quick", action="store_true", help="8 nodes, a tenth of the case's duration")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    wanted = [w.strip() for w in (args.only or ",".join(RATES_16)).split(",") if w.strip()]
    cases = {c.workload: c for c in br.CASES}
    if any(w not in RATES_16 for w in wanted):
        parser.error(f"--only: one of {', '.join(RATES_16)}")
    nodes = 8 if args.quick else args.nodes

    def run_at(w: str, q: float, seed: int) -> dict[str, Any]:
        duration = args.duration or cases[w].duration_s / (10 if args.quick else 1)
        return run(w, q, nodes, seed, args.kv_fraction, args.link, duration, args.policy, args.oracle)

    if args.ladder:
        start, stop, step = (float(x) for x in args.ladder.split(":"))
        ladder = [round(start + i * step, 6) for i in range(round((stop - start) / step) + 1)]
        caps = [capacity(w, ladder, cases[w].slo_s, args.seeds, run_at) for w in wanted]
        settings = {"nodes": nodes, "kv_fraction": args.kv_fraction, "link_gbps": args.link, "policy": args.policy,
                    "oracle": args.oracle, "ladder": ladder}  # fmt: skip
        if args.json:
            print(json.dumps({**settings, "cases": caps}, indent=1))
            return 0
        print(f"SLO capacity ({settings})")
        for c in caps:
            hits = ", ".join(
                f"{q}: hit {sum(x['kv_hit'] for x in v) / len(v):.3f}, p99 {max(x['p99_ttft_s'] for x in v):.1f} s"
                for q, v in c["by_qps"].items()
            )
            print(f"{c['workload']}: {c['capacity_mean']:g} QPS (seeds {c['capacities']}); {hits}")
        return 0
    rates = [float(q) for q in args.qps.split(",")] if args.qps else [RATES_16[w] * nodes / 16 for w in wanted]
    if len(rates) != len(wanted):
        parser.error("--qps: one rate per workload")
    rows = []
    for w, q in zip(wanted, rates, strict=True):
        rows.append(mean_rows([run_at(w, q, seed) for seed in range(args.seeds)]))
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
    else:
        print(table(rows), memory_table(rows), sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
