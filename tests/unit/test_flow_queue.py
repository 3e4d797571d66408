"""The node's waiting queue: priority first, then fair shares of token work across tenants, bounded and timed."""

from __future__ import annotations

import math
import random

import pytest

from p2pnode.flow.queue import MIN_TAGS, STALE_FACTOR, STALE_SLACK, TAG_SLACK, FairQueue, QueueFull


def drain(queue: FairQueue) -> list:
    out = []
    while (w := queue.pop()) is not None:
        out.append(w.item)
    return out


def test_one_tenant_one_priority_leaves_in_arrival_order_whatever_the_costs():
    rng = random.Random(7)
    queue: FairQueue[int] = FairQueue(100)
    for i in range(50):
        queue.push(i, "a", 0, rng.choice([0, 1, 500, 4000]), now=i)
    assert drain(queue) == list(range(50))


def test_better_priority_leaves_first_and_equal_priorities_keep_arrival_order():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("low-1", "a", 5, 10, now=0)
    queue.push("high-1", "b", -1, 10, now=1)
    queue.push("low-2", "a", 5, 10, now=2)
    queue.push("mid", "a", 0, 10, now=3)
    queue.push("high-2", "a", -1, 10, now=4)
    assert drain(queue) == ["high-1", "high-2", "mid", "low-1", "low-2"]


def test_backlogged_tenants_share_token_work_by_weight():
    """A tenant that queued 4x as much as another does not get 4x the service while both wait: each gets its
    weight's share of the work served, within one request's cost."""
    weights = {"gold": 3.0, "free": 1.0}
    queue: FairQueue[tuple[str, int]] = FairQueue(10_000, weights.__getitem__)
    for i in range(400):
        queue.push(("free", i), "free", 0, 100, now=0)
    for i in range(100):
        queue.push(("gold", i), "gold", 0, 100, now=0)
    served = {"gold": 0, "free": 0}
    for _ in range(100):  # while both are backlogged
        tenant, _ = queue.pop().item
        served[tenant] += 100
        assert abs(served["gold"] / 3.0 - served["free"] / 1.0) <= 100 / 3.0 + 100
    assert served["gold"] == 75 * 100 and served["free"] == 25 * 100


def test_a_tenant_that_was_idle_banks_no_credit():
    """Having sent nothing for a while does not let a tenant jump ahead of everyone's next requests."""
    queue: FairQueue[str] = FairQueue(100)
    for i in range(10):
        queue.push(f"busy-{i}", "busy", 0, 100, now=0)
    for _ in range(8):
        queue.pop()
    queue.push("quiet-0", "quiet", 0, 100, now=1)
    queue.push("quiet-1", "quiet", 0, 100, now=1)
    # The newcomer starts at the current virtual time (the start of the request served last): it is next, then it
    # alternates with the busy tenant; credit for its quiet spell would have put both of its requests first.
    assert drain(queue) == ["quiet-0", "busy-8", "quiet-1", "busy-9"]


def test_charged_work_served_elsewhere_moves_a_tenant_back():
    queue: FairQueue[str] = FairQueue(100)
    queue.charge("heavy", 1000)
    queue.push("heavy-0", "heavy", 0, 100, now=0)
    queue.push("light-0", "light", 0, 100, now=0)
    queue.push("light-1", "light", 0, 100, now=0)
    assert drain(queue) == ["light-0", "light-1", "heavy-0"]


def test_full_queue_refuses_and_removal_makes_room():
    queue: FairQueue[int] = FairQueue(2)
    first = queue.push(1, "a", 0, 1, now=0)
    queue.push(2, "a", 0, 1, now=0)
    with pytest.raises(QueueFull):
        queue.push(3, "a", 0, 1, now=0)
    assert queue.remove(first) and not queue.remove(first)
    queue.push(3, "a", 0, 1, now=0)
    assert drain(queue) == [2, 3] and len(queue) == 0


def test_a_cancelled_request_costs_its_tenant_nothing():
    queue: FairQueue[str] = FairQueue(100)
    queue.push("a-0", "a", 0, 100, now=0)
    cancelled = queue.push("a-big", "a", 0, 10_000, now=0)
    queue.remove(cancelled)
    queue.push("a-1", "a", 0, 100, now=0)
    queue.push("b-0", "b", 0, 100, now=0)
    assert drain(queue) == ["a-0", "b-0", "a-1"]


def test_a_request_that_expires_behind_others_of_its_tenant_costs_them_nothing():
    queue: FairQueue[str] = FairQueue(100)
    queue.push("a-0", "a", 0, 100, now=0, expires=1.0)
    queue.push("a-1", "a", 0, 100, now=0)
    queue.push("a-2", "a", 0, 100, now=0)
    queue.push("b-0", "b", 0, 100, now=0)
    queue.push("b-1", "b", 0, 100, now=0)
    assert [w.item for w in queue.pop_expired(1.0)] == ["a-0"]
    # a's later requests move up by a-0's work, as if it had never come: a and b alternate from the start
    assert drain(queue) == ["a-1", "b-0", "a-2", "b-1"]


def test_expired_requests_leave_at_their_limit_and_only_then():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("forever", "a", 0, 1, now=0)
    queue.push("short", "a", 0, 1, now=0, expires=5.0)
    popped = queue.push("soon-served", "b", 0, 1, now=0, expires=3.0)
    queue.push("long", "b", 0, 1, now=0, expires=9.0)
    assert queue.next_expiry() == 3.0
    assert queue.pop() is not None  # "forever" leaves first
    assert queue.pop() is popped  # served before its limit: it never expires
    assert queue.next_expiry() == 5.0
    assert queue.pop_expired(4.9) == []
    assert [w.item for w in queue.pop_expired(10.0)] == ["short", "long"]
    assert len(queue) == 0 and queue.next_expiry() == math.inf


def test_ahead_of_counts_what_a_new_request_would_wait_behind():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("high", "a", -1, 10, now=0)
    queue.push("normal", "a", 0, 20, now=0)
    queue.push("low", "a", 3, 40, now=0)
    assert queue.ahead_of(-1) == (1, 10)
    assert queue.ahead_of(0) == (2, 30)
    assert queue.ahead_of(9) == (3, 70)
    assert queue.waiting_by_tenant() == {"a": 3}


def test_per_tenant_tags_stay_bounded_under_a_flood_of_tenant_names():
    queue: FairQueue[int] = FairQueue(4)
    for i in range(3 * (TAG_SLACK * queue.max_length + MIN_TAGS)):  # three times the bound
        queue.charge(f"tenant-{i}", 10)
        waiting = queue.push(i, f"tenant-{i}", 0, 10, now=i)
        queue.remove(waiting) if i % 2 else queue.pop()
    assert len(queue._finish) <= TAG_SLACK * queue.max_length + MIN_TAGS


def test_requests_that_leave_a_band_never_served_do_not_pile_up_in_it():
    """A band below a busy one is never popped; requests that left it early (their clients gone) stayed in its heap
    and in every later removal's scan: 20,000 left 20,001 entries and made each removal ~1.4 ms. Its heaps now hold
    at most STALE_FACTOR times what waits (plus STALE_SLACK), and what leaves is still served in order."""
    queue: FairQueue[str] = FairQueue(100)
    queue.push("busy", "a", 0, 10, now=0.0)  # priority 0 always waits: band 5 is never the best
    kept = [queue.push(f"kept{i}", "b", 5, 10, now=0.0, expires=1e9) for i in range(2)]
    for i in range(20_000):
        gone = queue.push(f"gone{i}", "c", 5, 10, now=float(i), expires=1e9)
        assert queue.remove(gone)
    assert len(queue._bands[5]) <= STALE_FACTOR * 2 + STALE_SLACK
    assert len(queue._expiries) <= STALE_FACTOR * 3 + STALE_SLACK
    assert [w.item for w in kept] == ["kept0", "kept1"] and len(queue) == 3
    assert drain(queue) == ["busy", "kept0", "kept1"]


def test_each_priority_is_a_fair_queue_of_its_own():
    """One virtual time and one tag per tenant for every priority: a tenant's waiting normal work was charged to its
    urgent request (100 of another tenant's urgent requests left before it), and every urgent pop moved the normal
    priority's V, so a tenant arriving there queued behind another's whole backlog (10th instead of 1st)."""
    queue: FairQueue[str] = FairQueue(10_000)
    for i in range(10):
        queue.push(f"x{i}", "x", 0, 1000, now=0.0)
    for i in range(5):
        queue.push(f"y{i}", "y", -1, 100, now=0.0)
    queue.push("x-urgent", "x", -1, 100, now=0.0)
    ahead, n = 0, 5
    while queue.pop().item != "x-urgent":  # y keeps its urgent band backlogged
        ahead += 1
        queue.push(f"y{n}", "y", -1, 100, now=0.0)
        n += 1
    assert ahead <= 1  # its normal backlog does not count at the urgent priority

    queue2: FairQueue[str] = FairQueue(10_000)
    for i in range(10):
        queue2.push(f"x{i}", "x", 0, 1000, now=0.0)
    for i in range(100):  # urgent traffic of another tenant, served
        queue2.push(f"u{i}", "u", -1, 100, now=0.0)
        assert queue2.pop().item == f"u{i}"
    queue2.push("z", "z", 0, 1000, now=0.0)
    assert drain(queue2).index("z") <= 1  # z shares the normal priority with x from its arrival


def test_tags_and_virtual_times_of_client_chosen_priorities_stay_bounded():
    queue: FairQueue[int] = FairQueue(4)
    for i in range(3 * (TAG_SLACK * queue.max_length + MIN_TAGS)):
        waiting = queue.push(i, f"tenant-{i % 7}", i, 10, now=i)  # a new priority every time
        queue.remove(waiting) if i % 2 else queue.pop()
    assert len(queue._finish) <= TAG_SLACK * queue.max_length + MIN_TAGS
    assert len(queue._virtual) <= len(queue._finish) + len(queue)


def test_work_served_elsewhere_is_charged_at_the_default_priority_whatever_else_the_tenant_sent():
    """The charge went only to priorities where the tenant had a tag: one earlier urgent request (a tag at -1) took
    its default-priority requests here out of the mesh's share."""
    orders = []
    for urgent_first in (False, True):
        queue: FairQueue[str] = FairQueue(100)
        if urgent_first:
            queue.push("x-urgent", "x", -1, 100, now=0.0)
            assert queue.pop().item == "x-urgent"
        for i in range(5):
            queue.push(f"y{i}", "y", 0, 100, now=0.0)
        queue.charge("x", 1000)  # served elsewhere
        queue.push("x0", "x", 0, 100, now=0.0)
        orders.append(drain(queue))
    assert orders[0] == orders[1] and orders[0][-1] == "x0"


def test_tag_counts_stay_those_of_the_tags():
    rng = random.Random(9)
    queue: FairQueue[int] = FairQueue(16)
    waiting = []
    for i in range(2000):
        op = rng.random()
        if op < 0.5 and len(queue) < queue.max_length:
            waiting.append(queue.push(i, f"t{rng.randrange(40)}", rng.randrange(-2, 3), rng.randrange(1, 50), now=i))
        elif op < 0.7 and waiting:
            queue.remove(waiting.pop(rng.randrange(len(waiting))))
        elif op < 0.8:
            queue.charge(f"t{rng.randrange(40)}", rng.randrange(1, 200), max_lead=500)
        else:
            queue.pop()
        if i % 10:
            continue
        counts: dict[int, int] = {}
        for priority, _ in queue._finish:
            counts[priority] = counts.get(priority, 0) + 1
        assert counts == queue._tags_at
        assert {t: {p for p, u in queue._finish if u == t} for _, t in queue._finish} == queue._bands_of
