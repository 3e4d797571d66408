"""The alive peers ordered by load as this ingress sees it: each one's reported load plus its sends since that report.

Why: a policy that chooses by load alone (``flat``: ``Reads.load_only``) wants the few least loaded peers counting
the requests this ingress sent them since their last report (``ledger.py``). Handing it every peer with sends in
flight and letting it sort them costs O(peers with sends) per request -- ~1-2 ms at a busy ingress of 1,000 peers.
A peer's effective load only moves when a send to it begins or ends, or when its report is re-read, so the order is
kept as those happen: the ledger names the peers whose sends changed (``InFlightLedger.track_changes``), the peer
table the peers it re-read (``PeerTable.track_rereads``), and ``sync`` moves just those before a decision reads
``least``.

Invariants (after ``sync``): ``keys`` holds one ``(effective load, node id)`` per alive peer of the table, sorted,
where the effective load is ``base.requests`` plus ``ledger.since(peer, reported_at)``'s sends -- exactly what
``candidates.assemble`` hands a policy as that peer's ``requests``; (load, id) is unique, so bisection finds a key.
A table or ledger other than the ones last synced, or a table rebuilt since, is read whole.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Container

from p2pnode.routing.ledger import InFlightLedger
from p2pnode.routing.peer_table import PeerTable, least_in_order
from p2pnode.routing.policies.types import PeerSnapshot

__all__ = ["EffectiveLoadOrder"]


class EffectiveLoadOrder:
    """Alive peers by (reported load + sends since the report, node id) (see the module docstring)."""

    __slots__ = ("_key_of", "_ledger", "_table", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple[int, str]] = []
        self._key_of: dict[str, tuple[int, str]] = {}
        self._table: PeerTable | None = None
        self._ledger: InFlightLedger | None = None

    def sync(self, table: PeerTable, ledger: InFlightLedger) -> None:
        """Bring the order up to ``table`` (caught up with its directory) and ``ledger``."""
        rereads = table.track_rereads()
        changed = ledger.track_changes()
        if table is not self._table or ledger is not self._ledger or table.rebuilt:
            self._rebuild(table, ledger)
            return
        if not rereads and not changed:
            return
        dirty = rereads | changed
        rereads.clear()
        changed.clear()
        keys, key_of = self.keys, self._key_of
        by_id, reported_at = table.by_id, table.reported_at
        for node_id in dirty:
            old = key_of.pop(node_id, None)
            if old is not None:
                del keys[bisect_left(keys, old)]
            base = by_id.get(node_id)
            if base is not None and base.alive:
                key = key_of[node_id] = _key(base, reported_at, ledger)
                insort(keys, key)

    def _rebuild(self, table: PeerTable, ledger: InFlightLedger) -> None:
        reported_at = table.reported_at
        self._key_of = key_of = {base.node_id: _key(base, reported_at, ledger) for base in table.alive_by_load}
        self.keys = sorted(key_of.values())
        self._table, self._ledger = table, ledger
        table.rebuilt = False
        table.track_rereads().clear()
        ledger.track_changes().clear()

    def least(self, count: int, tiebreak: int, exclude: Container[str]) -> list[str]:
        """Up to ``count`` peers not in ``exclude``, least loaded first, a run of equal loads entered at the
        ``tiebreak``'s offset: ``PeerTable.least_loaded``'s walk (``least_in_order``) over these loads (without sends
        the two give the same peers)."""
        keys = self.keys
        return [keys[i][1] for i in least_in_order(keys, count, tiebreak, exclude)]


def _key(base: PeerSnapshot, reported_at: dict[str, float], ledger: InFlightLedger) -> tuple[int, str]:
    """A peer's place: its reported load plus this ingress's sends to it since the report, then its id."""
    node_id = base.node_id
    return base.requests + (ledger.since(node_id, reported_at[node_id])[0] if node_id in ledger else 0), node_id
