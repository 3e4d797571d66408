"""Mesh-wide fair shares: each node gossips the token work its engine took per tenant, and every node charges the
work its peers served beyond a fair share of it to its own queue (``EngineQueue.charge``), so a tenant heavy
elsewhere waits behind lighter tenants at a node that is backlogged, not only behind its own requests there.

Wire value (gossip key ``SERVED_KEY``): a msgpack map ``{tenant: work}`` of the node's totals since it started (a
request's work is ``request_cost``: prompt tokens plus ``max_tokens``, counted as it enters the engine, forwarded
ones included), for the ``MAX_SERVED_TENANTS`` tenants with the most recent work -- at most ``MAX_SERVED_BYTES``.
Totals rather than per-round amounts, read as ``tenant_usage.py`` reads its own: a reader takes the growth of each
total since it last read it (the first value from a node is a baseline; a total that went down is a new life,
counted whole).

What is charged, once per round (``charge_round``): the round's growth from all peers, less each tenant's weighted
equal share of it among the tenants that grew or wait here (``flow/shares.py``: the simulator's rule too). A tenant
served elsewhere no more than the others is charged nothing (charging every tenant its whole remote work would push
a light tenant behind the queued requests of a heavy one, a round's work at a time); only the excess orders it back.
The charge is a debt of at most the work
waiting at this node when it is charged (``EngineQueue.charge``): a node that is not backlogged keeps none, and a
tenant served elsewhere for hours waits behind what waits here, no longer.

Bounds: the value (4 KiB, 32 tenants), the totals a node keeps of its own (``REMEMBERED_OWN``, the least recent work
forgotten first), per peer (``REMEMBERED_PER_PEER``), and the growth waiting for the round (``MAX_PENDING``
tenants). Nothing here runs per request but ``record`` (two dict updates).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from p2pnode.flow.shares import excess_over_share
from p2pnode.serving.peer_totals import PeerTotals, decode_totals, encode_totals

log = logging.getLogger("p2pnode.flow")

__all__ = ["MAX_SERVED_BYTES", "MAX_SERVED_TENANTS", "SERVED_KEY", "TenantServed", "decode_served", "encode_served"]

#: The gossip key a node publishes its tenants' served work under.
SERVED_KEY = "flow/served"
#: Tenants one node publishes at most: those with the most recent work, which are the ones a fair share is about.
MAX_SERVED_TENANTS = 32
#: Longest value published or accepted (bytes): 32 tenants of 64-character names and a 64-bit total fit.
MAX_SERVED_BYTES = 4096
#: Per-peer totals a reader remembers (least recently seen forgotten first).
REMEMBERED_PER_PEER = 4 * MAX_SERVED_TENANTS
#: This node's own totals kept (beyond twice as many, those with the least recent work are forgotten).
REMEMBERED_OWN = 4 * MAX_SERVED_TENANTS
#: Tenants whose peers' growth waits for the round's charge (new ones beyond are dropped until the round).
MAX_PENDING = 1024
#: What is left of a tenant's recent work after each round: the ranking of the published tenants follows the last
#: few rounds.
RECENT_DECAY = 0.5

Served = dict[str, int]


def encode_served(served: Served) -> bytes:
    """The totals as published (the first MAX_SERVED_TENANTS), dropping the last until they fit MAX_SERVED_BYTES."""
    return encode_totals(served, MAX_SERVED_TENANTS, MAX_SERVED_BYTES)


def _work(wire: object) -> int | None:
    return wire if type(wire) is int and wire >= 0 else None


def decode_served(value: bytes) -> Served | None:
    """A peer's published totals; None when malformed (a peer's bug must not reach the queue)."""
    return decode_totals(value, MAX_SERVED_TENANTS, MAX_SERVED_BYTES, _work)


class TenantServed:
    """This node's served work per tenant (``record``, published by ``publish_value``), and its peers' charged to
    its queue once per round (``apply`` as their values arrive, ``charge_round`` at the round)."""

    def __init__(
        self,
        charge: Callable[[str, float], None],
        waiting: Callable[[], Iterable[str]],
        weight_of: Callable[[str], float] = lambda tenant: 1.0,
    ) -> None:
        self._charge = charge
        self._waiting = waiting
        self._weight_of = weight_of
        self._totals: dict[str, int] = {}
        self._recent: dict[str, float] = {}
        #: Per peer: its totals as last read.
        self.peers = PeerTotals(REMEMBERED_PER_PEER)
        #: Peers' growth since the last round's charge, per tenant.
        self._pending: dict[str, int] = {}
        #: Work peers reported served (their totals' growth), and the excess of it charged to the queue (whose bound
        #: on the debt may take less).
        self.reported = 0
        self.charged = 0.0

    # --- this node's work ---------------------------------------------------------------------------------------

    def record(self, tenant: str, work: int) -> None:
        """A request of ``tenant`` with ``work`` tokens entered this node's engine."""
        self._totals[tenant] = self._totals.get(tenant, 0) + work
        self._recent[tenant] = self._recent.get(tenant, 0.0) + work
        if len(self._totals) > 2 * REMEMBERED_OWN:
            self._forget_own()

    def _forget_own(self) -> None:
        keep = sorted(self._totals, key=lambda t: self._recent.get(t, 0.0), reverse=True)[:REMEMBERED_OWN]
        self._totals = {t: self._totals[t] for t in keep}
        self._recent = {t: self._recent[t] for t in keep if t in self._recent}

    def publish_value(self) -> bytes:
        """What to publish this round (call once per round): the totals of the tenants with the most recent work,
        the most first; their recent work then decays."""
        top = sorted(self._recent, key=self._recent.__getitem__, reverse=True)[:MAX_SERVED_TENANTS]
        value = encode_served({t: self._totals[t] for t in top})
        self._recent = {t: r * RECENT_DECAY for t, r in self._recent.items() if r * RECENT_DECAY >= 1.0}
        return value

    # --- peers' work ----------------------------------------------------------------------------------------------

    def apply(self, node_id: str, value: bytes | None) -> None:
        """A peer's published totals changed: keep their growth for the round's charge."""
        if value is None:
            self.peers.forget(node_id)
            return
        served = decode_served(value)
        if served is None:
            log.debug("ignored a malformed served-work value from %s", node_id)
            return
        for tenant, (growth,) in self.peers.growth(node_id, {t: (work,) for t, work in served.items()}):
            if tenant in self._pending or len(self._pending) < MAX_PENDING:
                self._pending[tenant] = self._pending.get(tenant, 0) + growth
                self.reported += growth

    def charge_round(self) -> None:
        """Charge the round's growth (call once per round): each tenant's part beyond its weighted equal share of it
        among the tenants that grew or wait here (module docstring)."""
        pending, self._pending = self._pending, {}
        for tenant, excess in excess_over_share(pending, self._waiting(), self._weight_of).items():
            self._charge(tenant, excess)
            self.charged += excess
