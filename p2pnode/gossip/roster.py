"""The members as the node sees them: the replicated state (who exists, at which address, in which life) and the
membership (alive, suspect, dead, left) read together, and the places given up at the member cap.

``membership.py`` knows liveness only, and ``state.py`` knows the maps only; every question about a peer that
needs both -- whom to address a message to, which life to seal it for, what ``p2pnode status`` lists, which
member gives way to a new one -- is answered here.

At most ``max_members`` members are kept (admission.py, rule 2): a new member takes the place of the member dead
or left the longest (``make_room``, asked by the state when it is full); one that must get in -- it returns, or
introduces itself -- may take the place of the never-reachable member heard of last (``displace``), never a
seed's member and never one that answered us.
"""

from __future__ import annotations

from p2pnode.gossip.clock import Clock
from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.liveness import Liveness
from p2pnode.gossip.membership import Member, Membership, MemberState, Transition
from p2pnode.gossip.state import ClusterState, NodeState

__all__ = ["Roster"]


class Roster:
    """Every known member, from the state and the membership together (see the module docstring)."""

    def __init__(
        self,
        self_id: str,
        seeds: list[str],
        state: ClusterState,
        liveness: Liveness,
        clock: Clock,
        config: GossipConfig,
    ) -> None:
        self.self_id = self_id
        self.seeds = seeds
        self.state = state
        self.liveness = liveness
        self.membership: Membership = liveness.membership
        self.clock = clock
        self.config = config

    def peers(self) -> list[tuple[str, str, MemberState]]:
        """(node id, address, state) of every other known node that has published an address."""
        out = []
        states = self.membership.state
        for node_id, node in self.state.nodes.items():
            if node_id == self.self_id:
                continue
            address = _address(node)
            if address:
                out.append((node_id, address, states(node_id) or MemberState.DEAD))
        return out

    def address_of(self, node_id: str) -> str:
        """The address ``node_id`` published ("" when it published none, or is not known)."""
        node = self.state.nodes.get(node_id)
        return _address(node) if node is not None else ""

    def ids_by_address(self) -> dict[str, str]:
        """The node id to address a message to, by address (a usable member wins over a dead one there)."""
        ids: dict[str, str] = {}
        for node_id, address, _ in sorted(self.peers(), key=lambda p: p[2].usable):
            ids[address] = node_id
        return ids

    def generation_of(self, node_id: str) -> int:
        """The generation (life) of ``node_id`` this node knows -- what a message to it is sealed for -- or 0."""
        node = self.state.nodes.get(node_id)
        return 0 if node is None else node.generation

    def usable(self, node_id: str) -> bool:
        """Whether ``node_id`` is alive or suspect (this node always is)."""
        return (self.membership.state(node_id) or MemberState.DEAD).usable

    def usable_ids(self) -> list[str]:
        """The ids of the usable members, this node included, sorted."""
        return sorted(n for n in self.state.nodes if self.usable(n))

    def trusted(self, node_id: str) -> bool:
        """Alive (not suspect) and reachable (it answered a message of ours at its address)."""
        return self.membership.state(node_id) is MemberState.ALIVE and self.membership.reachable(node_id)

    def members(self) -> list[Member]:
        """Every known member (this node included), sorted by node id."""
        now = self.clock.now()
        out = []
        for node_id in sorted(self.state.nodes):
            node = self.state.nodes[node_id]
            is_self = node_id == self.self_id
            out.append(Member(
                node_id=node_id,
                address=_address(node),
                state=self.membership.state(node_id) or MemberState.DEAD,
                generation=node.generation,
                heartbeat=node.heartbeat,
                info_age_s=0.0 if is_self else max(0.0, now - node.fresh_at),
                phi=self.membership.phi(node_id, now),
                is_self=is_self,
            ))
        return out

    # ---------------------------------------------------------------------------------------- room at the cap

    def make_room(self) -> bool:
        """At the member cap: forget the member dead or left the longest, so a new one can be taken."""
        victim = self.membership.longest_down()
        if victim is None:
            return False
        self._evict(victim)
        return True

    def displace(self) -> bool:
        """At the member cap, for a member that must get in (admission.py, rule 2): forget the member never
        reachable heard of last (never a seed's member, never one that answered us)."""
        seeds = frozenset(n for n, address, _ in self.peers() if address in self.seeds)
        victim = self.membership.newest_unreachable(keep=seeds)
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _evict(self, victim: str) -> None:
        self.liveness.transition(Transition(victim, self.membership.state(victim), None))
        self.membership.forget(victim)
        self.state.forget(victim, self.clock.now(), self.config.dead_node_grace_s)


def _address(node: NodeState) -> str:
    """The address a node published, decoded ("" when it published none): the one decode of ``ADDRESS_KEY``."""
    address = node.get(ADDRESS_KEY)
    return address.decode(errors="replace") if address else ""
