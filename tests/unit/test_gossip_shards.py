"""Digests cut into shards in a large mesh (digest.py, ``digest_max_members``) and loads published less often in
one (``load_updates_per_s``): what a shard's Syn names and asks for, and whole meshes in simulated time that
converge, spread loads and declare a death with them."""

from __future__ import annotations

import itertools

import msgpack
import pytest

from p2pnode.gossip import GossipConfig, MemberState
from p2pnode.gossip.codec import MAX_SHARDS, Ack, MalformedMessage, Syn, SynAck, decode, encode
from p2pnode.gossip.config import NEWCOMER_ROUNDS
from p2pnode.gossip.digest import FULL, NodeDigest, digest_shards, in_shard, make_digest
from p2pnode.gossip.exchange import make_syn, step
from p2pnode.gossip.keys import DOWN_KEY
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LOAD_KEY, NodeLoad
from p2pnode.v1 import peer_pb2
from tests.unit.test_gossip_cluster import Mesh

BIG = 1 << 20


def knowing(self_id: str, others: list[str]) -> ClusterState:
    """A state of ``self_id`` holding a copy (one entry) of each of ``others``."""
    state = ClusterState(self_id, generation=1)
    state.set("k", b"v", 0.0)
    for node_id in others:
        node = state.reset_node(node_id, 1, 0, 0.0, "")
        state.put(node, "k", 1, b"v", 0.0)
        node.max_version = 1
    return state


def test_shard_counts_keep_each_digest_within_its_bound() -> None:
    assert digest_shards(400, 400) == 1
    assert digest_shards(401, 400) == 2
    assert digest_shards(1000, 400) == 3
    assert digest_shards(10_000, 0) == 1  # 0: never cut


def test_the_shards_of_a_membership_name_every_member_once_and_always_both_ends() -> None:
    ids = [f"node-{i}" for i in range(200)]
    state = knowing("me", ids)
    shards = 4
    named = [{d.node_id for d in make_digest(state, (i, shards), {"node-7"})} for i in range(shards)]
    for digest in named:
        assert {"me", "node-7"} <= digest
        assert len(digest) < 200 / shards * 1.5  # a crc32 spreads 200 ids evenly enough
    rest = [digest - {"me", "node-7"} for digest in named]
    assert set().union(*rest) | {"me", "node-7"} == {"me", *ids}
    assert sum(len(r) for r in rest) == len(set().union(*rest))  # disjoint
    assert {d.node_id for d in make_digest(state)} == {"me", *ids}


def test_a_syn_of_a_shard_round_trips_and_a_bad_shard_is_refused_naming_it() -> None:
    syn = Syn((NodeDigest("a", 1, 2, 3, 0),), (2, 3))
    assert decode(encode(syn), BIG) == syn
    whole = Syn((NodeDigest("a", 1, 2, 3, 0),))
    assert decode(encode(whole), BIG) == whole and len(encode(whole)) < len(encode(syn))  # the old layout
    for shard in ([3, 3], [0, 0], [-1, 2], [0, MAX_SHARDS + 1], ["0", 2], [0, 2, 1], 5):
        data = msgpack.packb([2, 0, 0, ["a", 1, 2, 3, 0], shard])
        with pytest.raises(MalformedMessage, match="shard"):
            decode(data, BIG)


def test_a_shard_syn_gets_what_its_shard_lacks_and_nothing_of_the_other_shards() -> None:
    """The responder sends every member of the Syn's shard the initiator does not name (unknown to it: a reset),
    and leaves the other shards alone: they are not "unknown" for being left out."""
    ids = [f"m{i}" for i in range(60)]
    responder = knowing("b", ids)
    initiator = knowing("a", ["b"])  # knows only the responder
    shard = (1, 3)
    reply = step(responder, decode(encode(make_syn(initiator, shard, {"b"})), BIG), 0.0, BIG).reply
    assert isinstance(reply, SynAck)
    sent = {nd.node_id for nd in reply.delta}
    assert sent == {i for i in ids if in_shard(i, shard)} and all(nd.reset for nd in reply.delta)
    # an initiator that knows everything asks nothing and gets nothing, whichever shard it sends
    full = knowing("a", ["b", *ids])
    for index in range(3):
        reply = step(responder, decode(encode(make_syn(full, (index, 3), {"b"})), BIG), 0.0, BIG).reply
        assert isinstance(reply, SynAck) and reply.delta == ()
    # the whole digest, as before: every member the initiator lacks
    reply = step(knowing("b", ids), decode(encode(make_syn(initiator, FULL)), BIG), 0.0, BIG).reply
    assert {nd.node_id for nd in reply.delta} == set(ids)


def syn_sizes(mesh: Mesh) -> list[int]:
    """Digest lengths of every Syn the mesh sends from now on (filled as it runs)."""
    sizes: list[int] = []

    def tap(src: str, dst: str, data: bytes) -> None:
        message = decode(peer_pb2.GossipEnvelope.FromString(data).payload, BIG)
        if isinstance(message, Syn):
            sizes.append(len(message.digest))

    mesh.net.tap = tap
    return sizes


async def test_a_mesh_larger_than_a_digest_converges_spreads_loads_and_declares_a_death() -> None:
    """30 members, at most 8 a digest: 4 shards; each Syn also names its sender and receiver and the 2 members heard
    longest ago (without those, a live member went unheard long enough here and there to be suspected), and for a
    while the members new to its sender."""
    mesh = Mesh(digest_max_members=8, digest_stalest_members=2, load_updates_per_s=10.0, dead_node_grace_s=60.0)
    agents = await mesh.add_many(30)
    for i, agent in enumerate(agents):
        mesh.loads[agent.self_id].set(NodeLoad(running=i, waiting=0, kv_usage=0.5))
    mesh.run_until(mesh.converged, limit=40.0)
    mesh.run(NEWCOMER_ROUNDS)  # while members are new here, Syns name them whatever their shard
    sizes = syn_sizes(mesh)
    mesh.run(60.0)
    largest_shard = max(sum(in_shard(f"n{i}", (s, 4)) for i in range(30)) for s in range(4))
    assert sizes and max(sizes) <= largest_shard + 2 + 2 < 30
    assert max(a.stats.established_phi_max_milli for a in agents) < 1000 * GossipConfig().suspect_phi  # none suspected
    view = mesh.view(agents[0])
    assert {p.node_id for p in view.usable_peers()} == {f"n{i}" for i in range(30)}
    assert view.peer("n17").load.running == 17
    victim = agents[11]
    await victim.stop(leave=False)
    others = [a for a in agents if a is not victim]
    took = mesh.run_until(lambda: all(a.membership.state("n11") is MemberState.DEAD for a in others), limit=30.0)
    assert took < 15.0
    assert all(a.membership.state(b.self_id) is MemberState.ALIVE for a in others for b in others)


async def test_in_a_large_mesh_a_node_publishes_its_load_every_few_rounds_and_peers_follow() -> None:
    """30 members, at most 10 load updates a second for a node to hear: each member publishes every 3rd round."""
    mesh = Mesh(load_updates_per_s=10.0)
    agents = await mesh.add_many(30)
    node = agents[4]
    mesh.loads[node.self_id].set(NodeLoad(running=0, waiting=0, kv_usage=0.1))
    mesh.run_until(mesh.converged, limit=30.0)
    seen: list[int] = []
    versions = []
    for second in range(12):
        mesh.loads[node.self_id].set(NodeLoad(running=second, waiting=0, kv_usage=0.1))
        mesh.run(1.0)
        versions.append(node.state.self_node.versioned(LOAD_KEY).version)
        peer = mesh.view(agents[20]).peer(node.self_id)
        seen.append(peer.load.running)
    changed = [second for second in range(1, 12) if versions[second] != versions[second - 1]]
    assert len(changed) >= 3 and {b - a for a, b in itertools.pairwise(changed)} == {3}  # one publish in 3 rounds
    assert seen[-1] >= 12 - 1 - 3 - 2  # at most a few rounds behind: a publish every 3, then gossip's delay
    assert seen == sorted(seen)  # never an older load after a newer one


async def test_a_mesh_within_the_budget_publishes_loads_every_round_with_whole_digests() -> None:
    mesh = Mesh()  # defaults: 400 members a digest, 400 load updates a second
    agents = await mesh.add_many(12)
    mesh.run_until(mesh.converged, limit=20.0)
    sizes = syn_sizes(mesh)
    node = agents[3]
    versions = []
    for second in range(6):
        mesh.loads[node.self_id].set(NodeLoad(running=second, waiting=0, kv_usage=0.1))
        mesh.run(1.0)
        versions.append(node.state.self_node.versioned(LOAD_KEY).version)
    assert len(set(versions)) == 6
    assert sizes and min(sizes) == 12  # every Syn names the whole membership


async def test_a_death_declared_is_pushed_at_once_and_its_declarer_named_in_every_shard() -> None:
    """The first survivor to declare a killed member dead pushes its ``down`` key to its peers at once (an Ack from
    it carrying the key, sent at the moment it wrote it); the survivors holding its verdict name it in their Syns
    whatever the shard, so its verdict spreads as fast as with whole digests."""
    mesh = Mesh(digest_max_members=8, digest_stalest_members=0)
    agents = await mesh.add_many(30)
    mesh.run_until(mesh.converged, limit=40.0)
    mesh.run(20.0)
    sent: list[tuple[float, str, object]] = []
    mesh.net.tap = lambda src, dst, data: sent.append(
        (mesh.clock.now(), src.split(":")[0], decode(peer_pb2.GossipEnvelope.FromString(data).payload, BIG))
    )
    victim = agents[11]
    await victim.stop(leave=False)
    survivors = [a for a in agents if a is not victim]
    mesh.run_until(lambda: any(a.state.self_node.get(DOWN_KEY) for a in survivors), limit=20.0, every=0.05)
    declarer = next(a for a in survivors if a.state.self_node.get(DOWN_KEY))
    written = declarer.state.self_node.versioned(DOWN_KEY)
    pushes = [m for t, src, m in sent if src == declarer.self_id and isinstance(m, Ack)
              and any(key == DOWN_KEY for nd in m.delta for key, _, _ in nd.entries)]
    assert len(pushes) >= 3 and written is not None
    first = len(sent)
    mesh.run(3.0)
    shards = digest_shards(30, 8)  # the round's Syns (a stale probe's shard is of about one member: agent.py)
    naming = [m for _, src, m in sent[first:] if isinstance(m, Syn) and src not in (declarer.self_id, victim.self_id)
              and m.shard[1] == shards and not in_shard(declarer.self_id, m.shard)]
    assert naming and sum(declarer.self_id in {d.node_id for d in m.digest} for m in naming) > len(naming) / 2
