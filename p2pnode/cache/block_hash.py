"""p2pnode's block hashes: engine-independent 64-bit names for token-block prefixes.

Every node computes these for its own cache (from ``BlockStored.token_ids``) and for incoming prompts, and
gossips them to peers, so they are a wire format: they must not depend on the engine's hash seed, on
``PYTHONHASHSEED``, on the host's byte order or on the Python/numpy version. Changing anything here (the seed,
the byte layout, the hash function) changes every hash in the mesh.

Definition (``block_size`` = B tokens, blocks counted from 0, only FULL blocks are hashed)::

    bytes_i = token_ids[i*B:(i+1)*B] as little-endian uint32
    h_0     = xxh3_64(bytes_0, seed=ROOT_SEED if parent is None else parent)
    h_i     = xxh3_64(bytes_i, seed=h_{i-1})

Invariants:
- The chain makes ``h_i`` name the whole prefix ``token_ids[:(i+1)*B]`` (up to 64-bit collisions), so a set of
  hashes is a set of prefixes and ``block_hashes(t[:k*B]) == block_hashes(t)[:k]``.
- ``block_hashes(t2, B, parent=block_hashes(t1, B)[-1]) == block_hashes(t1 + t2, B)[len(t1)//B:]``
  whenever ``len(t1)`` is a multiple of B: an engine event that continues a known parent hashes like the
  whole prefix.
- The block size is not mixed into the hash: hashes are only comparable between indexes of one block size.
"""

from __future__ import annotations

import array
import itertools
import sys
from collections.abc import Callable, Container, Iterator, Sequence

import numpy as np
import xxhash

__all__ = [
    "NATIVE", "ROOT_SEED", "block_hashes", "block_hashes_packed", "count_leading", "iter_block_hashes", "mix64",
    "token_buffer",
]

# Seed of the first block of every prompt: the ASCII bytes "p2pnode1" read as a big-endian integer. Part of
# the wire format (see the module docstring); bump the trailing digit if the hash definition ever changes.
ROOT_SEED: int = int.from_bytes(b"p2pnode1", "big")

_U32_MAX = 0xFFFF_FFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
_TOKEN_DTYPE = np.dtype("<u4")
_xxh3_64 = xxhash.xxh3_64_intdigest

try:  # the same chain in one C loop (native/chain.c), built by ``pip install``; Python below when it is not
    from p2pnode.cache._chain import chain as _native_chain
    from p2pnode.cache._chain import leading_in as _native_leading_in
    from p2pnode.cache._chain import mix64 as _native_mix64
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_chain = _native_leading_in = _native_mix64 = None
#: Whether the C extension is built: hashing a whole prompt then costs about what hashing its first block does in
#: Python, so a match hashes every block at once rather than lazily up to the first miss.
NATIVE = _native_chain is not None

# ``array.array`` typecode with 4-byte items. Python lists of ints (vLLM's ``prompt_token_ids``) convert to
# it about 3.5x faster than to a numpy array (measured: 23 us vs 80 us for 4096 tokens), and the hot-path
# budget for hash + match of a 4k-token prompt is 100 us, so lists go through ``array``, ndarrays through
# numpy. Both give the same bytes.
_ARRAY_TYPECODE = next(code for code in "IL" if array.array(code).itemsize == 4)


_MASK64 = (1 << 64) - 1


def _mix64(h: int) -> int:
    """splitmix64's finaliser: a uniform 64-bit value from any int, for sampling or placing by a block hash (the
    simulator's and the tests' block hashes are small integers). The definition of ``mix64``, which is this in C
    where the extension is built."""
    z = (h + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


mix64: Callable[[int], int] = _native_mix64 if _native_mix64 is not None else _mix64


def token_buffer(token_ids: Sequence[int] | np.ndarray) -> memoryview:
    """Return the tokens as a flat byte view of little-endian uint32s (4 bytes per token).

    Converting once and slicing the view per block keeps per-block work to one xxh3 call. Raises ValueError
    for a token id outside [0, 2**32) or an ndarray that is not 1-D, TypeError for non-integer tokens.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.dtype != _TOKEN_DTYPE:
            if token_ids.size and (int(token_ids.min()) < 0 or int(token_ids.max()) > _U32_MAX):
                raise ValueError("token ids must fit in uint32")
            token_ids = token_ids.astype(_TOKEN_DTYPE)
        return memoryview(np.ascontiguousarray(token_ids)).cast("B")
    try:
        arr = array.array(_ARRAY_TYPECODE)
        if isinstance(token_ids, list):
            arr.fromlist(token_ids)  # ~2x faster than the constructor for a list (26 vs 47 us at 4096 tokens)
        else:
            arr.extend(token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in uint32: {exc}") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return memoryview(arr).cast("B")


def _seed(parent: int | None) -> int:
    if parent is None:
        return ROOT_SEED
    if 0 <= parent <= _U64_MAX:
        return parent
    raise ValueError(f"parent must be a uint64 hash, got {parent}")


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: int | None = None,
) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored).

    ``parent`` is the hash of the block preceding ``token_ids[0]`` (None: the tokens start a prompt). Raises
    ValueError for ``block_size < 1``, a parent outside uint64 or a token id outside uint32.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    h = _seed(parent)
    if _native_chain is not None and type(token_ids) is list:
        return _native_chain(token_ids, block_size, h)  # ~3x faster on a 4k-token prompt
    return _chain_bytes(bytes(token_buffer(token_ids)), block_size, h)  # slicing bytes beats a memoryview by ~30%


def block_hashes_packed(packed: bytes, block_size: int, parent: int | None = None) -> list[int]:
    """``block_hashes`` of tokens already in the hash's byte form (``token_buffer``'s, 4 little-endian bytes each:
    how ``token_wire.read_tokens_packed`` keeps a prompt read from the wire). No token is read or checked, so a
    4,096-token prompt hashes in ~2.4 us here against ~5.7 from a list. Raises ValueError for a ``block_size`` < 1,
    a parent outside uint64 or a length that is not whole uint32s."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if type(packed) is not bytes:
        raise TypeError(f"packed tokens must be bytes, got {type(packed).__name__}")
    h = _seed(parent)
    if _native_chain is not None:
        return _native_chain(packed, block_size, h)
    if len(packed) % 4:
        raise ValueError(f"packed tokens must be whole uint32s, got {len(packed)} bytes")
    return _chain_bytes(packed, block_size, h)


def _chain_bytes(buf: bytes, block_size: int, h: int) -> list[int]:
    stride = block_size * 4
    end = len(buf) - len(buf) % stride
    xxh3 = _xxh3_64
    return [h := xxh3(buf[off : off + stride], h) for off in range(0, end, stride)]


def count_leading(hashes: Sequence[int], present: Container[int]) -> int:
    """How many of ``hashes``' first items are in ``present``, up to the first that is not: the longest prefix a
    set of cached hashes holds, in blocks. In C for a list or a tuple against a dict or a set (native/chain.c)."""
    if _native_leading_in is not None and type(hashes) in (list, tuple) and type(present) in (dict, set, frozenset):
        return _native_leading_in(hashes, present)
    return len(list(itertools.takewhile(present.__contains__, hashes)))


def iter_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: int | None = None,
    max_blocks: int | None = None,
) -> Iterator[int]:
    """Lazily yield the same hashes as ``block_hashes``, at most ``max_blocks`` of them.

    For prefix matching, which stops at the first miss: a cold prompt then costs one xxh3 call, not one per
    block. Arguments are validated (and the tokens converted) before the first hash is requested.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seed = _seed(parent)
    buf = token_buffer(token_ids)
    stride = block_size * 4
    n_blocks = len(buf) // stride
    if max_blocks is not None:
        n_blocks = max(0, min(n_blocks, max_blocks))
    return _chain(buf, stride, n_blocks * stride, seed)


def _chain(buf: memoryview, stride: int, end: int, h: int) -> Iterator[int]:
    xxh3 = _xxh3_64
    for off in range(0, end, stride):
        h = xxh3(buf[off : off + stride], h)
        yield h
