"""Eviction policies of a KV cache, one per module, selectable by name (``--eviction`` in the simulator,
``--eviction-policy`` on a node): ``lru``, ``s3fifo``, ``sieve``, ``arc`` and ``adaptive``; ``belady.py`` is the
offline yardstick and ``selector.py`` the live choice. docs/eviction.md describes them."""

from __future__ import annotations

from p2pnode.cache.eviction.adaptive import Adaptive
from p2pnode.cache.eviction.base import EvictionPolicy, PolicyFactory
from p2pnode.cache.eviction.registry import STATIC_POLICIES

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "PolicyFactory", "get_eviction"]

EVICTION_POLICIES: dict[str, PolicyFactory] = {**STATIC_POLICIES, "adaptive": Adaptive}


def get_eviction(name: str) -> PolicyFactory:
    """The policy factory called ``name``; ValueError listing the valid names otherwise."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(EVICTION_POLICIES)}") from None
