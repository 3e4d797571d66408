"""Routers that read one directory share its peer bases (``peer_table.SharedBases``): every table must see exactly
what a table of its own would, after any interleaving of directory changes and reads -- never an older base."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from p2pnode.load import NodeLoad
from p2pnode.routing.peer_table import PeerTable, SharedBases
from p2pnode.sim.cluster import Cluster, SimConfig


@dataclass
class _Peer:
    node_id: str
    load: NodeLoad | None
    cached_blocks: int = 0
    address: str = ""
    usable: bool = True
    report_time: float = 0.0
    clock: list[float] = field(default_factory=lambda: [0.0])
    kv_layout: str = ""

    @property
    def load_age_s(self) -> float:
        return self.clock[0] - self.report_time

    @property
    def info_age_s(self) -> float:
        return self.clock[0] - self.report_time


class _Directory:
    """A directory whose peers change one at a time; it remembers only the last ``memory`` changes."""

    def __init__(self, memory: int = 64) -> None:
        self.version = 0
        self.clock = [0.0]
        self.by_id: dict[str, _Peer] = {}
        self.log: list[str] = []  # node of each change, version = index + 1
        self.memory = memory

    def set(self, node_id: str, load: NodeLoad | None, cached_blocks: int = 0, usable: bool = True) -> None:
        self.by_id[node_id] = _Peer(node_id, load, cached_blocks, f"{node_id}:1", usable, self.clock[0], self.clock)
        self._changed(node_id)

    def forget(self, node_id: str) -> None:
        del self.by_id[node_id]
        self._changed(node_id)

    def _changed(self, node_id: str) -> None:
        self.version += 1
        self.log.append(node_id)

    def peers(self) -> list[_Peer]:
        return list(self.by_id.values())

    def peer(self, node_id: str) -> _Peer | None:
        return self.by_id.get(node_id)

    def changes_since(self, version: int) -> list[str] | None:
        if self.version - version > self.memory:
            return None
        return self.log[version:]


def _load(running: int, waiting: int = 0) -> NodeLoad:
    return NodeLoad(running=running, waiting=waiting, prefill_backlog_tokens=100 * running)


def _seen(table: PeerTable) -> dict:
    """Everything a request reads of a table (a base's info age aside: no policy decides on it)."""
    return {
        "bases": {
            n: (b.alive, b.load, b.cached_blocks, b.served_rate, b.link_bytes_per_s) for n, b in table.by_id.items()
        },
        "order": list(table.by_id),  # what full assembly hands a policy in
        "by_load": [b.node_id for b in table.alive_by_load],
        "alive_keys": list(table.alive_keys),
        "alive_ids": table.alive_ids,
        "ids_by_id": table.ids_by_id,
        "mesh_ids": table.mesh_ids,
        "positions": {n: table.alive_position(n) for n in table.by_id},
        "addresses": dict(table.addresses),
        "reported_at": dict(table.reported_at),
        "least_loaded": [b.node_id for b in table.least_loaded({}, 7, 5)],
    }


def test_a_shared_table_sees_the_load_the_directory_changed_after_another_reader_caught_up() -> None:
    directory = _Directory()
    for n in ("a", "b", "c"):
        directory.set(n, _load(1))
    shared = SharedBases()
    first, second = (PeerTable(n, f"{n}:1", served_rates=False, shared=shared) for n in ("a", "b"))
    first.refresh(directory, 0.0, float("inf"))
    second.refresh(directory, 0.0, float("inf"))
    directory.set("c", _load(9))  # one round: c is busy now
    first.refresh(directory, 1.0, float("inf"))
    second.refresh(directory, 1.0, float("inf"))
    assert first.by_id["c"].load.running == 9 and second.by_id["c"].load.running == 9
    assert second.alive_ids == ("a", "c") and first.alive_ids == ("b", "c")
    assert "a" not in first.by_id and "b" not in second.by_id  # each leaves its own node out
    directory.set("a", _load(20))  # read by the second reader first this time
    second.refresh(directory, 2.0, float("inf"))
    first.refresh(directory, 2.0, float("inf"))
    assert second.by_id["a"].load.running == 20 and second.alive_ids == ("c", "a")


@pytest.mark.parametrize("seed", range(6))
def test_shared_tables_read_exactly_what_tables_of_their_own_read(seed: int) -> None:
    rng = random.Random(seed)
    directory = _Directory(memory=rng.choice([3, 8, 64]))
    nodes = [f"n{i}" for i in range(12)]
    for n in nodes:
        directory.set(n, _load(rng.randrange(4)))
    shared = SharedBases()
    readers = [*nodes[:5], "outsider"]  # one reader the directory does not list
    tables = {n: PeerTable(n, f"{n}:1", served_rates=False, shared=shared) for n in readers}
    own = {n: PeerTable(n, f"{n}:1", served_rates=False) for n in readers}
    for step in range(400):
        directory.clock[0] += rng.random()
        for _ in range(rng.choice([0, 1, 1, 2, 5, 12])):  # rounds heard between two reads
            n = rng.choice(nodes)
            roll = rng.random()
            if roll < 0.05 and n in directory.by_id:
                directory.forget(n)
            elif roll < 0.1:
                directory.set(n, None)  # known, no load yet: not a candidate
            elif roll < 0.15:
                directory.set(n, _load(rng.randrange(4)), usable=False)
            else:
                directory.set(n, _load(rng.randrange(6), rng.randrange(3)), cached_blocks=rng.randrange(100))
        reader = rng.choice(readers)
        now = directory.clock[0]
        tables[reader].refresh(directory, now, float("inf"))
        own[reader].refresh(directory, now, float("inf"))
        assert _seen(tables[reader]) == _seen(own[reader]), f"step {step}: {reader}"
        by_load = tables[reader].alive_by_load
        assert all(tables[reader].by_id[b.node_id] is b for b in by_load)  # one object per peer, the current one
        base = next(iter(tables[reader].by_id.values()), None)
        if base is not None and base.alive:  # a variant derives from the current base, never an older one
            assert tables[reader].variant(base, 3, 1, 10).load.running == directory.by_id[base.node_id].load.running


def test_a_shared_base_holds_nothing_of_one_reader() -> None:
    with pytest.raises(ValueError):
        PeerTable("a", "a:1", shared=SharedBases())  # its served rates are its own
    with pytest.raises(ValueError):
        PeerTable("a", "a:1", lambda node_id: 1e9, served_rates=False, shared=SharedBases())


def test_the_simulators_routers_share_the_gossip_models_bases_when_theirs_hold_nothing_of_their_own() -> None:
    shared = Cluster(SimConfig(nodes=4, seed=1))
    shared.run([])
    tables = [router.table for router in shared.routers]
    assert tables[0].shared is not None and all(t.shared is tables[0].shared for t in tables)
    assert all(t.served_rates is None for t in tables)  # p2p reads no served rate: none kept
    rated = Cluster(SimConfig(nodes=4, seed=1).with_routing(policy="cacheroute"))  # reads served rates
    rated.run([])
    assert all(router.table.shared is None and router.table.served_rates is not None for router in rated.routers)
    exact = Cluster(SimConfig(nodes=4, seed=1).with_routing(policy="upper-bound"))  # moves at every read
    exact.run([])
    assert all(router.table.shared is None for router in exact.routers)
