"""Engine-neutral KV-cache events: what an engine tells the local prefix indexes.

The shapes follow vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` (vllm/distributed/kv_events.py),
reduced to the fields p2pnode uses. ``medium`` says which of the node's media the blocks entered or left (the engine's
own cache, its host tier, its disk tier: ``tiers.Medium``); each medium has an index of its own. ``engine_block_hashes``
are the engine's own 64-bit ids for blocks; p2pnode never routes on them (they depend on the engine's hash seed) and
only keeps them to resolve removals.

Invariants:
- ``BlockStored.token_ids`` holds exactly ``len(engine_block_hashes) * block_size`` tokens, block i being
  ``token_ids[i*block_size:(i+1)*block_size]``; block 0's parent is ``parent_engine_hash`` (None: the root).
- ``CacheReset`` is synthesised by the subscriber (never sent by vLLM): the engine restarted or events were lost
  beyond recovery, so everything known about the cache, its tiers included, is void. ``AllBlocksCleared`` is the
  engine's own cache only.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.tiers import Medium


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the engine's prefix cache, in chain order. ``namespace`` (the adapter and cache salt
    the blocks' KV depends on, ``namespace.py``) matters only for a chain's first blocks (``parent_engine_hash`` None):
    later ones continue their parent's chain, namespace included."""

    engine_block_hashes: tuple[int, ...]
    parent_engine_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    namespace: CacheNamespace = DEFAULT_NAMESPACE
    medium: Medium = Medium.GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted from its prefix cache (or a tier dropped: ``medium``)."""

    engine_block_hashes: tuple[int, ...]
    medium: Medium = Medium.GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. ``reset_prefix_cache``)."""


@dataclass(frozen=True, slots=True)
class CacheReset:
    """The subscriber lost track of the engine's cache (engine restart, unrecoverable gap): start from empty."""

    reason: str


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared | CacheReset
