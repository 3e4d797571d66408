"""A member holding the secret floods the membership; misconfigured nodes say so.

- 10,000 made-up members were all accepted, every node wrote ~20,000 INFO lines, and gossiping with the fakes
  delayed real heartbeats until real peers were declared dead for seconds. Now a node keeps ``max_members`` at most,
  logs a bounded number of lines, and real peers stay alive (gossip goes to proven members first).
- A node with the wrong secret, or whose seeds never answer, ran alone without a word at INFO. Now both sides of
  a refusal log a WARNING, and a node with seeds and no live peer warns that it runs alone.
"""

from __future__ import annotations

import logging
import random

import grpc
import pytest

from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, MemberState, SimClock
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.codec import Ack, encode
from p2pnode.gossip.delta import NodeDelta
from p2pnode.gossip.exchange import make_syn
from p2pnode.gossip.grpc_transport import GOSSIP_METHOD, ConnectionBudget, GrpcTransport, add_peer_service
from tests.polling import until

SECRET = b"flood-test-cluster-secret-0123456"


def flooder(clock: SimClock) -> Authenticator:
    return Authenticator(
        cluster_id="p2pnode", secret=SECRET, sender_id="flooder", sender_address="flooder:1", sender_generation=1,
        wall_ms=clock.wall_ms, replay_window_s=60.0, max_seen_nonces=100, max_receive_bytes=1 << 20,
    )  # fmt: skip


def fakes(start: int, count: int) -> tuple[NodeDelta, ...]:
    return tuple(
        NodeDelta(f"fake-{i}", 1, 5, 0, 1, 0, True, (("addr", 1, f"10.9.{i // 250}.{i % 250}:1".encode()),))
        for i in range(start, start + count)
    )


async def three_nodes(clock: SimClock, config: GossipConfig, seed: int, settle_rounds: int) -> list[GossipAgent]:
    """Three agents n0..n2 on an in-memory network, seeded by n0, run ``settle_rounds`` quarter seconds to converge."""
    net = InMemoryNetwork(clock, seed=seed)
    agents = []
    for i in range(3):
        address = f"n{i}:1"
        agent = GossipAgent(config, f"n{i}", address, net.transport(address), clock, seeds=["n0:1"],
                            rng=random.Random(i))
        await agent.start()
        agents.append(agent)
    for _ in range(settle_rounds):
        clock.advance(0.25)
    return agents


async def test_a_flood_of_made_up_members_is_bounded_and_kills_no_real_peer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.gossip")
    clock = SimClock()
    agents = await three_nodes(clock, GossipConfig(cluster_secret=SECRET, max_members=64), seed=3, settle_rounds=40)
    assert all(a.membership.state(p) is MemberState.ALIVE for a in agents for p in ("n0", "n1", "n2") if p != a.self_id)
    caplog.clear()

    auth = flooder(clock)
    for start in range(0, 10_000, 500):
        agents[0].handle(auth.seal(encode(Ack(fakes(start, 500))), "n0", agents[0].generation))
    dead: set[tuple[str, str]] = set()
    most = 0
    for _ in range(120):  # 30 s: the fakes' heartbeats never move, they die, the dead give way to new ones
        clock.advance(0.25)
        most = max(most, *(len(a.state.nodes) for a in agents))
        for a in agents:
            dead |= {(a.self_id, p) for p in ("n0", "n1", "n2") if a.membership.state(p) is not MemberState.ALIVE
                     and p != a.self_id}
    assert most <= 64
    assert dead == set()
    assert agents[0].stats.members_refused > 9_000
    gossip_lines = [r for r in caplog.records if r.name.startswith("p2pnode.gossip")]
    assert len(gossip_lines) <= 3 * (32 * 2 + 20)  # per node: ~a minute of membership lines, a few warnings
    assert any("max_members" in r.getMessage() for r in gossip_lines)


async def start_grpc_agent(node_id: str, seeds: list[str], secret: bytes) -> tuple[GossipAgent, grpc.aio.Server]:
    config = GossipConfig(cluster_secret=secret, interval_s=0.1, alone_warning_s=0.5)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    agent = GossipAgent(config, node_id, f"127.0.0.1:{port}", GrpcTransport(config), seeds=seeds)
    add_peer_service(server, agent)
    await server.start()
    await agent.start()
    return agent, server


async def test_a_wrong_secret_and_seeds_that_never_answer_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    good, good_server = await start_grpc_agent("good", [], SECRET)
    wrong, wrong_server = await start_grpc_agent("wrong", [good.address], b"a-different-secret-of-the-right-len")
    try:

        def warnings() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

        def said(w: list[str]) -> tuple[bool, bool, bool]:
            return (
                any("bad_mac" in m and "another cluster secret" in m for m in w),  # the refuser
                any("refused our message" in m and "cluster secret differs" in m for m in w),  # the refused node
                any("serves alone" in m for m in w),  # the refused node: its seed never accepts it
            )

        def refused() -> int:  # the wrong node's messages the good one refused, and the calls the wrong one saw fail
            return min(good.stats.rejected["bad_mac"], wrong.transport.stats["failed:UNAUTHENTICATED"])

        # Polled, not slept on: until both sides have said so and at least 15 messages were refused (the bound on
        # lines below only means something over many refusals).
        await until(lambda: all(said(warnings())) and refused() >= 15, "15 refusals and the three warnings")
        w = warnings()
        assert all(said(w)), w
        assert [m.node_id for m in wrong.members()] == ["wrong"]
        assert [m.node_id for m in good.members()] == ["good"]
        assert len(w) <= 12, w  # 15 or more refused rounds: a few lines, not one per message
    finally:
        for agent, server in ((good, good_server), (wrong, wrong_server)):
            await agent.stop(leave=False)
            await server.stop(None)


async def test_a_stall_of_this_nodes_own_loop_makes_no_peer_suspect() -> None:
    """Before: a node whose event loop was held up 6 s (a flood of messages to open, a pause) judged every peer by
    the clock alone at its next round -- silent 6 s, phi 6: suspect -- though their heartbeats had arrived on time and
    only waited unread. Now the round timer's lateness is counted as this node's stall, discounted from the silences
    it spans, and reported."""
    clock = SimClock()
    agents = await three_nodes(clock, GossipConfig(cluster_secret=SECRET), seed=5, settle_rounds=80)
    judged: list[tuple[str, str, MemberState | None]] = []
    for a in agents:
        a.watch_liveness(lambda t, viewer=a.self_id: judged.append((viewer, t.node_id, t.new)))
    clock.stall(6.0)  # every process held up 6 s: each round fires late, each message is read late
    for _ in range(20):
        clock.advance(0.25)
    assert judged == []
    assert all(a.stats.loop_lag_ms_max >= 5_000 for a in agents)
    assert 0 < max(a.stats.established_phi_max_milli for a in agents) < 4_000


async def test_made_up_members_forgotten_or_refused_are_not_brought_back_by_relays() -> None:
    """Before: made-up members an insider kept heartbeating came back after they were forgotten, as "returning"
    members (known before: no budget spent, and each may displace another), through honest peers' gossip as much as
    from the insider. Now a life forgotten without ever answering a node at its address, or refused at its cap, is
    refused from any relay for ``shun_s``; the honest members keep their place and their liveness."""
    clock = SimClock()
    config = GossipConfig(cluster_secret=SECRET, max_members=64, dead_node_grace_s=5.0)
    agents = await three_nodes(clock, config, seed=7, settle_rounds=40)
    auth = flooder(clock)

    def flood(heartbeat: int) -> None:
        deltas = tuple(d._replace(heartbeat=heartbeat) for d in fakes(0, 40))
        agents[0].handle(auth.seal(encode(Ack(deltas)), "n0", agents[0].generation))

    flood(5)
    for _ in range(8):
        clock.advance(0.25)
    assert all(sum(n.startswith("fake-") for n in a.state.nodes) == 40 for a in agents)  # relayed to every node
    for _ in range(80):  # 20 s: silent, the fakes die and are forgotten after the 5 s grace
        clock.advance(0.25)
    assert not any(n.startswith("fake-") for a in agents for n in a.state.nodes)
    for heartbeat in range(6, 26):  # the insider heartbeats them again, 20 s
        flood(heartbeat)
        for _ in range(4):
            clock.advance(0.25)
    assert [sum(n.startswith("fake-") for n in a.state.nodes) for a in agents] == [0, 0, 0]
    assert agents[0].stats.shunned_refused > 0
    assert all(a.membership.state(p) is MemberState.ALIVE for a in agents for p in ("n0", "n1", "n2") if p != a.self_id)


async def test_made_up_members_are_no_longer_gossiped_soon_after_a_flood_ends() -> None:
    """Before: made-up members an insider heartbeated died once it stopped, and every node went on gossiping them
    (digests, resets to peers that lacked them) for the 300 s grace. Now a member dead here that never answered this
    node at its address is withheld: 30 s after the flood no node gossips one or holds one alive, and the honest
    members are alive and gossiped."""
    clock = SimClock()
    agents = await three_nodes(clock, GossipConfig(cluster_secret=SECRET, max_members=64), seed=9, settle_rounds=40)
    auth = flooder(clock)
    for heartbeat in range(5, 25):  # 20 s of heartbeats
        deltas = tuple(d._replace(heartbeat=heartbeat) for d in fakes(0, 30))
        agents[0].handle(auth.seal(encode(Ack(deltas)), "n0", agents[0].generation))
        for _ in range(4):
            clock.advance(0.25)

    def gossiped(agent: GossipAgent) -> list[str]:
        return [d.node_id for d in make_syn(agent.state).digest]

    assert all(sum(n.startswith("fake-") for n in gossiped(a)) == 30 for a in agents)
    for _ in range(120):  # 30 s after the flood
        clock.advance(0.25)
    assert [sum(n.startswith("fake-") for n in gossiped(a)) for a in agents] == [0, 0, 0]
    assert not any(a.membership.state(n) is MemberState.ALIVE for a in agents for n in a.state.nodes
                   if n.startswith("fake-"))
    assert all(a.membership.state(p) is MemberState.ALIVE for a in agents for p in ("n0", "n1", "n2") if p != a.self_id)
    assert all({"n0", "n1", "n2"} <= set(gossiped(a)) for a in agents)


async def test_a_connection_over_its_message_budget_is_refused_unopened() -> None:
    """Before: every message a connection sent was opened (its MAC computed, its payload decoded), however many came
    a second. Now each connection has a budget (``max_peer_messages_per_s``, a burst of twice as many): beyond it a
    message is answered RESOURCE_EXHAUSTED without being opened, and counted."""
    config = GossipConfig(cluster_secret=SECRET, max_peer_messages_per_s=5.0)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    agent = GossipAgent(config, "n0", f"127.0.0.1:{port}", GrpcTransport(config))
    add_peer_service(server, agent)
    await server.start()
    await agent.start()
    sender = Authenticator(
        cluster_id="p2pnode", secret=SECRET, sender_id="flooder", sender_address="flooder:1", sender_generation=1,
        wall_ms=agent.clock.wall_ms, replay_window_s=60.0, max_seen_nonces=100, max_receive_bytes=1 << 20,
    )  # fmt: skip
    codes: list[grpc.StatusCode] = []
    try:
        async with grpc.aio.insecure_channel(agent.address) as channel:
            call = channel.unary_unary(GOSSIP_METHOD)
            for i in range(30):
                data = sender.seal(encode(Ack(fakes(i, 1))), "n0", agent.generation)
                try:
                    await call(data, timeout=5)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
    finally:
        await agent.stop(leave=False)
        await server.stop(None)
    assert codes[:10] == [grpc.StatusCode.OK] * 10  # the burst
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 15
    assert agent.stats.throttled == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert agent.stats.messages_received == 30 - agent.stats.throttled  # the throttled were never opened


def test_a_connection_budget_refills_and_is_per_connection() -> None:
    budget = ConnectionBudget(rate=2.0, max_connections=2)
    assert [budget.spend("a", 0.0) for _ in range(5)] == [True] * 4 + [False]
    assert budget.spend("b", 0.0)  # another connection: its own burst
    assert budget.spend("a", 0.5) and not budget.spend("a", 0.5)  # 2 a second: one more after 0.5 s
