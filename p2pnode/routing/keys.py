"""Routing keys for requests whose client names none: what should stay together shares a key, what should not
does not.

A routing key groups requests for the policies that pin keys to nodes (``sticky``, ``chwbl``, ``dualmap``) and for
the rate plan (``plan/``), which counts and places keys. A good key is stable across a conversation's turns and an
agent's steps, distinct between conversations -- even when they all begin with the same system prompt -- and shared
by requests built on one prefix of their own (a few-shot template, a document asked many questions).

How: every ingress learns, from the block chains it routes, the *branch points* of its traffic -- blocks followed by
at least ``BRANCH_CHILDREN`` different next blocks -- and, for each, whether what follows it comes back: the share of
passes through it whose next block was seen there before (a later turn of a conversation, a later step of a
session) rather than new (a one-off question). A branch point whose continuations come back (``SPLIT_SHARE`` of the
passes or more) starts contexts of their own: the end of a platform or application prompt that many conversations
share, or the start of the chains when nothing is shared. A request's key is the block right after the deepest such
point on its chain: the first block that is its own context's.
- conversations behind a shared platform prompt: each conversation's first own block names it, and every later turn
  (which repeats the history) keeps that key;
- nested prompts (a platform prompt, one of a few application prompts, then conversations): conversations are apart;
- requests on one template or document, each with a one-off question: the template's end branches but nothing after
  it comes back, so it is no split; the key is the template's first block, shared by all of them;
- a prompt that ends on a split point (a short question inside the block after a system prompt, or a prompt of no
  full block) has nothing cacheable of its own: its key is its request id, so key-pinning policies spread such
  requests instead of piling them on one node;
- before anything is learned (a node's first requests, or the first minutes of a conversation workload, until
  turns come back), the leading ``fallback_blocks`` name the key, as they always did.

Bounded: the chain is walked to at most ``MAX_KEY_DEPTH`` blocks; blocks and branch children are remembered in two
generations each (seen again: kept; the older generation is dropped whole when the younger fills).

Invariant: a branch point (a block in ``_fan``) is in neither generation of single next blocks (``_next``, ``_old``):
it leaves them as it becomes one, and only a block that is none is remembered there.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.config import DEFAULT_ROUTING_KEY_BLOCKS

__all__ = ["BRANCH_CHILDREN", "MAX_KEY_DEPTH", "SPLIT_SHARE", "RoutingKeys"]

#: Distinct next blocks that make a block a branch point. Two children can be an edited or regenerated turn; four
#: different continuations are a prefix that separate requests share.
BRANCH_CHILDREN = 4
#: Share of the passes through a branch point that must continue something seen there before for it to start
#: contexts of their own (conversations with ~4 turns on average come back on ~3/4 of their passes; one-off questions
#: on none).
SPLIT_SHARE = 0.25
#: Passes through a branch point before its share is trusted; its counts are halved past ``2 * MAX_PASSES``, so a
#: change of traffic shows within about that many passes.
MIN_PASSES, MAX_PASSES = 8, 512
#: Blocks of a chain the keys look at (8k tokens at 32-token blocks, 128k at Mooncake's 512).
MAX_KEY_DEPTH = 256
#: Blocks remembered per generation for finding branch points (~100 B each).
DEFAULT_KEY_ENTRIES = 65_536
#: Continuations of branch points remembered per generation, to tell whether they come back (~60 B each): contexts
#: started in the last several minutes at tens of new contexts a second.
DEFAULT_KEY_CONTEXTS = 32_768
_ROOT = -1  # the parent of every chain's first block (hashes are unsigned)


class RoutingKeys:
    """Derives the routing key of requests without one, learning as it goes (module docstring)."""

    __slots__ = (
        "_fan",
        "_kids",
        "_kids_old",
        "_next",
        "_old",
        "_passes",
        "fallback_blocks",
        "max_contexts",
        "max_entries",
    )

    def __init__(
        self,
        fallback_blocks: int = DEFAULT_ROUTING_KEY_BLOCKS,
        max_entries: int = DEFAULT_KEY_ENTRIES,
        max_contexts: int = DEFAULT_KEY_CONTEXTS,
    ) -> None:
        self.fallback_blocks = fallback_blocks
        self.max_entries = max_entries
        self.max_contexts = max_contexts
        self._next: dict[int, int] = {}  # block -> the one next block seen after it (younger generation)
        self._old: dict[int, int] = {}  # the older generation
        self._fan: dict[int, set[int]] = {}  # blocks seen followed by several next blocks (up to BRANCH_CHILDREN)
        self._passes: dict[int, list[int]] = {}  # branch point -> [passes, passes onto a continuation seen before]
        self._kids: set[int] = set()  # continuations of branch points seen (younger generation)
        self._kids_old: set[int] = set()

    def key(self, hashes: Sequence[int], request_id: str) -> str:
        """The key of a request with these block hashes; learns from it first."""
        parent = _ROOT
        own = -1  # index of the first block after the deepest split point seen so far
        last_split = False  # whether the chain's last block is a split point
        fan, nxt, branches = self._fan, self._next, self._branches  # (``fan`` is only ever cleared, never replaced)
        for i, h in enumerate(hashes[:MAX_KEY_DEPTH]):
            if nxt.get(parent) == h:
                # ``_branches``' common case, read inline (no call per block): ``parent`` was seen followed by this
                # block and by no other (a branch point is in neither generation) -- nothing to learn
                parent = h
                continue
            if branches(parent, h) and self._split(parent, h):
                own = i
            nxt = self._next  # (a full younger generation was just swapped out: read the new one)
            parent = h
        n = len(hashes)
        if n:
            seen = fan.get(hashes[n - 1])
            last_split = seen is not None and len(seen) >= BRANCH_CHILDREN and self._splits(hashes[n - 1])
        if n == 0 or last_split:
            return f"request:{request_id}"  # nothing cacheable of its own
        if own >= 0:
            return f"prefix:{hashes[own]:016x}"
        return f"prefix:{hashes[min(self.fallback_blocks, n) - 1]:016x}"

    def _branches(self, parent: int, child: int) -> bool:
        """Learn that ``child`` followed ``parent``; whether ``parent`` is a branch point."""
        seen = self._fan.get(parent)
        if seen is None:
            known = self._next.get(parent)
            if known is None:
                known = self._old.pop(parent, None)
                if known is not None:
                    self._remember(parent, known)  # seen again: kept young
            if known is None:
                self._remember(parent, child)
                return False
            if known == child:
                return False
            seen = self._fan[parent] = {known, child}
            self._next.pop(parent, None)
            if len(self._fan) > self.max_entries // 16:
                self._fan.clear()  # branch points are few; losing them costs a few requests' relearning
                self._passes.clear()
                return False
        elif child not in seen and len(seen) < BRANCH_CHILDREN:
            seen.add(child)
        return len(seen) >= BRANCH_CHILDREN

    def _split(self, point: int, child: int) -> bool:
        """Count a pass through branch point ``point`` onto ``child``; whether ``point`` starts contexts."""
        counts = self._passes.get(point)
        if counts is None:
            counts = self._passes[point] = [0, 0]
        counts[0] += 1
        if child in self._kids:
            counts[1] += 1
        elif child in self._kids_old:
            counts[1] += 1
            self._kids_old.discard(child)
            self._add_kid(child)
        else:
            self._add_kid(child)
        if counts[0] > 2 * MAX_PASSES:
            counts[0] //= 2
            counts[1] //= 2
        return self._splits(point)

    def _splits(self, point: int) -> bool:
        counts = self._passes.get(point)
        return counts is not None and counts[0] >= MIN_PASSES and counts[1] >= SPLIT_SHARE * counts[0]

    def _add_kid(self, child: int) -> None:
        kids = self._kids
        kids.add(child)
        if len(kids) >= self.max_contexts:
            self._kids_old, self._kids = kids, set()

    def _remember(self, parent: int, child: int) -> None:
        nxt = self._next
        nxt[parent] = child
        if len(nxt) >= self.max_entries:
            self._old, self._next = nxt, {}
