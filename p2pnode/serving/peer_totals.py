"""Per-tenant totals a node gossips (its admitted usage: ``tenant_usage.py``; its served work: ``tenant_served.py``)
and how a reader turns a peer's values into growth.

A value is a msgpack map ``{tenant: total}`` of the node's totals since it started, for at most ``max_tenants``
tenants and ``max_bytes`` (the last tenants dropped until it fits). Totals rather than per-round amounts, so a round a
reader misses loses nothing: it takes the growth of each total since it last read it. The first value it reads from a
node is a baseline (a node that joins or restarts does not count what its peers did before it was watching); a total
it reads for the first time afterwards counts whole, and so does one that went down (the peer's new life).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgpack

from p2pnode.config import MAX_TENANT_CHARS

__all__ = ["PeerTotals", "decode_totals", "encode_totals", "is_tenant_name"]

V = TypeVar("V")
Totals = tuple[int, ...]


def is_tenant_name(value: object) -> bool:
    """A tenant name as the wire may carry one: a non-empty printable string of at most MAX_TENANT_CHARS."""
    return isinstance(value, str) and 0 < len(value) <= MAX_TENANT_CHARS and value.isprintable()


def encode_totals(values: Mapping[str, Any], max_tenants: int, max_bytes: int) -> bytes:
    """The first ``max_tenants`` of ``values`` (tenant -> its wire value), dropping the last until they fit
    ``max_bytes``."""
    items = list(values.items())[:max_tenants]
    while True:
        value = msgpack.packb(dict(items))
        if len(value) <= max_bytes or not items:
            return value
        items.pop()


def decode_totals(
    value: bytes, max_tenants: int, max_bytes: int, parse: Callable[[object], V | None]
) -> dict[str, V] | None:
    """A peer's published totals, each wire value read by ``parse`` (None: malformed); None when anything is
    malformed (a peer's bug must not reach what the totals are charged to)."""
    if len(value) > max_bytes:
        return None
    try:
        raw = msgpack.unpackb(value, strict_map_key=True)
    except Exception:
        return None
    if not isinstance(raw, dict) or len(raw) > max_tenants:
        return None
    out: dict[str, V] = {}
    for tenant, wire in raw.items():
        parsed = parse(wire) if is_tenant_name(tenant) else None
        if parsed is None:
            return None
        out[tenant] = parsed
    return out


class PeerTotals:
    """Per peer, its totals as last read (at most ``remembered`` tenants each, least recently seen forgotten first),
    and the growth each new value brings (module docstring)."""

    def __init__(self, remembered: int) -> None:
        self.remembered = remembered
        self._seen: dict[str, OrderedDict[str, Totals]] = {}

    def growth(self, node_id: str, totals: Mapping[str, Totals]) -> list[tuple[str, Totals]]:
        """The tenants whose totals grew since ``node_id``'s last value, with the growth (none from its first)."""
        seen = self._seen.get(node_id)
        first = seen is None
        if seen is None:
            seen = self._seen[node_id] = OrderedDict()
        grown: list[tuple[str, Totals]] = []
        for tenant, total in totals.items():
            before = seen.pop(tenant, None)
            seen[tenant] = total
            if first:
                continue
            if before is not None and all(now >= then for now, then in zip(total, before, strict=True)):
                total = tuple(now - then for now, then in zip(total, before, strict=True))
            if any(total):
                grown.append((tenant, total))
        while len(seen) > self.remembered:
            seen.popitem(last=False)
        return grown

    def __contains__(self, node_id: str) -> bool:
        """Whether a value of ``node_id``'s has been read (and not forgotten since)."""
        return node_id in self._seen

    def forget(self, node_id: str) -> None:
        """What ``node_id`` published is no longer read (it left, or withdrew its value)."""
        self._seen.pop(node_id, None)
