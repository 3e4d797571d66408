"""Failure detection, wired into the agent: where the heartbeats the exchanges bring meet the phi-accrual detector,
and where each liveness change is logged and told to the node.

``membership.py`` holds the states and ``failure_detector.py`` the arithmetic; neither knows of the replicated
state, the log or the node. Here:

- every heartbeat advance an exchange observed (in a digest or a delta) is fed to the detector with the count it
  reached (a jump of k steps after t seconds is one sample of t / k: relays bring a far node's heartbeat in jumps);
- phi is re-evaluated at the start of every round and before every staggered Syn (a death is declared within a
  third of a round of phi crossing the threshold), and members dead or left longer than ``dead_node_grace_s`` are
  forgotten by the membership and the state together;
- every transition is told to the liveness watchers (the node cancels forwards to a peer turning suspect) and
  logged: an *established* member's (one that answered this node at its address, in this life or an earlier one:
  membership.py) always, every other at most ``DEFAULT_MEMBERSHIP_LOG_BURST`` lines a minute (a flood of members is
  counted, not logged). With one budget for both, a flood spent it on made-up members: 8,045 lines held back in a
  minute and not one said that three honest peers had turned suspect;
- a death this node's own detector declares is published in its ``down`` key (written once per evaluation), and a
  peer's verdict is held and makes a member dead at the first evaluation that finds it suspect (``verdicts.py``: a
  far observer hears a heartbeat later than a near one);
- a member declared dead here that never answered this node at its address (made up, or never exchanged with) is
  *withheld*: left out of this node's digests and deltas until its heartbeat moves again (a peer holding it alive
  brings that) or it is forgotten. Before, an insider's made-up members, dead once its flood ended, went on being
  gossiped by every node for the 300 s grace, and relayed back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from p2pnode.gossip.clock import Clock
from p2pnode.gossip.config import (
    DEFAULT_MEMBERSHIP_LOG_BURST,
    MAX_DEAD_VERDICTS,
    MAX_NEWCOMERS,
    NEWCOMER_ROUNDS,
    GossipConfig,
)
from p2pnode.gossip.keys import DOWN_KEY
from p2pnode.gossip.membership import Membership, MemberState, Transition
from p2pnode.gossip.state import ClusterState
from p2pnode.gossip.stats import GossipStats
from p2pnode.gossip.verdicts import OwnVerdicts, decode_verdicts
from p2pnode.log_limit import LogLimiter

__all__ = ["Liveness", "LivenessWatcher"]

log = logging.getLogger("p2pnode.gossip")

LivenessWatcher = Callable[[Transition], None]


class Liveness:
    """The membership's liveness, kept current from the exchanges and the rounds (see the module docstring)."""

    def __init__(
        self, membership: Membership, state: ClusterState, config: GossipConfig, stats: GossipStats, clock: Clock
    ) -> None:
        self.membership = membership
        self.state = state
        self.config = config
        self.stats = stats
        self.clock = clock
        self._watchers: list[LivenessWatcher] = []
        self._log = LogLimiter(log, burst=DEFAULT_MEMBERSHIP_LOG_BURST, clock=clock.now)
        keep_s = config.dead_verdict_rounds * config.interval_s
        self._verdicts = OwnVerdicts(keep_s) if keep_s > 0 else None  # None: verdicts neither published nor heeded
        self._verdicts_changed = False  # this node's own verdicts changed since its ``down`` key was last written
        self._declared = False  # ... and one of the changes is a new death
        #: Peers whose ``down`` key named a member lately (the newest MAX_DEAD_VERDICTS, for the verdicts' rounds),
        #: and members new here lately (a join or a new life: the newest MAX_NEWCOMERS, for NEWCOMER_ROUNDS): a
        #: shard's Syn names both whatever their shard, so that their news spreads at the pace of whole digests.
        self._declarers = RecentIds(MAX_DEAD_VERDICTS, keep_s)
        self._newcomers = RecentIds(MAX_NEWCOMERS, NEWCOMER_ROUNDS * config.interval_s)
        #: Called once a new death this node declared is in its ``down`` key (the agent pushes it at once).
        self.on_declared: Callable[[], None] | None = None

    def watch(self, callback: LivenessWatcher) -> None:
        self._watchers.append(callback)

    def update(self, now: float) -> None:
        """Re-evaluate every member's phi (alive / suspect / dead) and forget those gone longer than the grace."""
        transitions, expired = self.membership.update(now)
        phi_milli = int(self.membership.established_phi_max(now) * 1000)
        self.stats.established_phi_max_milli = max(self.stats.established_phi_max_milli, phi_milli)
        for t in transitions:
            self.transition(t)
        for node_id in expired:
            self.state.forget(node_id, now, self.config.dead_node_grace_s)
        verdicts = self._verdicts
        if verdicts is not None and (verdicts.expire(now) or self._verdicts_changed):
            self._verdicts_changed = False
            self.state.set(DOWN_KEY, verdicts.value(), now)  # once per evaluation, however many deaths it saw
            if self._declared:
                self._declared = False
                if self.on_declared is not None:
                    self.on_declared()

    def recent(self) -> list[str]:
        """The members a Syn of a shard names whatever their shard (digest.py): the peers whose verdicts this node
        heard within ``dead_verdict_rounds`` and the members new here within ``NEWCOMER_ROUNDS``."""
        now = self.clock.now()
        return self._declarers.ids(now) + self._newcomers.ids(now)

    def verdicts_heard(self, declarer: str, value: bytes | None) -> None:
        """A peer's ``down`` key changed: its own detector's verdicts, held for the next evaluations (``update``)."""
        if self._verdicts is None or declarer == self.membership.self_id:
            return
        now = self.clock.now()
        until = now + self._verdicts.keep_s
        nodes = self.state.nodes
        verdicts = decode_verdicts(value)
        if verdicts:
            self._declarers.note(declarer, now)
        for node_id, generation, heartbeat in verdicts:
            node = nodes.get(node_id)
            if node is not None:  # its heartbeat as this node's copy has it: a message's digest moved it already
                self.membership.on_verdict(node_id, generation, heartbeat, node.heartbeat, now, until)

    def heartbeats(self, node_ids: Iterable[str], now: float) -> None:
        """The heartbeats of ``node_ids`` advanced (an exchange saw it): sample the detector at the count reached."""
        nodes = self.state.nodes
        for node_id in node_ids:
            node = nodes.get(node_id)
            self.transition(self.membership.on_heartbeat(node_id, now, node.heartbeat if node is not None else None))

    def node_appeared(self, node_id: str, generation: int) -> None:
        """A node's state appeared in the replicated state (first heard of, or a new life)."""
        now = self.clock.now()
        self._newcomers.note(node_id, now)
        self.transition(self.membership.on_node(node_id, generation, now))

    def node_left(self, node_id: str) -> None:
        """The node wrote its "left" status (a graceful stop, or a withdrawal)."""
        self.transition(self.membership.on_left(node_id, self.clock.now()))

    def transition(self, t: Transition | None) -> None:
        """Log a liveness change and tell the watchers (None: nothing changed)."""
        if t is None:
            return
        established = t.established or self.membership.established(t.node_id)
        self._note_verdict(t, established)
        if t.new is MemberState.DEAD and not established:
            self.state.withheld.add(t.node_id)  # no longer spoken for (module docstring)
        else:
            self.state.withheld.discard(t.node_id)
        if established:
            if t.new is None:
                log.info("gossip: forgot %s (was %s)", t.node_id, t.old)
            else:
                log.info("gossip: %s is %s (was %s)", t.node_id, t.new, t.old)
        elif t.new is None:
            self._log.info("membership", "gossip: forgot %s (was %s)", t.node_id, t.old)
        else:
            self._log.info("membership", "gossip: %s is %s (was %s)", t.node_id, t.new, t.old)
        for watcher in self._watchers:
            try:
                watcher(t)
            except Exception:  # a watcher's bug must not break gossip
                log.exception("gossip: liveness watcher failed")
                self.stats.internal_errors += 1

    def _note_verdict(self, t: Transition, established: bool) -> None:
        """Keep this node's own verdicts (``verdicts.py``) in step with ``t``; the key is written by ``update``."""
        if t.new is MemberState.DEAD and t.confirmed:
            self.stats.deaths_confirmed += 1
        verdicts = self._verdicts
        if verdicts is None:
            return
        if t.new is MemberState.DEAD:
            node = self.state.nodes.get(t.node_id)
            # its own detector's or a verdict it followed (it suspected the member too), on a member that answered
            # it at its address: relayed so, a verdict reaches every suspecting node within a few pushes
            if established and node is not None:
                verdicts.declare(t.node_id, node.generation, node.heartbeat, self.clock.now())
                self._verdicts_changed = self._declared = True
        elif t.old is MemberState.DEAD and verdicts.withdraw(t.node_id):  # heard again, a new life, or forgotten
            self._verdicts_changed = True

    def flush(self) -> None:
        """Say how many membership lines the rate limit held back (once a round)."""
        self._log.flush()


class RecentIds:
    """The newest ``limit`` ids noted within the last ``keep_s`` seconds, oldest first."""

    def __init__(self, limit: int, keep_s: float) -> None:
        self.limit = limit
        self.keep_s = keep_s
        self._until: OrderedDict[str, float] = OrderedDict()

    def note(self, node_id: str, now: float) -> None:
        until = self._until
        until[node_id] = now + self.keep_s
        until.move_to_end(node_id)
        while len(until) > self.limit:
            until.popitem(last=False)

    def ids(self, now: float) -> list[str]:
        until = self._until
        while until and next(iter(until.values())) < now:
            until.popitem(last=False)
        return list(until)
