"""The order of peers by load with this ingress's sends counted (``routing/effective_load.py``), held to its
definition: every alive peer sorted by (reported load + sends since its report, id), runs of equal loads entered at
the tiebreak's offset -- over sends begun and ended through the router and straight into the ledger, reports that
move loads and reset what counts, peers dying and coming back, a replaced ledger and a full re-read of the table."""

from __future__ import annotations

import random
from collections.abc import Container

import pytest

from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.load import LOAD_KEY, NodeLoad, encode_load
from p2pnode.routing.effective_load import EffectiveLoadOrder
from p2pnode.routing.ledger import InFlightLedger
from p2pnode.routing.peer_table import PeerTable
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, get_workloads
from tests.unit.test_router import Mesh


def definition(table: PeerTable, ledger: InFlightLedger, count: int, tiebreak: int, exclude: set[str]) -> list[str]:
    keys = sorted(
        (b.requests + ledger.since(b.node_id, table.reported_at[b.node_id])[0], b.node_id)
        for b in table.by_id.values() if b.alive
    )
    out: list[str] = []
    start = 0
    while start < len(keys) and len(out) < count:
        end = start
        while end < len(keys) and keys[end][0] == keys[start][0]:
            end += 1
        run = keys[start:end]
        offset = tiebreak % len(run)
        for key in run[offset:] + run[:offset]:
            if key[1] not in exclude and len(out) < count:
                out.append(key[1])
        start = end
    return out


def test_the_order_is_its_definition_through_sends_reports_deaths_and_rebuilds() -> None:
    for seed in range(4):
        rng = random.Random(seed)
        mesh = Mesh(30, [], rng, holders=0, max_load=4)
        router = mesh.router("flat", sparse=True)
        order = router.by_load
        assert isinstance(order, EffectiveLoadOrder)
        tickets: list[tuple[str, int]] = []
        for step in range(600):
            op = rng.random()
            now = mesh.clock.now()
            if op < 0.35:  # a send, through the ledger as the router's begin makes it
                peer = rng.choice(mesh.ids)
                tickets.append((peer, router.ledger.begin(peer, now, rng.randrange(512))))
            elif op < 0.55 and tickets:  # a send ends
                peer, ticket = tickets.pop(rng.randrange(len(tickets)))
                router.end(peer, ticket)
            elif op < 0.75:  # a report: a new load, and the sends before it no longer count
                mesh.clock.advance(rng.choice([0.0, 0.5]))
                load = NodeLoad(running=rng.randrange(4), waiting=rng.randrange(2))
                mesh.view.on_key_changed(rng.choice(mesh.ids), LOAD_KEY, encode_load(load))
            elif op < 0.8:  # a peer loses its address (not alive), or gets it back
                p = rng.randrange(len(mesh.ids))
                address = None if rng.random() < 0.5 else f"10.0.0.{p}:1".encode()
                mesh.view.on_key_changed(mesh.ids[p], ADDRESS_KEY, address)
            elif op < 0.83:
                router.forget_peer(rng.choice(mesh.ids))
            elif op < 0.85:  # every peer read anew (the table's periodic full read)
                router.table.version = -1
            elif op < 0.86:  # another ledger (as a test or a restart could make)
                router.ledger = InFlightLedger()
                tickets.clear()
            table = router.peer_table(mesh.clock.now())
            order.sync(table, router.ledger)
            exclude = set(rng.sample(mesh.ids, rng.randrange(3)))
            tiebreak = rng.getrandbits(64)
            count = rng.randrange(1, 6)
            expected = definition(table, router.ledger, count, tiebreak, exclude)
            assert order.least(count, tiebreak, exclude) == expected, (seed, step)
            assert len(order.keys) == sum(b.alive for b in table.by_id.values())


def test_without_sends_it_enters_the_reported_load_order_as_the_table_does() -> None:
    """At an idle ingress the order is the table's load order: ``least`` hands the peers ``least_loaded`` would."""
    rng = random.Random(5)
    mesh = Mesh(50, [], rng, holders=0, max_load=3)
    router = mesh.router("flat", sparse=True)
    table = router.peer_table(mesh.clock.now())
    order = router.by_load
    assert order is not None
    order.sync(table, router.ledger)
    for _ in range(200):
        exclude = dict.fromkeys(rng.sample(mesh.ids, rng.randrange(4)))
        tiebreak = rng.getrandbits(64)
        expected = [s.node_id for s in table.least_loaded(exclude, tiebreak, 4)]  # type: ignore[arg-type]
        assert order.least(4, tiebreak, exclude) == expected


def test_the_simulators_routers_keep_it_through_shared_bases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's ingresses read one directory through shared bases (``PeerTable._follow``): every order a
    ``flat`` decision reads there is its definition, over a run with sends in flight and reports every round."""
    checked = []
    least = EffectiveLoadOrder.least

    def checking(self: EffectiveLoadOrder, count: int, tiebreak: int, exclude: Container[str]) -> list[str]:
        out = least(self, count, tiebreak, exclude)
        assert self._table is not None and self._ledger is not None
        assert out == definition(self._table, self._ledger, count, tiebreak, set(exclude))
        checked.append(len(self._ledger.peers()))
        return out

    monkeypatch.setattr(EffectiveLoadOrder, "least", checking)
    wl = get_workloads("cacheroute-aggregate")[0]
    cfg = SimConfig(nodes=8, block_size=wl.block_size, seed=2, warmup_s=0.0).with_routing(policy="flat")
    cluster = Cluster(cfg)
    assert all(r.table.shared is not None for r in cluster.routers)
    cluster.run(wl.requests(40.0, 2, cluster.space, Limit(max_requests=600)))
    assert len(checked) == 600 and max(checked) >= 3  # every decision, some with sends to several peers in flight
