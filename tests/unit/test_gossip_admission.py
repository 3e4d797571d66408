"""Membership admission against an insider, in simulated time on the in-memory network (admission.py): a member
holding the secret that floods heartbeating members, a second process under an existing node id, and the pure rules
behind them (the vouching budget, judging a claim to a node id). The same faults on real processes:
tests/slow/test_faults.py and scripts/chaos.py."""

from __future__ import annotations

import logging
import random
import zlib

import pytest

from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, MemberState, SimClock
from p2pnode.gossip.admission import VouchBudget, judge_claim
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.codec import Ack, encode
from p2pnode.gossip.delta import NodeDelta

SECRET = b"admission-test-cluster-secret-0123"
HONEST = ("n0", "n1", "n2", "n3")


# --- the pure rules ------------------------------------------------------------------------------------------------


def test_a_sender_vouches_for_a_burst_then_at_the_refill_rate() -> None:
    budget = VouchBudget(limit=4, window_s=60.0, max_senders=2)
    assert [budget.spend("f", 0.0) for _ in range(5)] == [True, True, True, True, False]
    assert not budget.spend("f", 14.0)  # 14 s refill 0.93 of a token
    assert budget.spend("f", 15.0) and not budget.spend("f", 15.0)
    assert budget.available("f", 1000.0) == 4.0  # never more than the burst
    assert budget.spend("g", 15.0) and budget.spend("h", 15.0)  # a third sender: the least recent one is forgotten
    assert budget.available("f", 15.0) == 4.0
    with pytest.raises(ValueError):
        VouchBudget(0, 60.0, 1)


@pytest.mark.parametrize(
    ("known_state", "generation", "address", "taken"),
    [
        (MemberState.ALIVE, 5, "a:1", True),  # the life we know
        (MemberState.ALIVE, 5, None, True),
        (MemberState.ALIVE, 5, "a:2", False),  # the same life elsewhere: another process
        (MemberState.ALIVE, 6, "a:1", True),  # a restart in place
        (MemberState.ALIVE, 6, "a:2", False),  # a second process while the known one is alive
        (MemberState.SUSPECT, 6, "a:2", False),
        (MemberState.DEAD, 6, "a:2", True),  # rescheduled after its death was seen
        (MemberState.LEFT, 6, "a:2", True),
        (MemberState.ALIVE, 4, "a:1", False),  # an earlier life still talking
    ],
)
def test_judge_claim(known_state: MemberState, generation: int, address: str | None, taken: bool) -> None:
    assert (judge_claim(5, "a:1", known_state, generation, address) is None) is taken


# --- whole agents --------------------------------------------------------------------------------------------------


class Mesh:
    """Four honest agents on one in-memory network at p2pnode's defaults (interval 1 s, member cap 1,024)."""

    def __init__(self) -> None:
        self.clock = SimClock()
        self.net = InMemoryNetwork(self.clock, seed=3)
        self.config = GossipConfig(cluster_secret=SECRET)
        self.agents: dict[str, GossipAgent] = {}

    async def add(self, node_id: str, address: str | None = None, seeds: tuple[str, ...] = ("n0:1",)) -> GossipAgent:
        address = address or f"{node_id}:1"
        agent = GossipAgent(
            self.config, node_id, address, self.net.transport(address), self.clock, seeds=list(seeds),
            rng=random.Random(zlib.crc32(f"{node_id}/{self.clock.now()}".encode())),
        )  # fmt: skip
        await agent.start()
        return agent

    async def start(self) -> None:
        for node_id in HONEST:
            self.agents[node_id] = await self.add(node_id)
        self.run(10.0)
        assert not self.not_alive(), self.not_alive()

    def run(self, seconds: float) -> None:
        end = self.clock.now() + seconds
        while self.clock.now() < end:
            self.clock.advance(0.25)

    def not_alive(self) -> set[str]:
        """"viewer->member" for every running honest member some running honest agent does not see alive in its
        current life (not known yet, an earlier life, or suspect, dead, left)."""
        return {
            f"{a.self_id}->{p}" for a in self.agents.values() if a.running for p, b in self.agents.items()
            if p != a.self_id and b.running and (a.generation_of(p) != b.generation
                                                 or a.membership.state(p) is not MemberState.ALIVE)
        }  # fmt: skip

    def suspected(self) -> set[str]:
        """"viewer->member state" for every honest member some honest agent suspects or declares dead (a life that
        left is not suspected)."""
        return {
            f"{a.self_id}->{p} {a.membership.state(p)}" for a in self.agents.values() if a.running for p in self.agents
            if a.membership.state(p) in (MemberState.SUSPECT, MemberState.DEAD)
        }  # fmt: skip


class Flooder:
    """A secret holder announcing ``fakes`` members to every honest agent each second, their heartbeats advancing."""

    def __init__(self, mesh: Mesh, fakes: int) -> None:
        self.mesh = mesh
        self.fakes = fakes
        self.heartbeat = 5
        self.auth = Authenticator(
            cluster_id="p2pnode", secret=SECRET, sender_id="flooder", sender_address="flooder:1",
            sender_generation=1, wall_ms=mesh.clock.wall_ms, replay_window_s=60.0, max_seen_nonces=10,
            max_receive_bytes=1 << 22,
        )  # fmt: skip

    def round(self) -> None:
        self.heartbeat += 1
        for start in range(0, self.fakes, 1000):
            deltas = tuple(
                NodeDelta(f"fake-{i}", 1, self.heartbeat, 0, 1, 0, True, (("addr", 1, f"10.9.{i}:1".encode()),))
                for i in range(start, min(start + 1000, self.fakes))
            )
            for agent in self.mesh.agents.values():
                if agent.running:
                    agent.handle(self.auth.seal(encode(Ack(deltas)), agent.self_id, agent.generation))


async def test_a_heartbeating_flood_suspects_no_honest_member_and_a_returning_node_gets_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: 5,000 heartbeating members filled every table to the cap (1,024) and all proved themselves (their
    heartbeats advanced), the agents gossiped with them instead of each other (12 of 730 messages to honest peers in
    a minute), every honest member was suspected ~6 s in and dead ~12 s in, and n1, after leaving and coming back,
    was refused for want of room. Now the flooder's vouching budget lets 64 in, then ~1 a second, the honest agents
    gossip with the members that answer them first, and n1 returns at once. The flood here is twice the cap (as
    5,000 did, it would fill every table), at 40% of the agents' work of decoding 5,000."""
    caplog.set_level(logging.WARNING, logger="p2pnode.gossip")
    mesh = Mesh()
    await mesh.start()
    flooder = Flooder(mesh, 2 * mesh.config.max_members)
    suspected: set[str] = set()
    for second in range(60):
        flooder.round()
        if second == 20:  # n1 leaves and comes back under its id (a new generation, the same address)
            await mesh.agents["n1"].stop(leave=True)
            mesh.run(1.0)
            mesh.agents["n1"] = await mesh.add("n1")
            returned_at = mesh.clock.now()
            admitted_after = None
        for _ in range(4):
            mesh.clock.advance(0.25)
            suspected |= mesh.suspected()
            if second >= 20 and admitted_after is None and not mesh.not_alive():
                admitted_after = mesh.clock.now() - returned_at
    assert suspected == set()
    assert admitted_after is not None and admitted_after <= 15.0
    n0 = mesh.agents["n0"]
    fakes_kept = sum(n.startswith("fake-") for n in n0.state.nodes)
    assert fakes_kept <= 64 + 64 * 3  # the flooder's burst and refill, and what the honest relayed within theirs
    assert n0.stats.vouches_refused > 10_000
    assert all(n0.membership.reachable(p) for p in HONEST if p != "n0")
    assert not any(n0.membership.reachable(n) for n in n0.state.nodes if n.startswith("fake-"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("from flooder: it vouched for 64 new members" in w for w in warnings), warnings[:5]
    assert len(warnings) < 4 * 20  # rate-limited: a few lines a minute per node and kind


async def test_a_second_process_under_a_live_node_id_is_refused_everywhere_and_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a second "n1" at another address, seeded to n2, made every node switch n1 to the newcomer's address
    (a higher generation replaced the known life wholesale) while the real n1 ran on, invisible. Now the mesh keeps
    the life it knows and every node the impostor reaches refuses it with a WARNING; once the real n1 is dead, the
    same process -- a node rescheduled to a new address -- is admitted."""
    caplog.set_level(logging.WARNING, logger="p2pnode.gossip")
    mesh = Mesh()
    await mesh.start()
    original = {p: a.members() for p, a in mesh.agents.items()}
    impostor = await mesh.add("n1", address="n1-elsewhere:1", seeds=("n2:1",))
    mesh.run(15.0)
    for viewer, agent in mesh.agents.items():
        if viewer == "n1":
            continue
        n1 = next(m for m in agent.members() if m.node_id == "n1")
        assert (n1.address, n1.state) == ("n1:1", MemberState.ALIVE), viewer
        assert n1.generation == next(m.generation for m in original[viewer] if m.node_id == "n1")
    assert mesh.agents["n2"].stats.identity_conflicts > 0  # the seed the impostor dialled
    assert impostor.transport is not None and [m.node_id for m in impostor.members()] == ["n1"]
    refusals = [r.getMessage() for r in caplog.records if "identity_conflict" in r.getMessage()]
    assert any("'n1' at 'n1-elsewhere:1'" in m for m in refusals), refusals[:3]

    # The original dies (no goodbye); once the others see it dead, the process at the new address gets in.
    mesh.agents["n1"].transport.close_now()  # type: ignore[attr-defined]
    await mesh.agents["n1"].stop(leave=False)
    mesh.agents["n1"] = impostor
    others = [mesh.agents[p] for p in ("n0", "n2", "n3")]
    seen_dead: dict[str, float] = {}  # viewer -> when it first saw the original dead
    admitted: dict[str, float] = {}  # viewer -> when it first saw the newcomer's life alive
    stopped = mesh.clock.now()
    while len(admitted) < len(others) and mesh.clock.now() - stopped < 120.0:
        mesh.clock.advance(0.25)
        for a in others:
            life = a.state.nodes["n1"].generation if "n1" in a.state.nodes else None
            if life != impostor.generation and a.membership.state("n1") is MemberState.DEAD:
                seen_dead.setdefault(a.self_id, mesh.clock.now())
            if life == impostor.generation and a.membership.state("n1") is MemberState.ALIVE:
                admitted.setdefault(a.self_id, mesh.clock.now())
    assert set(admitted) == set(seen_dead) == {"n0", "n2", "n3"}, (seen_dead, admitted)
    assert all(seen_dead[v] <= admitted[v] <= seen_dead[v] + 15.0 for v in admitted), (seen_dead, admitted)


async def test_a_seed_restarted_in_place_without_seeds_of_its_own_is_found_again() -> None:
    """Before: n0, the mesh's seed (it has no seeds itself), killed and restarted under its id at its address, was
    never seen again: the others kept sealing their Syns for its earlier life, which the new life refuses
    (wrong_generation), and it knew nobody to call itself (seen on real processes: the fault suite's n1 after kill
    -9 timed out converging). Now a member not heard from lately (suspect or dead) is asked which life runs there
    (a Hello), and the HelloAck's life gets the Syn."""
    mesh = Mesh()
    await mesh.start()
    old = mesh.agents["n0"]
    old.transport.close_now()  # type: ignore[attr-defined]
    await old.stop(leave=False)
    mesh.agents["n0"] = await mesh.add("n0", seeds=())
    restarted = mesh.clock.now()
    while mesh.not_alive() and mesh.clock.now() - restarted < 120.0:
        mesh.clock.advance(0.25)
    assert not mesh.not_alive(), mesh.not_alive()
    assert mesh.clock.now() - restarted <= 15.0
