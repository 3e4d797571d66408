"""Deltas: the entries a peer is missing, chosen from its digest, cut to a byte budget without ever leaving a gap.

Per owner X, given the peer's digest entry for X (``theirs``) and this node's copy (``mine``):

- the peer does not know X, knows an older generation of it, or is behind X's ``last_gc_version`` (it may have
  missed a deletion whose tombstone is gone, and ``theirs.last_gc_version`` does not cover it): **reset** -- every
  entry of X from version 0, tombstones included; the peer replaces its copy;
- the peer is behind (``theirs.max_version < mine.max_version``): every entry newer than ``theirs.max_version``;
- otherwise nothing (the peer is up to date, or ahead: it will send to us instead).

Entries are sent in increasing version order and a node delta holds *all* of X's entries in
``(from_version, to_version]``; when the budget runs out inside an owner, ``to_version`` is the last entry sent, so
the receiver's copy is still a gap-free prefix and the next exchange continues from there (a receiver never sets
``max_version`` past what it received). Owners are served smallest-delta first (ties in random order): the
frequent small updates (load, heartbeats of new nodes) are never starved by one large reset, which takes the rest.

Applying (``apply_delta``) re-checks everything against the receiver's *current* copy, because deltas can be
duplicated, reordered or overtaken by a concurrent exchange: a delta that would leave a gap is dropped (counted),
a delta of an older generation is dropped, entries the copy already has are skipped, and a reset is taken as a plain
delta when the copy is already past the sender's ``last_gc_version`` (so a late reset never rolls a copy back).
Whether a node never known here may enter, and whether a known node's new life may replace the one known, is a
``Gate``'s decision when one is given (the agent's: ``admission.py``); without one, a new node needs room under the
state's ``max_nodes`` and every new life is taken.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from p2pnode.gossip.digest import FULL, NodeDigest, Shard, in_shard
from p2pnode.gossip.state import ClusterState, NodeState

__all__ = [
    "ApplyResult",
    "Gate",
    "NodeDelta",
    "apply_delta",
    "compute_delta",
    "delta_size",
    "message_base",
    "suffix_delta",
]

Entry = tuple[str, int, bytes | None]


class NodeDelta(NamedTuple):
    """Owner ``node_id``'s entries in ``(from_version, to_version]``, all of them, in version order.

    ``reset``: the receiver must start from an empty copy unless it is already past ``last_gc_version`` (then
    ``from_version`` is 0). ``heartbeat`` and ``last_gc_version`` are the sender's for that owner. ``origin`` (resets
    only; "" when unknown or when the owner sends its own): the node id that first vouched for this life in the
    mesh -- the sender of the message that brought it to the first node that took it, the owner itself when it
    introduced itself -- as relayed node to node, so that a refusal can name where a made-up member came from and
    not only the honest peer relaying it. (A NamedTuple, like NodeDigest: cheap to build on every exchange.)
    """

    node_id: str
    generation: int
    heartbeat: int
    from_version: int
    to_version: int
    last_gc_version: int
    reset: bool
    entries: tuple[Entry, ...]
    origin: str = ""


class Gate(Protocol):
    """Decides who enters the membership, on behalf of the node applying a delta (``admission.py``)."""

    def wants(self, node_id: str) -> bool:
        """Whether to ask for a node never known here (a peer's digest lists it); nothing is spent."""
        ...

    def new_member(self, delta: NodeDelta) -> bool:
        """Take a node never known here (its delta is a reset); the gate makes room for it. False: refused."""
        ...

    def new_life(self, node: NodeState, delta: NodeDelta) -> bool:
        """Let ``delta``'s higher generation (a reset) replace the life ``node`` holds. False: refused."""
        ...

    def origin_of(self, delta: NodeDelta) -> str:
        """Who first vouched for the life ``delta`` resets: the origin it names, else its sender."""
        ...


@dataclass(slots=True)
class ApplyResult:
    """What applying a delta did."""

    heartbeats: list[str] = field(default_factory=list)  # nodes whose heartbeat advanced (incl. new nodes)
    added: list[str] = field(default_factory=list)  # nodes created or replaced by a reset
    entries: int = 0  # entries applied
    gaps: int = 0  # node deltas dropped because they did not start at or below the copy's max_version
    stale: int = 0  # node deltas of an older generation, forgotten nodes, or this node itself
    refused: list[str] = field(default_factory=list)  # new nodes refused: the state holds max_nodes (no gate)
    gated: list[str] = field(default_factory=list)  # new nodes or new lives the gate refused
    oversized: list[str] = field(default_factory=list)  # nodes whose delta would pass max_node_keys / max_node_bytes


def _too_large(state: ClusterState, mine: NodeState, nd: NodeDelta, base: int) -> bool:
    """Whether applying ``nd`` past ``base`` would take ``mine`` past the state's bound on one node's keys or bytes
    (an honest node holds a few thousand keys and well under a MiB: its summaries, segment keys, load and plan)."""
    max_keys, max_bytes = state.max_node_keys, state.max_node_bytes
    if max_keys is None and max_bytes is None:
        return False
    keys, size = len(mine), mine.bytes
    for key, version, value in nd.entries:
        if version <= base:
            continue
        held = mine.versioned(key)
        if held is None:
            keys += 1
            size += len(key) + len(value or b"")
        else:
            size += len(value or b"") - len(held.value or b"")
    return (max_keys is not None and keys > max_keys) or (max_bytes is not None and size > max_bytes)


# --- msgpack sizes (codec.py encodes exactly this layout; the budget is checked against these) -------------------


def _uint_size(v: int) -> int:
    return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 4294967296 else 9


def message_base(generation: int, version: int = 2) -> int:
    """The ``base`` a node of ``generation`` sends its messages of ``version`` with (codec.py): its generation, where
    every offset from it fits a msgpack integer (below 2**63 ms: no clock's), else 0 (generations as they are, as
    version 1 always sends them). ``version``'s default is codec.PROTOCOL_VERSION (codec imports this module)."""
    return generation if generation < 1 << 63 and version > 1 else 0


def _generation_size(generation: int, base: int) -> int:
    """A generation as sent: its offset from the message's ``base`` (a signed integer), nil for 0 (codec.py)."""
    if not generation:
        return 1
    v = generation - base
    if v >= 0:
        return _uint_size(v)
    return 1 if v >= -32 else 2 if v >= -128 else 3 if v >= -32768 else 5 if v >= -(1 << 31) else 9


def _str_size(s: str) -> int:
    n = len(s) if s.isascii() else len(s.encode())
    return n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5)


def _bin_size(b: bytes | None) -> int:
    if b is None:
        return 1
    n = len(b)
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


def _origin_size(origin: str) -> int:
    """The optional ninth element of a node delta (codec.py): nothing when empty."""
    return _str_size(origin) if origin else 0


def _header_size(node: NodeState, from_version: int, base: int) -> int:
    # fixarray(8 or 9) + id + generation + heartbeat + from + to (bounded by 9) + last_gc + bool + entries array
    # (<= 5) + a reset's origin
    return (
        _origin_size(node.origin if from_version == 0 else "")
        + 1
        + _str_size(node.node_id)
        + _generation_size(node.generation, base)
        + _uint_size(node.heartbeat)
        + _uint_size(from_version)
        + 9
        + _uint_size(node.last_gc_version)
        + 1
        + 5
    )


#: Bytes the delta list's own array header may take.
DELTA_LIST_OVERHEAD = 5


def delta_size(deltas: Iterable[NodeDelta], base: int) -> int:
    """Upper bound of the encoded size of ``deltas`` in a message of ``base`` (the size model the budget uses)."""
    size = DELTA_LIST_OVERHEAD
    for nd in deltas:
        size += (
            1
            + _str_size(nd.node_id)
            + _generation_size(nd.generation, base)
            + _uint_size(nd.heartbeat)
            + _uint_size(nd.from_version)
            + 9
            + _uint_size(nd.last_gc_version)
            + 1
            + 5
            + _origin_size(nd.origin)
        )
        prev = nd.from_version
        for key, version, value in nd.entries:
            size += _str_size(key) + _uint_size(version - prev) + _bin_size(value)
            prev = version
    return size


def _take(
    node: NodeState, from_version: int, reset: bool, room: int, base: int
) -> tuple[NodeDelta | None, int, bool]:
    """The longest gap-free delta of ``node`` after ``from_version`` within ``room`` bytes of a message of ``base``:
    (delta, size, complete)."""
    size = _header_size(node, from_version, base)
    if size > room:
        return None, 0, False
    entries = node.entries_after(from_version)
    taken: list[Entry] = []
    prev = from_version
    for entry in entries:
        key, version, value = entry
        cost = _str_size(key) + _uint_size(version - prev) + _bin_size(value)
        if size + cost > room:
            break
        size += cost
        taken.append(entry)
        prev = version
    complete = len(taken) == len(entries)
    if not taken and not complete:
        return None, 0, False
    to_version = node.max_version if complete else prev
    delta = NodeDelta(
        node.node_id,
        node.generation,
        node.heartbeat,
        from_version,
        to_version,
        node.last_gc_version,
        reset,
        tuple(taken),
        node.origin if reset else "",
    )
    return delta, size, complete


def compute_delta(
    state: ClusterState,
    digest: Mapping[str, NodeDigest],
    budget: int,
    *,
    complete: bool,
    rng: random.Random | None = None,
    shard: Shard = FULL,
    base: int | None = None,
) -> list[NodeDelta]:
    """What the peer whose digest is ``digest`` is missing, within ``budget`` encoded bytes of a message sent with
    ``base`` (codec.py; None: ``message_base`` of this node's generation, as its messages of the current version).

    ``complete``: the digest lists every node of ``shard`` the peer knows (a Syn's), so a node of the shard absent
    from it is unknown to the peer; otherwise (a SynAck's reply digest) only the listed nodes are considered.
    """
    plans: list[tuple[int, float, NodeState, int, bool]] = []
    rand = (rng or random).random
    withheld = state.withheld
    for node_id, mine in state.nodes.items():
        if node_id in withheld:
            continue
        theirs = digest.get(node_id)
        if theirs is None or theirs.generation == 0:
            if theirs is None and not (complete and (shard[1] == 1 or in_shard(node_id, shard))):
                continue
            from_version, reset = 0, True
        elif theirs.generation > mine.generation:
            continue
        elif theirs.generation < mine.generation or mine.last_gc_version > max(
            theirs.max_version, theirs.last_gc_version
        ):
            from_version, reset = 0, True
        elif mine.max_version > theirs.max_version:
            from_version, reset = theirs.max_version, False
        else:
            continue
        plans.append((mine.max_version - from_version, rand(), mine, from_version, reset))
    plans.sort(key=lambda p: (p[0], p[1]))
    out: list[NodeDelta] = []
    room = budget - DELTA_LIST_OVERHEAD
    if base is None:
        base = message_base(state.self_node.generation)
    for _, _, node, from_version, reset in plans:
        delta, size, done = _take(node, from_version, reset, room, base)
        if delta is None:
            break
        out.append(delta)
        room -= size
        if not done:
            break
    return out


def suffix_delta(node: NodeState, budget: int, base: int | None = None) -> NodeDelta | None:
    """The newest entries of ``node`` that fit in ``budget`` bytes, as a delta a peer that is only a little
    behind can apply (used to push a leaving node's last change: its owner sends it, in a message of ``base``; None:
    ``message_base`` of its generation)."""
    entries = node.entries_after(0)
    base = message_base(node.generation) if base is None else base
    room = budget - DELTA_LIST_OVERHEAD - _header_size(node, node.max_version, base)
    taken: list[Entry] = []
    for entry in reversed(entries):
        cost = _str_size(entry[0]) + 9 + _bin_size(entry[2])
        if cost > room:
            break
        room -= cost
        taken.append(entry)
    if not taken:
        return None
    taken.reverse()
    # The delta must hold every entry in (from_version, max_version]: start right after the newest entry left out
    # (versions in between were overwritten and no longer exist), and never below a collected tombstone.
    left_out = len(entries) - len(taken)
    from_version = max(entries[left_out - 1][1] if left_out else 0, node.last_gc_version)
    taken = [entry for entry in taken if entry[1] > from_version]
    return NodeDelta(
        node.node_id,
        node.generation,
        node.heartbeat,
        from_version,
        node.max_version,
        node.last_gc_version,
        from_version == 0,
        tuple(taken),
    )


def apply_delta(
    state: ClusterState, deltas: Iterable[NodeDelta], now: float, gate: Gate | None = None
) -> ApplyResult:
    """Apply node deltas received from a peer (see the module docstring for the checks)."""
    result = ApplyResult()
    self_id = state.self_id
    for nd in deltas:
        node_id = nd.node_id
        if node_id == self_id or state.is_forgotten(node_id, nd.generation, nd.heartbeat):
            result.stale += 1
            continue
        mine = state.node(node_id)
        if mine is None or nd.generation > mine.generation:
            if not nd.reset:
                result.gaps += 1
                continue
            if gate is not None:
                if not (gate.new_member(nd) if mine is None else gate.new_life(mine, nd)):
                    result.gated.append(node_id)
                    continue
            elif mine is None and not state.has_room():
                result.refused.append(node_id)
                continue
            origin = gate.origin_of(nd) if gate is not None else nd.origin
            mine = state.reset_node(node_id, nd.generation, nd.last_gc_version, now, origin)
            result.added.append(node_id)
            base = 0
        elif nd.generation < mine.generation:
            result.stale += 1
            continue
        elif nd.reset and mine.max_version < nd.last_gc_version and mine.last_gc_version < nd.last_gc_version:
            heartbeat, origin = mine.heartbeat, mine.origin
            mine = state.reset_node(node_id, nd.generation, nd.last_gc_version, now, origin)
            mine.heartbeat = heartbeat
            result.added.append(node_id)
            base = 0
        elif not nd.reset and nd.from_version > mine.max_version:
            result.gaps += 1
            continue
        else:
            base = mine.max_version
        if _too_large(state, mine, nd, base):
            result.oversized.append(node_id)
            continue
        for key, version, value in nd.entries:
            if version > base:
                state.put(mine, key, version, value, now)
                result.entries += 1
        if nd.to_version > mine.max_version:
            mine.max_version = nd.to_version
            mine.fresh_at = now
        if nd.heartbeat > mine.heartbeat:
            mine.heartbeat = nd.heartbeat
            result.heartbeats.append(node_id)
    return result
