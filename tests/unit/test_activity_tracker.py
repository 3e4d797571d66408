"""The calls a node counts as in progress (``serving/local.py``'s ActivityTracker): what its drain waits for and its
in-flight bound reads."""

from __future__ import annotations

from p2pnode.serving.local import ActivityTracker


async def test_a_call_id_begun_twice_keeps_the_node_busy_until_both_ended() -> None:
    """Two HTTP calls under one client-chosen id can both pass the running-id check (the check and the call's start
    are a loop turn apart there). The first to end took the key out: the node counted one call less than it served,
    and a drain could stop the node with the second still streaming."""
    tracker = ActivityTracker()
    tracker.begin("dup")
    tracker.begin("dup")
    tracker.begin("other")
    assert len(tracker) == 3
    tracker.end("dup")
    assert len(tracker) == 2 and "dup" in tracker and not tracker.idle.is_set()
    tracker.end("other")
    assert not tracker.idle.is_set()  # the second "dup" still runs
    tracker.end("dup")
    assert len(tracker) == 0 and tracker.idle.is_set()
    tracker.end("dup")  # a stray end changes nothing
    assert len(tracker) == 0 and tracker.idle.is_set()
