"""The static eviction policies by name: what ``adaptive`` chooses among and what a shadow cache replays."""

from __future__ import annotations

from p2pnode.cache.eviction.arc import ARC
from p2pnode.cache.eviction.base import PolicyFactory
from p2pnode.cache.eviction.lru import LRU
from p2pnode.cache.eviction.s3fifo import S3FIFO
from p2pnode.cache.eviction.sieve import SIEVE

__all__ = ["STATIC_POLICIES", "get_static"]

STATIC_POLICIES: dict[str, PolicyFactory] = {"lru": LRU, "s3fifo": S3FIFO, "sieve": SIEVE, "arc": ARC}


def get_static(name: str) -> PolicyFactory:
    """The static policy factory called ``name``; ValueError listing the valid names otherwise."""
    try:
        return STATIC_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(STATIC_POLICIES)}") from None
