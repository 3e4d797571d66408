"""Who may enter the membership, and who may take over a node id: the rules every delta and every sender passes
before it changes who the members are (the agent applies them; this module holds the pure parts).

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
2. **Room at the cap** (the agent's ``_make_room``). A new member takes the place of the member dead or left the
   longest; a member that must get in -- one that returns, or that introduced itself -- may also take the place of
   the member never reachable (never answered this node at its address) heard of last. A member that answered us
   is never displaced.
3. **Identity** (``judge_claim``). A node id's life (generation) and address are replaced only when the change is
   what a restart looks like: a new generation at the same address (a restart in place), or at any address once
   the earlier life is seen dead or has left (a rescheduled node). A new life at another address while the known
   one is alive or suspect, the same life at another address, or an earlier life still talking, is a second process
   under that id: refused (the envelope with ALREADY_EXISTS, the relayed delta dropped) and logged at WARNING by
   every node that sees it. The mesh keeps the life it knows.

What it does not stop: a secret holder can still sign as any node id (the budget is per claimed sender, so one that
invents a sender per member is bounded only by the cap and rule 2, while honest members, reachable, keep their
place and their liveness); and it can write keys of another member's current life (say, "left"), which only
per-node signatures would prevent. With mTLS the sender id is bound to the caller's certificate (auth.py), which
makes the budget one per certificate.
"""

from __future__ import annotations

from collections import OrderedDict

from p2pnode.gossip.membership import MemberState

__all__ = ["VouchBudget", "judge_claim"]


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
