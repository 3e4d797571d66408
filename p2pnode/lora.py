"""LoRA adapters across the mesh: which adapters a node serves, and how it tells its peers.

A node serves the adapters it was started with (``--lora-modules NAME=PATH``) and those loaded at run time
(``/v1/load_lora_adapter``). Its engine keeps at most ``--max-loras`` of them in its accelerator's adapter slots;
the others load on their first request (a few milliseconds to a second, by size). A request for adapter X may go
only to a node that serves X (routing excludes the others, ``routing/router.py``), and a node that served X recently
is preferred by the load it saves: every node publishes both sets under ``ADAPTERS_KEY`` once per gossip round when
they change (``AdapterPublisher``), and its peers read them into their ``ClusterView``.

Bounded: at most ``MAX_ADAPTERS`` names of at most ``MAX_ADAPTER_NAME_CHARS`` each; a value beyond is refused whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import msgpack

from p2pnode.config import MAX_ADAPTER_NAME_CHARS, MAX_ADAPTERS

__all__ = ["ADAPTERS_KEY", "AdapterPublisher", "AdapterSet", "RecentAdapters", "decode_adapters", "encode_adapters"]

#: The gossip key of a node's adapters.
ADAPTERS_KEY = "adapters"


@dataclass(frozen=True, slots=True)
class AdapterSet:
    """The adapters a node serves (``served``) and those it used most recently, up to its engine's adapter slots
    (``resident``: likely still loaded, so a request for one costs no load)."""

    served: frozenset[str] = frozenset()
    resident: frozenset[str] = frozenset()
    #: (name, path) of each adapter this node serves, where it loaded it from (``/v1/models`` reports it as vLLM
    #: does): a node's own business, never gossiped (a peer's paths name its file system, not this one's).
    paths: tuple[tuple[str, str], ...] = ()


NO_ADAPTERS = AdapterSet()


def encode_adapters(adapters: AdapterSet) -> bytes:
    return msgpack.packb([sorted(adapters.served), sorted(adapters.resident & adapters.served)])


def decode_adapters(value: bytes) -> AdapterSet | None:
    """A peer's adapters, or None when the value is malformed or beyond the bounds (never trusted in part)."""
    if len(value) > 2 * MAX_ADAPTERS * (MAX_ADAPTER_NAME_CHARS + 8) + 16:
        return None
    try:
        served, resident = msgpack.unpackb(value)
    except Exception:
        return None
    names = [*served, *resident] if isinstance(served, list) and isinstance(resident, list) else None
    if names is None or len(served) > MAX_ADAPTERS or len(resident) > MAX_ADAPTERS:
        return None
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_ADAPTER_NAME_CHARS for n in names):
        return None
    return AdapterSet(frozenset(served), frozenset(resident) & frozenset(served))


class RecentAdapters:
    """The ``slots`` adapters a node used most recently: what its engine most likely still holds loaded."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self._recent: OrderedDict[str, None] = OrderedDict()

    def used(self, adapter: str) -> None:
        if adapter:
            self._recent.pop(adapter, None)
            self._recent[adapter] = None
            while len(self._recent) > self.slots:
                self._recent.popitem(last=False)

    def forget(self, adapter: str) -> None:
        self._recent.pop(adapter, None)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._recent)


class _Publisher(Protocol):
    def before_round(self, hook) -> None: ...  # type: ignore[no-untyped-def]

    def publish(self, key: str, value: bytes) -> None: ...


class AdapterPublisher:
    """Publishes a node's adapters under ``ADAPTERS_KEY`` at the start of each gossip round, when they changed."""

    def __init__(self, agent: _Publisher, current) -> None:  # type: ignore[no-untyped-def]
        """``current()``: the node's ``AdapterSet`` now."""
        self._agent = agent
        self._current = current
        self._last: bytes | None = None
        agent.before_round(self._publish)

    def _publish(self) -> None:
        value = encode_adapters(self._current())
        if value != self._last:
            self._agent.publish(ADAPTERS_KEY, value)
            self._last = value
