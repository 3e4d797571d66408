"""The node's gate in front of its engine: at most ``max_in_flight`` requests inside, the rest waiting here, in the
order of ``flow.queue.FairQueue`` (strict priority, then fair shares of token work across tenants).

Why requests wait here and not in vLLM's queue: vLLM serves a priority first come first served, so once a request
is inside the engine its tenant's share is decided. Requests therefore enter the engine only while fewer than
``max_in_flight`` of the node's are inside (running or in vLLM's own queue), and every other one waits here, where the
order is fair. The gate is work-conserving: a slot that frees is handed to the next waiting request at once (in the
same event-loop step), so the engine never idles while requests wait; one tenant at one priority leaves in arrival
order, exactly as before the queue.

**New tenants do not wait behind busy ones** (FQ-CoDel's sparse-flow rule, RFC 8290): a tenant with nothing inside
the engine and nothing waiting enters at once, into the one slot held above ``max_in_flight`` for that, even while
other tenants' requests wait. Start-time fair queueing alone would put its first request next in line, but "next"
here means after a whole request leaves the engine (seconds), not after a packet; a tenant sending a request now and
then would pay that wait every time. One spare slot in all, so the engine holds at most ``max_in_flight + 1``.

A request leaves the queue in one of these ways:
- into the engine (``enter`` returns), when a slot frees and it is next;
- shed, once it has waited ``--max-queue-seconds`` (RESOURCE_EXHAUSTED, overload, with a Retry-After), or its
  client's deadline passed (DEADLINE_EXCEEDED, the node's usual answer);
- taken out, when its caller goes away (the waiting task is cancelled): no engine work is ever done for it.

A request that cannot start within ``--max-queue-seconds`` is not queued at all: when the queue is full, or the
requests ahead of it (at its priority or better) would take longer than that to enter the engine (``max_in_flight``
of them leave per mean time a request spends inside), it is refused at once, retryable (RESOURCE_EXHAUSTED,
overload), so an ingress tries the next node instead of leaving it here. With ``--max-queue-length 0`` nothing
waits: a full node refuses, as before the queue.

Fairness needs vLLM's own queue short: set ``--max-in-flight`` near what the engine runs at once (its
``max_num_seqs``), so that what would wait there waits here instead.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pnode.config import FlowConfig
from p2pnode.flow.queue import FairQueue, QueueFull, Waiting
from p2pnode.request import Request
from p2pnode.serving.errors import ServeCode, TargetFailed, Throttle
from p2pnode.serving.tenants import TenantLabels

__all__ = ["REFUSAL_REASONS", "URGENT_PRIORITY", "EngineQueue", "FlowStats", "request_cost"]

#: Requests whose time inside the engine the wait estimate averages (the latest ones): enough to smooth one long
#: generation, few enough to follow a change of workload within a minute or two.
SERVICE_SAMPLES = 256
#: The worst priority the gossiped load's urgent view counts (``NodeLoad.urgent_waiting``: better than the default 0).
URGENT_PRIORITY = -1
#: The shortest Retry-After an overloaded node gives (seconds: HTTP's Retry-After is whole seconds).
MIN_RETRY_AFTER_S = 1.0

#: Why a request was refused or shed, the label values of p2pnode:flow_refused_total: over its tenant's rate limit;
#: the queue was full; it could not start within --max-queue-seconds; it waited that long; its deadline passed
#: while it waited; the node was full with no queue (--max-queue-length 0).
REFUSAL_REASONS = ("rate_limit", "queue_full", "wait_too_long", "queue_timeout", "deadline", "in_flight_full")


def request_cost(request: Request) -> int:
    """A request's token work, the fair share's currency: its prompt plus its whole output budget (``max_tokens``:
    what it may take, the only bound known before it runs)."""
    return len(request.tokens) + request.max_tokens


@dataclass
class FlowStats:
    """What flow control did (the metrics read it): refusals by (tenant label, reason), requests that waited."""

    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    queued: int = 0


class EngineQueue:
    """At most ``slots`` requests inside the engine, the rest waiting in a fair queue (module docstring)."""

    def __init__(
        self,
        node_id: str,
        slots: int,
        flow: FlowConfig,
        weight_of: Callable[[str], float] = lambda tenant: 1.0,
        labels: TenantLabels | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.slots = slots
        self.max_wait_s = flow.max_queue_seconds
        self.inside = 0
        self.queue: FairQueue[asyncio.Future[None]] | None = (
            FairQueue(flow.max_queue_length, weight_of) if flow.max_queue_length > 0 else None
        )
        self.labels = labels or TenantLabels()
        self.stats = FlowStats()
        #: Told the seconds each request waited before it entered the engine (0 for one that did not wait).
        self.on_wait: Callable[[float], None] | None = None
        #: Told the tenant and token work (``request_cost``) of each request as it enters the engine: the work this
        #: node serves, gossiped for the mesh's fair shares (``serving/tenant_served.py``).
        self.on_enter: Callable[[str, int], None] | None = None
        self._clock = clock
        self._held: deque[float] = deque(maxlen=SERVICE_SAMPLES)
        self._timer: asyncio.TimerHandle | None = None
        self._inside_by: Counter[str] = Counter()

    def __len__(self) -> int:
        """Requests waiting."""
        return len(self.queue) if self.queue is not None else 0

    def waiting_ahead_of(self, priority: int) -> int:
        """Requests waiting at ``priority`` or better (what a new one of that priority would wait behind at most)."""
        return self.queue.ahead_of(priority)[0] if self.queue is not None else 0

    def waiting_by_tenant(self) -> dict[str, int]:
        return self.queue.waiting_by_tenant() if self.queue is not None else {}

    def charge(self, tenant: str, work: float) -> None:
        """Count ``work`` served to ``tenant`` at other nodes in its fair share here, as a debt of at most the work
        waiting now (``FairQueue.charge``'s ``max_lead``): it then waits behind what waits here, no longer, and a node
        that is not backlogged keeps no debt at all."""
        if self.queue is not None:
            self.queue.charge(tenant, work, max_lead=self.queue.waiting_cost())

    def refuse(self, tenant: str, reason: str) -> None:
        """Count a refusal (the rate limits' too: the metrics show both in one family)."""
        self.stats.refused[(self.labels(tenant), reason)] += 1

    # --- the gate -----------------------------------------------------------------------------------------------

    async def enter(self, request: Request) -> None:
        """Take a slot in the engine for ``request``: at once when one is free and none waits, else once it is next
        in the queue; raise TargetFailed when it is refused or shed (module docstring). The caller calls ``leave``
        once the request is out of the engine."""
        now = self._clock()
        tenant = request.tenant
        new = not self._inside_by[tenant] and not (self.queue is not None and self.queue.waiting_of(tenant))
        if (self.inside < self.slots and not len(self)) or (new and self.inside < self.slots + 1):  # the spare slot
            self.inside += 1
            self._inside_by[tenant] += 1
            self._observe(request, 0.0)
            return
        queue = self.queue
        priority = request.sampling.priority
        if queue is None:
            self.refuse(tenant, "in_flight_full")
            raise self._overloaded(f"{self.slots} requests in flight (max_in_flight)", 1, retryable=True)
        ahead, _ = queue.ahead_of(priority)
        expected = self.expected_wait(ahead + 1)
        if expected > self.max_wait_s:
            self.refuse(tenant, "wait_too_long")
            message = (
                f"overloaded: {ahead} requests wait ahead of this one, ~{expected:.0f} s at the rate requests "
                f"leave the engine (max_queue_seconds {self.max_wait_s:g})"
            )
            raise self._overloaded(message, ahead + 1, retryable=True)
        expires = now + self.max_wait_s
        if request.deadline is not None:
            expires = min(expires, request.deadline)
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            waiting = queue.push(admitted, tenant, priority, request_cost(request), now, expires)
        except QueueFull:
            self.refuse(tenant, "queue_full")
            message = f"overloaded: the queue is full ({len(queue)} requests wait; max_queue_length {queue.max_length})"
            raise self._overloaded(message, len(queue), retryable=True) from None
        self.stats.queued += 1
        self._arm()
        try:
            await admitted
        except asyncio.CancelledError:
            granted = admitted.done() and not admitted.cancelled() and admitted.exception() is None
            if not queue.remove(waiting) and granted:
                self.leave(None, tenant)  # handed a slot as its caller went away: hand it on
            self._arm()
            raise
        self._observe(request, self._clock() - waiting.enqueued)

    def leave(self, held_s: float | None, tenant: str = "") -> None:
        """A request left the engine after ``held_s`` seconds inside (None: it never ran): its slot goes to the next
        waiting one."""
        self.inside -= 1
        self._inside_by[tenant] -= 1
        if self._inside_by[tenant] <= 0:
            del self._inside_by[tenant]
        if held_s is not None:
            self._held.append(held_s)
        self._grant()

    def _grant(self) -> None:
        queue = self.queue
        while queue is not None and self.inside < self.slots:
            waiting = queue.pop()
            if waiting is None:
                break
            if waiting.item.done():  # its caller is going away (cancelled) and has not taken it out yet
                continue
            self.inside += 1
            self._inside_by[waiting.tenant] += 1
            waiting.item.set_result(None)
        self._arm()

    # --- time limits ----------------------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Wake up when the earliest time limit of a waiting request passes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        expiry = self.queue.next_expiry() if self.queue is not None else math.inf
        if expiry != math.inf:
            delay = max(expiry - self._clock(), 0.0)
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        assert self.queue is not None
        now = self._clock()
        for waiting in self.queue.pop_expired(now):
            if not waiting.item.done():
                waiting.item.set_exception(self._expired(waiting, now))
        self._arm()

    def _expired(self, waiting: Waiting[asyncio.Future[None]], now: float) -> TargetFailed:
        waited = now - waiting.enqueued
        if waiting.expires < waiting.enqueued + self.max_wait_s:  # its client's deadline came first
            self.refuse(waiting.tenant, "deadline")
            return TargetFailed(
                self.node_id,
                ServeCode.DEADLINE_EXCEEDED,
                f"deadline exceeded after waiting {waited:.1f} s for the engine",
                retryable=False,
            )
        self.refuse(waiting.tenant, "queue_timeout")
        message = f"overloaded: waited {waited:.1f} s for the engine (max_queue_seconds {self.max_wait_s:g})"
        return self._overloaded(message, len(self) + 1, retryable=False)

    # --- estimates --------------------------------------------------------------------------------------------------

    def service_time(self) -> float:
        """The mean time requests spent inside the engine, over the last SERVICE_SAMPLES (0: none left yet)."""
        return sum(self._held) / len(self._held) if self._held else 0.0

    def expected_wait(self, position: int) -> float:
        """Seconds until the request ``position``-th in line enters the engine: ``slots`` requests leave per mean
        service time (the engine's capacity, whatever the load has been); 0 while no request has finished yet (no
        figure to judge by: it may wait, bounded by --max-queue-seconds)."""
        return position * self.service_time() / max(self.slots, 1)

    def _overloaded(self, message: str, position: int, *, retryable: bool) -> TargetFailed:
        retry_after = max(MIN_RETRY_AFTER_S, min(self.expected_wait(position), self.max_wait_s))
        return TargetFailed(
            self.node_id,
            ServeCode.RESOURCE_EXHAUSTED,
            message,
            retryable=retryable,
            throttle=Throttle.OVERLOAD,
            retry_after_s=retry_after,
        )

    def _observe(self, request: Request, waited: float) -> None:
        if self.on_wait is not None:
            self.on_wait(waited)
        if self.on_enter is not None:
            self.on_enter(request.tenant, request_cost(request))
