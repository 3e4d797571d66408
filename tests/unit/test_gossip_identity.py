"""A node id bound to its certificate end to end (simulated time, in-memory network; admission.py rule 4, agent.py):
with per-node certificates a new life of an id is taken only from that node itself, never on a relay's word, so an
impostor relaying a new life of a frozen node never becomes it, and the node resumed is a member again without a
restart; with a shared secret alone the same takeover succeeds once the node is seen dead -- logged as the WARNING
it is -- and the node resumed says it is superseded; with certificates it reclaims its id. The same on real
processes with real certificates: tests/slow/test_insider_faults.py."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, MemberState, SimClock
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.codec import Ack, Syn, encode
from p2pnode.gossip.config import TlsConfig
from p2pnode.gossip.delta import NodeDelta
from p2pnode.gossip.digest import NodeDigest

SECRET = b"identity-test-cluster-secret-0123"
#: Per-node certificates: the in-memory network checks no certificate, but every agent applies rule 4 (each sender
#: here signs as its own id, as a certificate would force it to).
CERTIFIED = TlsConfig(Path("cert"), Path("key"), Path("ca"), bind_node_id=True)


async def mesh(certified: bool) -> tuple[SimClock, InMemoryNetwork, dict[str, GossipAgent]]:
    clock = SimClock()
    net = InMemoryNetwork(clock, seed=7)
    config = GossipConfig(cluster_secret=SECRET, tls=CERTIFIED if certified else None)
    agents = {}
    for node_id in ("n0", "n1", "n2"):
        agents[node_id] = GossipAgent(config, node_id, f"{node_id}:1", net.transport(f"{node_id}:1"), clock,
                                      seeds=["n0:1"], rng=random.Random(node_id))
        await agents[node_id].start()
    run(clock, 10.0)
    assert all(a.membership.state(p) is MemberState.ALIVE for a in agents.values() for p in agents if p != a.self_id)
    assert all(a.membership.reachable("n1") for a in (agents["n0"], agents["n2"]))
    return clock, net, agents


def run(clock: SimClock, seconds: float) -> None:
    end = clock.now() + seconds
    while clock.now() < end:
        clock.advance(0.25)


def impostor(clock: SimClock, sender: str = "imp") -> Authenticator:
    return Authenticator(
        cluster_id="p2pnode", secret=SECRET, sender_id=sender, sender_address="imp:1", sender_generation=1,
        wall_ms=clock.wall_ms, replay_window_s=60.0, max_seen_nonces=1000, max_receive_bytes=1 << 20,
    )  # fmt: skip


def relay_new_life(clock: SimClock, agents: dict[str, GossipAgent], victim: str, generation: int) -> None:
    """"imp" (a member signing as itself) tells every running agent of a new life of ``victim`` at imp's address."""
    auth = impostor(clock)
    delta = NodeDelta(victim, generation, 50, 0, 1, 0, True, (("addr", 1, b"imp:1"),))
    for agent in agents.values():
        if agent.running and agent.self_id != victim:
            agent.handle(auth.seal(encode(Ack((delta,))), agent.self_id, agent.generation))


def freeze(net: InMemoryNetwork, address: str) -> None:
    """No message to or from ``address`` (a SIGSTOPped process)."""
    net.partition([address])


def views(agents: dict[str, GossipAgent], node_id: str) -> dict[str, tuple[int, str, str]]:
    out = {}
    for a in agents.values():
        if a.self_id != node_id and node_id in a.state.nodes:
            node = a.state.nodes[node_id]
            out[a.self_id] = (node.generation, (node.get("addr") or b"").decode(), str(a.membership.state(node_id)))
    return out


async def test_with_certificates_a_relayed_new_life_never_takes_a_frozen_nodes_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a relayed new life of n1 was taken once n1 was seen dead, from any certificate holder's word, and
    n1, resumed, was refused for good ("it runs a later life")."""
    caplog.set_level(logging.INFO, logger="p2pnode.gossip")
    clock, net, agents = await mesh(certified=True)
    life = agents["n1"].generation
    freeze(net, "n1:1")
    for _ in range(30):  # 30 s frozen: dead at every peer after ~10 s; the impostor keeps relaying a new life
        relay_new_life(clock, agents, "n1", life + 1000)
        run(clock, 1.0)
        for viewer, (generation, address, _) in views(agents, "n1").items():
            assert (generation, address) == (life, "n1:1"), viewer
    assert {v[2] for v in views(agents, "n1").values()} == {"dead"}
    assert agents["n0"].stats.lives_deferred > 0
    net.heal()  # resumed: a member again, the same life, without a restart
    run(clock, 10.0)
    assert views(agents, "n1") == {"n0": (life, "n1:1", "alive"), "n2": (life, "n1:1", "alive")}
    assert agents["n1"].generation == life and agents["n1"].stats.superseded == 0
    assert not any("taking over" in r.getMessage() for r in caplog.records)


async def test_with_a_shared_secret_the_takeover_succeeds_and_is_a_warning_everywhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The limit of a shared secret (docs/gossip.md, README): once n1 is seen dead, a new life elsewhere is what a
    rescheduled node looks like. Before: taken without a warning; the original, resumed, served alone silently."""
    caplog.set_level(logging.INFO, logger="p2pnode.gossip")
    clock, net, agents = await mesh(certified=False)
    life = agents["n1"].generation
    freeze(net, "n1:1")
    for _ in range(20):
        relay_new_life(clock, agents, "n1", life + 1000)
        run(clock, 1.0)
    assert {v[:2] for v in views(agents, "n1").values()} == {(life + 1000, "imp:1")}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    taken = [w for w in warnings if w.startswith("gossip: n1 now runs at imp:1") and "taking over from n1:1" in w]
    assert len(taken) == 2, warnings  # n0 and n2
    assert all("cluster secret" in w and "vouched for by imp" in w for w in taken)
    net.heal()
    # n1 hears of the later life (a peer's digest names it): it says so, at ERROR, and does not reclaim the id
    n0 = agents["n0"]
    auth = impostor(clock, "n0")
    auth.sender_address, auth.sender_generation = "n0:1", n0.generation
    digest = (NodeDigest("n1", life + 1000, 60, 1, 0), NodeDigest("n0", n0.generation, 1, 1, 0))
    agents["n1"].handle(auth.seal(encode(Syn(digest)), "n1", life))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(e.startswith(f"gossip: another process runs as n1: generation {life + 1000}") for e in errors), errors
    assert agents["n1"].stats.superseded == 1 and agents["n1"].generation == life


async def test_with_certificates_a_superseded_node_reclaims_its_id() -> None:
    """A later life of n1 that n1's certificate never announced (one a node took from a relay before it knew n1,
    say): n1, told of it, starts a new life above it, and every peer takes n1's own word over the relayed one."""
    clock, _, agents = await mesh(certified=True)
    life = agents["n1"].generation
    n2 = agents["n2"]
    n2.state.forget("n1", clock.now(), 0.0)  # n2 forgets n1, then hears of a bogus later life through a relay
    n2.membership.forget("n1")
    relay_new_life(clock, {"n2": n2}, "n1", life + 1000)
    assert views(agents, "n1")["n2"][:2] == (life + 1000, "imp:1")
    run(clock, 15.0)  # n2's digests name the later life to n1, which reclaims its id
    n1 = agents["n1"]
    assert n1.stats.superseded >= 1 and n1.stats.reclaims == 1
    assert n1.generation > life + 1000
    assert views(agents, "n1") == {"n0": (n1.generation, "n1:1", "alive"), "n2": (n1.generation, "n1:1", "alive")}


async def test_with_certificates_a_rescheduled_node_is_taken_on_its_own_word() -> None:
    """Rule 4 defers only relays: n1 frozen past dead and started again elsewhere (a new life, its own certificate)
    is taken by each peer from n1's own messages -- n0 first, which it seeds from, then n2, which meanwhile heard of
    the new life only from n0 and kept the life it knew."""
    clock, net, agents = await mesh(certified=True)
    life = agents["n1"].generation
    freeze(net, "n1:1")
    run(clock, 20.0)
    assert {v[2] for v in views(agents, "n1").values()} == {"dead"}
    await agents["n1"].stop(leave=False)
    rescheduled = GossipAgent(agents["n0"].config, "n1", "n1b:1", net.transport("n1b:1"), clock, seeds=["n0:1"],
                              generation=life + 5000, rng=random.Random("n1b"))
    await rescheduled.start()
    agents["n1"] = rescheduled
    run(clock, 20.0)
    assert views(agents, "n1") == {"n0": (life + 5000, "n1b:1", "alive"), "n2": (life + 5000, "n1b:1", "alive")}
    assert agents["n2"].stats.lives_deferred > 0  # n0's relay of the new life came first, and waited
    assert rescheduled.stats.superseded == 0 and rescheduled.stats.reclaims == 0


async def test_a_made_up_life_far_in_the_future_is_reported_and_not_reclaimed(caplog: pytest.LogCaptureFixture) -> None:
    """A later life of n1 with a generation no clock gives (near 2**64): n1 says so at ERROR and keeps its life.
    Before, it reclaimed the id above it -- 2**64 fits no envelope, so every message n1 sealed then failed."""
    caplog.set_level(logging.INFO, logger="p2pnode.gossip")
    clock, _, agents = await mesh(certified=True)
    n1, n2 = agents["n1"], agents["n2"]
    life = n1.generation
    n2.state.forget("n1", clock.now(), 0.0)
    n2.membership.forget("n1")
    relay_new_life(clock, {"n2": n2}, "n1", 2**64 - 1)
    run(clock, 15.0)
    assert n1.stats.superseded >= 1 and n1.stats.reclaims == 0 and n1.generation == life
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("another process runs as n1" in e and "not reclaimed" in e for e in errors), errors
    assert views(agents, "n1")["n0"] == (life, "n1:1", "alive")


async def test_a_node_restarted_with_its_clock_behind_its_earlier_life_is_a_member_again_at_once() -> None:
    """A restart whose generation (its start's wall clock) is below the earlier life's -- the clock stepped back, or
    the host boots before its clock is synced: every peer refused it as "it runs a later life" until they forgot that
    life, ~10 minutes. The refusal names the later life at this node's own address: the node starts a life above it."""
    clock, net, agents = await mesh(certified=False)
    life = agents["n1"].generation
    await agents["n1"].stop(leave=False)
    run(clock, 2.0)
    restarted = GossipAgent(agents["n0"].config, "n1", "n1:1", net.transport("n1:1"), clock, seeds=["n0:1"],
                            generation=life - 5_000, rng=random.Random("n1 again"))
    await restarted.start()
    agents["n1"] = restarted
    run(clock, 10.0)
    assert restarted.generation > life and restarted.stats.reclaims == 1
    assert views(agents, "n1") == {"n0": (restarted.generation, "n1:1", "alive"),
                                   "n2": (restarted.generation, "n1:1", "alive")}


async def test_a_refusal_naming_a_generation_of_thousands_of_digits_is_ignored() -> None:
    """A refusal's status text is not signed: one naming a later life of 5,000 digits made ``int()`` raise out of the
    call's task (Python refuses ints of more than 4,300 digits from text)."""
    _, _, agents = await mesh(certified=False)
    n1 = agents["n1"]
    n1._refused_as_conflict("n0:1", f"identity_conflict: it runs a later life ({'9' * 5000}) at n1:1")
    assert n1.stats.superseded == 0


async def test_a_withdrawn_node_is_no_usable_member_to_itself_either() -> None:
    """A node whose engine died (or that drains) withdraws: its peers see it as left. It still counted itself usable,
    so as the smallest id it stayed the mesh's planner and put warm keys on itself, where nobody routes."""
    clock, _, agents = await mesh(certified=False)
    n0 = agents["n0"]
    assert n0.usable_ids() == ["n0", "n1", "n2"]
    n0.withdraw()
    run(clock, 5.0)
    assert n0.usable_ids() == ["n1", "n2"]
    assert "n0" not in agents["n1"].usable_ids()  # as its peers see it
