"""The simulated mesh: N engines, a gossip view, and an ingress router per node that calls the real policies.

Per request: a client picks an ingress node at random; the ingress builds ``PeerSnapshot``s the way the node's router
does (``p2pnode/routing/router.py``; the field semantics are in ``snapshots.py``) -- itself exact (its own
PrefixIndex and live engine load), every peer from its view (gossiped summary and load, the match raised by the
ingress's real ``SpeculativeIndex``, plus the requests this ingress sent there since the peer's last load report) --
and calls the policy function from ``p2pnode.routing.policies`` with the current plan. A forwarded request reaches
its target after ``forward_latency_s`` and is served there (one hop, never re-forwarded).

Hot-path economies, none of which changes a decision:
- one inverted index answers every peer's estimate in one walk of the chain (``staleness.py``);
- peer snapshots are immutable, so one built for (estimate, in-flight) is reused until that peer's next gossip
  update, and a request only touches the peers that differ from their default (no match, nothing in flight from
  this ingress): building 32 snapshots per request cost as much as the policy itself. The price: a reused
  snapshot's ``info_age_s`` is the age when it was built (at most one gossip interval low); no built-in policy
  reads it;
- in-flight counts are kept incrementally (a deque per ingress and peer, pruned as reports advance), not recounted.

The run ends when the workload is exhausted and every request has finished; periodic tasks (gossip rounds, plan
periods, speculative-index expiry) stop then.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.cost import DEFAULT_PROFILE, CostProfile, get_profile
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.plan.rates import RateSketch
from p2pnode.routing.policies import cacheroute, dualmap, get_policy, p2p, preble
from p2pnode.routing.policies.types import Decision, PeerSnapshot, Policy, RouteRequest, sample_peers
from p2pnode.routing.router import DEFAULT_ROUTING_KEY_BLOCKS, derive_routing_key
from p2pnode.routing.speculative import DEFAULT_SPECULATIVE_TTL_S, SpeculativeIndex
from p2pnode.sim import oracle
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.des import EventLoop
from p2pnode.sim.metrics import Recorder
from p2pnode.sim.plan import PLAN_POLICIES, PlanInput, PlanProvider, provider_for
from p2pnode.sim.snapshots import peer_snapshot, self_snapshot
from p2pnode.sim.staleness import DEFAULT_GOSSIP_INTERVAL_S, StalenessGossip
from p2pnode.sim.views import ExactView, SimView

__all__ = ["DEFAULT_BLOCK_SIZE", "Cluster", "SimConfig", "make_policy"]

#: Default block size of a ``SimConfig`` (each workload states its own preference: ``Workload.block_size``). A block
#: is the unit of caching, hashing and matching: a coarser block loses up to block_size - 1 reusable tokens per
#: shared-prefix boundary (vLLM's block is 16 tokens), a finer one multiplies per-request work (hashing, cache,
#: index and speculative-index upkeep are per block). On the aggregate, 128 instead of 256 raises p2p's hit rate by
#: ~2.5% (0.432 vs 0.422 over 1M requests) and costs 1.75x the time.
DEFAULT_BLOCK_SIZE = 256
#: One network hop between nodes (gRPC on a LAN; the routing issue's budget for forwarding is <= 2 ms).
DEFAULT_FORWARD_LATENCY_S = 0.001
#: Decode batch used to turn the profile into Preble's TPOT: a moderately loaded step (32 seqs of 2k tokens).
_PREBLE_TPOT_BATCH, _PREBLE_TPOT_CTX = 32, 2048
#: Decode batch used for the planner's decode-token cost: a busy step (64 seqs of 2k tokens).
_PLAN_DECODE_BATCH, _PLAN_DECODE_CTX = 64, 2048


def decode_token_cost(profile: CostProfile) -> float:
    """GPU time of one decode token in prefill-token units, from the profile (the planner's load unit)."""
    step = profile.step_time(0, 0.0, _PLAN_DECODE_BATCH, _PLAN_DECODE_BATCH * _PLAN_DECODE_CTX)
    return step / _PLAN_DECODE_BATCH / profile.prefill_s_per_token

#: Speculative-index expiry runs every this many TTLs.
SPECULATIVE_EXPIRE_TTLS = 10

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class SimConfig:
    """One simulated run's settings (the workload and its rate are given to ``Cluster.run``)."""

    nodes: int = 16
    policy: str = "p2p"
    profile: str = DEFAULT_PROFILE
    block_size: int = DEFAULT_BLOCK_SIZE
    eviction: str = "lru"
    gossip_interval_s: float = DEFAULT_GOSSIP_INTERVAL_S
    gossip_delay_s: float | None = None  # None: staleness.default_delay(interval, nodes); model only
    gossip: str = "model"  # "model": staleness.StalenessGossip; "agent": the real GossipAgent (gossip_view.py)
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S  # 0 turns the speculative index off
    forward_latency_s: float = DEFAULT_FORWARD_LATENCY_S
    routing_key_blocks: int = DEFAULT_ROUTING_KEY_BLOCKS
    slo_p99_ttft_s: float = 3.5  # dualmap's TTFT SLO
    warmup_s: float = 0.0
    seed: int = 0
    kv_capacity_tokens: int | None = None  # override the profile's KV cache size (tests, what-ifs)


def make_policy(name: str, profile: CostProfile, slo_s: float) -> Policy:
    """The policy function for ``name``, with the cost-model policies given this profile's timings.

    Preble and DualMap estimate time from a prefill rate (and Preble a TPOT); their docstrings invite the
    simulator to pass its own profile's values, so they are bound here. ``cacheroute-p2p`` is ``cacheroute``
    with the ``p2p`` fallback for cold keys (the comparison its docstring asks the simulator for). Everything
    else runs with its defaults.
    """
    if name == oracle.NAME:
        return oracle.route
    if name in PLAN_POLICIES and PLAN_POLICIES[name] is not None:
        return functools.partial(cacheroute.route, fallback=PLAN_POLICIES[name])
    policy = get_policy(name)
    if name == preble.NAME:
        tpot = profile.step_time(0, 0.0, _PREBLE_TPOT_BATCH, _PREBLE_TPOT_BATCH * _PREBLE_TPOT_CTX)
        return functools.partial(policy, prefill_s_per_token=profile.prefill_s_per_token, tpot_s=tpot)
    if name == dualmap.NAME:
        return functools.partial(policy, prefill_s_per_token=profile.prefill_s_per_token, ttft_slo_s=slo_s)
    return policy


class Cluster:
    """Build once per run: ``Cluster(cfg).run(requests)`` returns the run's summary."""

    def __init__(self, cfg: SimConfig, view: SimView | None = None, plan_provider: PlanProvider | None = None):
        if cfg.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {cfg.nodes}")
        self.cfg = cfg
        self.loop = EventLoop()
        self.space = BlockSpace(cfg.block_size)
        profile = get_profile(cfg.profile)
        if cfg.kv_capacity_tokens is not None:
            profile = replace(profile, kv_capacity_tokens=cfg.kv_capacity_tokens)
        self.profile = profile
        n = self.n = cfg.nodes
        width = max(2, len(str(n - 1)))
        self.node_ids = [f"n{j:0{width}d}" for j in range(n)]
        self.id_index = {nid: j for j, nid in enumerate(self.node_ids)}
        # Per ingress, every other node's id, sorted: the population the router draws ``RouteRequest.sampled`` from.
        self._others = [tuple(nid for k, nid in enumerate(self.node_ids) if k != j) for j in range(n)]
        blocks = profile.kv_blocks(cfg.block_size)
        self.engines = [
            NodeEngine(j, self.loop, profile, PagedPrefixCache(blocks, self.space, cfg.eviction), self._on_finish)
            for j in range(n)
        ]
        self.is_oracle = cfg.policy == oracle.NAME
        self.policy = make_policy(cfg.policy, profile, cfg.slo_p99_ttft_s)
        if view is None:
            if self.is_oracle:
                view = ExactView()
            elif cfg.gossip == "agent":
                from p2pnode.sim.gossip_view import AgentGossip  # imported on demand: it loads the gossip package

                view = AgentGossip(cfg.gossip_interval_s, cfg.seed)
            elif cfg.gossip != "model":
                raise ValueError(f"gossip must be 'model' or 'agent', got {cfg.gossip!r}")
            else:
                view = StalenessGossip(cfg.gossip_interval_s, cfg.gossip_delay_s, cfg.seed)
        self.view = view
        if plan_provider is None:
            plan_provider = provider_for(cfg.policy, decode_token_cost(profile))
        self.plan_provider = plan_provider
        self.plan: object | None = None
        self.plans_built = 0
        self.sketches = [RateSketch() for _ in range(n)] if plan_provider is not None else []
        use_spec = cfg.speculative_ttl_s > 0 and not self.is_oracle
        self.specs: list[SpeculativeIndex | None] = [
            SpeculativeIndex(cfg.speculative_ttl_s) if use_spec else None for _ in range(n)
        ]
        self.hop_counts = [0] * n
        # Expiry only frees memory (lookups check expiry themselves); every few TTLs, each entry is scanned ~once.
        self._expire_period_s = SPECULATIVE_EXPIRE_TTLS * cfg.speculative_ttl_s
        # in-flight sends per (ingress, peer) since the peer's last visible report
        self._fq: list[list[deque[SimRequest]]] = [[deque() for _ in range(n)] for _ in range(n)]
        self._fn: list[list[int]] = [[0] * n for _ in range(n)]
        # Peer snapshots are immutable: one per (estimate, in-flight) is reused until the peer's next report.
        self._snap_cache: list[dict[tuple[int, int], PeerSnapshot]] = [{} for _ in range(n)]
        self._defaults: list[PeerSnapshot] = [peer_snapshot(nid, 0, 0, 0, 0.0, 0, 0.0, 0) for nid in self.node_ids]
        self._def_ver = [-1] * n
        self._seen_updates = -1
        self._fq_live: list[set[int]] = [set() for _ in range(n)]  # peers with a non-empty in-flight deque
        self._ests = [0] * n
        self._rand = random.Random(cfg.seed).random
        self.recorder = Recorder(n, cfg.block_size, cfg.warmup_s, cfg.forward_latency_s)
        self._it: Iterator[SimRequest] = iter(())
        self._stream_done = False
        self._pending_follow = 0
        self.n_arrived = 0
        self.n_finished = 0
        self.last_arrival = 0.0
        self.t_last_finish = 0.0
        self.decisions: list[Decision] | None = None  # set to a list to keep every decision (tests)

    # --- lifecycle -----------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The workload is exhausted and every request that arrived has finished."""
        return self._stream_done and self.n_finished == self.n_arrived and not self._pending_follow

    def run(self, requests: Iterator[SimRequest] | list[SimRequest]) -> dict[str, Any]:
        self._it = iter(requests)
        self.view.start(self)
        self.views = [self.view.view_for(i) for i in range(self.n)]
        if self.plan_provider is not None:
            self.loop.at(self.plan_provider.period_s, self._replan, None)
        if any(s is not None for s in self.specs):
            self.loop.at(self._expire_period_s, self._expire_speculative, None)
        self._pull()
        self.loop.run()
        if not self.done:
            raise RuntimeError(f"simulation stalled: {self.n_arrived} arrived, {self.n_finished} finished")
        return self.recorder.summary(self)

    def _pull(self) -> None:
        nxt = next(self._it, None)
        if nxt is None:
            self._stream_done = True
            return
        if nxt.arrival < self.last_arrival:
            raise ValueError(f"workload out of order: request {nxt.rid} at {nxt.arrival} after {self.last_arrival}")
        self.last_arrival = nxt.arrival
        self.loop.at(nxt.arrival, self._arrive_stream, nxt)

    def _arrive_stream(self, r: SimRequest) -> None:
        self._arrive(r)
        self._pull()

    def _arrive_follow(self, r: SimRequest) -> None:
        self._pending_follow -= 1
        self._arrive(r)

    # --- routing -------------------------------------------------------------------------------------------------

    def _arrive(self, r: SimRequest) -> None:
        self.n_arrived += 1
        loop = self.loop
        ing = int(self._rand() * self.n)
        r.ingress = ing
        hashes = tuple(r.chain[: r.n_prompt_blocks])
        key = r.key or derive_routing_key(hashes, self.cfg.routing_key_blocks)
        t = self._route(r, ing, hashes, key)
        r.target = t
        if self.sketches:
            usable = (r.prompt_tokens - 1) // self.cfg.block_size
            est = min(r.est_match_blocks, usable) * self.cfg.block_size
            self.sketches[ing].observe(key, loop.now, r.prompt_tokens, est, r.output_tokens)
        if t == ing:
            self.engines[t].submit(r)
            return
        now = loop.now
        r.forwarded = True
        r.sent_at = now
        r.counted = True
        self._fq[ing][t].append(r)
        self._fn[ing][t] += 1
        self._fq_live[ing].add(t)
        spec = self.specs[ing]
        if spec is not None and hashes:
            spec.record(self.node_ids[t], hashes, now)
        self.hop_counts[t] += 1
        loop.at(now + self.cfg.forward_latency_s, self._deliver, r)

    def _deliver(self, r: SimRequest) -> None:
        self.hop_counts[r.target] -= 1
        self.engines[r.target].submit(r)

    def _route(self, r: SimRequest, ing: int, hashes: tuple[int, ...], key: str) -> int:
        now = self.loop.now
        n = self.n
        view = self.views[ing]
        ests = self._ests
        matched = view.match_all(hashes, ests)
        states = view.states()
        node_ids = self.node_ids
        if view.live:
            snaps: list[PeerSnapshot] = []
            for j in range(n):
                st = states[j]
                if j == ing:
                    snaps.append(
                        self_snapshot(node_ids[j], ests[j], st.running, st.waiting, st.kv_usage, st.cached_blocks)
                    )
                else:
                    snaps.append(
                        peer_snapshot(
                            node_ids[j], ests[j], st.running, st.waiting, st.kv_usage, 0, 0.0, st.cached_blocks
                        )
                    )
        else:
            if view.updates != self._seen_updates:
                self._refresh_defaults(view)
            snaps = self._defaults.copy()
            eng = self.engines[ing]
            index = eng.cache.index
            snaps[ing] = self_snapshot(
                node_ids[ing], index.match_blocks(hashes), eng.running, eng.n_waiting, eng.kv_usage, len(index)
            )
            # Peers whose snapshot differs from their default (no match, nothing in flight from here): a match in
            # the view, a speculative match, or sends from this ingress since their last report.
            special = set(matched)
            spec = self.specs[ing]
            if spec is not None:
                id_index = self.id_index
                for node_id, sm in spec.match_all(hashes, now).items():
                    j = id_index[node_id]
                    if sm > ests[j]:
                        ests[j] = sm
                        special.add(j)
            live = self._fq_live[ing]
            if live:
                special |= live
            special.discard(ing)
            fq = self._fq[ing]
            fn = self._fn[ing]
            snap_cache = self._snap_cache
            for j in special:
                st = states[j]
                q = fq[j]
                if q:
                    rt = st.report_time
                    while q and q[0].sent_at < rt:
                        x = q.popleft()
                        if x.counted:
                            x.counted = False
                            fn[j] -= 1
                    if not q:
                        live.discard(j)
                e = ests[j]
                f = fn[j]
                if not (e or f):
                    continue
                cache = snap_cache[j]
                snap = cache.get((e, f))
                if snap is None:
                    snap = cache[(e, f)] = peer_snapshot(
                        node_ids[j], e, st.running, st.waiting, st.kv_usage, f, now - st.report_time, st.cached_blocks
                    )
                snaps[j] = snap
        tiebreak = xxhash.xxh3_64_intdigest(r.rid.to_bytes(8, "little"), self.cfg.seed & _MASK64)
        request = RouteRequest(
            hashes,
            r.prompt_tokens,
            r.output_tokens,
            key,
            self.cfg.block_size,
            tiebreak,
            sample_peers(self._others[ing], tiebreak, p2p.CHOICES),  # as the router draws it
        )
        decision = self.policy(request, snaps, self.plan)
        if self.decisions is not None:
            self.decisions.append(decision)
        r.est_match_blocks = decision.est_match_blocks
        return self.id_index[decision.ranked[0]]

    def _refresh_defaults(self, view: SimView) -> None:
        """Rebuild the default snapshot (no match, nothing in flight) of every peer whose report changed."""
        self._seen_updates = view.updates
        now = self.loop.now
        node_ids = self.node_ids
        for j, st in enumerate(view.states()):
            if self._def_ver[j] != st.version:
                self._def_ver[j] = st.version
                self._snap_cache[j] = {}
                self._defaults[j] = peer_snapshot(
                    node_ids[j], 0, st.running, st.waiting, st.kv_usage, 0, now - st.report_time, st.cached_blocks
                )

    # --- completions ---------------------------------------------------------------------------------------------

    def _on_finish(self, r: SimRequest) -> None:
        self.n_finished += 1
        self.t_last_finish = r.t_done
        if r.counted:
            r.counted = False
            self._fn[r.ingress][r.target] -= 1
        self.recorder.record(r)
        f = r.follow
        if f is not None:
            back = self.cfg.forward_latency_s if r.forwarded else 0.0
            f.arrival = r.t_done + back + r.follow_gap_s
            self._pending_follow += 1
            self.loop.at(f.arrival, self._arrive_follow, f)

    # --- periodic tasks ------------------------------------------------------------------------------------------

    def _replan(self, _: object) -> None:
        provider = self.plan_provider
        assert provider is not None
        if self.done:
            return
        now = self.loop.now
        inp = PlanInput(
            now=now,
            node_ids=tuple(self.node_ids),
            rates=tuple(sk.summary(now) for sk in self.sketches),
            previous=self.plan,
            loads=tuple((e.running, e.n_waiting) for e in self.engines),
        )
        self.plan = provider.plan(inp)
        self.plans_built += 1
        self.loop.at(now + provider.period_s, self._replan, None)

    def _expire_speculative(self, _: object) -> None:
        if self.done:
            return
        now = self.loop.now
        for spec in self.specs:
            if spec is not None:
                spec.expire(now)
        self.loop.at(now + self._expire_period_s, self._expire_speculative, None)


def run_once(cfg: SimConfig, requests: Iterator[SimRequest] | list[SimRequest]) -> dict[str, Any]:
    """Convenience: one run with the default view and plan provider."""
    return Cluster(cfg).run(requests)

