"""A mesh forming at once is not a flood, and a flood that says it is one is still refused (admission.py, rule 1).

Before: past a sender's vouching budget every new member was refused and logged as "a flood of made-up members or
a bug" on the sender, so an honest seed of a mesh starting at once was called a flooder by nearly every member
(150 members started within 5 s: 131 of them logged 410 such WARNING lines, scripts/bench_gossip.py --cold-start).
Now a member whose delta says it introduced itself is deferred past the budget (counted, not logged), and judged a
window later: it got in through another peer (a join wave), or it is logged as made up. And a deferred member is
asked at its address: one that answers as itself gets in when next brought, so a wave joins in seconds, not in a
vouching window.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest

from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, MemberState, SimClock
from p2pnode.gossip.admission import Deferred
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.codec import Ack, encode
from p2pnode.gossip.delta import NodeDelta

SECRET = b"join-wave-test-cluster-secret-0123"
#: A budget far below the mesh, so that the test's 24 members are a wave to it as 1,000 are to the default 64.
CONFIG = GossipConfig(cluster_secret=SECRET, max_vouched_members=4, vouch_window_s=10.0)


def test_deferred_members_are_judged_a_window_later() -> None:
    deferred = Deferred(wait_s=10.0, max_ids=3)
    deferred.add("a", "s1", 0.0)
    deferred.add("b", "s1", 1.0)
    deferred.add("a", "s2", 5.0)  # brought again by another sender: the first deferral's wait still runs
    assert deferred.due(9.0, lambda n: False) == []
    held = {"a"}
    assert deferred.due(10.0, held.__contains__) == []  # "a" got in: a join wave, nothing to report
    assert deferred.due(11.0, held.__contains__) == [("b", "s1")]  # "b" never did: made up, by s1
    assert len(deferred) == 0
    for i, node in enumerate("cdef"):
        deferred.add(node, "s3", 20.0 + i)  # one more than a mesh may hold: the oldest is judged at once
    assert len(deferred) == 3
    assert deferred.due(23.0, lambda n: False) == [("c", "s3")]


def gossip_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "p2pnode.gossip"]


async def start_wave(members: int, config: GossipConfig) -> tuple[SimClock, list[GossipAgent]]:
    """``members`` agents joining through one seed, 0.05 s apart."""
    clock = SimClock()
    net = InMemoryNetwork(clock, seed=7)
    agents = []
    for i in range(members):
        address = f"m{i}:1"
        agent = GossipAgent(
            config, f"m{i}", address, net.transport(address), clock, seeds=["m0:1"], rng=random.Random(i)
        )
        await agent.start()
        agents.append(agent)
        clock.advance(0.05)
    return clock, agents


def all_alive(agents: list[GossipAgent]) -> bool:
    return all(a.membership.state(b.self_id) is MemberState.ALIVE for a in agents for b in agents if a is not b)


async def test_a_mesh_forming_at_once_is_not_read_as_a_flood(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pnode.gossip")
    clock, agents = await start_wave(24, CONFIG)  # within 1.2 s: the seed vouches for all to each newcomer
    for _ in range(30 * 4):  # 30 s: three vouching windows
        clock.advance(0.25)
    assert all_alive(agents)
    assert sum(a.stats.vouches_deferred for a in agents) > 0  # the budget did hold members back on the way
    assert sum(a.stats.vouches_refused for a in agents) == 0
    assert not [w for w in gossip_warnings(caplog) if "max_vouched_members" in w]


@pytest.mark.parametrize("probes", [CONFIG.max_join_probes, 0])
async def test_a_join_wave_is_let_in_once_its_members_answer_at_their_address(probes: int) -> None:
    """60 members within 3 s, a budget of 4 a 10 s window: every member holds every other alive within 4 s of the
    last start when deferred members are asked at their address; waiting for other senders' budgets (no probes, as
    before) took ~11 s, a window and more."""
    clock, agents = await start_wave(60, dataclasses.replace(CONFIG, max_join_probes=probes))
    last_start = clock.now()
    while not all_alive(agents) and clock.now() - last_start < 30:
        clock.advance(0.25)
    joined_in = clock.now() - last_start
    assert sum(a.stats.vouches_deferred for a in agents) > 0  # the budget did hold members back
    assert sum(a.stats.vouches_refused for a in agents) == 0
    if probes:
        assert joined_in <= 4.0
        assert sum(a.stats.joins_confirmed for a in agents) > 0
    else:
        assert joined_in > 8.0


def self_introduced_fakes(count: int, address: str | None = None) -> tuple[NodeDelta, ...]:
    """Made-up members whose deltas name each its own origin, as an honest member's relayed introduction does (at
    ``address``, else at addresses where nothing runs)."""
    return tuple(
        NodeDelta(
            f"fake-{i}", 1, 5, 0, 1, 0, True, (("addr", 1, (address or f"10.9.0.{i}:1").encode()),), f"fake-{i}"
        )
        for i in range(count)
    )


@pytest.mark.parametrize("address", [None, "n1:1"], ids=["nothing-runs-there", "an-honest-node-runs-there"])
async def test_a_flood_naming_its_members_as_their_own_origin_is_refused_and_logged_a_window_later(
    caplog: pytest.LogCaptureFixture, address: str | None
) -> None:
    """Its members are asked at the address they name: nothing answers, or another node does (an honest one's
    address); none gets in past the sender's burst."""
    caplog.set_level(logging.WARNING, logger="p2pnode.gossip")
    clock = SimClock()
    net = InMemoryNetwork(clock, seed=3)
    agents = []
    for i in range(3):
        address = f"n{i}:1"
        agent = GossipAgent(
            CONFIG, f"n{i}", address, net.transport(address), clock, seeds=["n0:1"], rng=random.Random(i)
        )
        await agent.start()
        agents.append(agent)
    for _ in range(40):
        clock.advance(0.25)
    n0 = agents[0]
    flooder = Authenticator(
        cluster_id="p2pnode", secret=SECRET, sender_id="flooder", sender_address="flooder:1", sender_generation=1,
        wall_ms=clock.wall_ms, replay_window_s=60.0, max_seen_nonces=10, max_receive_bytes=1 << 20,
    )  # fmt: skip
    probes_before = n0.stats.probes_sent
    n0.handle(flooder.seal(encode(Ack(self_introduced_fakes(40, address))), "n0", n0.generation))
    fakes_in = sum(n.startswith("fake-") for n in n0.state.nodes)
    assert fakes_in == 4  # the sender's burst, as for any flood: saying "a join wave" lets no more in
    assert n0.stats.vouches_deferred == 36
    assert n0.stats.vouches_refused == 0
    for _ in range(12 * 4):  # past the window: no other peer ever brought them
        clock.advance(0.25)
    assert n0.stats.vouches_refused == 36
    assert n0.stats.probes_sent - probes_before >= 36 and n0.stats.joins_confirmed == 0
    assert sum(n.startswith("fake-") for n in n0.state.nodes) == 4
    flood_lines = [w for w in gossip_warnings(caplog) if "never reached this node" in w]
    assert flood_lines and "sent by flooder (36)" in flood_lines[0], gossip_warnings(caplog)
