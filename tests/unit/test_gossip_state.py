"""Replicated state, digests and deltas: versions, tombstones and their GC, generations, budgeted gap-free deltas,
and (hypothesis) convergence under any interleaving, loss, duplication and reordering of exchanges."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.gossip.codec import Ack, Message, Syn, SynAck, decode, encode
from p2pnode.gossip.delta import NodeDelta, apply_delta, compute_delta, delta_size, suffix_delta
from p2pnode.gossip.digest import FULL, NodeDigest, make_digest, observe_digest, reply_digest
from p2pnode.gossip.exchange import make_syn, step
from p2pnode.gossip.state import ClusterState

BIG = 1 << 20


def digest_map(state: ClusterState) -> dict[str, NodeDigest]:
    return {d.node_id: d for d in make_digest(state)}


def sync(a: ClusterState, b: ClusterState, now: float = 0.0, budget: int = BIG) -> None:
    """One complete exchange a -> b, through the wire encoding."""
    synack = step(b, decode(encode(make_syn(a)), BIG), now, budget).reply
    assert synack is not None
    ack = step(a, decode(encode(synack), BIG), now, budget).reply
    if ack is not None:
        step(b, decode(encode(ack), BIG), now, budget)


def live(state: ClusterState, owner: str) -> dict[str, bytes]:
    node = state.node(owner)
    return {} if node is None else dict(node.items())


# --- state ---------------------------------------------------------------------------------------------------


def test_owner_writes_take_consecutive_versions_and_noops_take_none() -> None:
    s = ClusterState("a", generation=1)
    assert s.set("k", b"1", 0.0)
    assert not s.set("k", b"1", 0.0)  # same value: no version
    assert s.set("k", b"2", 0.0)
    assert s.delete("k", 0.0)
    assert not s.delete("k", 0.0)
    assert not s.delete("missing", 0.0)
    me = s.self_node
    assert me.max_version == 3
    assert me.get("k") is None and me.versioned("k").version == 3  # a tombstone
    assert me.entries_after(0) == [("k", 3, None)]


def test_tombstones_are_collected_after_the_grace_and_raise_last_gc_version() -> None:
    s = ClusterState("a", generation=1)
    s.set("x", b"1", 0.0)
    s.set("y", b"1", 0.0)
    s.delete("x", 1.0)
    s.delete("y", 5.0)
    assert s.gc_tombstones(now=3.0, grace_s=1.0) == 1
    assert s.self_node.last_gc_version == 3 and len(s.self_node) == 1
    assert s.gc_tombstones(now=100.0, grace_s=1.0) == 1
    assert s.self_node.last_gc_version == 4 and len(s.self_node) == 0
    assert s.self_node.max_version == 4  # max_version survives the collection of its entry


def test_entries_after_walks_back_from_the_end_in_version_order() -> None:
    s = ClusterState("a", generation=1)
    for i in range(200):
        s.set(f"k{i % 50}", str(i).encode(), 0.0)
    entries = s.self_node.entries_after(190)
    assert [v for _, v, _ in entries] == list(range(191, 201))
    assert [v for _, v, _ in s.self_node.entries_after(0)] == list(range(151, 201))


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_node_added(self, node_id: str, generation: int) -> None:
        self.events.append(("added", node_id, generation))

    def on_node_removed(self, node_id: str) -> None:
        self.events.append(("removed", node_id))

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        self.events.append(("key", node_id, key, value))


def test_listener_sees_nodes_and_key_changes() -> None:
    a, b = ClusterState("a", 1), ClusterState("b", 1)
    rec = Recorder()
    b.listener = rec
    a.set("k", b"v", 0.0)
    sync(b, a)
    assert rec.events == [("added", "a", 1), ("key", "a", "k", b"v")]
    a.delete("k", 0.0)
    sync(b, a)
    assert rec.events[-1] == ("key", "a", "k", None)


# --- digests -------------------------------------------------------------------------------------------------


def test_reply_digest_lists_only_what_the_initiator_can_use() -> None:
    a, b = ClusterState("a", 1), ClusterState("b", 1)
    a.set("k", b"v", 0.0)
    b.set("k", b"v", 0.0)
    sync(a, b)
    # now both know both; a learns something new about itself, b's heartbeat of b moves on
    a.set("k2", b"v", 0.0)
    b.bump_heartbeat(0.0)
    entries = {d.node_id: d for d in reply_digest(b, make_digest(a))}
    assert set(entries) == {"a", "b"}  # a is ahead on a; b has a newer heartbeat of b
    assert entries["a"].max_version == 1
    unknown = reply_digest(ClusterState("c", 1), make_digest(a))
    assert {(d.node_id, d.generation) for d in unknown} == {("a", 0), ("b", 0)}


def test_observe_digest_moves_heartbeats_forward_within_a_generation_only() -> None:
    a, b = ClusterState("a", 1), ClusterState("b", 1)
    sync(a, b)
    assert b.node("a").heartbeat == 0
    a.bump_heartbeat(0.0)
    a.bump_heartbeat(0.0)
    assert observe_digest(b, make_digest(a), 5.0) == ["a"]
    assert b.node("a").heartbeat == 2 and b.node("a").fresh_at == 5.0
    assert observe_digest(b, make_digest(a), 6.0) == []
    restarted = ClusterState("a", 2)
    for _ in range(10):
        restarted.bump_heartbeat(0.0)
    assert observe_digest(b, make_digest(restarted), 7.0) == []  # another life: only a delta may replace it


# --- deltas --------------------------------------------------------------------------------------------------


def test_budgeted_deltas_never_leave_gaps_and_finish_over_several_exchanges() -> None:
    owner = ClusterState("a", 1)
    for i in range(500):
        owner.set(f"key-{i % 300:04d}", b"x" * (i % 17), 0.0)
    peer = ClusterState("b", 1)
    exchanges = 0
    while live(peer, "a") != live(owner, "a") or peer.node("a").max_version != owner.self_node.max_version:
        delta = compute_delta(owner, digest_map(peer), budget=1024, complete=True)
        assert delta_size(delta, 1) <= 1024
        assert len(encode(Ack(tuple(delta), 1))) <= 1024 + 16
        for nd in delta:
            versions = [v for _, v, _ in nd.entries]
            assert versions == sorted(versions) and all(nd.from_version < v <= nd.to_version for v in versions)
            # all of the owner's entries in (from, to] are there: nothing skipped inside the range
            assert [e[1] for e in owner.node(nd.node_id).entries_after(nd.from_version) if e[1] <= nd.to_version] == [
                v for v in versions
            ]
        apply_delta(peer, decode(encode(Ack(tuple(delta))), BIG).delta, 0.0)
        if peer.node("a") is not None:
            node = peer.node("a")
            # the copy is always the owner's state restricted to versions <= max_version
            expected = {
                k: v for k, v in owner.self_node.items() if owner.self_node.versioned(k).version <= node.max_version
            }
            assert live(peer, "a") == expected
        exchanges += 1
        assert exchanges < 50
    assert exchanges > 3


def test_a_delta_that_would_leave_a_gap_is_dropped() -> None:
    owner, peer = ClusterState("a", 1), ClusterState("b", 1)
    owner.set("k1", b"1", 0.0)
    sync(peer, owner)
    owner.set("k2", b"2", 0.0)  # version 2
    owner.set("k3", b"3", 0.0)  # version 3
    late = NodeDelta("a", 1, 0, 2, 3, 0, False, (("k3", 3, b"3"),))  # starts after version 2, peer has 1
    result = apply_delta(peer, [late], 0.0)
    assert result.gaps == 1 and live(peer, "a") == {"k1": b"1"}


def test_peer_behind_a_collected_tombstone_gets_a_reset() -> None:
    owner, peer = ClusterState("a", 1), ClusterState("b", 1)
    owner.set("gone", b"1", 0.0)
    owner.set("kept", b"1", 0.0)
    sync(peer, owner)
    assert live(peer, "a") == {"gone": b"1", "kept": b"1"}
    owner.delete("gone", 1.0)
    owner.gc_tombstones(now=100.0, grace_s=10.0)  # the tombstone is gone before the peer heard of it
    delta = compute_delta(owner, digest_map(peer), BIG, complete=True)
    assert [nd.reset for nd in delta if nd.node_id == "a"] == [True]
    apply_delta(peer, delta, 0.0)
    assert live(peer, "a") == {"kept": b"1"}
    assert peer.node("a").last_gc_version == owner.self_node.last_gc_version


def test_a_late_reset_does_not_roll_a_newer_copy_back() -> None:
    owner, peer = ClusterState("a", 1), ClusterState("b", 1)
    owner.set("k", b"1", 0.0)
    stale_reset = compute_delta(owner, digest_map(peer), BIG, complete=True)
    owner.set("k", b"2", 0.0)
    sync(peer, owner)
    apply_delta(peer, stale_reset, 0.0)
    assert live(peer, "a") == {"k": b"2"}


def test_a_higher_generation_replaces_the_old_state_and_a_lower_one_is_ignored() -> None:
    old, peer = ClusterState("a", 1), ClusterState("b", 1)
    old.set("old-only", b"1", 0.0)
    old.set("shared", b"old", 0.0)
    sync(peer, old)
    new = ClusterState("a", 2)
    new.set("shared", b"new", 0.0)
    sync(new, peer)
    assert peer.node("a").generation == 2 and live(peer, "a") == {"shared": b"new"}
    old_a = [nd for nd in compute_delta(old, {}, BIG, complete=True) if nd.node_id == "a"]
    result = apply_delta(peer, old_a, 0.0)
    assert result.stale == 1 and live(peer, "a") == {"shared": b"new"}


def test_forgotten_nodes_do_not_come_back_with_the_same_state() -> None:
    a, b, c = ClusterState("a", 1), ClusterState("b", 1), ClusterState("c", 1)
    c.set("k", b"v", 0.0)
    sync(a, c)
    sync(b, c)
    a.forget("c", now=0.0, remember_s=100.0)
    sync(a, b)  # b still gossips c's old state
    assert a.node("c") is None
    c.bump_heartbeat(0.0)  # c is actually alive: a newer heartbeat is accepted
    sync(a, c)
    assert a.node("c") is not None
    a.forget("c", 0.0, 100.0)
    a.expire_forgotten(now=200.0)
    sync(a, b)
    assert a.node("c") is not None


def test_suffix_delta_pushes_the_newest_entries_to_up_to_date_peers() -> None:
    owner, peer = ClusterState("a", 1), ClusterState("b", 1)
    for i in range(100):
        owner.set(f"k{i}", b"v" * 50, 0.0)
    sync(peer, owner)
    owner.set("status", b"left", 0.0)
    push = suffix_delta(owner.self_node, budget=600)
    assert push is not None and push.entries[-1][0] == "status" and push.to_version == 101
    assert delta_size([push], 1) <= 600
    apply_delta(peer, [push], 0.0)
    assert peer.node("a").get("status") == b"left"
    behind = ClusterState("c", 1)
    assert apply_delta(behind, [push], 0.0).gaps == 1  # a node that never saw a: nothing applied


# --- property: any interleaving converges, and copies never have gaps --------------------------------------------


@dataclass
class World:
    nodes: list[ClusterState]
    #: owner -> key -> (version, value or None): every owner's latest write per key (deletes included).
    model: dict[str, dict[str, tuple[int, bytes | None]]]
    in_flight: list[tuple[int, int, bytes]] = field(default_factory=list)  # (src, dst, encoded message)
    now: float = 0.0

    def check_no_gaps(self) -> None:
        for b in self.nodes:
            for owner_id, node in b.nodes.items():
                owner = self.owner(owner_id)
                if node.generation != owner.self_node.generation:
                    continue
                for key, (version, value) in self.model[owner_id].items():
                    if version <= node.max_version:
                        assert node.get(key) == value, (b.self_id, owner_id, key)

    def owner(self, node_id: str) -> ClusterState:
        return self.nodes[int(node_id[1:])]


# One op = (selector, i, j, k, blob); the selector's ranges weight the kinds: mostly writes and exchange steps,
# sometimes loss, duplication, tombstone GC and restarts.
ops = st.lists(
    st.tuples(st.integers(0, 99), st.integers(0, 3), st.integers(0, 3), st.integers(0, 60), st.binary(max_size=40)),
    min_size=10,
    max_size=200,
)


def run_ops(world: World, program: list[tuple], rng: random.Random) -> None:
    for selector, i, j, k, blob in program:
        world.now += 1.0
        if selector < 30:  # a write (a delete when the blob is empty and k is even)
            node = world.nodes[i]
            key = f"key{k % 7}"
            value = None if not blob and k % 2 == 0 else blob
            changed = node.set(key, value, world.now) if value is not None else node.delete(key, world.now)
            if changed:
                world.model[node.self_id][key] = (node.self_node.max_version, value)
        elif selector < 45:  # i starts an exchange with j, with its whole digest or one of two shards (digest.py)
            if i != j:
                shard = FULL if selector < 35 else (k % 2, 2)
                world.in_flight.append((i, j, encode(make_syn(world.nodes[i], shard, {f"n{j}"}))))
        elif selector < 85:  # deliver an in-flight message (any of them: reordering), with a small budget
            if world.in_flight:
                src, dst, data = world.in_flight.pop(k % len(world.in_flight))
                budget = 200 + 40 * len(blob)
                reply = step(world.nodes[dst], decode(data, BIG), world.now, budget, rng).reply
                if reply is not None:
                    encoded = encode(reply)
                    assert len(encoded) <= budget or isinstance(reply, SynAck)  # a SynAck's digest is not budgeted
                    world.in_flight.append((dst, src, encoded))
        elif selector < 88:
            if world.in_flight:
                world.in_flight.append(world.in_flight[k % len(world.in_flight)])
        elif selector < 92:
            if world.in_flight:
                world.in_flight.pop(k % len(world.in_flight))
        elif selector < 98:
            world.nodes[i].gc_tombstones(world.now, float(k))
        else:
            old = world.nodes[i]
            world.nodes[i] = ClusterState(old.self_id, old.self_node.generation + 1)
            world.model[old.self_id] = {}
        world.check_no_gaps()


def settle(world: World, rng: random.Random, shards: int = 1) -> None:
    """Lossless exchanges between every pair until nothing changes (bounded), each pair once per shard."""
    for _ in range(20):
        before = [{o: (n.generation, n.max_version) for o, n in s.nodes.items()} for s in world.nodes]
        for a, b, index in itertools.product(world.nodes, world.nodes, range(shards)):
            if a is not b:
                msg: Message | None = make_syn(a, (index, shards), {b.self_id})
                here, there = b, a
                while msg is not None:
                    msg = step(here, decode(encode(msg), BIG), world.now, 4096, rng).reply
                    here, there = there, here
        after = [{o: (n.generation, n.max_version) for o, n in s.nodes.items()} for s in world.nodes]
        if before == after:
            return
    raise AssertionError("did not settle")


#: Lives whose offsets from one another take every size a message may give them (codec.py), 1 to 9 bytes, and one
#: past 2**63 (its node sends generations as they are: ``delta.message_base``).
LIVES = [1, 40_000, 1_704_067_200_000, 1_704_067_230_000, 1_704_067_200_000 + 40 * 86_400_000, (1 << 63) + 7]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=ops,
    seed=st.integers(0, 2**32 - 1),
    shards=st.sampled_from([1, 3]),
    lives=st.lists(st.sampled_from(LIVES), min_size=4, max_size=4),
)
def test_any_interleaving_of_exchanges_converges_to_the_owners_state(
    program: list[tuple], seed: int, shards: int, lives: list[int]
) -> None:
    """With whole digests or shards, in any order, whatever the lives' generations (every reply within its budget):
    a shard's Syn leaves the other shards' members alone, and a member of its shard it does not name is one the
    initiator lacks (it gets all of it)."""
    rng = random.Random(seed)
    nodes = [ClusterState(f"n{i}", generation=life) for i, life in enumerate(lives)]
    world = World(nodes, {n.self_id: {} for n in nodes})
    run_ops(world, program, rng)
    settle(world, rng, shards)
    for s in world.nodes:
        assert set(s.nodes) == {n.self_id for n in world.nodes}
        for owner in world.nodes:
            copy = s.node(owner.self_id)
            assert copy.generation == owner.self_node.generation
            assert copy.max_version == owner.self_node.max_version
            assert dict(copy.items()) == dict(owner.self_node.items())


@pytest.mark.parametrize("kind", [Syn, SynAck, Ack])
def test_codec_round_trips_every_message(kind: type) -> None:
    a = ClusterState("a", 7)
    a.set("k", b"\x00\xff", 0.0)
    a.set("gone", b"1", 0.0)
    a.delete("gone", 0.0)
    digest = tuple(make_digest(a))
    delta = tuple(compute_delta(a, {}, BIG, complete=True))
    msg = {Syn: Syn(digest, base=7), SynAck: SynAck(digest, delta, 7), Ack: Ack(delta, 7)}[kind]
    data = encode(msg)
    assert decode(data, BIG) == msg
    if kind is not Syn:
        assert len(data) <= delta_size(delta, 7) + len(encode(Syn(digest, base=7))) + 2


def test_generations_travel_as_offsets_from_the_senders_own_and_come_back_exact() -> None:
    """A life is its start in ms since the epoch (9 bytes as it is), named in every digest entry and node delta:
    sent as offsets from the sender's own generation, a mesh started within half a minute pays 3 bytes a life."""
    me = 1_704_067_200_000
    lives = [0, 1, me, me + 1, me - 20_000, me + 30_000, me - 20 * 86_400_000, me + 40 * 86_400_000, (1 << 64) - 1]
    digest = tuple(NodeDigest(f"n{i}", life, 3, 4, 0) for i, life in enumerate(lives))
    delta = tuple(NodeDelta(f"n{i}", life, 3, 0, 1, 0, True, (("k", 1, b"v"),)) for i, life in enumerate(lives) if life)
    for base in (0, 1, me, (1 << 63) - 1):
        for msg in (Syn(digest, base=base), SynAck(digest, delta, base), Ack(delta, base)):
            assert decode(encode(msg), BIG) == msg
        assert len(encode(Ack(delta, base))) <= delta_size(delta, base) + 12  # the budget's model bounds it
        same = NodeDelta("n", base, 3, 0, 1, 0, True, ())  # its generation's offset: 0, one byte
        for life in lives:  # and sizes each generation as it is sent, to the byte
            other = same._replace(generation=life)
            model = delta_size((other,), base) - delta_size((same,), base)
            assert model == len(encode(Ack((other,), base))) - len(encode(Ack((same,), base))), (life, base)
    started_together = tuple(NodeDigest(f"n{i:03d}", me - 15_000 + 300 * i, 3, 4, 0) for i in range(100))
    saved = len(encode(Syn(started_together))) - len(encode(Syn(started_together, base=me)))
    assert saved >= 100 * (9 - 3) - 8  # 6 bytes a life or more, less the base's own 9 bytes (1 as 0)
    with pytest.raises(ValueError, match="base"):
        encode(Syn(digest, base=1 << 63))  # an offset from it might not pack: such a node sends absolute ones


def test_a_member_whose_state_would_pass_the_bound_is_refused_and_the_others_go_on() -> None:
    """Nothing bounded one member's keys: a cluster-secret holder wrote 200,000 keys under one member in 200
    messages, and every node copied them. A delta that would take a member past ``max_node_keys`` or
    ``max_node_bytes`` is refused whole (counted); the member's state stays as it was and other members' deltas in
    the same message apply."""
    state = ClusterState("a", 1, max_nodes=1024, max_node_keys=1000, max_node_bytes=64_000)
    apply_delta(state, [NodeDelta("evil", 5, 1, 0, 0, 0, True, ())], 0.0)
    apply_delta(state, [NodeDelta("b", 5, 1, 0, 0, 0, True, ())], 0.0)
    version = 0
    refused: list[str] = []
    for message in range(5):
        entries = tuple((f"k{version + i + 1}", version + i + 1, b"x" * 16) for i in range(400))
        evil = NodeDelta("evil", 5, 2 + message, version, version + 400, 0, False, entries)
        honest = NodeDelta("b", 5, 2 + message, message, message + 1, 0, False, (("load", message + 1, b"1"),))
        result = apply_delta(state, decode(encode(Ack((evil, honest), 0, 1)), 1 << 20).delta, 1.0)  # type: ignore[union-attr]
        refused += result.oversized
        version += 400
    assert len(state.node("evil")) == 800 and refused == ["evil"]  # 1,200 would pass 1,000; after it, gaps
    assert state.node("b").max_version == 5  # the honest member beside it: every delta applied
    big = NodeDelta("c", 5, 1, 0, 1, 0, True, (("plan", 1, b"x" * 70_000),))
    assert apply_delta(state, [big], 2.0).oversized == ["c"]  # bytes too
