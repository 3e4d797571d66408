"""Who may enter the membership, and who may take over a node id: the rules every delta and every sender passes
before it changes who the members are (``Admission``: the agent's, with a ``MessageGate`` per inbound message).

Why. Every node holding the cluster secret can say anything about anyone, and the protocol relays it. Measured on a
4-node mesh (scripts/chaos.py ``insider_flood``, docs/results-history.md "Faults"): one secret holder announcing 5,000
members that keep heartbeating filled every node's table to the cap with members nobody could reach, every honest
peer turned suspect ~6 s later and dead ~12 s later, and an honest node that left and came back was refused for want
of room. And a second process started under an existing node id, seeded to a third node, made every node switch that
id to the newcomer's address within seconds while the original still ran.

Rules.

1. **Vouching budget** (``VouchBudget``). The sender of a message that brings a node id this node has never known
   *vouches* for it. Each sender may vouch for at most ``limit`` new members per ``window_s`` here (a token bucket
   refilled continuously: a burst of ``limit``, then ``limit`` a window); beyond it the new members it brings are
   refused, counted and logged as its doing. A node introducing itself (the member is the sender) and a node id
   known before (a member that returns after being forgotten) spend nothing. An honest node vouches for the members
   it learned of: a seed of a mesh forming at once vouches for many, which then reach a node through several
   senders (each with its own budget) over a few more rounds.

   **A join wave is not a flood** (``Deferred``). Past the budget, a member whose delta says it introduced itself
   (its ``origin`` is itself: the first node that took it heard it from the member) is *deferred*, not refused as
   a flood: counted (``vouches_deferred``), nothing logged. Measured before (scripts/bench_gossip.py
   ``--cold-start``): 150 members started within 5 s had 131 of them refuse vouches and log 410 WARNING lines
   calling their honest peers "a flood of made-up members or a bug". A deferred member is checked a window later:
   taken by then (it reached this node through another sender or itself, as a real member of a forming mesh
   does), it was a join wave; still not taken, it is counted refused and logged as a flood, naming the sender, as
   a refusal is at once otherwise. More deferred at once than ``max_members`` (more than a mesh may hold) is a flood
   too: the oldest is judged at once. What is taken is the same either way: a flood that names its made-up members
   as their own origin gets in no faster than one that does not, and is logged a window later.

   **A deferred member is asked** (``join_probes``). Waiting for other senders' budgets held a join wave back: a
   node joining a formed mesh defers most of it (300 members started within 20 s through three seeds: every member
   held every other alive 5 s after the last start, 2 s with no budget at all). So this node sends a deferred member
   a Hello at the address its delta names (``max_join_probes`` a round); a HelloAck from that node id -- signed with
   the cluster secret, bound to this node and to the Hello's nonce -- is first-hand word that it runs there, and the
   member gets in as soon as any peer brings it again, spending no budget (as one introducing itself does). A
   made-up member nobody can reach, the flood the budget is for, never answers; a secret holder that answers for the
   members it makes up could have introduced them itself, which the budget never bounded (only per-node
   certificates do: rule 4, under which the answer's sender is the certificate's).
2. **Room at the cap** (``Roster.make_room`` and ``Roster.displace``). A new member takes the place of the member
   dead or left the longest; a member that must get in -- one that returns, or that introduced itself -- may also
   take the place of the member never reachable (never answered this node at its address) heard of last. A member
   that answered us is never displaced.
3. **Identity** (``judge_claim``). A node id's life (generation) and address are replaced only when the change is
   what a restart looks like: a new generation at the same address (a restart in place), or at any address once
   the earlier life is seen dead or has left (a rescheduled node). A new life at another address while the known
   one is alive or suspect, the same life at another address, or an earlier life still talking, is a second process
   under that id: refused (the envelope with ALREADY_EXISTS, the relayed delta dropped) and logged at WARNING by
   every node that sees it. The mesh keeps the life it knows.

5. **Refused lives stay out** (``Shunned``). A member's life refused at the cap, or forgotten (dead past the
   grace, or displaced) without ever having answered this node at its address, is refused when a relay brings it back
   (same generation), for ``DEFAULT_SHUN_S``. Before, a made-up member that an insider kept heartbeating came back
   through honest peers' gossip as a "returning" member (known before: no budget spent, and it may displace others)
   40 s after the flood stopped. The member's own message (it introduces itself) and a new life are not refused.

4. **Identity bound to certificates** (``GossipConfig.certified_ids``: mTLS, each node's certificate naming its node
   id). A sender is its certificate (auth.py), so a node id's new life is taken only from that node itself -- its
   own message, its own reset -- never from a relay (``MessageGate.new_life`` defers it: the node is probed once its
   known life is in doubt, and its answer is first-hand), and a first-hand claim wins over a life this node only
   ever heard of through relays (one the node never confirmed: it never spoke to us in it). Before, a relayed new
   life was taken once the earlier one was seen dead, from any certificate holder's word.

What it does not stop, with a shared secret alone: a secret holder can sign as any node id (the budget is per
claimed sender, so one that invents a sender per member is bounded only by the cap and rule 2, while honest
members, reachable, keep their place and their liveness); it can write keys of another member's current life (say,
"left"); and once a node is seen dead (frozen 20 s, say), it can take its id: a new life at another address is what
a rescheduled node looks like, and a secret holder cannot be told apart from it. Such a move is logged as a WARNING
on every node that takes it, and the original, if it comes back, finds itself superseded and says so (agent.py).
Only per-node certificates prevent it (rule 4).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from p2pnode.gossip.auth import Rejected, RejectReason
from p2pnode.gossip.clock import Clock
from p2pnode.gossip.config import SHUNNED_PER_MEMBER, GossipConfig
from p2pnode.gossip.delta import NodeDelta
from p2pnode.gossip.keys import address_of, delta_address
from p2pnode.gossip.membership import Membership, MemberState, Transition
from p2pnode.gossip.state import ClusterState, NodeState
from p2pnode.gossip.stats import GossipStats
from p2pnode.log_limit import LogLimiter

__all__ = ["Admission", "Deferred", "MessageGate", "Shunned", "VouchBudget", "judge_claim"]


def most_common_ids(counts: Counter[str], shown: int = 3) -> str:
    """The ``shown`` ids counted most, each cut to 64 characters with its count, and how many more there are: what a
    flood's warning names (its ids are the sender's to choose, so each is cut)."""
    top = ", ".join(f"{node_id[:64]} ({n})" for node_id, n in counts.most_common(shown))
    more = len(counts) - shown
    return top + (f" and {more} more" if more > 0 else "")


class VouchBudget:
    """New members each sender may still vouch for (rule 1): a token bucket per sender, ``limit`` tokens refilled
    over ``window_s``, for at most ``max_senders`` senders (the least recently used is forgotten: it starts over
    with a full bucket, which costs at most ``limit`` more members)."""

    def __init__(self, limit: int, window_s: float, max_senders: int) -> None:
        if limit < 1 or window_s <= 0 or max_senders < 1:
            raise ValueError("limit, window_s and max_senders must be positive")
        self.limit = limit
        self.window_s = window_s
        self.max_senders = max_senders
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # sender -> (tokens, at)

    def available(self, sender: str, now: float) -> float:
        """Tokens ``sender`` has at ``now`` (``limit`` for a sender never seen)."""
        tokens, at = self._buckets.get(sender, (float(self.limit), now))
        return min(float(self.limit), tokens + (now - at) * self.limit / self.window_s)

    def spend(self, sender: str, now: float) -> bool:
        """Take one token of ``sender``; False (and nothing taken) when it has none left."""
        tokens = self.available(sender, now)
        if tokens < 1.0:
            return False
        self._buckets[sender] = (tokens - 1.0, now)
        self._buckets.move_to_end(sender)
        while len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        return True


class Shunned:
    """Lives of node ids a relay may not bring back (rule 5): node id -> (generation, until), at most ``max_ids`` (the
    oldest forgotten first)."""

    def __init__(self, remember_s: float, max_ids: int) -> None:
        self.remember_s = remember_s
        self.max_ids = max_ids
        self._lives: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def add(self, node_id: str, generation: int, now: float) -> None:
        self._lives[node_id] = (generation, now + self.remember_s)
        self._lives.move_to_end(node_id)
        while len(self._lives) > self.max_ids:
            self._lives.popitem(last=False)

    def holds(self, node_id: str, generation: int | None, now: float) -> bool:
        """Whether ``node_id``'s life ``generation`` (None: any life) is refused from a relay now."""
        record = self._lives.get(node_id)
        if record is None:
            return False
        shunned, until = record
        if until <= now:
            del self._lives[node_id]
            return False
        return generation is None or generation <= shunned

    def __len__(self) -> int:
        return len(self._lives)


class Deferred:
    """Members refused past a sender's budget whose delta says they introduced themselves (rule 1: maybe a join
    wave): node id -> (sender that brought it first, when), at most ``max_ids`` (beyond it the oldest is judged at
    once). ``due(now, held)`` returns the members deferred ``wait_s`` ago or more that ``held`` (whether the node
    holds a member now) says never got in: made up, by the sender named."""

    def __init__(self, wait_s: float, max_ids: int) -> None:
        self.wait_s = wait_s
        self.max_ids = max_ids
        self._members: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._overflow: list[tuple[str, str]] = []

    def add(self, node_id: str, sender: str, now: float) -> bool:
        """Defer ``node_id``, brought by ``sender``; False when it already waits."""
        if node_id in self._members:
            return False  # the first deferral starts the wait; a member brought again by others waits no longer
        self._members[node_id] = (sender, now)
        while len(self._members) > self.max_ids:
            oldest, (first_sender, _) = self._members.popitem(last=False)
            self._overflow.append((oldest, first_sender))
        return True

    def due(self, now: float, held: Callable[[str], bool]) -> list[tuple[str, str]]:
        """``(node id, sender)`` of the members judged now that never got in (see the class docstring)."""
        out = [(n, s) for n, s in self._overflow if not held(n)]
        self._overflow.clear()
        members = self._members
        while members:
            node_id, (sender, since) = next(iter(members.items()))
            if now - since < self.wait_s:
                break
            del members[node_id]
            if not held(node_id):
                out.append((node_id, sender))
        return out

    def __len__(self) -> int:
        return len(self._members)


def judge_claim(
    known_generation: int,
    known_address: str | None,
    known_state: MemberState | None,
    generation: int,
    address: str | None,
) -> str | None:
    """Whether a claim to be a known node -- life ``generation`` at ``address`` (None: not said) -- may be taken,
    given the life this node knows (rule 3). None when it may; else why not, for the warning."""
    if generation == known_generation:
        if known_address and address and address != known_address:
            return f"its life {known_generation} runs at {known_address}, not {address}"
        return None
    if generation < known_generation:
        return f"it runs a later life ({known_generation}) at {known_address or 'an unknown address'}"
    if known_state in (None, MemberState.DEAD, MemberState.LEFT):
        return None
    if not known_address or address == known_address:
        return None  # a restart in place (or nothing to compare with)
    return f"its life {known_generation} at {known_address} is {known_state}"


class Admission:
    """The rules as the agent applies them: one vouching budget per sender, room at the cap (``displace``: forget
    a member that never answered us, for one that must get in, True when it did), identity checks of senders.
    Refusals are counted in ``stats`` and logged through ``log`` (a few lines a minute per kind)."""

    def __init__(
        self,
        state: ClusterState,
        membership: Membership,
        config: GossipConfig,
        stats: GossipStats,
        clock: Clock,
        log: LogLimiter,
        displace: Callable[[], bool],
    ) -> None:
        self.state = state
        self.membership = membership
        self.config = config
        self.stats = stats
        self.clock = clock
        self.log = log
        self.displace = displace
        self.vouches = VouchBudget(config.max_vouched_members, config.vouch_window_s, max_senders=config.max_members)
        self.shunned = Shunned(config.shun_s, SHUNNED_PER_MEMBER * config.max_members)
        self.deferred = Deferred(config.vouch_window_s, config.max_members)
        #: Deferred members to ask at their address (node id -> address), and those that answered as themselves (node
        #: id -> until when that word lets them in), each at most max_members, the oldest dropped first.
        self._to_probe: OrderedDict[str, str] = OrderedDict()
        self._answered: OrderedDict[str, float] = OrderedDict()

    def defer(self, node_id: str, sender: str, address: str | None, now: float) -> None:
        """Defer a member that introduced itself, past ``sender``'s budget; ask it at ``address`` (rule 1)."""
        if self.deferred.add(node_id, sender, now) and address and self.config.max_join_probes:
            self._to_probe[node_id] = address
            while len(self._to_probe) > self.config.max_members:
                self._to_probe.popitem(last=False)

    def join_probes(self, limit: int) -> list[tuple[str, str]]:
        """Up to ``limit`` deferred members to ask now, ``(node id, address)``, oldest first (those that got in
        meanwhile skipped)."""
        out: list[tuple[str, str]] = []
        while self._to_probe and len(out) < limit:
            node_id, address = self._to_probe.popitem(last=False)
            if node_id not in self.state.nodes:
                out.append((node_id, address))
        return out

    def answered_join_probe(self, asked: str, answered_by: str) -> None:
        """A HelloAck to the join probe that asked ``asked``, from ``answered_by`` (its envelope's verified sender):
        the member runs at its address; it gets in when next brought, for a vouching window."""
        if answered_by != asked:
            return  # another node runs there (a stale or made-up address): the member stays deferred
        self._answered[asked] = self.clock.now() + self.config.vouch_window_s
        self._answered.move_to_end(asked)
        while len(self._answered) > self.config.max_members:
            self._answered.popitem(last=False)
        self.stats.joins_confirmed += 1

    def answered_as_itself(self, node_id: str) -> bool:
        """Whether ``node_id`` answered a join probe of this node within the last vouching window."""
        until = self._answered.get(node_id)
        if until is None:
            return False
        if until <= self.clock.now():
            del self._answered[node_id]
            return False
        return True

    def judge_deferred(self, now: float) -> None:
        """Count and log as a flood the members deferred a window ago that never got in (rule 1), once a round."""
        made_up = self.deferred.due(now, lambda node_id: node_id in self.state.nodes)
        if not made_up:
            return
        self.stats.vouches_refused += len(made_up)
        top = most_common_ids(Counter(sender for _, sender in made_up))
        self.log.warning(
            "vouch_deferred",
            "gossip: %d new member(s) said to have introduced themselves (e.g. %s), deferred past their sender's "
            "max_vouched_members, never reached this node through any other peer within %.0f s: made up (a flood "
            "naming its members as their own origin), sent by %s",
            len(made_up), made_up[0][0][:64], self.deferred.wait_s, top,
        )

    def forgotten(self, t: Transition) -> None:
        """A liveness watcher: a member forgotten (dead past the grace, or displaced at the cap) that never answered
        this node at its address is not brought back by relays (rule 5)."""
        if t.new is not None or t.established or self.membership.established(t.node_id):
            return
        node = self.state.nodes.get(t.node_id)
        if node is not None:
            self.shunned.add(t.node_id, node.generation, self.clock.now())

    def judge(self, node: NodeState, generation: int, address: str | None, *, first_hand: bool) -> str | None:
        """Rule 3 (``judge_claim``) for a claim to be ``node``'s id; with certified ids (rule 4), a first-hand claim
        -- the node itself, by its certificate -- also wins over a life it never confirmed here. None: taken."""
        why = judge_claim(node.generation, address_of(node), self.membership.state(node.node_id), generation, address)
        if why is not None and first_hand and self.config.certified_ids and not self.confirmed(node.node_id):
            return None
        return why

    def confirmed(self, node_id: str) -> bool:
        """Whether the member's current life spoke to this node itself or answered it (not only relays' word)."""
        return self.membership.spoke(node_id) or self.membership.reachable(node_id)

    def check_sender(self, sender_id: str, address: str, generation: int) -> None:
        """Refuse (raise Rejected ``identity_conflict``) a sender claiming a node id whose known life says it is
        another process (rules 3 and 4)."""
        node = self.state.nodes.get(sender_id)
        if node is None or sender_id == self.state.self_id:
            return
        why = self.judge(node, generation, address, first_hand=True)
        if why is not None:
            self.stats.identity_conflicts += 1
            raise Rejected(
                RejectReason.IDENTITY_CONFLICT,
                f"{sender_id[:64]!r} at {address[:64]!r} (generation {generation}) is another process: {why}",
            )

    def gate(self, sender: str) -> MessageGate:
        """The gate for the deltas of one message from ``sender``."""
        return MessageGate(self, sender)


class MessageGate:
    """The rules for the deltas of one message from ``sender`` (``delta.Gate``); ``report`` counts and logs what it
    refused, once the message is applied."""

    def __init__(self, admission: Admission, sender: str) -> None:
        self.admission = admission
        self.sender = sender
        self.refused_cap: list[str] = []
        self.refused_vouch: list[str] = []
        self.deferred = 0
        self.refused_shunned = 0
        self.conflicts: list[tuple[NodeDelta, str]] = []
        #: New lives taken at another address than the known one: (delta, old address, old generation, new address).
        self.moves: list[tuple[NodeDelta, str, int, str]] = []
        #: Who first vouched for each refused member (its delta's origin, else the sender), for the warnings.
        self.origins: Counter[str] = Counter()

    def origin_of(self, delta: NodeDelta) -> str:
        return delta.origin or self.sender

    def _must_get_in(self, node_id: str) -> bool:
        """A member that introduces itself (or answered a join probe as itself), or that this node knew before (it
        returns): no budget spent, and it may take the place of a member that never answered us (rules 1 and 2)."""
        admission = self.admission
        return node_id == self.sender or admission.state.was_known(node_id) or admission.answered_as_itself(node_id)

    def _shunned(self, node_id: str, generation: int | None) -> bool:
        """A life refused before, brought back by a relay (rule 5)."""
        admission = self.admission
        return node_id != self.sender and admission.shunned.holds(node_id, generation, admission.clock.now())

    def wants(self, node_id: str) -> bool:
        admission = self.admission
        if self._shunned(node_id, None):
            return False
        if self._must_get_in(node_id):
            return True
        if admission.vouches.available(self.sender, admission.clock.now()) < 1.0:
            return False
        state = admission.state
        return len(state.nodes) < admission.config.max_members or admission.membership.longest_down() is not None

    def new_member(self, delta: NodeDelta) -> bool:
        admission = self.admission
        node_id = delta.node_id
        now = admission.clock.now()
        if self._shunned(node_id, delta.generation):
            self.refused_shunned += 1
            return False
        must = self._must_get_in(node_id)
        if not must and admission.vouches.available(self.sender, now) < 1.0:
            if delta.origin == node_id:  # it introduced itself to a node: maybe a mesh forming at once (rule 1)
                admission.defer(node_id, self.sender, delta_address(delta), now)
                self.deferred += 1
            else:
                self.refused_vouch.append(node_id)
                self.origins[self.origin_of(delta)] += 1
            return False
        if not admission.state.has_room() and not (must and admission.displace()):
            self.refused_cap.append(node_id)
            if node_id != self.sender:
                admission.shunned.add(node_id, delta.generation, now)
            self.origins[self.origin_of(delta)] += 1
            return False
        if not must:
            admission.vouches.spend(self.sender, now)
        return True

    def new_life(self, node: NodeState, delta: NodeDelta) -> bool:
        admission = self.admission
        first_hand = delta.node_id == self.sender
        if admission.config.certified_ids and not first_hand:  # rule 4: only the node itself announces its new life
            admission.stats.lives_deferred += 1
            return False
        claimed = delta_address(delta)
        why = admission.judge(node, delta.generation, claimed, first_hand=first_hand)
        if why is not None:
            self.conflicts.append((delta, f"{claimed or 'an unknown address'}: {why}"))
            return False
        known = address_of(node)
        if claimed and known and claimed != known:
            self.moves.append((delta, known, node.generation, claimed))
        return True

    def report(self) -> None:
        """Count and log the refusals of this message (a flood is counted, and logged a few lines a minute)."""
        self.admission.stats.shunned_refused += self.refused_shunned  # counted only: each was logged when first refused
        self.admission.stats.vouches_deferred += self.deferred  # counted only: judged a window later (judge_deferred)
        if self.refused_cap:
            self._report_cap()
        if self.refused_vouch:
            self._report_vouch()
        for delta, why in self.conflicts:
            self.admission.stats.identity_conflicts += 1
            self.admission.log.warning(
                f"identity:{delta.node_id[:64]}",
                "gossip: refused a new life of %s (generation %d at %s; %s): a second process runs under that node "
                "id, or it moved before its earlier life was seen dead (it is admitted once it is)",
                delta.node_id[:64], delta.generation, why, self._provenance(self.origin_of(delta), delta.node_id),
            )
        for delta, old_address, old_generation, new_address in self.moves:
            self._report_move(delta, old_address, old_generation, new_address)

    def _report_move(self, delta: NodeDelta, old_address: str, old_generation: int, new_address: str) -> None:
        """A node id's new life at another address: a rescheduled node -- or, where a shared secret is all that
        vouches for it, possibly a takeover, which is the operator's to judge (a WARNING on every node)."""
        node_id = delta.node_id[:64]
        provenance = self._provenance(self.origin_of(delta), delta.node_id)
        if self.admission.config.certified_ids:  # first-hand, by its certificate (rule 4)
            self.admission.log.info(
                f"move:{node_id}", "gossip: %s moved to %s (generation %d) from %s (generation %d; %s, its "
                "certificate names it)", node_id, new_address[:64], delta.generation, old_address[:64],
                old_generation, provenance,
            )
            return
        self.admission.log.warning(
            f"move:{node_id}",
            "gossip: %s now runs at %s (generation %d), taking over from %s (generation %d, seen dead or gone; "
            "%s): a rescheduled node -- or a takeover of the id by any holder of the cluster secret, which cannot be "
            "told apart (per-node certificates prevent it: --tls-cert/--tls-key/--tls-ca)",
            node_id, new_address[:64], delta.generation, old_address[:64], old_generation, provenance,
        )

    def _provenance(self, origin: str, member: str) -> str:
        """Where a refused member came from: who first vouched for it, and the peer that relayed it here."""
        if origin == self.sender:
            return f"from {self.sender[:64]} itself" if origin == member else f"vouched for by {self.sender[:64]}"
        first = "it introduced itself" if origin == member else f"first vouched for by {origin[:64]}"
        return f"{first}, relayed by {self.sender[:64]}"

    def _origins(self) -> str:
        """The refused members' origins, most first (a relaying peer is not their source)."""
        return most_common_ids(self.origins)

    def _report_cap(self) -> None:
        self.admission.stats.members_refused += len(self.refused_cap)
        self.admission.log.warning(
            "member_cap",
            "gossip: refused %d new member(s) sent by %s (e.g. %s; first vouched for by %s): this node already keeps "
            "max_members = %d and none is dead to make room (a flood of made-up members, or a mesh larger than the "
            "cap)",
            len(self.refused_cap), self.sender[:64], self.refused_cap[0][:64], self._origins(),
            self.admission.config.max_members,
        )

    def _report_vouch(self) -> None:
        config = self.admission.config
        self.admission.stats.vouches_refused += len(self.refused_vouch)
        relayed = set(self.origins) != {self.sender}
        self.admission.log.warning(
            f"vouch:{self.sender[:64]}",
            "gossip: refused %d new member(s) sent by %s (e.g. %s; first vouched for by %s): it vouched for %d new "
            "members in %.0f s already (max_vouched_members); %s",
            len(self.refused_vouch), self.sender[:64], self.refused_vouch[0][:64], self._origins(),
            config.max_vouched_members, config.vouch_window_s,
            f"it relays members others made up (the origins named are their source, not {self.sender[:64]})"
            if relayed else f"a flood of made-up members or a bug on {self.sender[:64]}",
        )
