"""A simulated node's admission queue: the node's own ``FairQueue`` (``p2pnode/flow/queue.py``) ahead of its engine.

A request that reaches its target joins the queue, which orders the waiting strictly by priority (lower first, as
vLLM) and, within one priority, fairly across tenants by token work (prompt tokens + output budget), each tenant
weighted. It moves to the engine when the engine's own waiting queue is empty and the engine can take it -- its KV
fits, or a lower-priority request would be preempted for it (``NodeEngine.can_take``): the engine asks for one more
each time its admission finds none waiting (``NodeEngine.feed``), so it never idles while requests wait here
(work-conserving) -- or when it outranks the engine's first waiting request (the engine then orders it ahead:
``NodeEngine.priority_policy``). Whoever the engine's freed KV goes to is thus the fair queue's choice when it
frees, not the choice of when a request happened to arrive: a request that cannot start waits here, not at the head
of the engine's queue. (The engine's queue holds only requests that outrank its blocked head and preempted ones.)

A request waits here at most ``max_queue_s``; then it is shed: answered unserved (``SimRequest.shed``; a node
answers 429), counted per tenant and priority by the run's metrics. A full queue (``max_length``) sheds at once.
While it waits, a request counts in its node's load -- waiting, and its uncached prompt in the prefill backlog -- so
routing sees the queue as waiting load, as it sees a node's (and an urgent request, better than the default priority,
only the urgent part of it: ``NodeLoad.urgent``).
"""

from __future__ import annotations

from collections.abc import Callable

from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.flow.queue import FairQueue, QueueFull
from p2pnode.flow.shares import excess_over_share
from p2pnode.sim.des import EventLoop

__all__ = ["MeshShares", "NodeQueue", "token_work"]


def token_work(r: SimRequest) -> float:
    """What a request costs its tenant's fair share: its prompt tokens and its output budget."""
    return float(r.prompt_tokens + r.output_tokens)


class NodeQueue:
    """One node's admission queue in front of ``engine``; ``on_shed(r)`` is told of every request it sheds."""

    __slots__ = ("engine", "fair", "loop", "max_queue_s", "on_shed", "served", "shed", "weight_of")

    def __init__(
        self,
        engine: NodeEngine,
        loop: EventLoop,
        on_shed: Callable[[SimRequest], None],
        max_queue_s: float,
        max_length: int,
        weight_of: Callable[[str], float],
    ) -> None:
        if max_queue_s <= 0:
            raise ValueError(f"max_queue_s must be > 0, got {max_queue_s}")
        self.engine = engine
        self.loop = loop
        self.on_shed = on_shed
        self.max_queue_s = max_queue_s
        self.fair: FairQueue[SimRequest] = FairQueue(max_length, weight_of)
        self.weight_of = weight_of
        self.shed = 0
        #: Token work this queue handed its engine per tenant since the mesh last heard (``MeshShares``).
        self.served: dict[str, float] = {}
        engine.feed = self._feed

    def __len__(self) -> int:
        return len(self.fair)

    def arrive(self, r: SimRequest) -> None:
        """``r`` reached this node: it queues, and goes on to the engine at once if the engine has room for it."""
        now = self.loop.now
        try:
            waiting = self.fair.push(r, r.tenant, r.priority, token_work(r), now, now + self.max_queue_s)
        except QueueFull:
            self._shed(r, now)
            return
        r.queued_at = now
        r.queue_wait_s = -1.0  # waiting (set when it leaves)
        eng = self.engine
        eng.queued += 1
        r.backlog_tokens = eng.backlog_of(r)
        eng.prefill_backlog_tokens += r.backlog_tokens
        if r.priority < 0:
            eng.count_urgent(r, 1)
        if eng.prefill_backlog_tokens > eng.max_backlog_tokens:
            eng.max_backlog_tokens = eng.prefill_backlog_tokens
        self._release()
        if r.queue_wait_s < 0:  # still here: shed at its limit unless it leaves first
            self.loop.at(waiting.expires, self._expire, None)

    def _release(self) -> None:
        """Move requests to the engine while it has room for them (module docstring)."""
        eng, fair = self.engine, self.fair
        while True:
            head = fair.peek()
            if head is None:
                return
            waiting = eng.waiting
            if waiting:
                if not (eng.priority_policy and head.priority < waiting[0].priority):
                    return
            elif not eng.has_room_for(head.item):
                return  # the engine's next admission asks (``_feed``)
            eng.submit(self._take())

    def _feed(self) -> bool:
        """The engine's admission found nothing waiting: the next request, if any, joins its waiting queue."""
        fair = self.fair
        head = fair.peek()
        if head is None or not self.engine.can_take(head.item):
            return False
        self.engine.enqueue(self._take())
        return True

    def _take(self) -> SimRequest:
        """The queue's next request, taken out for the engine (its work counted as served here)."""
        head = self.fair.pop()
        assert head is not None
        self._leave(head.item)
        self.served[head.tenant] = self.served.get(head.tenant, 0.0) + head.cost
        return head.item

    def _leave(self, r: SimRequest) -> None:
        """``r`` leaves the queue (to the engine, or shed): no longer counted in the node's load here."""
        eng = self.engine
        eng.queued -= 1
        eng.prefill_backlog_tokens -= r.backlog_tokens
        if r.priority < 0:
            eng.count_urgent(r, -1)
        r.queue_wait_s = self.loop.now - r.queued_at

    def _expire(self, _: object) -> None:
        now = self.loop.now
        for waiting in self.fair.pop_expired(now):
            self._leave(waiting.item)
            self._shed(waiting.item, now)

    def _shed(self, r: SimRequest, now: float) -> None:
        r.shed = True
        r.t_done = now
        self.shed += 1
        self.on_shed(r)


class MeshShares:
    """Fair shares over the mesh, not per node: every ``interval_s`` each node's queue tells the others the work it
    handed its engine per tenant since, and they hear it ``delay_s`` later and charge each tenant what it got beyond
    its weighted equal share of it, as a debt of at most the work waiting there (``flow/shares.py``: the node's rule
    over gossip, ``serving/tenant_served.py``), as gossip would carry it. Without it each node shares
    its own engine only, so a tenant's burst at one node gets that node's share whatever the tenant got elsewhere."""

    def __init__(self, loop: EventLoop, queues: list[NodeQueue], interval_s: float, delay_s: float,
                 done: Callable[[], bool]) -> None:
        self.loop = loop
        self.queues = queues
        self.interval_s = interval_s
        self.delay_s = delay_s
        self.done = done

    def start(self) -> None:
        self.loop.at(self.interval_s, self._round, None)

    def _round(self, _: object) -> None:
        if self.done():
            return
        news = []
        for j, queue in enumerate(self.queues):
            if queue.served:
                news.append((j, queue.served))
                queue.served = {}
        if news:
            self.loop.at(self.loop.now + self.delay_s, self._hear, news)
        self.loop.at(self.loop.now + self.interval_s, self._round, None)

    def _hear(self, news: list[tuple[int, dict[str, float]]]) -> None:
        for k, queue in enumerate(self.queues):
            elsewhere: dict[str, float] = {}
            for j, served in news:
                if j != k:
                    for tenant, cost in served.items():
                        elsewhere[tenant] = elsewhere.get(tenant, 0.0) + cost
            fair = queue.fair
            for tenant, excess in excess_over_share(elsewhere, fair.waiting_by_tenant(), queue.weight_of).items():
                fair.charge(tenant, excess, max_lead=fair.waiting_cost())
