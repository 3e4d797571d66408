"""Stale probes (agent._probe_stale, config ``stale_probe_phi``): a live member this node has not heard for a while
is asked directly, with a Syn that names little but it, instead of waiting for a relay to bring its heartbeat."""

from __future__ import annotations

from p2pnode.gossip import GossipAgent, GossipConfig, MemberState
from p2pnode.gossip.codec import Syn, decode
from p2pnode.gossip.config import MAX_UNANSWERED_PROBES, NEWCOMER_ROUNDS
from p2pnode.gossip.membership import Membership
from p2pnode.v1 import peer_pb2
from tests.unit.test_gossip_cluster import Mesh

BIG = 1 << 20


async def sharded_mesh(**config: object) -> tuple[Mesh, list[GossipAgent]]:
    """30 members in 4 digest shards, no stalest members named (``digest_stalest_members`` 0), past the join: a
    member's heartbeat moves on only in the exchanges of its shard, a quarter of them."""
    mesh = Mesh(digest_max_members=8, digest_stalest_members=0, **config)
    agents = await mesh.add_many(30)
    mesh.run_until(mesh.converged, limit=40.0)
    mesh.run(NEWCOMER_ROUNDS)  # while members are new here, Syns name them whatever their shard
    for agent in agents:
        agent.stats.established_phi_max_milli = 0
    return mesh, agents


async def test_a_member_unheard_for_a_while_is_asked_directly_and_no_live_member_is_suspected() -> None:
    mesh, agents = await sharded_mesh()
    probes: list[tuple[str, Syn]] = []

    def tap(src: str, dst: str, data: bytes) -> None:
        message = decode(peer_pb2.GossipEnvelope.FromString(data).payload, BIG)
        if isinstance(message, Syn) and message.shard[1] > 4:  # not one of the round's shards
            probes.append((dst.split(":")[0], message))

    mesh.net.tap = tap
    before = sum(a.stats.stale_probes for a in agents)
    mesh.run(30.0)  # the window in which the same mesh without probes suspects a live member (next test)
    assert max(a.stats.established_phi_max_milli for a in agents) < 1000 * GossipConfig().suspect_phi
    assert all(a.membership.state(b.self_id) is MemberState.ALIVE for a in agents for b in agents)
    assert len(probes) == sum(a.stats.stale_probes for a in agents) - before > 0
    # each names about nothing but its receiver (and its sender, as every Syn does)
    assert all(len(syn.digest) <= 4 and receiver in {d.node_id for d in syn.digest} for receiver, syn in probes)


async def test_without_the_probes_a_live_member_is_suspected_in_the_same_mesh() -> None:
    """The mesh above with ``stale_probe_phi`` 0 (the gossip before the probes): the scene does starve nodes."""
    mesh, agents = await sharded_mesh(stale_probe_phi=0.0)
    mesh.run(30.0)
    assert max(a.stats.established_phi_max_milli for a in agents) >= 1000 * GossipConfig().suspect_phi
    assert sum(a.stats.stale_probes for a in agents) == 0


async def test_a_dead_member_is_probed_in_vain_and_still_declared_dead_in_time() -> None:
    mesh = Mesh(digest_max_members=8, digest_stalest_members=0)
    agents = await mesh.add_many(30)
    mesh.run_until(mesh.converged, limit=40.0)
    mesh.run(NEWCOMER_ROUNDS)
    await agents[11].stop(leave=False)
    others = [a for a in agents if a is not agents[11]]
    took = mesh.run_until(lambda: all(a.membership.state("n11") is MemberState.DEAD for a in others), limit=30.0)
    assert took < 12.0
    assert sum(a.stats.stale_probes for a in others) > 0
    assert all(a.membership.state(b.self_id) is MemberState.ALIVE for a in others for b in others)


def test_members_that_answered_are_probed_first_and_the_others_at_most_twice_a_round() -> None:
    """Of 12 silent members, 4 answered this node and 8 only had their heartbeat relayed (made up, maybe, by a
    secret holder at anyone's address): a round asks the 4 and 2 of the 8, the silent longest first; a member heard
    lately is not asked."""
    membership = Membership("me", GossipConfig())
    for i in range(13):
        membership.on_node(f"m{i}", 1, 0.0)
        membership.on_heartbeat(f"m{i}", 1.0 + i * 0.01)  # proven: seen advancing
    for i in range(4):
        membership.mark_reachable(f"m{i}")
    membership.on_heartbeat("m12", 4.5)  # heard lately
    stale = membership.stale_members(4.6, GossipConfig().stale_probe_phi, GossipConfig().max_stale_probes)
    assert stale == ["m0", "m1", "m2", "m3", "m4", "m5"]
    assert len([n for n in stale if not membership.reachable(n)]) == MAX_UNANSWERED_PROBES == 2
    assert membership.stale_members(4.6, 0.0, 8) == []  # 0: never
