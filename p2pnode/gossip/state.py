"""The replicated state: every node owns a versioned key/value map, and every node holds a copy of every map.

Scuttlebutt's data model (van Renesse et al., "Efficient Reconciliation and Flow Control for Anti-Entropy
Protocols"), with chitchat's extensions for deletion and restarts:

- Only the owner writes its map. Each write (set or delete) takes the owner's next version, so versions of one
  owner are 1, 2, 3, ...; the owner's ``max_version`` is its newest. A delete leaves a *tombstone* (value None)
  carrying that version, so that the deletion itself replicates.
- Tombstones are garbage-collected after a grace period (each node collects its own copies). ``last_gc_version``
  is the newest version a node dropped that way (or inherited from a reset): a peer whose copy is older than it may
  have missed a deletion and must be sent a full reset of that owner instead of a delta (see ``delta.py``).
- ``generation`` identifies one life of an owner (its start time in ms): a higher generation replaces every copy
  of the old state wholesale; versions restart with it.
- ``heartbeat`` is a counter the owner bumps every round. It is not a version (it would make every round a delta
  of every node); it travels in digests, and its advances feed the failure detector.

Invariant (per node B and owner X, what ``delta.py`` preserves): B's copy of X holds exactly the entries of X's map
as it was at some moment, restricted to versions <= B's ``max_version`` (minus tombstones B collected), so that
applying X's entries newer than ``max_version`` in version order brings B up to date without gaps.

Memory: one entry is a key string, a small value and a ``VersionedValue``, ~150 B; with the default summary cap a
node holding 100 peers' maps keeps ~1M entries at most (see ``docs/gossip.md``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ClusterState", "NodeState", "StateListener", "VersionedValue"]

#: Forgotten node ids remembered at most (beyond it the oldest record is dropped).
MAX_FORGOTTEN = 10_000


@dataclass(slots=True)
class VersionedValue:
    """One entry of an owner's map. ``value`` None is a tombstone (the key was deleted at ``version``)."""

    value: bytes | None
    version: int


class StateListener(Protocol):
    """Told about every change of the replicated state (the agent fans it out to membership and ClusterView).

    Calls happen synchronously inside the state mutation, after it is done; a listener must not mutate the state.
    """

    def on_node_added(self, node_id: str, generation: int) -> None:
        """A node's state appeared (first heard of, a new generation, or a reset): its keys follow as changes."""

    def on_node_removed(self, node_id: str) -> None:
        """A node's state is gone (forgotten, or about to be replaced by a reset / new generation)."""

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        """A live key took a new value (``value``), or was deleted (None)."""


class NodeState:
    """One owner's map as this node knows it (the owner's own copy is authoritative)."""

    __slots__ = (
        "_by_version",
        "_kv",
        "_tombstones",
        "bytes",
        "fresh_at",
        "generation",
        "heartbeat",
        "last_gc_version",
        "max_version",
        "node_id",
        "origin",
    )

    def __init__(self, node_id: str, generation: int, now: float = 0.0) -> None:
        self.node_id = node_id
        self.generation = generation
        #: Who first vouched for this life in the mesh, as far as this node was told (delta.py, "origin"); "" for
        #: this node itself, or when no one said.
        self.origin = ""
        self.heartbeat = 0
        self.max_version = 0
        self.last_gc_version = 0
        #: Local time at which this copy was last known to be as new as the owner's newest version.
        self.fresh_at = now
        self._kv: dict[str, VersionedValue] = {}
        # version -> key, in increasing version order (versions are applied in order; an overwritten key moves to
        # the end), so "entries newer than v" is a walk back from the end.
        self._by_version: dict[int, str] = {}
        # (local time of deletion, key, version), oldest first: what tombstone GC pops.
        self._tombstones: deque[tuple[float, str, int]] = deque()
        #: Bytes of the keys and values held (tombstones' keys included): what ``ClusterState.max_node_bytes`` bounds.
        self.bytes = 0

    def get(self, key: str) -> bytes | None:
        """The live value of ``key`` (None when absent or deleted)."""
        entry = self._kv.get(key)
        return None if entry is None else entry.value

    def versioned(self, key: str) -> VersionedValue | None:
        """The entry of ``key``, tombstones included."""
        return self._kv.get(key)

    def items(self, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        """Live ``(key, value)`` pairs whose key starts with ``prefix``."""
        for key, entry in self._kv.items():
            if entry.value is not None and key.startswith(prefix):
                yield key, entry.value

    def __len__(self) -> int:
        """Entries held, tombstones included."""
        return len(self._kv)

    def entries_after(self, version: int) -> list[tuple[str, int, bytes | None]]:
        """Every entry with a version above ``version``, as ``(key, version, value)`` in increasing version order."""
        if version >= self.max_version:
            return []
        kv = self._kv
        by_version = self._by_version
        if version <= 0 or len(by_version) < 64:
            out = [(key, v, kv[key].value) for v, key in by_version.items() if v > version]
            return out
        newer: list[tuple[str, int, bytes | None]] = []
        for v in reversed(by_version):
            if v <= version:
                break
            key = by_version[v]
            newer.append((key, v, kv[key].value))
        newer.reverse()
        return newer

    def _put(self, key: str, version: int, value: bytes | None, now: float) -> bool:
        """Store an entry (``version`` must exceed the key's current one); True when the live value changed."""
        old = self._kv.get(key)
        if old is not None:
            del self._by_version[old.version]
            old_value = old.value
            old.value = value
            old.version = version
            self.bytes += len(value or b"") - len(old_value or b"")
        else:
            old_value = None
            self._kv[key] = VersionedValue(value, version)
            self.bytes += len(key) + len(value or b"")
        self._by_version[version] = key
        if value is None:
            self._tombstones.append((now, key, version))
        return old_value != value

    def _gc_tombstones(self, before: float) -> int:
        dropped = 0
        tombstones = self._tombstones
        while tombstones and tombstones[0][0] < before:
            _, key, version = tombstones.popleft()
            entry = self._kv.get(key)
            if entry is not None and entry.version == version and entry.value is None:
                del self._kv[key]
                del self._by_version[version]
                self.bytes -= len(key)
                dropped += 1
            self.last_gc_version = max(self.last_gc_version, version)
        return dropped


class _NoListener:
    def on_node_added(self, node_id: str, generation: int) -> None:
        pass

    def on_node_removed(self, node_id: str) -> None:
        pass

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        pass


class ClusterState:
    """Every owner's map as this node knows it, its own included; the mutation primitives the protocol uses."""

    def __init__(
        self,
        self_id: str,
        generation: int,
        listener: StateListener | None = None,
        now: float = 0.0,
        max_nodes: int | None = None,
        max_node_keys: int | None = None,
        max_node_bytes: int | None = None,
    ) -> None:
        self.self_id = self_id
        self.listener: StateListener = listener or _NoListener()
        self.nodes: dict[str, NodeState] = {self_id: NodeState(self_id, generation, now)}
        # node id -> (generation, heartbeat, remembered until): forgotten nodes that must not come back as they were.
        self._forgotten: dict[str, tuple[int, int, float]] = {}
        #: Nodes held but no longer spoken for: left out of this node's digests and deltas, still known here (the
        #: agent's: members dead here that never answered it at their address; liveness.py). A peer that holds one
        #: alive brings its heartbeat back, and then it is spoken for again.
        self.withheld: set[str] = set()
        #: Most nodes held, this one included (None: no bound); see ``has_room``.
        self.max_nodes = max_nodes
        #: Most keys (tombstones included) and bytes of keys and values one peer's copy may hold (None: no bound): a
        #: delta that would take a copy past either is refused (``delta.apply_delta``).
        self.max_node_keys = max_node_keys
        self.max_node_bytes = max_node_bytes
        #: Called at the bound to forget one node (the owner of the state picks which); True when it did.
        self.make_room: Callable[[], bool] | None = None

    def has_room(self) -> bool:
        """Whether one more node may be added: under ``max_nodes``, or ``make_room`` freed a place."""
        if self.max_nodes is None or len(self.nodes) < self.max_nodes:
            return True
        return self.make_room is not None and self.make_room() and len(self.nodes) < self.max_nodes

    @property
    def self_node(self) -> NodeState:
        return self.nodes[self.self_id]

    def node(self, node_id: str) -> NodeState | None:
        return self.nodes.get(node_id)

    # --------------------------------------------------------------------------------------------- owner writes

    def set(self, key: str, value: bytes, now: float) -> bool:
        """Set one of this node's keys (a new version), unless it already holds ``value``. True when written."""
        me = self.self_node
        entry = me._kv.get(key)
        if entry is not None and entry.value == value:
            return False
        me.max_version += 1
        me._put(key, me.max_version, value, now)
        me.fresh_at = now
        self.listener.on_key_changed(self.self_id, key, value)
        return True

    def delete(self, key: str, now: float) -> bool:
        """Delete one of this node's keys (a tombstone version), unless absent. True when written."""
        me = self.self_node
        entry = me._kv.get(key)
        if entry is None or entry.value is None:
            return False
        me.max_version += 1
        me._put(key, me.max_version, None, now)
        me.fresh_at = now
        self.listener.on_key_changed(self.self_id, key, None)
        return True

    def bump_heartbeat(self, now: float) -> int:
        me = self.self_node
        me.heartbeat += 1
        me.fresh_at = now
        return me.heartbeat

    # ----------------------------------------------------------------------------------- replication primitives

    def reset_node(
        self, node_id: str, generation: int, last_gc_version: int, now: float, origin: str = ""
    ) -> NodeState:
        """Replace (or create) a peer's copy with an empty one of ``generation`` (first vouched for by ``origin``);
        keys follow via ``put``."""
        if node_id in self.nodes:
            del self.nodes[node_id]
            self.listener.on_node_removed(node_id)
        self._forgotten.pop(node_id, None)
        self.withheld.discard(node_id)
        node = NodeState(node_id, generation, now)
        node.last_gc_version = last_gc_version
        node.origin = origin
        self.nodes[node_id] = node
        self.listener.on_node_added(node_id, generation)
        return node

    def put(self, node: NodeState, key: str, version: int, value: bytes | None, now: float) -> None:
        """Apply one replicated entry to a peer's copy (the caller checks versions and order)."""
        if node._put(key, version, value, now):
            self.listener.on_key_changed(node.node_id, key, value)

    # ------------------------------------------------------------------------------------------------ forgetting

    def is_forgotten(self, node_id: str, generation: int, heartbeat: int) -> bool:
        """True when state of ``node_id`` at (generation, heartbeat) is what was forgotten (or older)."""
        record = self._forgotten.get(node_id)
        if record is None:
            return False
        gen, hb, _ = record
        return generation < gen or (generation == gen and heartbeat <= hb)

    def was_known(self, node_id: str) -> bool:
        """Whether ``node_id`` was forgotten here and is still remembered (any life): a member that returns."""
        return node_id in self._forgotten

    def forget(self, node_id: str, now: float, remember_s: float) -> None:
        """Drop a peer's state; refuse the same or older (generation, heartbeat) for ``remember_s`` seconds."""
        if node_id == self.self_id:
            return
        node = self.nodes.pop(node_id, None)
        self.withheld.discard(node_id)
        if node is None:
            return
        self.listener.on_node_removed(node_id)
        if len(self._forgotten) >= MAX_FORGOTTEN:
            del self._forgotten[next(iter(self._forgotten))]
        self._forgotten[node_id] = (node.generation, node.heartbeat, now + remember_s)

    def expire_forgotten(self, now: float) -> None:
        for node_id in [n for n, (_, _, until) in self._forgotten.items() if until <= now]:
            del self._forgotten[node_id]

    def forgotten(self) -> list[str]:
        return list(self._forgotten)

    # --------------------------------------------------------------------------------------------------- upkeep

    def gc_tombstones(self, now: float, grace_s: float) -> int:
        """Drop tombstones older than ``grace_s`` (local time of deletion); returns how many."""
        before = now - grace_s
        return sum(node._gc_tombstones(before) for node in self.nodes.values())

    def live_items(self, prefix: str) -> dict[str, dict[str, bytes]]:
        """``{node id: {key: value}}`` of every live key starting with ``prefix``, over all known nodes."""
        out: dict[str, dict[str, bytes]] = {}
        for node_id, node in self.nodes.items():
            items = dict(node.items(prefix))
            if items:
                out[node_id] = items
        return out
