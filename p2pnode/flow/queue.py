"""The requests a node holds until its engine can take them: strict priority, then fair shares of token work.

Why a queue of our own: vLLM's queue is first come first served within a priority, so a tenant that sends 4x its
share takes 4x the engine, and the node's only answer beyond ``max_in_flight`` was a refusal. Requests that cannot
start now wait here instead, and leave in this order:

1. **Priority, strictly** (vLLM's convention: the lower value first). A request of a worse priority waits while a
   better one does; its time limit (``expires``) is what bounds that wait.
2. **Within a priority, start-time fair queueing** (Goyal, Vin and Cheng, SIGCOMM 1996) across tenants, by token
   work (the caller's ``cost``: prompt tokens plus an output budget) divided by the tenant's weight. A request's
   start tag is ``max(V, F[tenant])`` and its finish tag ``start + cost / weight``, where ``F[tenant]`` is the
   finish tag of the tenant's previous request and ``V`` the start tag of the request popped last -- both of its
   priority: each priority is a fair queue of its own (one ``V`` and one tag per tenant for all of them charged a
   tenant's waiting normal work to its urgent request, and moved every priority's ``V`` on each urgent pop, so that
   a tenant arriving at the default priority queued behind another's whole backlog); the smallest start tag leaves
   first (ties: arrival order). Backlogged tenants then share the engine's work in proportion to
   their weights, within one request's cost of it at any time, and a tenant that was idle does not bank credit
   (its start is never below ``V``). SFQ needs no estimate of the server's rate, which a node cannot know.

Invariants: one tenant at one priority leaves in exact arrival order (start tags never decrease within a tenant,
ties by ``seq``); the queue holds at most ``max_length`` requests; per-tenant tags (per priority) are kept only for
tenants that wait there or are ahead of its ``V`` (at most ``TAG_SLACK`` times the queue's length plus ``MIN_TAGS``,
idle ones forgotten first), and a priority's ``V`` only while it has a waiting request or a tag; ``remove`` and
``pop_expired`` take a request out at once (lazily from the heaps, exactly from the counts), and a heap holds at
most ``STALE_FACTOR`` times its waiting requests plus ``STALE_SLACK`` entries.
``charge`` is how the mesh's share reaches a node: work a tenant was served elsewhere moves its next requests here
back as if it had been served here (at most ``max_lead`` ahead of ``V``, so the debt is bounded).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

#: Idle tenants' tags are forgotten once more than ``TAG_SLACK * max_length + MIN_TAGS`` tenants have tags, down to
#: ``TAGS_KEPT`` of that (a batch at a time: one tenant at a time cost a sort of every tag on every push at the bound).
TAG_SLACK = 4
MIN_TAGS = 1024
TAGS_KEPT = 0.75
#: A heap (a priority's band, or the time limits) is rebuilt without its taken-out entries once they outnumber the
#: waiting ones by this factor (plus ``STALE_SLACK``): a band that is never the best one is never popped, and requests
#: that leave it early (their client gone) would pile up in it, and in every ``remove``'s scan, without bound.
STALE_FACTOR = 2
STALE_SLACK = 64


class QueueFull(Exception):
    """``push`` when ``max_length`` requests already wait."""


@dataclass(slots=True, eq=False)
class Waiting(Generic[T]):
    """One request in the queue: what the caller gave, and the tags the queue ordered it by."""

    item: T
    tenant: str
    priority: int
    cost: float
    enqueued: float
    expires: float
    start_tag: float
    seq: int
    #: True while it waits (popped, removed and expired requests are dropped from the heaps lazily).
    queued: bool = field(default=True, repr=False)


class FairQueue(Generic[T]):
    """Strict priority between priorities; within one, start-time fair queueing across tenants, each weighted by
    ``weight_of(tenant)``, over token work. One tenant and one priority: exactly FIFO."""

    def __init__(self, max_length: int, weight_of: Callable[[str], float] = lambda tenant: 1.0) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length = max_length
        self._weight_of = weight_of
        self._virtual: dict[int, float] = {}  # V per priority: the start tag of its request popped last
        self._finish: dict[tuple[int, str], float] = {}  # F per (priority, tenant): its last request's finish tag
        self._tags_at: dict[int, int] = {}  # tags per priority (``_finish``'s keys counted: no scan of them all)
        self._bands_of: dict[str, set[int]] = {}  # each tenant's priorities with a tag
        self._waiting_at: dict[tuple[int, str], int] = {}  # requests waiting per (priority, tenant)
        self._bands: dict[int, list[tuple[float, int, Waiting[T]]]] = {}  # priority -> heap by (start, seq)
        self._band_count: dict[int, int] = {}
        self._band_cost: dict[int, float] = {}
        self._by_tenant: dict[str, int] = {}
        self._expiries: list[tuple[float, int, Waiting[T]]] = []
        self._seq = itertools.count()
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def _weight(self, tenant: str) -> float:
        weight = self._weight_of(tenant)
        return weight if weight > 0 else 1.0

    def push(
        self, item: T, tenant: str, priority: int, cost: float, now: float, expires: float = math.inf
    ) -> Waiting[T]:
        """Queue ``item``; raises QueueFull when ``max_length`` requests already wait."""
        if self._length >= self.max_length:
            raise QueueFull(f"{self._length} requests are waiting (max {self.max_length})")
        cost = max(float(cost), 0.0)
        key = (priority, tenant)
        virtual = self._virtual.setdefault(priority, 0.0)
        start = max(virtual, self._finish.get(key, virtual))
        self._set_tag(key, start + cost / self._weight(tenant))
        self._waiting_at[key] = self._waiting_at.get(key, 0) + 1
        waiting = Waiting(item, tenant, priority, cost, now, expires, start, next(self._seq))
        heapq.heappush(self._bands.setdefault(priority, []), (start, waiting.seq, waiting))
        self._band_count[priority] = self._band_count.get(priority, 0) + 1
        self._band_cost[priority] = self._band_cost.get(priority, 0.0) + cost
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
        if expires != math.inf:
            heapq.heappush(self._expiries, (expires, waiting.seq, waiting))
        self._length += 1
        self._bound_tags()
        return waiting

    def _best_band(self) -> list[tuple[float, int, Waiting[T]]] | None:
        live = [p for p, n in self._band_count.items() if n > 0]
        if not live:
            return None
        heap = self._bands[min(live)]
        while not heap[0][2].queued:  # a live band's heap holds at least one queued request
            heapq.heappop(heap)
        return heap

    def peek(self) -> Waiting[T] | None:
        """The request ``pop`` would return, left in place."""
        heap = self._best_band()
        return heap[0][2] if heap else None

    def pop(self) -> Waiting[T] | None:
        """The next request to serve, taken out; None when none waits."""
        heap = self._best_band()
        if heap is None:
            return None
        _, _, waiting = heapq.heappop(heap)
        priority = waiting.priority
        self._virtual[priority] = max(self._virtual.get(priority, 0.0), waiting.start_tag)
        self._take_out(waiting)
        return waiting

    def remove(self, waiting: Waiting[T]) -> bool:
        """Take out a request that will not be served (its client left, or its limit passed); False when it no longer
        waits. Its tenant's tag and its tenant's later requests go back by its cost, never before ``V``: it got
        nothing, so it costs nothing (else a tenant whose requests expire behind others of its own would pay for
        them, fall further behind, and get only what the others leave)."""
        if not waiting.queued:
            return False
        tenant, priority = waiting.tenant, waiting.priority
        key = (priority, tenant)
        virtual = self._virtual.get(priority, 0.0)
        shift = waiting.cost / self._weight(tenant)
        if key in self._finish:
            self._finish[key] = max(virtual, self._finish[key] - shift)
        self._take_out(waiting)
        heap = self._bands.get(priority)
        if shift > 0 and heap is not None and self._waiting_at.get(key):
            # its tenant's later requests of its priority move up by its work, as if it had never come (a scan:
            # removals are rare)
            moved = False
            for i, (start, seq, w) in enumerate(heap):
                if w.queued and w.tenant == tenant and seq > waiting.seq:
                    w.start_tag = max(virtual, start - shift)
                    heap[i] = (w.start_tag, seq, w)
                    moved = True
            if moved:
                heapq.heapify(heap)
        return True

    def pop_expired(self, now: float) -> list[Waiting[T]]:
        """Take out every request whose time limit has passed (``expires <= now``), earliest first."""
        expired: list[Waiting[T]] = []
        while self._expiries and self._expiries[0][0] <= now:
            _, _, waiting = heapq.heappop(self._expiries)
            if waiting.queued:
                self.remove(waiting)
                expired.append(waiting)
        return expired

    def next_expiry(self) -> float:
        """When the earliest time limit of a waiting request passes; ``math.inf`` when none has one."""
        while self._expiries and not self._expiries[0][2].queued:
            heapq.heappop(self._expiries)
        return self._expiries[0][0] if self._expiries else math.inf

    def charge(self, tenant: str, cost: float, max_lead: float = math.inf) -> None:
        """Count ``cost`` of work served to ``tenant`` elsewhere: its next requests here start that much later, but
        never more than ``max_lead`` of work (weighted like the cost) after the current virtual time -- the bound on
        the debt work served elsewhere may leave here. At every priority the tenant has a tag at, and the default
        (0): one urgent request must not take its default ones out of the charge."""
        if cost <= 0:
            return
        weight = self._weight(tenant)
        for priority in sorted(self._bands_of.get(tenant, set()) | {0}):  # the default's too: its next requests
            key = (priority, tenant)
            virtual = self._virtual.setdefault(priority, 0.0)
            start = max(virtual, self._finish.get(key, virtual))
            finish = max(start, min(start + cost / weight, virtual + max_lead / weight))
            if finish > start:
                self._set_tag(key, finish)
        self._bound_tags()

    def waiting_cost(self) -> float:
        """The token work of every waiting request."""
        return sum(self._band_cost.values())

    def waiting_of(self, tenant: str) -> int:
        """How many of ``tenant``'s requests wait."""
        return self._by_tenant.get(tenant, 0)

    def waiting_by_tenant(self) -> dict[str, int]:
        return dict(self._by_tenant)

    def ahead_of(self, priority: int) -> tuple[int, float]:
        """(requests, cost) waiting at ``priority`` or better: the most a new request of ``priority`` waits behind."""
        count = sum(n for p, n in self._band_count.items() if p <= priority)
        cost = sum(c for p, c in self._band_cost.items() if p <= priority)
        return count, cost

    def _take_out(self, waiting: Waiting[T]) -> None:
        waiting.queued = False
        priority, tenant = waiting.priority, waiting.tenant
        key = (priority, tenant)
        self._band_count[priority] -= 1
        self._band_cost[priority] -= waiting.cost
        if self._band_count[priority] == 0:  # drop the band (its heap holds only taken-out requests now)
            del self._band_count[priority], self._band_cost[priority], self._bands[priority]
        else:
            _compact(self._bands[priority], self._band_count[priority])
        self._by_tenant[tenant] -= 1
        if self._by_tenant[tenant] == 0:
            del self._by_tenant[tenant]
        self._waiting_at[key] -= 1
        if self._waiting_at[key] == 0:
            del self._waiting_at[key]
            if key in self._finish and self._finish[key] <= self._virtual.get(priority, 0.0):
                self._drop_tag(key)  # idle and not ahead of V: its next start is V anyway
        if priority not in self._band_count and not self._tags_at.get(priority):
            self._virtual.pop(priority, None)  # nothing waits there and nobody is ahead: it starts afresh
        self._length -= 1
        if self._length == 0:
            self._expiries.clear()
        else:
            _compact(self._expiries, self._length)

    def _set_tag(self, key: tuple[int, str], finish: float) -> None:
        if key not in self._finish:
            priority, tenant = key
            self._tags_at[priority] = self._tags_at.get(priority, 0) + 1
            self._bands_of.setdefault(tenant, set()).add(priority)
        self._finish[key] = finish

    def _drop_tag(self, key: tuple[int, str]) -> None:
        del self._finish[key]
        priority, tenant = key
        left = self._tags_at[priority] - 1
        if left:
            self._tags_at[priority] = left
        else:
            del self._tags_at[priority]
        bands = self._bands_of[tenant]
        bands.discard(priority)
        if not bands:
            del self._bands_of[tenant]

    def _bound_tags(self) -> None:
        limit = TAG_SLACK * self.max_length + MIN_TAGS
        if len(self._finish) <= limit:
            return
        virtual = self._virtual
        idle = [key for key in self._finish if key not in self._waiting_at]
        idle.sort(key=lambda key: self._finish[key] > virtual.get(key[0], 0.0))  # those that no longer matter first
        for key in idle[: len(self._finish) - int(limit * TAGS_KEPT)]:
            self._drop_tag(key)
        for priority in [p for p in virtual if p not in self._band_count and not self._tags_at.get(p)]:
            del virtual[priority]


def _compact(heap: list[tuple[float, int, Waiting[T]]], waiting: int) -> None:
    """``heap`` without its taken-out entries once they outnumber the ``waiting`` ones (``STALE_FACTOR``): amortized
    O(1) per removal. The order is unchanged: every entry's (tag, seq) is unique."""
    if len(heap) > STALE_FACTOR * waiting + STALE_SLACK:
        heap[:] = [entry for entry in heap if entry[2].queued]
        heapq.heapify(heap)
