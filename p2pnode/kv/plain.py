"""Plain K/V of single tokens in a vLLM CPU KV-cache tensor: what segment reuse reads and writes.

vLLM's CPU attention backend keeps one tensor per layer, ``[blocks, kv_heads, block_size, 2 * head_size]``; per
(block, head) the memory is a K region then a V region, each **packed for the host's kernel** (``amx``: VNNI tiles;
``vec``: K transposed; others differ again). A whole block can be copied as bytes between equal layouts
(``blocks.py``), but a segment moves token by token to other positions, so it needs K and V as plain
``[tokens, kv_heads, head_size]`` arrays.

Reading: ``TokenCodec`` learns the packing by probing vLLM's own writer (``cpu_attn_reshape_and_cache``) once with
index-encoded values, and inverts it -- so it holds for every ISA the kernel supports, not only the two we could
inspect. Writing goes through that same kernel with a slot per token, which writes partial blocks too.

Invariant: ``codec.read(layer, slots)`` returns exactly the K/V that ``codec.write(layer, slots, K, V)`` stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TokenCodec", "slots_of"]

#: Values below this are exact in bf16/fp16, so a probe encodes an index in two such digits.
_PROBE_BASE = 128


def slots_of(block_ids: list[int], first_token: int, count: int, block_size: int) -> list[int]:
    """The cache slots (``block_id * block_size + offset``) of ``count`` tokens starting at token ``first_token`` of a
    request whose blocks are ``block_ids`` (from its first token)."""
    return [block_ids[t // block_size] * block_size + t % block_size for t in range(first_token, first_token + count)]


@dataclass(frozen=True)
class TokenCodec:
    """Reads and writes single tokens' plain K/V in one layout (see the module docstring)."""

    isa: str
    block_size: int
    head_size: int
    k_gather: Any  # packed position -> plain (token * head_size + dim), inverted: plain[i] = packed[k_gather[i]]
    v_gather: Any

    @classmethod
    def probe(cls, isa: str, dtype: Any, block_size: int, head_size: int) -> TokenCodec:
        """The codec of vLLM's CPU kernel ``isa`` for ``dtype`` blocks of ``block_size`` x ``head_size``."""
        import torch
        from vllm._custom_ops import cpu_attn_reshape_and_cache

        n = block_size * head_size
        index = torch.arange(n)
        digits = []
        for part in (index % _PROBE_BASE, index // _PROBE_BASE):
            scratch = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
            k_cache, v_cache = scratch.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
            plain = part.reshape(block_size, 1, head_size).to(dtype)
            cpu_attn_reshape_and_cache(plain, plain.clone(), k_cache, v_cache, torch.arange(block_size), isa)
            digits.append((k_cache.flatten().long(), v_cache.flatten().long()))
        k_perm = digits[0][0] + _PROBE_BASE * digits[1][0]
        v_perm = digits[0][1] + _PROBE_BASE * digits[1][1]
        if not (torch.equal(k_perm.sort().values, index) and torch.equal(v_perm.sort().values, index)):
            raise ValueError(f"the {isa} kernel's block packing is not a permutation of its tokens")
        return cls(isa, block_size, head_size, torch.argsort(k_perm), torch.argsort(v_perm))

    def read(self, layer: Any, slots: list[int]) -> tuple[Any, Any]:
        """K and V (``[tokens, kv_heads, head_size]``, the cache's dtype) of the tokens in ``slots``."""
        import torch

        bs, hs = self.block_size, self.head_size
        slot = torch.tensor(slots, dtype=torch.long)
        blocks, offsets = slot // bs, slot % bs
        unique, where = torch.unique(blocks, return_inverse=True)
        heads = layer.shape[1]
        raw = layer.index_select(0, unique).view(len(unique), heads, 2, bs * hs)
        keys = raw[:, :, 0][:, :, self.k_gather].view(len(unique), heads, bs, hs)
        values = raw[:, :, 1][:, :, self.v_gather].view(len(unique), heads, bs, hs)
        return keys[where, :, offsets].contiguous(), values[where, :, offsets].contiguous()

    def write(self, layer: Any, slots: list[int], keys: Any, values: Any) -> None:
        """Store ``keys`` and ``values`` (``[tokens, kv_heads, head_size]``) at ``slots``, packed by vLLM's kernel."""
        import torch
        from vllm._custom_ops import cpu_attn_reshape_and_cache

        blocks, heads, bs, _ = layer.shape
        k_cache, v_cache = layer.view(blocks, heads, 2 * bs, self.head_size).chunk(2, dim=2)
        slot = torch.tensor(slots, dtype=torch.long)
        cpu_attn_reshape_and_cache(
            keys.to(layer.dtype).contiguous(), values.to(layer.dtype).contiguous(), k_cache, v_cache, slot, self.isa
        )
