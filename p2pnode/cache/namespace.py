"""Cache namespaces: what a prompt's KV depends on besides its tokens.

The same tokens under another LoRA adapter, or another tenant's ``cache_salt``, are other KV: vLLM mixes both into
its block hashes, so such a prompt never hits the other's blocks. Everything p2pnode keys by a prompt must do the
same, or the mesh routes requests to KV they cannot use and reports hits that are not there. A namespace is
``(adapter, cache_salt)`` (the base model is one per mesh), and it enters every key as the seed of a prompt's first
block hash (``root``): the block hashes, the exact index built from KV events, the gossip summary, routing estimates,
and through them the derived routing keys and the plan's keys. The default namespace (no adapter, no salt) keeps
``block_hash.ROOT_SEED``, so prompts without either hash exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from p2pnode.cache.block_hash import ROOT_SEED

__all__ = ["APPROXIMATE_SALT", "DEFAULT_NAMESPACE", "RESERVED_SALT_PREFIX", "CacheNamespace", "approximate_salt"]

#: Cache salts p2pnode uses for itself: a client's may not start with it (admission refuses it).
RESERVED_SALT_PREFIX = "p2pnode:"
#: The cache salt of approximate-segment requests: their blocks hold KV that is not what a full prefill of their
#: tokens gives, so they must never answer a lookup of a request without it (the index keeps them in their own
#: namespace, where no plain request looks).
APPROXIMATE_SALT = RESERVED_SALT_PREFIX + "approximate"


def approximate_salt(client_salt: str) -> str:
    """The cache salt of an approximate-segment request: its own namespace, within the client's."""
    return f"{APPROXIMATE_SALT}|{client_salt}" if client_salt else APPROXIMATE_SALT


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """A LoRA adapter's name ("" for the base model) and a client's cache salt ("" for none)."""

    adapter: str = ""
    salt: str = ""

    @property
    def is_default(self) -> bool:
        return not self.adapter and not self.salt

    @property
    def root(self) -> int | None:
        """The seed of a prompt's first block hash in this namespace (None: the default, ``ROOT_SEED``)."""
        if self.is_default:
            return None
        return xxhash.xxh3_64_intdigest(f"namespace\0{self.adapter}\0{self.salt}".encode(), seed=ROOT_SEED)

    @property
    def label(self) -> str:
        """A short prefix for keys derived from a prompt (routing keys, segment keys): "" for the default."""
        return "" if self.is_default else f"{self.adapter}|{self.salt}"


DEFAULT_NAMESPACE = CacheNamespace()
