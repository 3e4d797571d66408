"""Eviction policies of the simulated KV cache, one per module, selectable by name (``--eviction``)."""

from __future__ import annotations

from p2pnode.cache.eviction.base import EvictionPolicy, PolicyFactory
from p2pnode.cache.eviction.lru import LRU
from p2pnode.cache.eviction.s3fifo import S3FIFO

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "PolicyFactory", "get_eviction"]

EVICTION_POLICIES: dict[str, PolicyFactory] = {"lru": LRU, "s3fifo": S3FIFO}


def get_eviction(name: str) -> PolicyFactory:
    """The policy factory called ``name``; ValueError listing the valid names otherwise."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(EVICTION_POLICIES)}") from None
