"""KV pulls between simulated nodes: a request served at one node with its cached prefix moved from another.

When a routing decision carries a ``Pull`` (``routing/policies/types.py``: serve at ``target`` with the first
``blocks`` blocks of the prompt's KV pulled from ``holder``), the request, once at its target (after the forward
hop), waits outside the target's batch while the pull runs, then joins the target's queue like any request:

- **what moves**: the blocks the holder holds past the target's own match, up to ``blocks``, both read from the real
  caches *when the pull starts* (a holder that evicted them since the decision's estimate moves only what it still
  holds: a partial pull, or a failed one that moved nothing; the request computes the rest). A target that holds
  every block by the time the request reaches it pulls nothing (``unneeded``, never on the link);
- **the link**: each holder has one outbound link, shared by the pulls from it first come, first served: a pull
  starts when the link is free and holds it for ``fixed_s`` (the call's round trip and set-up) + one engine step of
  the holder at its current batch (its export runs in its next step) + ``bytes / link_bytes_per_s``; a failed pull
  holds it for ``fixed_s`` (the holder answers at once that it has nothing);
- **bytes** = moved blocks x ``block_size`` x ``bytes_per_token`` (the profile's ``kv_bytes_per_token``);
- **from a holder's tiers** (KV tiers below its engine, ``engine/simulated/tiers.py``): the holder moves what its
  engine and its tiers hold (the tiers' continuation of its engine's prefix), reading the blocks its engine lacks from
  its tiers at their load rate (``cost/tiers.py``) before they go on the link -- served from the tier, not loaded into
  the holder's engine. The target's own tiers are not used by a pulling request (one load per request: the pull's),
  so what moves is everything past the target's engine match;
- **on admission** the pulled blocks count as cached for the request (not recomputed: ``kvcache.admit``) and join the
  target's cache like computed blocks.

**Segment pulls** (``request_segments``; approximate segment reuse, ``routing/segments.segment_pulls`` as the serving
node decides them): the request waits outside its target's batch while each holder named sends the segments asked
of it, on the same outbound link as prefix pulls (one job per holder and request, first come, first served), each
job holding the link for ``fixed_s`` + one engine step of the holder + its bytes / ``link_bytes_per_s``. What moves
is read from the holder's store when the job starts (a segment it evicted since its gossip said otherwise is not
moved and is computed at the target); what moves is pinned in the holder's store until the job ends. Jobs from
different holders run side by side; the request joins the target's queue when the last one ends, its pulled
segments then loading like held ones (``engine/simulated/segments.py``). Bytes = the moved segments' tokens x
``bytes_per_token``; ``pull_outcome`` says whether every segment asked moved, some, or none.

Calibration: ``link_bytes_per_s`` and ``fixed_s`` are what a measurement of real pulls gives (bytes per second of a
long pull, the time of a pull of almost nothing); the holder's step is modelled from its batch on top of ``fixed_s``,
so a measurement taken against an idle engine sets ``fixed_s`` to its fixed time minus an idle step
(``CostProfile.step_base_s``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.request import (
    PULL_FAILED,
    PULL_FULL,
    PULL_PARTIAL,
    PULL_UNNEEDED,
    SimRequest,
)
from p2pnode.sim.des import EventLoop

__all__ = ["KvPulls", "SegmentJob"]


@dataclass(slots=True, eq=False)
class SegmentJob:
    """The segments one request asks of one holder (indices into its segments), and what moved."""

    r: SimRequest
    holder: int
    indices: tuple[int, ...]
    moved: tuple[int, ...] = ()
    moved_bytes: int = 0

    @property
    def keys(self) -> list[int]:
        """The store keys of the segments that move: pinned in the holder's store while on the link."""
        assert self.r.segments is not None
        return [self.r.segments.keys[i] for i in self.moved]


class KvPulls:
    """Every holder's outbound link and the pulls queued on it (module docstring)."""

    __slots__ = (
        "block_size",
        "busy",
        "bytes_per_token",
        "engines",
        "fixed_s",
        "link_bytes_per_s",
        "loop",
        "observe",
        "queues",
        "segment_jobs",
        "submit",
    )

    def __init__(
        self,
        loop: EventLoop,
        engines: Sequence[NodeEngine],
        block_size: int,
        bytes_per_token: int,
        link_bytes_per_s: float,
        fixed_s: float,
        submit: Callable[[SimRequest], None],
        observe: Callable[[SimRequest, int, int, float, bool], None] | None = None,
    ) -> None:
        """``submit(r)``: hand ``r`` to its target's engine once its pull is over; ``observe(r, holder, bytes,
        seconds, ok)``: a pull or a segment job ended (the router that decided it learns the holder's link)."""
        if link_bytes_per_s <= 0 or bytes_per_token <= 0:
            raise ValueError(
                f"a pull needs a link and KV bytes per token, got {link_bytes_per_s} B/s, {bytes_per_token} B/token"
            )
        if fixed_s < 0:
            raise ValueError(f"a pull's fixed time must be >= 0, got {fixed_s}")
        self.loop = loop
        self.engines = engines
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.link_bytes_per_s = link_bytes_per_s
        self.fixed_s = fixed_s
        self.submit = submit
        self.observe = observe
        self.queues: list[deque[SimRequest | SegmentJob]] = [deque() for _ in engines]
        self.busy = [False] * len(engines)
        #: Requests waiting for segment jobs -> [jobs not yet ended, segments asked].
        self.segment_jobs: dict[SimRequest, list[int]] = {}

    def _limit(self, r: SimRequest) -> int:
        """Blocks the pull may bring: what the decision asked, never the last prompt token's block."""
        usable = (r.prompt_tokens - 1) // self.block_size
        return r.pull_blocks if r.pull_blocks < usable else usable

    def request(self, r: SimRequest) -> None:
        """``r`` has reached its target (``r.target``) and wants ``r.pull_blocks`` blocks from ``r.pull_holder``."""
        r.pull_t0 = self.loop.now
        limit = self._limit(r)
        if self.engines[r.target].cache.match_blocks(r.chain, limit) >= limit:
            r.pull_outcome = PULL_UNNEEDED  # computed here meanwhile: nothing to move
            self.submit(r)
            return
        self._enqueue(r.pull_holder, r)

    def request_segments(self, r: SimRequest, asks: Mapping[int, Sequence[int]]) -> None:
        """``r`` has reached its target and wants, from each holder ``h`` of ``asks``, the segments ``asks[h]``
        (indices into its segments; module docstring, "Segment pulls")."""
        assert r.segments is not None and asks
        r.pull_t0 = self.loop.now
        self.segment_jobs[r] = [len(asks), sum(len(indices) for indices in asks.values())]
        for h, indices in asks.items():
            self._enqueue(h, SegmentJob(r, h, tuple(indices)))

    def _enqueue(self, h: int, job: SimRequest | SegmentJob) -> None:
        self.queues[h].append(job)
        if not self.busy[h]:
            self._next(h)

    def _next(self, h: int) -> None:
        queue = self.queues[h]
        if not queue:
            self.busy[h] = False
            return
        self.busy[h] = True
        job = queue.popleft()
        if isinstance(job, SegmentJob):
            self._start_segments(job)
            return
        r = job
        now = self.loop.now
        r.pull_wait_s = now - r.pull_t0
        limit = self._limit(r)
        here = self.engines[r.target].cache.match_blocks(r.chain, limit)
        holder = self.engines[h]
        there = holder.cache.match_blocks(r.chain, limit)
        read_s = 0.0
        tiers = holder.cache.tiers
        if tiers is not None:  # what its tiers hold past its engine's prefix is read from them
            gpu = there
            host, there = tiers.depths(r.chain, gpu, limit)
            lo = max(here, gpu)
            if there > lo:
                bs = self.block_size
                on_host = max(0, min(host, there) - lo)
                read_s = holder.tier_rates.load_seconds(on_host * bs, (there - lo - on_host) * bs)
        duration = self.fixed_s
        if there <= here:
            r.pull_outcome = PULL_FAILED if here < limit else PULL_UNNEEDED
        else:
            r.pull_outcome = PULL_FULL if there >= limit else PULL_PARTIAL
            r.pull_lo, r.pull_hi = here, there
            r.pull_bytes = (there - here) * self.block_size * self.bytes_per_token
            duration += holder.step_s() + read_s + r.pull_bytes / self.link_bytes_per_s
        self.loop.at(now + duration, self._done, r)

    def _done(self, r: SimRequest) -> None:
        r.pull_s = self.loop.now - r.pull_t0
        if self.observe is not None and r.pull_outcome != PULL_UNNEEDED:  # nothing was asked of the holder's link
            ok = r.pull_outcome in (PULL_FULL, PULL_PARTIAL)
            self.observe(r, r.pull_holder, r.pull_bytes, r.pull_s, ok)
        self.submit(r)
        self._next(r.pull_holder)

    def _start_segments(self, job: SegmentJob) -> None:
        r, h = job.r, job.holder
        seg = r.segments
        assert seg is not None
        now = self.loop.now
        r.pull_wait_s = max(r.pull_wait_s, now - r.pull_t0)
        holder = self.engines[h]
        store = holder.segments.store if holder.segments is not None else None
        moved: list[int] = []
        tokens = 0
        if store is not None:
            for i in job.indices:
                start, end = seg.spans[i]
                if store.get(seg.keys[i], seg.tokens[start:end]) is not None:
                    moved.append(i)
                    tokens += end - start
        job.moved = tuple(moved)
        if store is not None:
            store.pin(job.keys)  # read by the export: not evicted while on the link
        job.moved_bytes = tokens * self.bytes_per_token
        duration = self.fixed_s
        if moved:
            duration += holder.step_s() + job.moved_bytes / self.link_bytes_per_s
        self.loop.at(now + duration, self._segments_done, job)

    def _segments_done(self, job: SegmentJob) -> None:
        r, h = job.r, job.holder
        seg = r.segments
        assert seg is not None
        holder = self.engines[h]
        if job.keys and holder.segments is not None and holder.segments.store is not None:
            holder.segments.store.unpin(job.keys)
        now = self.loop.now
        seg.pulled += job.moved
        r.pull_bytes += job.moved_bytes
        if self.observe is not None:
            self.observe(r, h, job.moved_bytes, now - r.pull_t0, bool(job.moved))
        waiting = self.segment_jobs[r]
        waiting[0] -= 1
        if not waiting[0]:
            del self.segment_jobs[r]
            asked, got = waiting[1], len(seg.pulled)
            r.pull_outcome = PULL_FULL if got >= asked else PULL_PARTIAL if got else PULL_FAILED
            r.pull_s = now - r.pull_t0
            self.submit(r)
        self._next(h)
