"""The worker's segment store: plain K/V of stored segments and tails, beside vLLM's KV tensors.

It only executes what the connector's scheduler side decided (``segments.SegmentStore``): copy a finished request's
tokens out of its blocks (``capture``), forget an entry (``drop``), write an entry's tokens into a new request's
blocks at other positions (``load``, keys re-rotated by the position difference). Entries are held in the cache's
dtype, one ``[tokens, kv_heads, head_size]`` pair per layer, in host memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from p2pnode.kv.plain import TokenCodec
from p2pnode.kv.rope import Rerotation

log = logging.getLogger("p2pnode.kv")

__all__ = ["LoadPiece", "SegmentKV"]


@dataclass(frozen=True, slots=True)
class LoadPiece:
    """Write ``count`` tokens of entry ``key`` (from its token ``offset``) to ``slots``, keys rotated by ``delta``."""

    key: int
    offset: int
    count: int
    delta: int
    slots: list[int]


class SegmentKV:
    """Stored segments' K/V, per layer (see the module docstring)."""

    def __init__(self, layers: list[Any], codec: TokenCodec, rotation: Rerotation) -> None:
        self.layers = layers
        self.codec = codec
        self.rotation = rotation
        #: Re-rotate keys to their new positions (off only to measure what that costs: docs/segments.md).
        self.rotate = True
        self._entries: dict[int, tuple[list[Any], list[Any]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def capture(self, key: int, slots: list[int]) -> None:
        """Copy the tokens at ``slots`` (every layer) into entry ``key``."""
        keys, values = [], []
        for layer in self.layers:
            k, v = self.codec.read(layer, slots)
            keys.append(k)
            values.append(v)
        self._entries[key] = (keys, values)

    def drop(self, key: int) -> None:
        self._entries.pop(key, None)

    def entry(self, key: int) -> tuple[list[Any], list[Any]] | None:
        """Entry ``key``'s K/V per layer (what a segment lease streams; never written in place: ``capture`` and
        ``put`` replace entries), or None."""
        return self._entries.get(key)

    def put(self, key: int, entry: tuple[list[Any], list[Any]]) -> None:
        """Hold K/V that arrived from a peer's store under ``key`` (its keys rotated where the peer computed it)."""
        self._entries[key] = entry

    def load(self, pieces: list[LoadPiece]) -> bool:
        """Write every piece; False (nothing further written) when an entry is missing or too short."""
        for piece in pieces:
            entry = self._entries.get(piece.key)
            if entry is None or entry[0][0].shape[0] < piece.offset + piece.count:
                log.warning("segment store: entry %x missing or short; its tokens are computed", piece.key)
                return False
            stop = piece.offset + piece.count
            for layer, k, v in zip(self.layers, entry[0], entry[1], strict=True):
                keys = self.rotation.shift(k[piece.offset : stop], piece.delta if self.rotate else 0)
                self.codec.write(layer, piece.slots, keys, v[piece.offset : stop])
        return True
