"""Synthetic token blocks: a 64-bit content id stands for a block's tokens, hashed with p2pnode's own chain hash.

Workloads do not carry token ids: they describe each full block by a content id (a Mooncake ``hash_id``, or an
id the generator allocated for "block i of key k's system prompt"). ``BlockSpace`` turns ids into real tokens --
block = ``[cid & 0xFFFFFFFF, cid >> 32, 0, 0, ...]`` (``block_size`` uint32 tokens) -- and hashes them exactly as
``p2pnode.cache.block_hash.block_hashes`` would (xxh3-64 of the little-endian bytes, seeded by the parent hash,
the root seed for the first block). So:
- equal id chains give equal hash chains, and a hash names its whole prefix, as in the node;
- the simulated engine can emit ``BlockStored`` events whose ``token_ids`` the real ``PrefixIndex`` re-hashes to
  the same values (the tokens travel as a uint32 ndarray, which the index's ``token_buffer`` accepts without
  conversion); the simulator's caches store their chains into the node's own ``PrefixIndex`` by hash instead
  (``PrefixIndex.store_hashed``: the same changes, tested against the events), so a run does not make and hash
  every stored block's tokens again.

Hashing costs one xxh3 call over ``4 * block_size`` bytes per block; no token lists are built except for the
events (``tokens``).
"""

from __future__ import annotations

import numpy as np
import xxhash

from p2pnode.cache.block_hash import ROOT_SEED
from p2pnode.engine.simulated.request import SimRequest

__all__ = ["BlockSpace"]

_MASK32 = 0xFFFF_FFFF
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
#: Up to this many blocks, ``token_array`` joins the blocks' bytes; above, it fills its reusable array (faster then).
_JOIN_MAX_BLOCKS = 16


class BlockSpace:
    """Content ids <-> tokens and chained p2pnode hashes, for one block size."""

    __slots__ = ("_buf", "_pad", "_zeros", "block_size")

    def __init__(self, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (a content id takes two tokens), got {block_size}")
        self.block_size = block_size
        self._pad = bytes(4 * block_size - 8)
        self._zeros = (0,) * (block_size - 2)
        self._buf = np.zeros((64, block_size), dtype="<u4")  # token_array's reusable rows (columns >= 2 stay 0)

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
        """The token ids of the blocks named by ``cids``, as a tuple."""
        out: list[int] = []
        ext = out.extend
        zeros = self._zeros
        for cid in cids:
            ext((cid & _MASK32, cid >> 32))
            ext(zeros)
        return tuple(out)

    def block_tokens(self, r: SimRequest, lo: int, hi: int) -> np.ndarray:
        """Blocks ``lo..hi-1`` of a workload request as tokens (the simulated KV cache's ``TokenSource``): its real
        tokens when it has them (a workload with segments: its chain hashes them), else its content ids'."""
        seg = r.segments
        if seg is not None:
            bs = self.block_size
            return np.asarray(seg.tokens[lo * bs : hi * bs], dtype="<u4")
        return self.token_array(r.cids[lo:hi])

    def token_array(self, cids: list[int]) -> np.ndarray:
        """The same tokens as ``tokens``, as a flat little-endian uint32 array (for ``BlockStored.token_ids``).

        The node's ``token_buffer`` takes an ndarray of uint32 as it is (no per-token conversion), which makes the
        index's re-hashing of a stored block ~3x cheaper than from a tuple; the hashes are identical (tested).
        The array may be a view of a buffer reused by the next call (or a read-only view of bytes): consume it at
        once (``PrefixIndex.apply`` hashes the tokens and keeps only the hashes).
        """
        k = len(cids)
        if k <= _JOIN_MAX_BLOCKS:  # a few blocks (most stores): joining each block's bytes is ~2x faster
            pad = self._pad
            return np.frombuffer(b"".join([c.to_bytes(8, "little") + pad for c in cids]), dtype="<u4")
        buf = self._buf
        if buf.shape[0] < k:
            buf = self._buf = np.zeros((max(k, 2 * buf.shape[0]), self.block_size), dtype="<u4")
        c = np.fromiter(cids, dtype=np.uint64, count=k)
        buf[:k, 0] = c & _MASK32
        buf[:k, 1] = c >> np.uint64(32)
        return buf[:k].reshape(-1)
