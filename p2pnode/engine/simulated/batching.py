"""One node's engine: vLLM-style continuous batching over a paged prefix cache, timed by a cost profile.

Scheduling follows vLLM v1's FCFS scheduler: each step first gives every decoding sequence one token and every
partially prefilled request its next chunk, then admits waiting requests in arrival order while the step's token
budget (``max_num_batched_tokens``), ``max_num_seqs`` and the KV cache allow (head-of-line blocking: the first
request that does not fit stops admission). A request's first token comes out of the step that finishes its
prefill; it then decodes one token per step until ``output_tokens``.

Speed: simulating every decode step would cost ~45 events per request at a realistic load. Between two changes of
the batch (an admission, a prefill chunk, a finish) the steps are pure decode with a known duration that grows
linearly with the context, so the engine schedules one event for the whole run of k steps up to the next finish:
``T(k) = k * alpha + beta * k (k + 1) / 2``. An arrival during a run cuts it at the end of the step in progress
(the step boundary vLLM would admit it at), so timing is exact, not approximated.

Segments (``segments.py``, ``SimSegments``): a request with segments is laid out or salted when it arrives, loads
what the node's segment store holds when it is admitted (those tokens are not prefilled), and its prefill steps stop
at its phases' cuts (``SimRequest.phase_stops``); it stores what it computed when it ends.

KV tiers (``tiers.py``, on the cache): a request admitted with blocks to load from its node's host or disk tier waits
outside the batch while they load, its KV reserved, and joins the prefilling requests when the load ends (vLLM's
offloading connector loads asynchronously: the request waits in ``WAITING_FOR_REMOTE_KVS`` and the engine schedules
others meanwhile). A load takes ``cost/tiers.py``'s time at the profile's rates, and the node's loads queue on its
one host link, first come first served. While it loads, a request counts as waiting in the node's load (vLLM counts
it so), not as running, and takes no token budget or sequence slot.

Priorities (``priority_policy``: vLLM's ``--scheduling-policy priority``, read from vLLM 0.32's v1 scheduler): the
waiting queue is ordered by (priority, arrival), lower first, and admission still stops at the first request that
does not fit. When that request cannot get its KV, the running request of the lowest priority (the latest arrival
among equals) is preempted -- if its priority is strictly lower than the blocked request's -- as vLLM preempts
``max(running, key=(priority, arrival_time))``: its KV is freed (the full blocks it computed stay cached, so its
recomputation mostly hits), it goes back to the waiting queue in its place, and it is resumed later by recomputing
its prompt and the tokens it had produced (``SimRequest.preempted_tokens``), then decodes the rest. One difference
from vLLM: there a running request that cannot grow by a block triggers the preemption (blocks are allocated as
tokens come); here a request's whole KV is reserved at admission, so the blocked admission does. Requests with
segments, or loading from a tier, are never preempted. Without ``priority_policy`` (the default) the queue is vLLM's
FCFS one and nothing is preempted.

A long prefill (vLLM's ``long_prefill_token_threshold``, the profile's; off by default, as in vLLM): while more than
one request is in the engine (running, waiting or loading, counted when a step is planned), a prefill takes at most
that many tokens a step, so one long prompt does not hold the whole token budget while short ones wait behind it.

Admission ahead of the engine (the simulator's ``sim/admission.py``): ``feed`` is asked for one more request each
time admission finds the waiting queue empty (True: it was enqueued), so a node's admission queue releases requests
exactly when this engine can take them (``can_take``: the request's KV fits), and ``queued`` (requests waiting there)
counts in the node's load.

Serving for real (``realtime.SimEngine``): ``step_by_step`` schedules every decode step as its own event and calls
``on_step`` after each, so a client sees its tokens as they are produced; ``abort`` ends a request at the next step
boundary (vLLM's own abort point), keeping the tokens it produced and caching their full blocks.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from p2pnode.cost import CostProfile
from p2pnode.cost.tiers import TierRates
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.simulated.segments import SimSegments
from p2pnode.load import NodeLoad

__all__ = ["NodeEngine", "Scheduler"]


class Scheduler(Protocol):
    """The clock an engine runs on: the simulator's event loop, or the node's (``realtime.py``)."""

    @property
    def now(self) -> float: ...

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at time ``t``."""
        ...

_IDLE, _STEP, _RUN = 0, 1, 2


class NodeEngine:
    """Continuous batching for one node; calls ``on_finish(r)`` when a request completes (or is dropped)."""

    __slots__ = (
        "aborting",
        "busy_s",
        "cache",
        "chunk_reqs",
        "chunk_takes",
        "dec_a",
        "decode_tokens",
        "dropped",
        "feed",
        "finish_heap",
        "finished",
        "idx",
        "link_free_at",
        "loading",
        "loop",
        "max_backlog_tokens",
        "n_decode",
        "on_finish",
        "on_step",
        "preemptions",
        "prefill_backlog_tokens",
        "prefill_tokens",
        "prefilling",
        "priority_policy",
        "profile",
        "queued",
        "run_alpha",
        "run_beta",
        "run_k",
        "run_t0",
        "run_token",
        "segments",
        "served",
        "served_at",
        "state",
        "step",
        "step_by_step",
        "steps",
        "tier_rates",
        "urgent_backlog_tokens",
        "urgent_waiting",
        "waiting",
    )

    def __init__(
        self,
        idx: int,
        loop: Scheduler,
        profile: CostProfile,
        cache: PagedPrefixCache,
        on_finish: Callable[[SimRequest], None],
        *,
        step_by_step: bool = False,
        on_step: Callable[[], None] | None = None,
        segments: SimSegments | None = None,
        priority_policy: bool = False,
    ) -> None:
        self.idx = idx
        self.loop = loop
        self.profile = profile
        self.cache = cache
        self.on_finish = on_finish
        self.step_by_step = step_by_step
        self.on_step = on_step
        #: Reuse of requests' segments beyond prefixes (None: served as plain prompts).
        self.segments = segments
        #: vLLM's priority scheduling (module docstring) instead of FCFS.
        self.priority_policy = priority_policy
        #: Asked for one more waiting request when admission finds none (module docstring); None: nothing waits
        #: ahead of this engine.
        self.feed: Callable[[], bool] | None = None
        #: Requests waiting ahead of this engine (its node's admission queue): part of the node's load.
        self.queued = 0
        #: Requests of better than the default priority before their first token, here or queued ahead, and their
        #: share of the prefill backlog: what an urgent request waits behind (``NodeLoad.urgent``; reported with
        #: ``priority_policy`` only).
        self.urgent_waiting = 0
        self.urgent_backlog_tokens = 0
        #: Uncached prompt tokens of the requests that have not produced their first token yet (see ``submit``).
        self.prefill_backlog_tokens = 0
        #: The most it ever was (a queue: more than one step's token budget waits for a step).
        self.max_backlog_tokens = 0
        self.aborting: set[SimRequest] = set()  # admitted requests to end at the next step boundary
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []  # admitted, prompt not fully computed, in admission order
        #: Admitted requests waiting for blocks from the KV tiers (module docstring), and when the node's host link
        #: is free of the loads queued on it.
        self.loading: set[SimRequest] = set()
        self.link_free_at = 0.0
        self.tier_rates = TierRates.of(profile)
        if cache.tiers is not None and not self.tier_rates.host:
            raise ValueError(f"profile {profile.name} gives no host tier rate: a KV tier's loads cannot be timed")
        if cache.tiers is not None and cache.tiers.disk is not None and not self.tier_rates.disk:
            raise ValueError(f"profile {profile.name} gives no disk tier rate: a disk tier's loads cannot be timed")
        self.n_decode = 0
        self.dec_a = 0  # sum over decoding requests of (prompt_tokens - decode_start_step)
        self.finish_heap: list[tuple[int, int, SimRequest]] = []  # (step of the last token, rid, request)
        self.step = 0  # steps completed
        self.state = _IDLE
        self.chunk_reqs: list[SimRequest] = []
        self.chunk_takes: list[int] = []
        self.run_token = 0
        self.run_t0 = 0.0
        self.run_k = 0
        self.run_alpha = 0.0
        self.run_beta = 0.0
        # counters
        self.busy_s = 0.0
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.finished = 0
        self.dropped = 0
        self.preemptions = 0
        #: What a node gossips of the work it served (``load.py``): requests, uncached prompt and completion tokens,
        #: and when they last changed.
        self.served = (0, 0, 0)
        self.served_at = 0.0

    # --- load, as the node would publish it ----------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self.prefilling) + self.n_decode

    @property
    def n_waiting(self) -> int:
        return len(self.waiting) + len(self.loading) + self.queued

    @property
    def idle(self) -> bool:
        """No step is running or planned."""
        return self.state == _IDLE

    def can_take(self, r: SimRequest) -> bool:
        """Whether admission would take ``r`` now if it came first: its KV fits, or a lower-priority request would be
        preempted for it, or nothing runs or loads (it is admitted or, larger than the cache, dropped)."""
        return (
            (self.running == 0 and not self.loading)
            or self.cache.fits(r)
            or (self.priority_policy and self._victim(r) is not None)
        )

    def has_room_for(self, r: SimRequest) -> bool:
        """Whether ``r``, submitted now, would be considered for admission at once: the engine is idle, or in a run
        of decode steps (cut for it) with room for it. In a step, the step's end asks ``feed``."""
        return self.state == _IDLE or (self.state == _RUN and self.can_take(r))

    @property
    def kv_usage(self) -> float:
        return self.cache.used_blocks / self.cache.num_blocks

    def load(self) -> NodeLoad:
        """The node's load now, its prefill backlog included (what a node running this engine reports)."""
        cache = self.cache  # kv_usage, running and n_waiting inlined: read for every routed request
        used = cache.num_blocks - cache.free - (len(cache.refs) - cache.n_pinned)
        return NodeLoad(
            running=len(self.prefilling) + self.n_decode,
            waiting=len(self.waiting) + len(self.loading) + self.queued,
            kv_usage=used / cache.num_blocks,
            prefill_backlog_tokens=self.prefill_backlog_tokens,
            served_requests=self.served[0], served_uncached_tokens=self.served[1],
            served_completion_tokens=self.served[2], served_at=self.served_at,
            urgent_waiting=self.urgent_waiting if self.priority_policy else 0,
            urgent_backlog_tokens=self.urgent_backlog_tokens if self.priority_policy else None,
        )

    def count_urgent(self, r: SimRequest, sign: int) -> None:
        """``r`` (of better than the default priority) joins (``sign`` 1) or leaves (-1) the urgent backlog."""
        self.urgent_waiting += sign
        self.urgent_backlog_tokens += sign * r.backlog_tokens

    def step_s(self) -> float:
        """Seconds of a decode step at the current batch: what exporting a KV pull's blocks waits for (the export
        runs in the next step; the simulator's ``sim/pulls.py``)."""
        n = self.n_decode
        return self.profile.step_time(0, 0.0, n, self.dec_a + n * (self.step + 1))

    # --- arrivals ------------------------------------------------------------------------------------------------

    def submit(self, r: SimRequest) -> None:
        at = self.enqueue(r)
        if self.state == _IDLE:
            self._plan()
        elif self.state == _RUN and at == 0:
            # Requests already waiting were blocked (KV or max_num_seqs) and the queue admits nothing behind the
            # first, so only a request that became the first can change the plan: cut the run at the current step.
            self._cut_run()

    def backlog_of(self, r: SimRequest) -> int:
        """``r``'s uncached prompt tokens as this node's cache stands (what ``submit`` counts, pulls and tiers aside):
        its part of the node's prefill backlog while it waits ahead of the engine."""
        cache = self.cache
        bs = cache.block_size
        return r.prompt_tokens - cache.match_blocks(r.chain, (r.prompt_tokens - 1) // bs) * bs

    def enqueue(self, r: SimRequest) -> int:
        """``r`` joins the waiting queue, counted in the prefill backlog; returns its place in the queue."""
        # What a node counts as its prefill backlog (``LocalServer``): the uncached part of every request that has
        # not produced its first token, as the cache stands when it arrives.
        # Blocks pulled for it (the simulator's sim/pulls.py) that continue the cached prefix are not prefilled.
        cache = self.cache
        segments = self.segments if r.segments is not None else None
        if segments is not None:
            segments.arrive(r)  # laid out (exact) or salted (approximate) by this node
        limit = (r.prompt_tokens - 1) // cache.block_size
        m = cache.match_blocks(r.chain, limit)
        if r.pull_hi > m and r.pull_lo <= m:
            m = r.pull_hi
        elif cache.tiers is not None:
            m = cache.tier_match(r, m, limit)  # loaded from the tiers, not prefilled
        r.backlog_tokens = r.prompt_tokens - m * cache.block_size
        if segments is not None:
            r.backlog_tokens -= segments.expected_loads(r, m * cache.block_size)
        self.prefill_backlog_tokens += r.backlog_tokens
        if self.prefill_backlog_tokens > self.max_backlog_tokens:
            self.max_backlog_tokens = self.prefill_backlog_tokens
        if self.priority_policy:
            if r.priority < 0:
                self.count_urgent(r, 1)
            return self._insert(r)
        self.waiting.append(r)
        return len(self.waiting) - 1

    def _insert(self, r: SimRequest) -> int:
        """``r`` into the waiting queue in (priority, arrival) order, after its equals (vLLM's priority queue);
        returns its place."""
        waiting = self.waiting
        key = (r.priority, r.arrival)
        i = len(waiting)
        while i and (waiting[i - 1].priority, waiting[i - 1].arrival) > key:
            i -= 1
        waiting.insert(i, r)
        return i

    def _cut_run(self) -> None:
        """Cut the run of decode steps at the end of the step in progress. ``T(k)``, its first k steps' time (module
        docstring), is written out here and in ``_start_run``: no call per evaluation."""
        dt = self.loop.now - self.run_t0
        alpha, beta = self.run_alpha, self.run_beta
        k = self.run_k
        if k * alpha + beta * k * (k + 1) * 0.5 <= dt:
            # The whole run is over by now (its event is due at this instant: steps of 0 s, the instant profile, end
            # where they start): nothing to cut, the run's end admits the arrival.
            return
        # smallest j >= 1 with T(j) > dt: the step in progress at dt is step j
        if beta > 0.0:
            b = alpha + 0.5 * beta
            j = int((-b + math.sqrt(b * b + 2.0 * beta * dt)) / beta)
        else:
            j = int(dt / alpha)
        j = max(1, j)
        while j * alpha + beta * j * (j + 1) * 0.5 <= dt:
            j += 1
        while j > 1 and (j - 1) * alpha + beta * (j - 1) * j * 0.5 > dt:
            j -= 1
        if j < k:
            self.run_k = j
            self.run_token += 1
            self.loop.at(self.run_t0 + (j * alpha + beta * j * (j + 1) * 0.5), self._run_done, self.run_token)

    # --- planning a step -----------------------------------------------------------------------------------------

    def _plan(self) -> None:
        n_decode = self.n_decode
        if not self.prefilling and not self.waiting and self.feed is None:  # most run ends: nothing to admit
            if self.chunk_reqs:
                self.chunk_reqs.clear()
                self.chunk_takes.clear()
            if n_decode:
                self._start_run()
            else:
                self.state = _IDLE
            return
        p = self.profile
        budget = p.max_num_batched_tokens - n_decode
        reqs = self.chunk_reqs
        takes = self.chunk_takes
        reqs.clear()
        takes.clear()
        ptoks = 0
        attn = 0.0
        # vLLM's long_prefill_token_threshold (module docstring): ``cap`` >= every take when there is none
        cap = p.long_prefill_token_threshold
        if not cap or len(self.prefilling) + n_decode + len(self.waiting) + len(self.loading) <= 1:
            cap = budget
        for r in self.prefilling:
            if budget <= 0:
                break
            take = r.remaining if r.remaining < budget else budget
            if take > cap:
                take = cap
            if r.phase_stops:
                take = _phase_take(r, take)
            attn += take * (r.prompt_tokens - r.remaining + take * 0.5)
            reqs.append(r)
            takes.append(take)
            budget -= take
            ptoks += take
        waiting = self.waiting
        n_run = len(self.prefilling) + n_decode
        admit = self.cache.admit
        feed = self.feed
        while budget > 0 and n_run < p.max_num_seqs:
            if not waiting and (feed is None or not feed()):
                break
            r = waiting[0]
            if not admit(r):
                if n_run == 0 and not self.loading:  # larger than the whole cache: it can never run (a request
                    # loading from a tier holds its blocks: what does not fit beside it waits for it)
                    waiting.popleft()
                    self._drop(r)
                    continue
                victim = self._victim(r) if self.priority_policy else None
                if victim is None:
                    break
                freed_budget, freed_ptoks, freed_attn = self._preempt(victim)
                budget += freed_budget
                ptoks -= freed_ptoks
                attn -= freed_attn
                n_run -= 1
                continue
            waiting.popleft()
            if r.segments is not None and self.segments is not None:
                self.segments.admit(r)  # what it loads is not prefilled
            r.remaining = rem = r.prompt_tokens - r.cached_tokens - r.loaded_tokens
            if r.tier_host_tokens or r.tier_disk_tokens:
                self._load(r)  # its prefill starts when its blocks are in
                continue
            self.prefilling.append(r)
            n_run += 1
            take = rem if rem < budget else budget
            if take > cap:
                take = cap
            if r.phase_stops:
                take = _phase_take(r, take)
            attn += take * (r.cached_tokens + take * 0.5)
            reqs.append(r)
            takes.append(take)
            budget -= take
            ptoks += take
        if reqs:
            self._start_step(ptoks, attn)
        elif n_decode:
            self._start_run()
        else:
            self.state = _IDLE

    def _victim(self, r: SimRequest) -> SimRequest | None:
        """The running request to preempt for ``r`` (module docstring): the lowest priority, the latest arrival among
        equals, if below ``r``'s; None when none is."""
        best: SimRequest | None = None
        best_key = (r.priority, math.inf)
        for v in itertools.chain(self.prefilling, (e[2] for e in self.finish_heap)):
            if v.priority <= r.priority or v.segments is not None or v in self.aborting:
                continue
            key = (v.priority, v.arrival)
            if best is None or key > best_key:
                best, best_key = v, key
        return best

    def _preempt(self, v: SimRequest) -> tuple[int, int, float]:
        """Free running ``v``'s KV and put it back in the waiting queue, to be recomputed (module docstring);
        returns the token budget, prefill tokens and attention units it had in the step being planned."""
        cache = self.cache
        bs = cache.block_size
        freed: tuple[int, int, float] = (0, 0, 0.0)
        if v.remaining:  # prefilling: what it computed of its prompt is lost (its cached prefix stays cached)
            self.prefilling.remove(v)
            if v in self.chunk_reqs:
                i = self.chunk_reqs.index(v)
                take = self.chunk_takes[i]
                del self.chunk_reqs[i], self.chunk_takes[i]
                freed = (take, take, take * (v.prompt_tokens - v.remaining + take * 0.5))
            cache.abandon(v)
        else:  # decoding: its prompt and the full blocks of what it produced are cached; it recomputes them
            heap = self.finish_heap
            heap.remove(next(e for e in heap if e[2] is v))
            heapq.heapify(heap)
            self.n_decode -= 1
            self.dec_a -= v.prompt_tokens - v.decode_start_step
            freed = (1, 0, 0.0)  # its decode token in this step
            produced = self.produced(v)
            left = v.output_tokens - produced
            v.output_tokens = produced
            chain_blocks = len(v.chain)  # a trace's chain holds its prompt's blocks only
            v.n_blocks = min((v.prompt_tokens + produced) // bs, chain_blocks)
            cache.release(v)
            v.prompt_tokens += produced
            v.output_tokens = left
            v.preempted_tokens += produced
            v.n_prompt_blocks = min(v.prompt_tokens // bs, chain_blocks)
            v.n_blocks = min((v.prompt_tokens + left) // bs, chain_blocks)
            v.backlog_tokens = 0  # its first token is out: no longer part of the prefill backlog
        if v.first_admission is None:  # what it reports reusing (vLLM sets num_cached_tokens once)
            v.first_admission = (v.cached_tokens, v.tier_host_tokens, v.tier_disk_tokens, v.pulled_tokens)
        v.remaining = 0
        v.cached_tokens = 0
        v.pull_lo = v.pull_hi = 0  # what it pulled is cached now (or evicted): nothing to load again
        v.tier_host_tokens = v.tier_disk_tokens = 0
        v.tier_offer_from = 0
        self.preemptions += 1
        self._insert(v)
        return freed

    def _load(self, r: SimRequest) -> None:
        """``r`` loads its tier blocks on the node's host link, after the loads queued there (module docstring)."""
        loop = self.loop
        now = loop.now
        start = self.link_free_at if self.link_free_at > now else now
        self.link_free_at = end = start + self.tier_rates.load_seconds(r.tier_host_tokens, r.tier_disk_tokens)
        r.tier_load_s = end - now
        self.loading.add(r)
        loop.at(end, self._loaded, r)

    def _loaded(self, r: SimRequest) -> None:
        """``r``'s tier blocks are in: it prefills from the next step on."""
        self.loading.discard(r)
        self.prefilling.append(r)
        if self.state == _IDLE:
            self._plan()
        elif self.state == _RUN:
            self._cut_run()

    def _start_step(self, ptoks: int, attn: float) -> None:
        """One step of the planned prefill chunks (``ptoks`` tokens, ``attn`` attention units) and a token of every
        decoding sequence."""
        n_decode = self.n_decode
        dt = self.profile.step_time(ptoks, attn, n_decode, self.dec_a + n_decode * (self.step + 1))
        self.state = _STEP
        self.busy_s += dt
        self.prefill_tokens += ptoks
        loop = self.loop
        loop.at(loop.now + dt, self._step_done, None)

    def _start_run(self) -> None:
        """Decode-only steps until the next sequence finishes (one step when ``step_by_step``), timed as one run
        (``T(k)``, module docstring)."""
        p, loop, n_decode = self.profile, self.loop, self.n_decode
        k = 1 if self.step_by_step else self.finish_heap[0][0] - self.step
        ctx = self.dec_a + n_decode * self.step
        self.run_alpha = alpha = p.step_base_s + p.decode_s_per_seq * n_decode + p.kv_read_s_per_token * ctx
        self.run_beta = beta = p.kv_read_s_per_token * n_decode
        self.run_t0 = now = loop.now
        self.run_k = k
        self.run_token += 1
        self.state = _RUN
        loop.at(now + (k * alpha + beta * k * (k + 1) * 0.5), self._run_done, self.run_token)

    # --- step ends -----------------------------------------------------------------------------------------------

    def _step_done(self, _: object) -> None:
        self.step += 1
        self.steps += 1
        s = self.step
        now = self.loop.now
        self.decode_tokens += self.n_decode
        done_prefill = []
        for r, take in zip(self.chunk_reqs, self.chunk_takes, strict=True):
            r.remaining -= take
            if r.remaining == 0:
                done_prefill.append(r)
        self._pop_finishes(s, now)
        if done_prefill:
            self.prefilling = [r for r in self.prefilling if r.remaining]
            store_prompt = self.cache.store_prompt
            heap = self.finish_heap
            for r in done_prefill:
                store_prompt(r)
                if r.t_first < 0:  # not a preempted request's recomputation
                    r.t_first = now
                    if r.priority < 0 and self.priority_policy:
                        self.count_urgent(r, -1)
                self.prefill_backlog_tokens -= r.backlog_tokens
                if r.output_tokens <= 1:
                    self._finish(r, now)
                else:
                    self.n_decode += 1
                    r.decode_start_step = s
                    self.dec_a += r.prompt_tokens - s
                    heapq.heappush(heap, (s + r.output_tokens - 1, r.rid, r))
        if self.aborting:
            self._reap(now)
        if self.on_step is not None:
            self.on_step()
        self._plan()

    def _run_done(self, token: int) -> None:
        if token != self.run_token:
            return  # this run was cut; a newer event ends it
        k = self.run_k
        self.step += k
        self.steps += k
        now = self.loop.now
        self.busy_s += now - self.run_t0
        self.decode_tokens += self.n_decode * k
        self._pop_finishes(self.step, now)
        if self.aborting:
            self._reap(now)
        if self.on_step is not None:
            self.on_step()
        self._plan()

    def _pop_finishes(self, s: int, now: float) -> None:
        heap = self.finish_heap
        while heap and heap[0][0] <= s:
            r = heapq.heappop(heap)[2]
            self.n_decode -= 1
            self.dec_a -= r.prompt_tokens - r.decode_start_step
            self._finish(r, now)

    def _finish(self, r: SimRequest, now: float, admitted: bool = True) -> None:
        if r.t_first < 0:  # ended before its first token (aborted or dropped)
            self.prefill_backlog_tokens -= r.backlog_tokens
            if r.priority < 0 and self.priority_policy:
                self.count_urgent(r, -1)
        if admitted:
            self.cache.release(r)
            if r.segments is not None and self.segments is not None:
                self.segments.finish(r)
        if r.preempted_tokens:  # back to the shape it was sent with
            r.prompt_tokens -= r.preempted_tokens
            r.output_tokens += r.preempted_tokens
            r.n_prompt_blocks = min(r.prompt_tokens // self.cache.block_size, len(r.chain))
        if r.first_admission is not None:
            r.cached_tokens, r.tier_host_tokens, r.tier_disk_tokens, r.pulled_tokens = r.first_admission
        r.t_done = now
        self.finished += 1
        if admitted:
            n, uncached, completion = self.served
            self.served = (n + 1, uncached + max(r.prompt_tokens - r.cached_tokens, 0), completion + r.output_tokens)
            self.served_at = now
        self.on_finish(r)

    def produced(self, r: SimRequest) -> int:
        """Output tokens ``r`` has produced so far (its first comes out of the step that finishes its prefill)."""
        if r.t_first < 0:
            return 0
        return min(r.output_tokens, self.step - r.decode_start_step + 1)

    def abort(self, r: SimRequest) -> None:
        """End ``r`` early: at once if it still waits, else at the next step boundary (``on_finish`` is called with
        ``r.output_tokens`` cut to what it produced). Only for ``step_by_step`` engines (a collapsed decode run would
        postpone the boundary). No-op for a request that already finished."""
        if r.t_done >= 0 or r in self.aborting:
            return
        try:
            self.waiting.remove(r)
        except ValueError:
            self.aborting.add(r)
            return
        r.output_tokens = 0
        self._finish(r, self.loop.now, admitted=False)

    def _reap(self, now: float) -> None:
        """End the requests ``abort`` marked, wherever they are (prefilling or decoding)."""
        aborting, self.aborting = self.aborting, set()
        for r in aborting:
            if r.t_done >= 0:
                continue  # finished in this very step
            if r in self.loading:  # ends once its load does (its blocks are being written)
                self.aborting.add(r)
                continue
            if r.remaining:  # still prefilling: nothing produced, nothing of its own stored yet
                self.prefilling.remove(r)
                r.output_tokens = 0
                self.prefill_backlog_tokens -= r.backlog_tokens
                if r.priority < 0 and self.priority_policy:
                    self.count_urgent(r, -1)
                self.cache.abandon(r)
                r.t_done = now
                self.finished += 1
                self.on_finish(r)
                continue
            self.finish_heap.remove(next(e for e in self.finish_heap if e[2] is r))
            heapq.heapify(self.finish_heap)
            self.n_decode -= 1
            self.dec_a -= r.prompt_tokens - r.decode_start_step
            r.output_tokens = self.produced(r)
            r.n_blocks = (r.prompt_tokens + r.output_tokens) // self.cache.block_size
            self._finish(r, now)

    def _drop(self, r: SimRequest) -> None:
        self.prefill_backlog_tokens -= r.backlog_tokens
        if r.priority < 0 and self.priority_policy:
            self.count_urgent(r, -1)
        r.dropped = True
        r.t_done = self.loop.now
        self.dropped += 1
        self.on_finish(r)


def _phase_take(r: SimRequest, take: int) -> int:
    """``take`` cut so that the step ends at ``r``'s next phase cut (``segments.py``: a phase is a request of its
    own, so its prefill ends before the next one starts)."""
    stops = r.phase_stops
    remaining = r.remaining
    while stops and stops[0] >= remaining:
        stops.pop(0)
    if not stops:
        r.phase_stops = None
        return take
    return min(take, remaining - stops[0])
