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
- **on admission** the pulled blocks count as cached for the request (not recomputed: ``kvcache.admit``) and join the
  target's cache like computed blocks.

Calibration: ``link_bytes_per_s`` and ``fixed_s`` are what a measurement of real pulls gives (bytes per second of a
long pull, the time of a pull of almost nothing); the holder's step is modelled from its batch on top of ``fixed_s``,
so a measurement taken against an idle engine sets ``fixed_s`` to its fixed time minus an idle step
(``CostProfile.step_base_s``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.request import (
    PULL_FAILED,
    PULL_FULL,
    PULL_PARTIAL,
    PULL_UNNEEDED,
    SimRequest,
)
from p2pnode.sim.des import EventLoop

__all__ = ["KvPulls"]


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
        "queues",
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
    ) -> None:
        """``submit(r)``: hand ``r`` to its target's engine once its pull is over."""
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
        self.queues: list[deque[SimRequest]] = [deque() for _ in engines]
        self.busy = [False] * len(engines)

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
        h = r.pull_holder
        self.queues[h].append(r)
        if not self.busy[h]:
            self._next(h)

    def _next(self, h: int) -> None:
        queue = self.queues[h]
        if not queue:
            self.busy[h] = False
            return
        self.busy[h] = True
        r = queue.popleft()
        now = self.loop.now
        r.pull_wait_s = now - r.pull_t0
        limit = self._limit(r)
        here = self.engines[r.target].cache.match_blocks(r.chain, limit)
        holder = self.engines[h]
        there = holder.cache.match_blocks(r.chain, limit)
        duration = self.fixed_s
        if there <= here:
            r.pull_outcome = PULL_FAILED if here < limit else PULL_UNNEEDED
        else:
            r.pull_outcome = PULL_FULL if there >= limit else PULL_PARTIAL
            r.pull_lo, r.pull_hi = here, there
            r.pull_bytes = (there - here) * self.block_size * self.bytes_per_token
            duration += holder.step_s() + r.pull_bytes / self.link_bytes_per_s
        self.loop.at(now + duration, self._done, r)

    def _done(self, r: SimRequest) -> None:
        r.pull_s = self.loop.now - r.pull_t0
        self.submit(r)
        self._next(r.pull_holder)
