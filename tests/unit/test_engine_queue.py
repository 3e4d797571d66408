"""The gate in front of the engine: who enters, in what order, who is refused or shed, and that nothing leaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2pnode.config import FlowConfig
from p2pnode.request import Request, SamplingOptions
from p2pnode.serving.engine_queue import EngineQueue, request_cost
from p2pnode.serving.errors import ServeCode, TargetFailed, Throttle
from tests.polling import until


def request(
    rid: str,
    tenant: str = "default",
    priority: int = 0,
    tokens: int = 10,
    max_tokens: int = 10,
    deadline: float | None = None,
) -> Request:
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, priority=priority)
    return Request(rid, list(range(tokens)), sampling, tenant=tenant, deadline=deadline)


def gate(slots: int = 1, **flow: object) -> EngineQueue:
    return EngineQueue("n1", slots, FlowConfig(**flow))  # type: ignore[arg-type]


async def fill(queue: EngineQueue, *tenants: str) -> None:
    """Take every slot, for ``tenants`` in turn (the default tenant when none is named)."""
    tenants = tenants or ("default",)
    for i in range(queue.slots):
        await queue.enter(request(f"running{i}", tenant=tenants[i % len(tenants)]))


async def admitted_order(queue: EngineQueue, requests: list[Request]) -> list[str]:
    """Queue ``requests`` behind a full engine, then free one slot at a time: the order they enter."""
    order: list[str] = []

    async def one(r: Request) -> None:
        await queue.enter(r)
        order.append(r.request_id)

    tasks = []
    for k, r in enumerate(requests, 1):  # in this order: each is queued before the next arrives
        tasks.append(asyncio.create_task(one(r)))
        await until(lambda k=k: len(queue) == k, "the request to wait")
    for k in range(1, len(requests) + 1):
        queue.leave(1.0)
        await until(lambda k=k: len(order) == k, "the next to enter")
    await asyncio.gather(*tasks)
    return order


def test_cost_is_prompt_plus_output_budget() -> None:
    assert request_cost(request("a", tokens=100, max_tokens=28)) == 128


async def test_one_tenant_one_priority_enters_in_arrival_order() -> None:
    queue = gate()
    await fill(queue)
    ids = [f"r{i}" for i in range(6)]
    assert await admitted_order(queue, [request(i, tokens=10 + 50 * (k % 2)) for k, i in enumerate(ids)]) == ids


async def test_lower_priority_value_enters_first() -> None:
    queue = gate()
    await fill(queue)
    order = await admitted_order(
        queue, [request("late", priority=5), request("urgent", priority=-1), request("normal", priority=0)]
    )
    assert order == ["urgent", "normal", "late"]


async def test_tenants_share_by_token_work_not_by_arrival() -> None:
    """A tenant that queued first does not hold the engine: the other's request goes before its second."""
    queue = gate(slots=2)
    await fill(queue, "a", "b")  # both are inside already: neither is new to the engine
    flood = [request(f"a{i}", tenant="a") for i in range(3)]
    order = await admitted_order(queue, [*flood, request("b0", tenant="b")])
    assert order.index("b0") < order.index("a1")


async def test_a_waiter_that_goes_away_leaves_the_queue_and_takes_no_slot() -> None:
    queue = gate()
    await fill(queue)
    task = asyncio.create_task(queue.enter(request("gone")))
    await until(lambda: len(queue) == 1, "it to wait")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(queue) == 0 and queue.inside == 1
    queue.leave(1.0)
    assert queue.inside == 0  # nobody was handed the slot
    await queue.enter(request("next"))  # and the next enters at once
    assert queue.inside == 1


async def test_a_slot_handed_to_a_waiter_that_went_away_is_handed_on() -> None:
    queue = gate()
    await fill(queue)
    first = asyncio.create_task(queue.enter(request("first")))
    second = asyncio.create_task(queue.enter(request("second")))
    await until(lambda: len(queue) == 2, "both to wait")
    queue.leave(1.0)  # the slot goes to "first"...
    first.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    await second  # the slot went on to "second"
    assert queue.inside == 1 and len(queue) == 0


async def test_without_a_queue_a_full_engine_refuses_retryably() -> None:
    queue = gate(max_queue_length=0)
    await fill(queue, "t")
    with pytest.raises(TargetFailed) as err:
        await queue.enter(request("x", tenant="t"))
    e = err.value
    assert e.code == ServeCode.RESOURCE_EXHAUSTED and e.retryable and e.throttle is Throttle.OVERLOAD
    assert "max_in_flight" in e.message and e.retry_after_s is not None and e.retry_after_s >= 1
    assert queue.stats.refused[("t", "in_flight_full")] == 1


async def test_a_full_queue_refuses_retryably() -> None:
    queue = gate(max_queue_length=1)
    await fill(queue)
    waiter = asyncio.create_task(queue.enter(request("w")))
    await until(lambda: len(queue) == 1, "it to wait")
    with pytest.raises(TargetFailed) as err:
        await queue.enter(request("x"))
    assert err.value.retryable and err.value.throttle is Throttle.OVERLOAD and "queue is full" in err.value.message
    assert queue.stats.refused[("default", "queue_full")] == 1
    waiter.cancel()


async def test_a_request_that_cannot_start_within_the_limit_is_refused_at_once() -> None:
    """Requests inside take 10 s each on one slot: one waiting ahead means ~20 s, past a 15 s limit."""
    queue = gate(max_queue_seconds=15.0)
    await fill(queue)
    queue.leave(10.0)
    await queue.enter(request("running"))
    waiter = asyncio.create_task(queue.enter(request("w")))
    await until(lambda: len(queue) == 1, "it to wait")
    with pytest.raises(TargetFailed) as err:
        await queue.enter(request("x"))
    assert err.value.retryable and "1 requests wait ahead" in err.value.message
    assert err.value.retry_after_s == 15.0  # the estimate, capped at the limit
    assert queue.stats.refused[("default", "wait_too_long")] == 1
    waiter.cancel()


async def test_a_request_waits_at_most_max_queue_seconds_then_is_shed() -> None:
    queue = gate(max_queue_seconds=0.05)
    await fill(queue, "t")
    with pytest.raises(TargetFailed) as err:
        await queue.enter(request("x", tenant="t"))
    e = err.value
    assert e.code == ServeCode.RESOURCE_EXHAUSTED and e.throttle is Throttle.OVERLOAD and not e.retryable
    assert "max_queue_seconds" in e.message and e.retry_after_s is not None
    assert len(queue) == 0 and queue.stats.refused[("t", "queue_timeout")] == 1


async def test_a_request_whose_deadline_passes_while_waiting_gets_deadline_exceeded() -> None:
    queue = gate(max_queue_seconds=60.0)
    await fill(queue)
    with pytest.raises(TargetFailed) as err:
        await queue.enter(request("x", deadline=time.monotonic() + 0.05))
    assert err.value.code == ServeCode.DEADLINE_EXCEEDED and not err.value.retryable
    assert len(queue) == 0 and queue.stats.refused[("default", "deadline")] == 1


async def test_the_engine_is_fed_whenever_requests_wait() -> None:
    """Work-conserving: every freed slot goes to a waiter in the same step, until none waits."""
    queue = gate(slots=2)
    await fill(queue)
    tasks = [asyncio.create_task(queue.enter(request(f"w{i}"))) for i in range(3)]
    await until(lambda: len(queue) == 3, "all to wait")
    queue.leave(1.0)
    queue.leave(1.0)
    assert queue.inside == 2 and len(queue) == 1
    queue.leave(1.0)
    await asyncio.gather(*tasks)
    assert queue.inside == 2 and len(queue) == 0 and queue.stats.queued == 3


async def test_a_tenant_new_to_the_engine_starts_at_once_in_the_one_spare_slot() -> None:
    """The sparse-flow rule: a tenant with nothing inside and nothing waiting does not wait behind a busy tenant's
    queue; it takes the one slot above max_in_flight, and a second such tenant then waits, as the busy one's do."""
    queue = gate(slots=2)
    await fill(queue, "busy")
    busy = asyncio.create_task(queue.enter(request("busy-next", tenant="busy")))
    await until(lambda: len(queue) == 1, "the busy tenant's next request to wait")
    await queue.enter(request("quiet-0", tenant="quiet"))  # at once
    assert queue.inside == 3
    other = asyncio.create_task(queue.enter(request("other-0", tenant="other")))
    await until(lambda: len(queue) == 2, "the second new tenant to wait")
    queue.leave(1.0)  # back to max_in_flight: nobody enters
    assert queue.inside == 2 and len(queue) == 2
    queue.leave(1.0)
    queue.leave(1.0)
    await asyncio.gather(busy, other)  # then both, in the queue's order
    assert queue.inside == 2 and len(queue) == 0
