"""The in-flight ledger: requests this ingress sent to each peer and has not yet seen finish, with the prompt tokens
each was expected to prefill there.

Why: a peer's load arrives by gossip, seconds old. Without counting its own recent sends, an ingress would see the
same stale load (and prefill backlog) for every request of a burst and herd them all onto one peer. Only sends made
*after* the peer's current load value arrived count (``since``): earlier ones are already in that load.

Invariants: per peer, entries are kept in send order (the clock never goes back), so the ones older than a report
are a prefix and are dropped the first time they are found too old -- a report time only moves forward, so they
would never count again; ``end`` of a dropped or unknown ticket is a no-op; a peer with no entry left is absent
from ``peers()``; a peer's token count is the sum of its entries' tokens, kept as they come and go (``since`` runs
for every peer with sends in flight on every request at a busy ingress: no pass over its entries). Tickets are
unique per ledger and also number every attempt, local ones included.
"""

from __future__ import annotations

from collections.abc import KeysView

__all__ = ["InFlightLedger"]


class InFlightLedger:
    """Sends in flight per peer, by ticket and send time (see the module docstring)."""

    __slots__ = ("_changed", "_sent", "_tokens", "tickets")

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[float, int]]] = {}  # peer -> ticket -> (sent at, tokens), send order
        self._tokens: dict[str, int] = {}  # peer -> the sum of its entries' tokens
        #: Tickets issued so far (the last one issued).
        self.tickets = 0
        self._changed: set[str] | None = None  # peers whose sends changed, once a reader asks (``track_changes``)

    def track_changes(self) -> set[str]:
        """The peers a send to which began or ended, or whose sends were forgotten, since the caller last cleared
        this set (empty when first asked: the caller reads the ledger whole first). One reader:
        ``effective_load.EffectiveLoadOrder``."""
        if self._changed is None:
            self._changed = set()
        return self._changed

    def issue(self) -> int:
        """A new ticket for an attempt that is not tracked (one served locally)."""
        self.tickets += 1
        return self.tickets

    def begin(self, peer: str, now: float, tokens: int = 0) -> int:
        """A request expected to prefill ``tokens`` there was sent to ``peer`` at ``now``; its ticket ends it."""
        self.tickets += 1
        sent = self._sent.get(peer)
        if sent is None:
            sent = self._sent[peer] = {}
            self._tokens[peer] = 0
        sent[self.tickets] = (now, tokens)
        self._tokens[peer] += tokens
        if self._changed is not None:
            self._changed.add(peer)
        return self.tickets

    def end(self, peer: str, ticket: int) -> None:
        sent = self._sent.get(peer)
        entry = sent.pop(ticket, None) if sent is not None else None
        if entry is not None:
            if self._changed is not None:
                self._changed.add(peer)
            if sent:
                self._tokens[peer] -= entry[1]
            else:
                del self._sent[peer], self._tokens[peer]

    def since(self, peer: str, since: float) -> tuple[int, int]:
        """(sends, their tokens) to ``peer`` at or after ``since`` that have not ended (older ones are dropped for
        good)."""
        sent = self._sent.get(peer)
        if sent is None:
            return 0, 0
        if next(iter(sent.values()))[0] < since:
            stale = []
            for ticket, (sent_at, _) in sent.items():
                if sent_at >= since:
                    break
                stale.append(ticket)
            dropped = 0
            for ticket in stale:
                dropped += sent.pop(ticket)[1]
            if not sent:
                del self._sent[peer], self._tokens[peer]
                return 0, 0
            self._tokens[peer] -= dropped
        return len(sent), self._tokens[peer]

    def peers(self) -> KeysView[str]:
        """Peers with at least one send that may still count."""
        return self._sent.keys()

    def __contains__(self, peer: object) -> bool:
        return peer in self._sent

    def forget(self, peer: str) -> None:
        """Drop every send to ``peer`` (it died or restarted)."""
        if self._changed is not None:
            self._changed.add(peer)
        self._sent.pop(peer, None)
        self._tokens.pop(peer, None)
