"""Mesh-wide rate limits: each node gossips what it admitted for its rate-limited tenants, and every node charges
its own buckets with what its peers admitted, so a tenant over its limit across the mesh is refused by any node
within a gossip round (``flow/rate_limit.TenantRateLimits.consume``).

Wire value (gossip key ``USAGE_KEY``): a msgpack map ``{tenant: [requests, tokens]}`` of the node's totals since it
started, for the tenants it admitted most recently -- at most ``MAX_USAGE_TENANTS`` and ``MAX_USAGE_BYTES`` (the
bound on what every node carries for every other). Totals rather than per-round amounts, so a round a peer misses
loses nothing: a reader charges the growth of each total since it last read it. A total it reads for the first time
is charged whole, except in the first value it reads from a node (a node that joins, or restarts, does not charge
what its peers admitted before it was watching); a total that went down is a peer's new life, charged whole. A node
publishes its value from its first round on (empty until it admits a limited tenant's call), so a peer watching
since then reads its first admissions as growth.

Only tenants with a rate limit are counted and published (the rest have no bucket to charge). A tenant that drops
out of a node's published set and comes back later is charged from its last total the reader remembers (it keeps
``REMEMBERED_PER_PEER`` per peer, least recently seen forgotten first).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from p2pnode.flow.rate_limit import TenantRateLimits
from p2pnode.serving.peer_totals import PeerTotals, decode_totals, encode_totals

log = logging.getLogger("p2pnode.flow")

__all__ = ["MAX_USAGE_BYTES", "MAX_USAGE_TENANTS", "USAGE_KEY", "TenantUsage", "decode_usage", "encode_usage"]

#: The gossip key a node publishes its tenants' admitted totals under.
USAGE_KEY = "flow/usage"
#: Tenants one node publishes at most (those it admitted most recently): a mesh-wide limit is for the tenants that
#: send a lot, which are the recent ones at any busy node.
MAX_USAGE_TENANTS = 32
#: Longest value published or accepted (bytes): 32 tenants of 64-character names and two 64-bit totals fit.
MAX_USAGE_BYTES = 4096
#: Per-peer totals a reader remembers (tenants beyond are forgotten least recently seen first).
REMEMBERED_PER_PEER = 4 * MAX_USAGE_TENANTS

Usage = dict[str, tuple[int, int]]


def encode_usage(usage: Usage) -> bytes:
    """The totals as published, dropping the last tenants until they fit MAX_USAGE_BYTES."""
    wire = {tenant: [requests, tokens] for tenant, (requests, tokens) in usage.items()}
    return encode_totals(wire, MAX_USAGE_TENANTS, MAX_USAGE_BYTES)


def _pair(wire: object) -> tuple[int, int] | None:
    if isinstance(wire, list) and len(wire) == 2 and all(type(x) is int and x >= 0 for x in wire):
        return wire[0], wire[1]
    return None


def decode_usage(value: bytes) -> Usage | None:
    """A peer's published totals; None when malformed (a peer's bug must not reach the buckets)."""
    return decode_totals(value, MAX_USAGE_TENANTS, MAX_USAGE_BYTES, _pair)


class TenantUsage:
    """This node's admitted totals per rate-limited tenant (``record``, published by ``value``), and its peers'
    charged to its own buckets as they arrive (``apply``)."""

    def __init__(
        self, limits: TenantRateLimits, limited: Callable[[str], bool], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._limited = limited
        self._clock = clock
        #: This node's totals, most recently admitted last (bounded: the published set is its newest part).
        self._totals: OrderedDict[str, tuple[int, int]] = OrderedDict()
        #: Per peer: its totals as last read.
        self.peers = PeerTotals(REMEMBERED_PER_PEER)
        #: What peers' totals charged here: (requests, tokens).
        self.charged = (0, 0)

    def record(self, tenant: str, tokens: int) -> None:
        """A call of ``tenant`` admitted here (one request, ``tokens`` tokens)."""
        if not self._limited(tenant):
            return
        requests, total = self._totals.pop(tenant, (0, 0))
        self._totals[tenant] = (requests + 1, total + tokens)
        while len(self._totals) > REMEMBERED_PER_PEER:
            self._totals.popitem(last=False)

    def value(self) -> bytes:
        """What to publish: the totals, the most recently admitted tenants first."""
        return encode_usage(dict(reversed(self._totals.items())))

    def apply(self, node_id: str, value: bytes | None) -> None:
        """A peer's published totals changed: charge their growth to this node's buckets."""
        if value is None:
            self.peers.forget(node_id)
            return
        usage = decode_usage(value)
        if usage is None:
            log.debug("ignored a malformed tenant usage value from %s", node_id)
            return
        now = self._clock()
        for tenant, (requests, tokens) in self.peers.growth(node_id, usage):
            if self._limited(tenant):
                self.limits.consume(tenant, requests, tokens, now)
                self.charged = (self.charged[0] + requests, self.charged[1] + tokens)
