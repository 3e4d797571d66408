"""Gossip: membership, failure detection and Scuttlebutt anti-entropy between the nodes of a mesh.

One concept per module (docs/gossip.md explains the protocol on one page):

- ``config``            every knob, with its default named and explained, and the named profiles (lan, wan, local)
- ``clock``             real (asyncio) and simulated time
- ``state``             every owner's versioned key/values, tombstones, generations, heartbeats
- ``digest``, ``delta`` what a node knows, and what a peer is missing (budgeted, gap-free)
- ``codec``             Syn / SynAck / Ack and their msgpack encoding
- ``auth``              signed envelopes: cluster id, HMAC-SHA256, receiver and its generation, replay protection
- ``failure_detector``  phi accrual
- ``membership``        alive / suspect / dead / left, generations, proven and reachable members, garbage collection
- ``liveness``          the failure detector fed from the exchanges, and every liveness change logged and told
- ``verdicts``          deaths a node's own detector declared, published; a peer's confirming a suspicion here
- ``roster``            the members as state and liveness see them together; room at the member cap
- ``admission``         who may enter the membership and who may take over a node id (vouching budget, identity)
- ``keys``              the core's own keys (address, status, down)
- ``transport``         the Transport protocol and the in-memory network (loss, delay, partitions)
- ``grpc_transport``    the Peer gRPC service and its client (HMAC and/or mTLS)
- ``inbound``           each inbound message opened, admitted, applied and answered (the exchange, with I/O)
- ``outbox``            each outbound message sealed, counted and sent; probes (Hello) of unknown addresses
- ``push``              this node's news pushed ahead of the round, and its leave
- ``targets``           whom a round gossips with
- ``listeners``         each state change fanned out to subscribers, liveness and key watchers
- ``stats``             the agent's counters
- ``agent``             GossipAgent: the round loop, and what consumers publish through and read from

The core knows none of its consumers: they publish through the agent and subscribe to it (``p2pnode/peering.py``
wires the node's: its load, its cache summary, and the router's ClusterView).
"""

from p2pnode.gossip.agent import GossipAgent, GossipStats
from p2pnode.gossip.clock import AsyncioClock, Clock, SimClock
from p2pnode.gossip.config import GossipConfig, TlsConfig
from p2pnode.gossip.membership import Member, MemberState
from p2pnode.gossip.transport import InMemoryNetwork, InMemoryTransport, Transport

__all__ = [
    "AsyncioClock",
    "Clock",
    "GossipAgent",
    "GossipConfig",
    "GossipStats",
    "InMemoryNetwork",
    "InMemoryTransport",
    "Member",
    "MemberState",
    "SimClock",
    "TlsConfig",
    "Transport",
]
