"""Death verdicts (gossip/verdicts.py): the ``down`` key's encoding, and a survivor that suspects a killed member
following a peer's verdict instead of waiting for its own threshold, on whole agents in simulated time."""

from __future__ import annotations

import msgpack
import pytest

from p2pnode.gossip import GossipConfig, MemberState
from p2pnode.gossip.config import MAX_DEAD_VERDICTS
from p2pnode.gossip.keys import DOWN_KEY
from p2pnode.gossip.verdicts import OwnVerdicts, decode_verdicts, encode_verdicts
from tests.unit.test_gossip_cluster import SECRET, Mesh


def test_verdicts_round_trip_and_keep_the_newest() -> None:
    verdicts = [(f"n{i}", i, 2 * i) for i in range(MAX_DEAD_VERDICTS + 5)]
    assert decode_verdicts(encode_verdicts(verdicts)) == verdicts[-MAX_DEAD_VERDICTS:]


@pytest.mark.parametrize("value", [
    None, b"", b"\xc1", b"\xff\x00", msgpack.packb({"a": 1}), msgpack.packb("n1"),
    msgpack.packb([[f"n{i}", i, i] for i in range(MAX_DEAD_VERDICTS + 1)]),  # longer than any node writes
])
def test_a_value_that_is_no_verdict_list_names_nothing(value: bytes | None) -> None:
    assert decode_verdicts(value) == []


def test_malformed_entries_are_skipped_and_the_rest_kept() -> None:
    value = msgpack.packb([["a", 1, 1], ["b", 1], [1, 2, 2], ["", 3, 3], ["c", -1, 1], ["x" * 300, 4, 4],
                           ["d", "5", 5], ["f", 7, -1], ["g", 8, True], ["e", 6, 9]])
    assert decode_verdicts(value) == [("a", 1, 1), ("e", 6, 9)]


def test_own_verdicts_are_bounded_ordered_withdrawn_and_expire() -> None:
    own = OwnVerdicts(keep_s=10.0)
    for i in range(MAX_DEAD_VERDICTS + 3):
        own.declare(f"n{i}", 1, 10, now=float(i))
    assert len(own) == MAX_DEAD_VERDICTS
    own.declare("n5", 2, 3, now=40.0)  # a later life of a member whose verdict was dropped: the newest now
    assert decode_verdicts(own.value())[-1] == ("n5", 2, 3)
    assert own.withdraw("n34") and not own.withdraw("n34")  # heard again: no verdict on it any more
    assert own.expire(45.0) and decode_verdicts(own.value()) == [("n5", 2, 3)]
    assert not own.expire(46.0)


async def _kill_beside_a_quick_judge(verdict_rounds: int) -> tuple[Mesh, float, list[str]]:
    """Six agents, one of them ("quick") declaring deaths at phi 5 where the others wait for 8; a seventh is killed.
    Returns the mesh, the simulated seconds until every default-threshold survivor held it dead, and their ids."""
    mesh = Mesh(dead_verdict_rounds=verdict_rounds)
    agents = await mesh.add_many(6)
    await mesh.add("quick", config=GossipConfig(cluster_secret=SECRET, phi_threshold=5.0,
                                                dead_verdict_rounds=verdict_rounds))
    mesh.run_until(mesh.converged, limit=20.0)
    mesh.run(20.0)  # the failure detectors learn the rhythm
    victim = agents[-1]
    await victim.stop(leave=False)
    judged = [a for a in agents if a is not victim]
    took = mesh.run_until(lambda: all(a.membership.state(victim.self_id) is MemberState.DEAD for a in judged), 20.0)
    return mesh, took, [a.self_id for a in judged]


async def test_survivors_that_suspect_a_killed_member_follow_a_peers_verdict() -> None:
    mesh, took, judged = await _kill_beside_a_quick_judge(verdict_rounds=10)
    alone_mesh, alone, _ = await _kill_beside_a_quick_judge(verdict_rounds=0)
    # the quick judge's verdict (phi 5) reaches the others while they suspect (phi > 4): dead well before phi 8
    assert took <= alone - 1.5, (took, alone)
    assert sum(mesh.agents[n].stats.deaths_confirmed for n in judged) >= len(judged) - 1
    assert mesh.agents["quick"].state.self_node.get(DOWN_KEY)  # it published its own verdict
    followers = [mesh.agents[n] for n in judged if mesh.agents[n].stats.deaths_confirmed]
    relayed = [a for a in followers if "n5" in {v[0] for v in decode_verdicts(a.state.self_node.get(DOWN_KEY))}]
    assert followers and relayed  # a follower relays the verdict on the killed n5 (it suspected n5 itself)
    assert sum(alone_mesh.agents[n].stats.deaths_confirmed for n in judged) == 0
    assert alone_mesh.agents["quick"].state.self_node.get(DOWN_KEY) is None  # off: nothing published


async def test_a_mistaken_verdict_does_not_kill_a_member_the_others_hear() -> None:
    """A peer's ``down`` key names a member that is alive (a judge's mistake, or a lie): every node hears the member's
    heartbeat, none suspects it, so none follows the verdict."""
    mesh = Mesh()
    agents = await mesh.add_many(6)
    mesh.run_until(mesh.converged, limit=20.0)
    mesh.run(20.0)
    liar, member = agents[0], agents[-1]
    copy = liar.state.node(member.self_id)
    assert copy is not None
    liar.state.set(DOWN_KEY, encode_verdicts([(member.self_id, copy.generation, copy.heartbeat)]), mesh.clock.now())
    mesh.run(20.0)  # twice the verdict's 10 rounds
    assert all(liar.state.self_node.get(DOWN_KEY) == a.state.node(liar.self_id).get(DOWN_KEY) for a in agents)
    assert all(a.membership.state(member.self_id) is MemberState.ALIVE for a in agents if a is not member)
    assert all(a.stats.deaths_confirmed == 0 for a in agents)
