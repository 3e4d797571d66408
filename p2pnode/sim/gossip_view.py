"""The real gossip agent inside the simulator: one ``GossipAgent`` per simulated node, on the in-memory transport.

``AgentGossip`` is a ``SimView`` (``views.py``) whose every ingress routes with its own agent's ``ClusterView``, the
object the node's router reads. What runs is the node's code, wired the way ``p2pnode/node.py`` wires it:

- each node's agent is peered with the simulated engine's real ``PrefixIndex`` (``peering.peer``, as a node's: a
  ``SummaryPublisher`` polls it once per round and publishes the stride-sampled summary);
- each node sets its load (``LoadPublisher.set``) once before its agent starts and
  then every ``NODE_LOAD_PERIOD_S`` (the node's ``_watch`` loop, ``HEALTH_CHECK_INTERVAL_S``), *not* once per
  round: at a 0.5 s interval the node gossips a load sampled once a second, and so does the simulator;
- everyone joins through node 0 as its seed; exchanges are signed with a cluster secret (HMAC), as in a node;
- messages travel on ``InMemoryNetwork`` with its default 1-10 ms uniform delay (one LAN hop, reordering allowed).

The adapter, and why it is small: the agent never sleeps or awaits; it only asks its clock for ``call_later`` and
reads ``now()`` / ``wall_ms()``. ``des.LoopClock`` provides that on the simulator's event loop, so agent rounds and
message deliveries are ordinary DES events interleaved with arrivals and engine steps, deterministic per seed (the
agents' and the network's random sources are seeded; auth nonces come from ``os.urandom`` but only their length
matters). Two pieces of glue: ``GossipAgent.start()`` is ``async`` but never suspends, so it is stepped to completion
synchronously (``_run_now``); and the clock drops every timer once the cluster is done, so the agents' endless
rounds do not keep the run alive (``Cluster.run`` stops when the event heap is empty).

Per ingress (``directory_for(i)``): the ingress's own agent's ``ClusterView``, which the ingress's ``Router`` reads
exactly as a node's router does (estimates from the stride-sampled summary, loads and the moment each arrived,
liveness; a peer not heard of yet is no candidate).
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from p2pnode.gossip.agent import GossipAgent
from p2pnode.gossip.config import DEFAULT_GOSSIP_INTERVAL_S, DEFAULT_SUMMARY_STRIDE, GossipConfig
from p2pnode.gossip.transport import InMemoryNetwork
from p2pnode.peering import Peering, peer
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.sim.des import EventLoop, LoopClock, Timer
from p2pnode.sim.views import MeshParts

__all__ = ["NODE_LOAD_PERIOD_S", "SIM_CLUSTER_SECRET", "AgentGossip", "DeliveryLag"]

#: How often a node refreshes the load its agent gossips: ``p2pnode.node.HEALTH_CHECK_INTERVAL_S`` (a test checks
#: they agree; importing ``p2pnode.node`` would pull gRPC into every simulator worker).
NODE_LOAD_PERIOD_S = 1.0
#: The simulated mesh's shared secret (the agent refuses to run without one on a non-mTLS transport).
SIM_CLUSTER_SECRET = b"p2pnode simulator cluster secret"
#: Port of every simulated node's advertised address (addresses only name endpoints on the in-memory network).
_PORT = 7000


def _run_now(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine that never suspends (``GossipAgent.start`` on a simulated clock) to its end, synchronously."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("the coroutine suspended: it needs a real event loop")


class _RunClock(LoopClock):
    """``LoopClock`` whose timers stop firing once the run is over (so endless gossip rounds let the loop drain)."""

    __slots__ = ("is_done",)

    def __init__(self, loop: EventLoop, is_done: Callable[[], bool]) -> None:
        super().__init__(loop)
        self.is_done = is_done

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(callback)
        self.loop.after(max(0.0, delay), self._fire, timer)
        return timer

    def _fire(self, timer: Timer) -> None:
        if not timer.cancelled and not self.is_done():
            timer.callback()


class AgentGossip:
    """One real ``GossipAgent`` per node; ``directory_for(i)`` is ingress i's ``ClusterView`` (module docstring).

    ``summary_stride``: the agent's base stride (its default, 4, is 4 blocks of whatever block size the run uses:
    1,024 tokens at the aggregate's 256-token blocks, 64 tokens at vLLM's 16). ``net_delay_s``: the in-memory
    network's per-message delay range.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_GOSSIP_INTERVAL_S,
        seed: int = 0,
        *,
        summary_stride: int = DEFAULT_SUMMARY_STRIDE,
        load_period_s: float = NODE_LOAD_PERIOD_S,
        net_delay_s: tuple[float, float] = (0.001, 0.010),
    ) -> None:
        if interval_s <= 0 or load_period_s <= 0:
            raise ValueError(f"gossip interval and load period must be positive, got {interval_s}, {load_period_s}")
        self.config = GossipConfig(
            cluster_secret=SIM_CLUSTER_SECRET, interval_s=interval_s, summary_stride=summary_stride
        )
        self.interval_s = interval_s
        self.seed = seed
        self.load_period_s = load_period_s
        self.net_delay_s = net_delay_s
        self.agents: list[GossipAgent] = []
        self.peerings: list[Peering] = []
        self.network: InMemoryNetwork | None = None
        self._mesh: MeshParts | None = None

    # --- SimView ------------------------------------------------------------------------------------------------------

    def start(self, mesh: MeshParts) -> None:
        self._mesh = mesh
        loop = mesh.loop
        clock = _RunClock(loop, mesh.is_done)
        self.network = InMemoryNetwork(clock, seed=self.seed ^ 0x6055, delay_s=self.net_delay_s)  # type: ignore[arg-type]
        addresses = [f"{nid}:{_PORT}" for nid in mesh.node_ids]
        self.agents = []
        self.peerings = []
        for j, (nid, address) in enumerate(zip(mesh.node_ids, addresses, strict=True)):
            agent = GossipAgent(
                self.config,
                nid,
                address,
                self.network.transport(address),
                clock,
                seeds=[addresses[0]],
                rng=random.Random(f"p2pnode-sim-gossip/{self.seed}/{j}"),
            )
            segments = mesh.engines[j].segments
            holdings = segments.holdings if segments is not None and segments.store is not None else None
            self.peerings.append(peer(agent, mesh.engines[j].cache.index, mesh.kv_layout, holdings))
            self.agents.append(agent)
        phases = random.Random(self.seed ^ 0x5EED)
        for j in range(len(self.agents)):  # nodes come up at independent phases, like independent processes
            loop.at(phases.uniform(0.0, self.interval_s), self._start_node, j)

    def directory_for(self, ingress: int) -> ClusterView:
        return self.peerings[ingress].view

    def gossip_bytes(self) -> int:
        """Every byte the agents sent (Syn, SynAck, Ack: envelopes included), from their own counters."""
        return sum(a.stats.bytes_sent for a in self.agents)

    # --- the node's side ----------------------------------------------------------------------------------------------

    def _start_node(self, j: int) -> None:
        """``Node.start``'s order: publish the load once, start the agent, then refresh the load periodically."""
        mesh = self._mesh
        assert mesh is not None
        if mesh.is_done():
            return
        self._publish_load(j)
        _run_now(self.agents[j].start())

    def _publish_load(self, j: int) -> None:
        """``Node._publish_load``: the engine's load, and the requests in flight on the node (running + waiting)."""
        mesh = self._mesh
        assert mesh is not None
        if mesh.is_done():
            return
        load = mesh.engines[j].load()
        self.peerings[j].load.set(replace(load, in_flight=load.requests))
        mesh.loop.after(self.load_period_s, self._publish_load, j)


class DeliveryLag:
    """How long an owner's writes take to reach each other node's copy, under the real agent (a measurement).

    Every ``period_s`` it samples each owner's own state version and every (receiver, owner) copy's version. When
    a receiver's copy advances, each owner round it now covers counts once, with lag = now - the first sample at
    which the owner had written it. That is the quantity the staleness model's ``delay_s`` stands for (publish ->
    visible), measured per receiver; sampling adds up to ``period_s`` of error. Writes before ``after_s`` (the join)
    are ignored. Attach before ``Cluster.run``: ``DeliveryLag().attach(cluster.loop, view, is_done)``.
    """

    def __init__(self, period_s: float = 0.05, after_s: float = 10.0) -> None:
        self.period_s = period_s
        self.after_s = after_s
        self.lags: list[float] = []
        self._owner_v: list[list[int]] = []  # per owner: its versions as sampled, increasing
        self._owner_t: list[list[float]] = []  # ... and when each was first seen
        self._copy: list[list[int]] = []  # [receiver][owner] version of the receiver's copy at the last sample

    def attach(self, loop: EventLoop, view: AgentGossip, is_done: Callable[[], bool]) -> None:
        self._loop, self._view, self._is_done = loop, view, is_done
        loop.at(self.period_s, self._tick, None)

    def _tick(self, _: object) -> None:
        if self._is_done():
            return
        agents = self._view.agents
        now = self._loop.now
        n = len(agents)
        if not self._owner_v:
            self._owner_v = [[] for _ in range(n)]
            self._owner_t = [[] for _ in range(n)]
            self._copy = [[0] * n for _ in range(n)]
        for j, agent in enumerate(agents):
            v = agent.state.self_node.max_version
            vs = self._owner_v[j]
            if not vs or v > vs[-1]:
                vs.append(v)
                self._owner_t[j].append(now)
        for i, agent in enumerate(agents):
            nodes = agent.state.nodes
            row = self._copy[i]
            for j, owner in enumerate(agents):
                if i == j:
                    continue
                node = nodes.get(owner.self_id)
                v = node.max_version if node is not None else 0
                old = row[j]
                if v > old:
                    row[j] = v
                    vs, ts = self._owner_v[j], self._owner_t[j]
                    for k in range(bisect_right(vs, old), bisect_right(vs, v)):  # owner samples in (old, v]
                        if ts[k] >= self.after_s:
                            self.lags.append(now - ts[k])
        self._loop.at(now + self.period_s, self._tick, None)

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags)
        if not lags:
            return {"n": 0}
        def pick(q: float) -> float:
            return lags[min(len(lags) - 1, int(q * len(lags)))]

        return {
            "n": len(lags),
            "mean_s": sum(lags) / len(lags),
            "p50_s": pick(0.5),
            "p90_s": pick(0.9),
            "p99_s": pick(0.99),
            "max_s": lags[-1],
        }
