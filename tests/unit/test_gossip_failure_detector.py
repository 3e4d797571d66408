"""Phi-accrual failure detector and membership states (alive -> suspect -> dead -> forgotten, left, generations)."""

from __future__ import annotations

import pytest

from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.failure_detector import FailureDetector, SamplingWindow
from p2pnode.gossip.membership import Membership, MemberState, Transition


def test_phi_is_elapsed_over_mean_interval() -> None:
    w = SamplingWindow(size=10, initial_interval_s=2.0, max_interval_s=5.0, now=0.0)
    w.heartbeat(3.0)  # window: [2, 3]
    assert w.mean == pytest.approx(2.5)
    assert w.phi(3.0) == 0.0
    assert w.phi(4.0) == pytest.approx(1.0 / 2.5)
    w.heartbeat(10.0)  # 7 s > max_interval: dropped, but it is the new last arrival
    assert w.mean == pytest.approx(2.5)
    assert w.phi(12.0) == pytest.approx(2.0 / 2.5)


def test_window_is_bounded_and_forgets_the_initial_guess() -> None:
    w = SamplingWindow(size=3, initial_interval_s=10.0, max_interval_s=20.0, now=0.0)
    for t in (1.0, 2.0, 3.0):
        w.heartbeat(t)
    assert len(w) == 3 and w.mean == pytest.approx(1.0)


def test_a_heartbeat_seen_in_jumps_is_sampled_per_step() -> None:
    """A far observer sees a node's 1 s heartbeat two steps at a time, every 2 s: its rhythm is still 1 s, so a
    silence is judged against 1 s (counting each jump as one interval judged it against 2 s: deaths were declared
    twice as late there)."""
    fd = FailureDetector(window=100, initial_interval_s=1.0, max_interval_s=10.0)
    fd.heartbeat("far", 0.0, 10)
    for k in range(1, 20):
        fd.heartbeat("far", 2.0 * k, 10 + 2 * k)
    assert fd.mean_interval("far") == pytest.approx(1.0)
    assert fd.phi("far", 38.0 + 8.5) > 8  # dead 8.5 s after the last heartbeat seen, as for a near observer
    blind = FailureDetector(window=100, initial_interval_s=1.0, max_interval_s=10.0)
    for k in range(20):
        blind.heartbeat("far", 2.0 * k)  # the counter unknown: one sample per advance
    assert blind.mean_interval("far") == pytest.approx(1.95, abs=0.06)


def test_a_catch_up_is_not_taken_for_a_faster_rhythm() -> None:
    """A node first hears of a member through a stale relay, then from fresher ones: 4 steps of its 1 s heartbeat
    arrive in 1.8 s. Judged against that 0.45 s mean, a 2-s silence read as phi 4.4 (suspect); against the least
    mean a member beating once a round can have (0.75 of the round, as the membership passes it), 2.7."""
    membership = Membership("me", GossipConfig())
    fd = membership.fd
    assert fd.min_interval_s == pytest.approx(0.75 * GossipConfig().interval_s)
    fd.heartbeat("late", 0.0, 10)
    for t, count in ((0.3, 11), (0.7, 12), (1.2, 13), (1.8, 14)):
        fd.heartbeat("late", t, count)
    assert fd.mean_interval("late") == pytest.approx(0.45)
    assert fd.phi("late", 3.8) == pytest.approx(2.0 / 0.75)
    assert fd.phi("late", 3.8) < GossipConfig().suspect_phi
    raw = FailureDetector(window=100, initial_interval_s=2.0, max_interval_s=10.0)  # no floor: the mean as measured
    raw.heartbeat("late", 0.0, 10)
    for t, count in ((0.3, 11), (0.7, 12), (1.2, 13), (1.8, 14)):
        raw.heartbeat("late", t, count)
    assert raw.phi("late", 3.8) > GossipConfig().suspect_phi


def test_the_initial_guess_leaves_once_real_intervals_are_in() -> None:
    w = SamplingWindow(size=100, initial_interval_s=2.0, max_interval_s=10.0, now=0.0)
    for t in (1.0, 2.0, 3.0):
        w.heartbeat(t)
    assert w.mean == pytest.approx(5.0 / 4)  # the guess still counts
    w.heartbeat(4.0)
    assert len(w) == 4 and w.mean == pytest.approx(1.0)  # four real intervals: the guess is gone
    small = SamplingWindow(size=2, initial_interval_s=2.0, max_interval_s=10.0, now=0.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        small.heartbeat(t)
    assert len(small) == 2 and small.mean == pytest.approx(1.0)


def test_detector_tracks_nodes_independently() -> None:
    fd = FailureDetector(window=100, initial_interval_s=1.0, max_interval_s=10.0)
    assert fd.phi("a", 0.0) is None
    for t in range(10):
        fd.heartbeat("a", float(t))
        fd.heartbeat("b", float(t) / 2)
    assert fd.phi("a", 9.0) == 0.0
    assert fd.phi("b", 9.0) > 8  # b's rhythm is 0.5 s and it has been silent 4.5 s
    fd.remove("b")
    assert "b" not in fd and fd.phi("b", 9.0) is None


def beat(m: Membership, node: str, start: float, end: float, every: float = 1.0) -> list[Transition]:
    out = []
    t = start
    while t <= end:
        tr = m.on_heartbeat(node, t)
        if tr:
            out.append(tr)
        got, _ = m.update(t)
        out.extend(got)
        t += every
    return out


def test_a_silent_node_becomes_suspect_then_dead_then_forgotten() -> None:
    cfg = GossipConfig(cluster_secret=b"x" * 16, dead_node_grace_s=30.0)
    m = Membership("me", cfg)
    m.on_node("a", generation=1, now=0.0)
    beat(m, "a", 1.0, 60.0)
    assert m.state("a") is MemberState.ALIVE
    seen: dict[MemberState | None, float] = {}
    t = 60.0
    while t < 120.0 and m.state("a") is not None:
        t += 0.5
        for tr in m.update(t)[0]:
            seen.setdefault(tr.new, t)
    assert seen[MemberState.SUSPECT] == pytest.approx(64.5, abs=0.6)  # phi > 4 at a 1 s rhythm
    assert seen[MemberState.DEAD] == pytest.approx(68.5, abs=0.6)  # phi > 8: dead ~8 s after the last heartbeat
    assert seen[None] == pytest.approx(seen[MemberState.DEAD] + 30.0, abs=0.6)  # forgotten after the grace


def test_a_dead_node_whose_heartbeat_moves_again_is_alive_with_a_fresh_window() -> None:
    m = Membership("me", GossipConfig(cluster_secret=b"x" * 16))
    m.on_node("a", 1, 0.0)
    beat(m, "a", 1.0, 20.0)
    m.update(40.0)
    assert m.state("a") is MemberState.DEAD
    tr = m.on_heartbeat("a", 41.0)
    assert tr == Transition("a", MemberState.DEAD, MemberState.ALIVE)
    assert m.fd.mean_interval("a") == pytest.approx(GossipConfig().fd_initial_interval_s)


def test_left_is_final_for_a_generation_and_a_new_generation_starts_over() -> None:
    m = Membership("me", GossipConfig(cluster_secret=b"x" * 16, dead_node_grace_s=10.0))
    m.on_node("a", 1, 0.0)
    assert m.on_left("a", 1.0) == Transition("a", MemberState.ALIVE, MemberState.LEFT)
    assert m.on_heartbeat("a", 2.0) is None and m.state("a") is MemberState.LEFT
    assert m.update(5.0) == ([], [])  # left is not re-evaluated by phi
    assert m.on_node("a", 2, 6.0) == Transition("a", MemberState.LEFT, MemberState.ALIVE)
    m.on_left("a", 7.0)
    _, expired = m.update(17.0)
    assert expired == ["a"] and m.state("a") is None


def test_self_is_always_alive() -> None:
    m = Membership("me", GossipConfig(cluster_secret=b"x" * 16))
    assert m.on_left("me", 0.0) is None and m.on_heartbeat("me", 0.0) is None
    m.update(1000.0)
    assert m.state("me") is MemberState.ALIVE and m.phi("me", 1000.0) == 0.0


def test_this_nodes_own_stall_is_not_a_peers_silence() -> None:
    """Before: a node whose loop was held up 6 s judged every peer silent for 6 s (phi 6 of a 1 s rhythm: suspect),
    though their heartbeats were on time and only waited unread. Now the stall since a peer's last heartbeat is
    discounted; a silence outside the stall still counts in full."""
    fd = FailureDetector(window=100, initial_interval_s=1.0, max_interval_s=10.0)
    for t in range(10):
        fd.heartbeat("peer", float(t))
    fd.stalled(6.0)  # this node held up from 9 s to 15 s
    assert fd.phi("peer", 15.5) == pytest.approx(0.5)
    fd.heartbeat("peer", 16.0)
    mean = fd.mean_interval("peer")
    assert mean is not None
    assert fd.phi("peer", 20.0) == pytest.approx(4.0 / mean)  # a stall before the last heartbeat discounts nothing


def _silent_since_60() -> Membership:
    """A member heard every second until 60 s (heartbeat 60), then silent (dead ~8 s later on this node's phi alone)."""
    m = Membership("me", GossipConfig(cluster_secret=b"x" * 16))
    m.on_node("a", generation=1, now=0.0)
    beat(m, "a", 1.0, 60.0)
    return m


def test_a_suspect_member_is_dead_on_a_peers_verdict_for_its_life_at_the_next_evaluation() -> None:
    m = _silent_since_60()
    m.update(65.0)
    assert m.state("a") is MemberState.SUSPECT  # phi 5
    m.on_verdict("a", generation=2, heartbeat=60, known_heartbeat=60, now=65.0, until=75.0)  # another life's death
    assert m.update(65.2)[0] == []
    m.on_verdict("a", generation=1, heartbeat=60, known_heartbeat=60, now=65.5, until=75.5)
    assert m.state("a") is MemberState.SUSPECT  # held, not acted on: the evaluation judges phi net of local stalls
    assert m.update(65.6)[0] == [Transition("a", MemberState.SUSPECT, MemberState.DEAD, confirmed=True)]
    assert m.down_since("a") == 65.6  # ~3 s before its own phi would have said so
    assert m.on_heartbeat("a", 66.0, 61) == Transition("a", MemberState.DEAD, MemberState.ALIVE)  # back, as after any


def test_a_verdict_on_a_member_heard_lately_waits_for_its_suspicion_and_lapses() -> None:
    m = _silent_since_60()
    m.on_verdict("a", 1, heartbeat=60, known_heartbeat=60, now=62.0, until=72.0)
    assert m.update(62.0)[0] == []  # phi 2: this node heard it lately, not dead yet
    # it turns suspect while the verdict holds: dead at that evaluation, not at phi 8
    assert m.update(64.5)[0] == [Transition("a", MemberState.ALIVE, MemberState.DEAD, confirmed=True)]
    lapsed = _silent_since_60()
    lapsed.on_verdict("a", 1, heartbeat=60, known_heartbeat=60, now=62.0, until=64.0)  # held until 64
    assert lapsed.update(64.5)[0] == [Transition("a", MemberState.ALIVE, MemberState.SUSPECT)]
    assert lapsed.update(68.5)[0] == [Transition("a", MemberState.SUSPECT, MemberState.DEAD)]  # its own phi


def test_a_member_heard_beyond_the_verdicts_heartbeat_is_judged_on_its_own() -> None:
    m = _silent_since_60()
    # the message that brings the verdict moved the member's heartbeat past what the declarer heard: not held
    m.on_verdict("a", 1, heartbeat=59, known_heartbeat=60, now=62.0, until=80.0)
    assert m.update(64.5)[0] == [Transition("a", MemberState.ALIVE, MemberState.SUSPECT)]
    heard = _silent_since_60()
    heard.on_verdict("a", 1, heartbeat=60, known_heartbeat=60, now=62.0, until=80.0)
    heard.on_heartbeat("a", 63.0, 61)  # heard beyond it since: the verdict no longer speaks for it
    # the declarer's key changes for another member and still names this one: nothing is re-armed
    heard.on_verdict("a", 1, heartbeat=60, known_heartbeat=61, now=64.0, until=82.0)
    assert heard.update(68.0)[0] == [Transition("a", MemberState.ALIVE, MemberState.SUSPECT)]  # phi 5, not dead
    late = _silent_since_60()
    late.on_verdict("a", 1, heartbeat=60, known_heartbeat=59, now=62.0, until=80.0)  # the declarer heard more
    late.on_heartbeat("a", 62.5, 60)  # the heartbeat the declarer last heard reaches here late: still held
    assert late.update(67.0)[0] == [Transition("a", MemberState.ALIVE, MemberState.DEAD, confirmed=True)]


def test_a_held_verdict_is_not_rearmed_by_the_declarers_key_changing() -> None:
    m = _silent_since_60()
    m.on_verdict("a", 1, heartbeat=60, known_heartbeat=60, now=61.0, until=63.0)
    m.on_verdict("a", 1, heartbeat=60, known_heartbeat=60, now=62.0, until=64.0)  # the same verdict again
    assert m.update(64.5)[0] == [Transition("a", MemberState.ALIVE, MemberState.SUSPECT)]  # lapsed at 63
