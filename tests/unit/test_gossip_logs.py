"""What a node's log keeps about its members under a flood (simulated time, in-memory network): every change of an
established member (one that answered at its address) is logged whatever the flood spends, and a refused member is
named with who first vouched for it, not only with the honest peer that relayed it (the delta's ``origin``)."""

from __future__ import annotations

import logging
import random

import pytest

from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, SimClock
from p2pnode.gossip.codec import Ack, MalformedMessage, decode, encode
from p2pnode.gossip.delta import NodeDelta, delta_size
from tests.unit.test_gossip_admission import SECRET, Flooder, Mesh


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "p2pnode.gossip" and r.levelno == level]


async def test_an_established_members_changes_are_logged_whatever_a_flood_spends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: one budget of 32 lines a minute for every membership change: a flood's made-up members spent it
    (8,045 lines held back in a minute) and no line said that honest peers turned suspect."""
    caplog.set_level(logging.INFO, logger="p2pnode.gossip")
    mesh = Mesh()
    await mesh.start()
    flooder = Flooder(mesh, 2000)
    for _ in range(3):  # 64 made-up members admitted by each node (the vouching budget): more than the budget of lines
        flooder.round()
        mesh.run(1.0)
    held_back = sum(a._liveness._log.suppressed_total for a in mesh.agents.values())
    assert held_back > 0  # the flood did spend the membership budget
    caplog.clear()
    await mesh.agents["n3"].stop(leave=False)  # n3 dies while the flood goes on
    for _ in range(20):
        flooder.round()
        mesh.run(1.0)
    said = lines(caplog)
    for viewer in ("n0", "n1", "n2"):
        assert mesh.agents[viewer].membership.state("n3") == "dead", viewer
    assert said.count("gossip: n3 is suspect (was alive)") == 3, said[:20]
    assert said.count("gossip: n3 is dead (was suspect)") == 3, said[:20]
    assert sum(a._liveness._log.suppressed_total for a in mesh.agents.values() if a.running) > held_back


async def test_a_refusal_names_who_first_vouched_for_a_member_not_the_peer_relaying_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: "refused 936 new member(s) (e.g. fake-64) from n0: ... a flood of made-up members or a bug on n0",
    when n0 only relayed what a flooder had made up."""
    caplog.set_level(logging.WARNING, logger="p2pnode.gossip")
    clock = SimClock()
    net = InMemoryNetwork(clock, seed=5)
    configs = {
        "n0": GossipConfig(cluster_secret=SECRET),
        "n1": GossipConfig(cluster_secret=SECRET, max_vouched_members=4),  # n0's relays exceed its budget here
        "n2": GossipConfig(cluster_secret=SECRET, max_members=8),  # and the member cap here
    }
    agents = {}
    for node_id, config in configs.items():
        agents[node_id] = GossipAgent(config, node_id, f"{node_id}:1", net.transport(f"{node_id}:1"), clock,
                                      seeds=["n0:1"], rng=random.Random(node_id))
        await agents[node_id].start()
    for _ in range(40):
        clock.advance(0.25)
    mesh = Mesh()
    mesh.clock, mesh.agents = clock, {"n0": agents["n0"]}  # the flooder reaches n0 alone
    Flooder(mesh, 200).round()
    for _ in range(40):
        clock.advance(0.25)
    relayed = [n for n in agents["n1"].state.nodes if n.startswith("fake-")]
    assert relayed and all(agents["n1"].state.nodes[n].origin == "flooder" for n in relayed)
    assert agents["n0"].state.nodes[relayed[0]].origin == "flooder"
    assert agents["n0"].state.nodes["n1"].origin == "n1"  # it introduced itself
    warnings = lines(caplog, logging.WARNING)
    vouch = [w for w in warnings if "sent by n0" in w and "max_vouched_members" in w]
    cap = [w for w in warnings if "sent by n0" in w and "max_members" in w]
    assert vouch and cap, warnings
    for line in vouch + cap:
        assert "first vouched for by flooder (" in line, line
    assert "the origins named are their source, not n0" in vouch[0]
    assert not any("bug on n0" in w for w in warnings)


def test_a_reset_carries_its_origin_on_the_wire_and_an_older_delta_still_decodes() -> None:
    with_origin = NodeDelta("m", 3, 9, 0, 1, 0, True, (("addr", 1, b"m:1"),), "flooder")
    without = with_origin._replace(origin="")
    for delta in (with_origin, without):
        data = encode(Ack((delta,)))
        assert decode(data, 1 << 20) == Ack((delta,))
        assert len(data) - 4 <= delta_size((delta,), 0)  # the budget's size model bounds the encoding
    assert len(encode(Ack((with_origin,)))) - len(encode(Ack((without,)))) == len("flooder") + 1
    import msgpack

    raw = msgpack.unpackb(encode(Ack((with_origin,))))
    raw[3][0].append("extra")
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb(raw, use_bin_type=True), 1 << 20)
    raw[3][0][8:] = [5]  # an origin that is no node id
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb(raw, use_bin_type=True), 1 << 20)
