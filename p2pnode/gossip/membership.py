"""Membership: which nodes exist and whether they are alive, suspect, dead or gone for good (left).

A member is a node id with a *generation* (its start time in ms, so it grows on every restart) and an advertised
address (its "addr" key). Its life as this node sees it:

    (first heard of) -> alive <-> suspect -> dead -> (forgotten after dead_node_grace_s)
                          |          |        \\-> alive again if its heartbeat moves (same generation)
                          \\----------+-> left (it announced a graceful shutdown) -> (forgotten after the grace)

- alive / suspect / dead come from the failure detector's phi (``suspect_phi``, ``phi_threshold``), and a suspect
  member is also dead while this node holds a peer's verdict on it (``on_verdict``: its own detector's, on this
  life, held ``dead_verdict_rounds`` rounds and until the member is heard beyond it: ``verdicts.py``);
- left comes from the member's own "status" key, written by its ``stop(leave=True)``; it is final for that
  generation;
- a higher generation replaces everything known about the old one (state, failure-detector window, liveness): a
  restarted node is alive at once, whatever its previous life's state;
- forgetting drops the member; the replicated state remembers its (generation, heartbeat) a while longer so that a
  peer still gossiping the old state cannot bring it back (``ClusterState.forget``).

This node itself is always alive and never goes through the failure detector.

A member is *proven* once its heartbeat has advanced since it was first heard of, and *reachable* once it has
answered a message this node sent to its address (a reply signed as it came back on our own call). Proof by
heartbeat is weak: a node holding the secret can advance the heartbeats of members it made up (measured: 5,000 of
them, heartbeating, made 1,023 of a node's 1,024 members proven, the honest peers got 12 of 730 gossip messages
in a minute, and every honest peer turned suspect after ~6 s). An answer from the member's own address cannot be
made up that way: the agent gossips with reachable members first, then proven ones, then the rest, and routers
send to reachable members first (a flood then cannot crowd real peers out of the gossip and get them declared
dead).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from p2pnode.gossip.config import FD_MIN_INTERVAL_ROUNDS, MAX_UNANSWERED_PROBES, GossipConfig
from p2pnode.gossip.failure_detector import FailureDetector

__all__ = ["Member", "MemberState", "Membership", "Transition"]


class MemberState(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"

    @property
    def usable(self) -> bool:
        """Whether requests may be routed there and its cache estimates used (alive or suspect)."""
        return self in (MemberState.ALIVE, MemberState.SUSPECT)


@dataclass(frozen=True, slots=True)
class Member:
    """A snapshot of one member as this node sees it (``GossipAgent.members()``, ``p2pnode status``)."""

    node_id: str
    address: str
    state: MemberState
    generation: int
    heartbeat: int
    #: Seconds since this node last knew its copy of the member's state to be as new as the member's own.
    info_age_s: float
    #: phi of the failure detector (0 for this node; None when not tracked, e.g. left).
    phi: float | None
    is_self: bool


@dataclass(frozen=True, slots=True)
class Transition:
    """A liveness change; ``new`` None means the member was forgotten (garbage-collected)."""

    node_id: str
    old: MemberState | None
    new: MemberState | None
    #: A forgotten member that was established (``Membership.established``: the membership no longer says).
    established: bool = False
    #: Declared dead on a peer's verdict (``verdicts.py``), not by this node's own detector.
    confirmed: bool = False


#: The states whose phi is still judged (a dead member's silence is expected).
_JUDGED = frozenset({MemberState.ALIVE, MemberState.SUSPECT})


class Membership:
    """Liveness of every known node (see the module docstring)."""

    def __init__(self, self_id: str, config: GossipConfig) -> None:
        self.self_id = self_id
        self.config = config
        self.fd = FailureDetector(
            config.fd_window, config.fd_initial_interval_s, config.fd_max_interval_s,
            FD_MIN_INTERVAL_ROUNDS * config.interval_s,
        )  # fmt: skip
        self._states: dict[str, MemberState] = {self_id: MemberState.ALIVE}
        self._generations: dict[str, int] = {}
        self._down_since: dict[str, float] = {}
        self._proven: set[str] = set()
        self._reachable: set[str] = set()
        self._spoke: set[str] = set()  # sent us a message itself in this life (a weaker sign: signable by any holder)
        self._established: set[str] = set()  # reachable in this life or an earlier one, until forgotten
        self._heard_at: dict[str, float] = {}  # when each member's current life was first heard of
        #: member -> (last heartbeat the declarer heard, until): a peer's detector declared its current life dead (a
        #: new life drops it: ``on_node``)
        self._verdicts: dict[str, tuple[int, float]] = {}

    def state(self, node_id: str) -> MemberState | None:
        return self._states.get(node_id)

    def states(self) -> dict[str, MemberState]:
        return dict(self._states)

    def down_since(self, node_id: str) -> float | None:
        """When the member became dead or left (None while it is alive or suspect)."""
        return self._down_since.get(node_id)

    def proven(self, node_id: str) -> bool:
        """Whether the member's heartbeat advanced in this life (see the module docstring); this node: True."""
        return node_id == self.self_id or node_id in self._proven

    def reachable(self, node_id: str) -> bool:
        """Whether the member answered a message this node sent to its address, in this life; this node: True."""
        return node_id == self.self_id or node_id in self._reachable

    def mark_reachable(self, node_id: str) -> None:
        """The member answered us at its address (its current life: a new generation starts unreachable)."""
        if node_id in self._states and node_id != self.self_id:
            self._reachable.add(node_id)
            self._established.add(node_id)

    def established(self, node_id: str) -> bool:
        """Whether the member was reachable in this life or an earlier one (a real process answered at its address;
        a made-up member never is): its changes are what an operator must see, whatever else floods the log."""
        return node_id in self._established

    def spoke(self, node_id: str) -> bool:
        """Whether a message signed as the member, in this life, reached this node (any secret holder can sign one:
        a hint for ordering gossip targets, never a proof)."""
        return node_id in self._spoke

    def mark_spoke(self, node_id: str) -> None:
        if node_id in self._states and node_id != self.self_id:
            self._spoke.add(node_id)

    def newest_unreachable(self, keep: frozenset[str] = frozenset()) -> str | None:
        """The member never reachable that was heard of last (not in ``keep``): the first to give way at the member
        cap to a member that must get in (a node that returns, one that introduced itself), if any."""
        candidates = [n for n in self._heard_at if n not in self._reachable and n not in keep and n != self.self_id]
        return max(candidates, key=self._heard_at.__getitem__, default=None)

    def longest_down(self) -> str | None:
        """The member dead or left for the longest time (the first to give way at the member cap), if any."""
        return min(self._down_since, key=self._down_since.__getitem__, default=None)

    def phi(self, node_id: str, now: float) -> float | None:
        return 0.0 if node_id == self.self_id else self.fd.phi(node_id, now)

    def stalest(self, count: int) -> list[str]:
        """The ``count`` members alive or suspect here whose heartbeat this node heard advance longest ago: those a
        Syn of a shard names whatever their shard, so that the reply brings their newest heartbeats (digest.py)."""
        if count <= 0:
            return []
        states = self._states
        return self.fd.stalest(count, lambda node_id: states.get(node_id) in _JUDGED)

    def stale_members(self, now: float, min_phi: float, count: int) -> list[str]:
        """Up to ``count`` alive members whose phi here is at least ``min_phi``, heard longest ago first: those a
        round asks directly for their heartbeat (agent.py, ``stale_probe_phi``). Members that answered this node
        before come first, then at most ``MAX_UNANSWERED_PROBES`` whose heartbeat it saw advance but that never
        answered it (a node has spoken with few of a large mesh's members; a member made up by a secret holder
        never answers, and its address may be anyone's)."""
        if min_phi <= 0 or count <= 0:
            return []
        states, reachable, proven, fd = self._states, self._reachable, self._proven, self.fd

        def answered(node_id: str) -> bool:
            return node_id in reachable and states.get(node_id) is MemberState.ALIVE

        def heard(node_id: str) -> bool:
            return node_id in proven and node_id not in reachable and states.get(node_id) is MemberState.ALIVE

        out = [n for n in fd.stalest(count, answered) if (fd.phi(n, now) or 0.0) >= min_phi]
        more = min(count - len(out), MAX_UNANSWERED_PROBES)
        return out + [n for n in fd.stalest(more, heard) if (fd.phi(n, now) or 0.0) >= min_phi]

    def established_phi_max(self, now: float) -> float:
        """The highest phi of an established member still judged (alive or suspect): how near a real peer is to
        suspicion."""
        phis = (self.fd.phi(n, now) for n in self._established if self._states.get(n) in _JUDGED)
        return max((phi for phi in phis if phi is not None), default=0.0)

    # ------------------------------------------------------------------------------------------------- events

    def on_node(self, node_id: str, generation: int, now: float) -> Transition | None:
        """A node's state appeared (first heard of, or replaced). A new generation starts a new life."""
        if node_id == self.self_id or self._generations.get(node_id) == generation:
            return None
        self._generations[node_id] = generation
        old = self._states.get(node_id)
        self._proven.discard(node_id)
        self._reachable.discard(node_id)
        self._spoke.discard(node_id)
        self._heard_at[node_id] = now
        self._verdicts.pop(node_id, None)
        self.fd.remove(node_id)
        self.fd.heartbeat(node_id, now)
        self._down_since.pop(node_id, None)
        self._states[node_id] = MemberState.ALIVE
        return None if old is MemberState.ALIVE else Transition(node_id, old, MemberState.ALIVE)

    def on_heartbeat(self, node_id: str, now: float, count: int | None = None) -> Transition | None:
        """The node's heartbeat advanced (to ``count``, when the caller knows it: the failure detector samples a jump
        of several steps per step)."""
        old = self._states.get(node_id)
        if old is None or old is MemberState.LEFT or node_id == self.self_id:
            return None
        if old is MemberState.DEAD:
            self.fd.remove(node_id)  # a fresh window: the rhythm before the failure says nothing now
        self.fd.heartbeat(node_id, now, count)
        if self._verdicts:
            verdict = self._verdicts.get(node_id)
            if verdict is not None and (count is None or count > verdict[0]):
                del self._verdicts[node_id]  # heard beyond what the declarer heard: its verdict no longer speaks
        if now > self._heard_at.get(node_id, now):  # not the heartbeat the member was first heard of with
            self._proven.add(node_id)
        if old is MemberState.DEAD:
            self._down_since.pop(node_id, None)
            self._states[node_id] = MemberState.ALIVE
            return Transition(node_id, old, MemberState.ALIVE)
        return None

    def on_left(self, node_id: str, now: float) -> Transition | None:
        """The node announced a graceful shutdown."""
        old = self._states.get(node_id)
        if old is None or old is MemberState.LEFT or node_id == self.self_id:
            return None
        self._states[node_id] = MemberState.LEFT
        self._down_since[node_id] = now
        self.fd.remove(node_id)
        return Transition(node_id, old, MemberState.LEFT)

    def on_verdict(
        self, node_id: str, generation: int, heartbeat: int, known_heartbeat: int, now: float, until: float
    ) -> None:
        """A peer's own detector declared ``node_id`` dead in its life ``generation``, having last heard its heartbeat
        ``heartbeat`` (``verdicts.py``); this node's copy has reached ``known_heartbeat``. Held until ``until`` and
        acted on by ``update``: the member is dead at the first evaluation that finds it suspect while it holds. A
        verdict on a member heard here beyond ``heartbeat`` is not held, and one already held is not re-armed."""
        if node_id == self.self_id or self._generations.get(node_id) != generation or known_heartbeat > heartbeat:
            return  # unknown here, another life (a restarted member), or heard here since the declarer last did
        if self._states.get(node_id) not in _JUDGED:
            return
        held = self._verdicts.get(node_id)
        if held is not None and held[0] >= heartbeat and held[1] >= now:
            return  # the same verdict again (the declarer's key changed for another member): its time runs on
        self._verdicts[node_id] = (heartbeat, until)

    def _verdict_holds(self, node_id: str, now: float) -> bool:
        """Whether a peer's verdict on the member's current life is still heeded (dropped once it is not)."""
        verdict = self._verdicts.get(node_id)
        if verdict is None:
            return False
        if now > verdict[1]:
            del self._verdicts[node_id]
            return False
        return True

    def forget(self, node_id: str) -> None:
        self._established.discard(node_id)
        self._proven.discard(node_id)
        self._reachable.discard(node_id)
        self._spoke.discard(node_id)
        self._heard_at.pop(node_id, None)
        self._verdicts.pop(node_id, None)
        self._states.pop(node_id, None)
        self._generations.pop(node_id, None)
        self._down_since.pop(node_id, None)
        self.fd.remove(node_id)

    # ------------------------------------------------------------------------------------------------- rounds

    def update(self, now: float) -> tuple[list[Transition], list[str]]:
        """Re-evaluate every member's phi; returns (liveness transitions, members to forget now)."""
        transitions: list[Transition] = []
        expired: list[str] = []
        threshold = self.config.phi_threshold
        suspect = self.config.suspect_phi
        grace = self.config.dead_node_grace_s
        for node_id, old in self._states.items():
            if node_id == self.self_id:
                continue
            if old is not MemberState.LEFT:
                phi = self.fd.phi(node_id, now)
                if phi is None:
                    continue
                confirmed = False
                if phi > threshold or old is MemberState.DEAD:  # only a heartbeat brings a dead node back
                    new = MemberState.DEAD
                elif phi > suspect:
                    confirmed = self._verdict_holds(node_id, now)
                    new = MemberState.DEAD if confirmed else MemberState.SUSPECT
                else:
                    new = MemberState.ALIVE
                if new is not old:
                    self._states[node_id] = new
                    transitions.append(Transition(node_id, old, new, confirmed=confirmed))
                    if new is MemberState.DEAD:
                        self._down_since[node_id] = now
            since = self._down_since.get(node_id)
            if since is not None and now - since >= grace:
                expired.append(node_id)
        for node_id in expired:
            transitions.append(Transition(node_id, self._states[node_id], None, node_id in self._established))
            self.forget(node_id)
        return transitions, expired
