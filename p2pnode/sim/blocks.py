"""Synthetic token blocks: a 64-bit content id stands for a block's tokens, hashed with p2pnode's own chain hash.

Workloads do not carry token ids: they describe each full block by a content id (a Mooncake ``hash_id``, or an
id the generator allocated for "block i of key k's system prompt"). ``BlockSpace`` turns ids into real tokens --
block = ``[cid & 0xFFFFFFFF, cid >> 32, 0, 0, ...]`` (``block_size`` uint32 tokens) -- and hashes them exactly as
``p2pnode.cache.block_hash.block_hashes`` would (xxh3-64 of the little-endian bytes, seeded by the parent hash,
the root seed for the first block). So:
- equal id chains give equal hash chains, and a hash names its whole prefix, as in the node;
- the simulated engine can emit ``BlockStored`` events whose ``token_ids`` the real ``PrefixIndex`` re-hashes to
  the same values, so the index the simulator routes on is the node's own code fed the node's own events.

Hashing costs one xxh3 call over ``4 * block_size`` bytes per block; no token lists are built except for the
events (``tokens``).
"""

from __future__ import annotations

import xxhash

from p2pnode.cache.block_hash import ROOT_SEED

__all__ = ["BlockSpace"]

_MASK32 = 0xFFFF_FFFF
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


class BlockSpace:
    """Content ids <-> tokens and chained p2pnode hashes, for one block size."""

    __slots__ = ("_pad", "_zeros", "block_size")

    def __init__(self, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (a content id takes two tokens), got {block_size}")
        self.block_size = block_size
        self._pad = bytes(4 * block_size - 8)
        self._zeros = (0,) * (block_size - 2)

    def extend(self, chain: list[int], cids: list[int], new_cids: list[int] | range) -> None:
        """Append ``new_cids`` to ``cids`` and their chained hashes to ``chain`` (which must be as long)."""
        h = chain[-1] if chain else ROOT_SEED
        pad = self._pad
        xxh3 = xxhash.xxh3_64_intdigest
        for cid in new_cids:
            if not 0 <= cid <= _MASK64:
                raise ValueError(f"content id must be a uint64, got {cid}")
            h = xxh3(cid.to_bytes(8, "little") + pad, h)
            chain.append(h)
            cids.append(cid)

    def hashes(self, cids: list[int] | range, parent: int | None = None) -> list[int]:
        """Chained hashes of a run of content ids following ``parent`` (None: a prompt's first block)."""
        out: list[int] = [] if parent is None else [parent]
        self.extend(out, [], cids)
        return out if parent is None else out[1:]

    def tokens(self, cids: list[int]) -> tuple[int, ...]:
        """The token ids of the blocks named by ``cids`` (for ``BlockStored.token_ids``)."""
        out: list[int] = []
        ext = out.extend
        zeros = self._zeros
        for cid in cids:
            ext((cid & _MASK32, cid >> 32))
            ext(zeros)
        return tuple(out)
