"""Mesh-wide fair shares: what a node publishes of the work it served per tenant, how a peer's reports are charged
to the queue (only the excess over an equal share, at most the work waiting), and the gossip between two nodes."""

from __future__ import annotations

import httpx
import msgpack

from p2pnode.flow.queue import FairQueue
from p2pnode.serving.tenant_served import (
    MAX_SERVED_BYTES,
    MAX_SERVED_TENANTS,
    TenantServed,
    decode_served,
    encode_served,
)
from tests.polling import until
from tests.unit.sim_nodes import make_node


class BackloggedNode:
    """A node's queue (``EngineQueue.charge``'s bound) fed by a fake gossip feed."""

    def __init__(self) -> None:
        self.queue: FairQueue[str] = FairQueue(100)
        self.served = TenantServed(self.charge, self.queue.waiting_by_tenant)

    def charge(self, tenant: str, work: float) -> None:
        self.queue.charge(tenant, work, max_lead=self.queue.waiting_cost())

    def peer_reports(self, *values: dict[str, int]) -> None:
        for value in values:
            self.served.apply("peer", encode_served(value))
        self.served.charge_round()

    def drain(self) -> list[str]:
        out = []
        while (waiting := self.queue.pop()) is not None:
            out.append(waiting.item)
        return out


def test_the_most_recent_work_is_published_first_and_bounded() -> None:
    served = TenantServed(lambda t, w: None, list)
    assert decode_served(served.publish_value()) == {}
    for tenant, work in (("old", 5000), ("a", 10), ("b", 300)):
        served.record(tenant, work)
    served.publish_value()
    served.publish_value()  # old's 5000 has decayed to 1250 by now
    served.record("b", 2000)
    assert list(decode_served(served.publish_value()) or {}) == ["b", "old", "a"]
    many = {f"{'t' * 60}{i:04d}": 2**60 for i in range(100)}
    decoded = decode_served(encode_served(many))
    assert len(encode_served(many)) <= MAX_SERVED_BYTES and decoded and len(decoded) <= MAX_SERVED_TENANTS


def test_malformed_values_are_ignored() -> None:
    for raw in ([1], {"a": -1}, {"a": "1"}, {"a": 1.5}, {"": 1}, {"a\n": 1}, {f"t{i}": 1 for i in range(33)}):
        assert decode_served(msgpack.packb(raw)) is None
    assert decode_served(b"\xc1") is None


def test_a_tenant_served_more_elsewhere_waits_behind_a_light_one() -> None:
    node = BackloggedNode()
    node.queue.push("backlog", "other", 0, 1000, now=0)  # the node is backlogged
    node.peer_reports({"heavy": 0, "light": 0}, {"heavy": 5000, "light": 100})  # a baseline, then one round's growth
    assert node.served.reported == 5100 and node.served.charged > 0
    node.queue.push("heavy-0", "heavy", 0, 100, now=1)
    node.queue.push("light-0", "light", 0, 100, now=1)
    assert node.drain() == ["backlog", "light-0", "heavy-0"]  # arrival order without the peer's report


def test_a_tenant_served_no_more_than_the_others_elsewhere_is_not_charged() -> None:
    node = BackloggedNode()
    node.queue.push("heavy-0", "heavy", 0, 100, now=0)
    node.queue.push("heavy-1", "heavy", 0, 100, now=0)
    node.peer_reports({"heavy": 0, "light": 0}, {"heavy": 5000, "light": 100})
    node.queue.push("light-0", "light", 0, 100, now=1)
    # light's 100 elsewhere is under its share: it starts at the virtual time, ahead of heavy's second request.
    assert node.drain() == ["heavy-0", "light-0", "heavy-1"]


def test_the_debt_is_at_most_the_work_waiting() -> None:
    idle = BackloggedNode()
    idle.peer_reports({"heavy": 0}, {"heavy": 10**6, "light": 1})  # nothing waits here: nothing to order
    idle.queue.push("heavy-0", "heavy", 0, 100, now=0)
    idle.queue.push("light-0", "light", 0, 100, now=0)
    assert idle.drain() == ["heavy-0", "light-0"]

    busy = BackloggedNode()
    busy.queue.push("backlog", "other", 0, 300, now=0)
    busy.peer_reports({"heavy": 0}, {"heavy": 10**6, "light": 1})
    busy.queue.push("heavy-0", "heavy", 0, 100, now=1)
    for i in range(5):
        busy.queue.push(f"light-{i}", "light", 0, 100, now=1)
    # heavy's debt is the 300 that waited when it was charged, not its million: it waits behind 3 of light's.
    assert busy.drain() == ["backlog", "light-0", "light-1", "light-2", "heavy-0", "light-3", "light-4"]


def test_first_values_are_baselines_and_a_restart_is_counted_whole() -> None:
    served = TenantServed(lambda t, w: None, list)
    served.apply("p", encode_served({"a": 500}))
    assert served.reported == 0
    served.apply("p", encode_served({"a": 700, "b": 10}))
    assert served.reported == 210
    served.apply("p", encode_served({"a": 50}))  # p restarted
    assert served.reported == 260
    served.apply("p", b"\xc1")
    served.apply("p", None)
    served.apply("p", encode_served({"a": 900}))
    assert served.reported == 260


async def test_peers_read_the_work_each_node_served() -> None:
    a = make_node("a", mesh=True)
    await a.start()
    b = make_node("b", mesh=True, seeds=(a.address,))
    await b.start()
    try:
        # Each reads the other's first value (a baseline: what was served before it watched is not charged).
        await until(lambda: "a" in b.tenant_served.peers, "b to read a's served work")  # type: ignore[union-attr]
        await until(lambda: "b" in a.tenant_served.peers, "a to read b's served work")  # type: ignore[union-attr]
        body = {"model": "sim", "prompt": "served work", "max_tokens": 4}
        async with httpx.AsyncClient(base_url=f"http://{a.http.address}", timeout=30) as http:
            assert (await http.post("/v1/completions", json=body)).status_code == 200
        nodes = (a, b)
        await until(
            lambda: sum(n.tenant_served.reported for n in nodes) > 4,  # type: ignore[union-attr]
            "the node that served it to publish the work and the other to read it",
        )
    finally:
        await b.stop()
        await a.stop()
