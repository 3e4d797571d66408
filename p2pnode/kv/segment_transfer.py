"""Stored segments between engines: the chunks a holder's block server streams for a segment lease, and the fetch a
puller's worker assembles them with.

A stored segment is plain K/V in the worker's host memory (``segment_kv.SegmentKV``: per layer, ``[tokens, kv_heads,
head_size]`` in the cache's dtype), not paged blocks, so it moves as such: one message per (segment, layer, chunk of
at most ``chunk_tokens`` tokens) -- the size of one layer of one block, as a prefix pull's messages
(``p2pnode/v1/kv.proto``). Plain K/V does not depend on the CPU kernel's packing, but the holder and the puller still
check the same layout fingerprint as block pulls do (``layout.py``): the numbers mean the same only for the same
weights, dtype and head shape.

Puller side: a segment counts only once every token of every layer arrived; whatever is missing when the stream ends
(the holder died, the lease expired, a timeout) is left out, and the request computes that segment instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from p2pnode.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger("p2pnode.kv")

__all__ = ["SegmentFetchResult", "fetch_segments", "segment_chunks"]

#: gRPC message bound of the segment stream (one layer of one block's worth of tokens is far smaller).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: One stored segment's K/V: per layer, keys and values ``[tokens, kv_heads, head_size]``.
Entry = tuple[list[Any], list[Any]]


def _raw(tensor: Any) -> bytes:
    import torch

    return tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def segment_chunks(entries: Sequence[Entry], chunk_tokens: int) -> Iterator[kv_pb2.SegmentChunk]:
    """The messages of a segment lease: each entry, chunk by chunk, every layer of a chunk before the next."""
    for index, (keys, values) in enumerate(entries):
        tokens = int(keys[0].shape[0]) if keys else 0
        for first in range(0, tokens, chunk_tokens):
            stop = min(tokens, first + chunk_tokens)
            for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
                yield kv_pb2.SegmentChunk(
                    segment=index, layer=layer, first_token=first, tokens=stop - first,
                    keys=_raw(k[first:stop]), values=_raw(v[first:stop]),
                )


@dataclass
class SegmentFetchResult:
    """How a segment fetch ended: ``entries`` holds the segments (by index in the lease) that arrived whole, ``bytes``
    of K/V in ``seconds``; ``error`` says why the others did not ("" when all did)."""

    entries: dict[int, Entry] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class _SegmentAssembly:
    """The segments of one lease as their chunks arrive: K/V buffers, and which tokens of which layer are written.
    A chunk that was not asked for, has the wrong size or arrives twice ends the fetch (``write`` says why)."""

    def __init__(self, lengths: Sequence[int], layers: int, shape: tuple[int, int], dtype: Any) -> None:
        import torch

        heads, head_size = shape
        self.lengths = lengths
        self.layers = layers
        self.token_bytes = heads * head_size * dtype.itemsize
        self.bufs = [
            ([torch.empty(n, heads, head_size, dtype=dtype) for _ in range(layers)],
             [torch.empty(n, heads, head_size, dtype=dtype) for _ in range(layers)])
            for n in lengths
        ]  # fmt: skip
        self.left = [n * layers for n in lengths]  # tokens x layers still missing, per segment
        self.seen = [[bytearray(n) for _ in range(layers)] for n in lengths]  # tokens written, per segment and layer
        self.moved = 0

    def write(self, m: kv_pb2.SegmentChunk) -> str:
        """Copy one chunk into its segment; why it was refused ("" when it was taken)."""
        import torch

        i, n = m.segment, m.tokens
        if not (0 <= i < len(self.lengths) and 0 <= m.layer < self.layers and n > 0
                and m.first_token + n <= self.lengths[i]):
            return f"holder sent segment {m.segment} layer {m.layer} tokens {m.first_token}+{n}, not asked for"
        if len(m.keys) != n * self.token_bytes or len(m.values) != n * self.token_bytes:
            return f"segment {i} layer {m.layer}: {len(m.keys)}/{len(m.values)} bytes, expected {n * self.token_bytes}"
        stop = m.first_token + n
        mask = self.seen[i][m.layer]
        if any(mask[m.first_token : stop]):
            return f"holder sent segment {i} layer {m.layer} tokens {m.first_token}+{n} twice"
        mask[m.first_token : stop] = b"\x01" * n
        for buf, data in ((self.bufs[i][0][m.layer], m.keys), (self.bufs[i][1][m.layer], m.values)):
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buf[m.first_token : stop].view(-1).view(torch.uint8).copy_(raw)
        self.moved += 2 * n * self.token_bytes
        self.left[i] -= n
        return ""

    def incomplete(self) -> str:
        """Why the lease is not whole when its stream ended ("" when it is)."""
        if not any(self.left):
            return ""
        return f"stream ended with {sum(1 for x in self.left if x)} of {len(self.lengths)} segments incomplete"

    def whole(self) -> dict[int, Entry]:
        """The segments every token of every layer of which arrived, by index in the lease."""
        return {i: self.bufs[i] for i, missing in enumerate(self.left) if missing == 0}


def fetch_segments(
    kv_address: str,
    lease: str,
    layout: str,
    lengths: Sequence[int],
    layers: int,
    shape: tuple[int, int],
    dtype: Any,
    timeout_s: float,
) -> SegmentFetchResult:
    """Pull every segment of ``lease`` (``lengths`` tokens each, ``layers`` layers of ``shape`` = (kv_heads,
    head_size) per token in ``dtype``) from the block server at ``kv_address`` (module docstring). Never raises."""
    started = time.monotonic()
    assembly = _SegmentAssembly(lengths, layers, shape, dtype)
    error = ""
    channel = grpc.insecure_channel(kv_address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    try:
        stub = kv_pb2_grpc.KvBlocksStub(channel)
        for m in stub.PullSegments(kv_pb2.SegmentPullRequest(lease=lease, kv_layout=layout), timeout=timeout_s):
            error = assembly.write(m)
            if error:
                break
        else:
            error = assembly.incomplete()
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        error = f"{code.name if code is not None else 'RPC'}: {e.details() if hasattr(e, 'details') else e}"
    except Exception as e:  # a bug must fail the pull (compute the segment), never the engine
        log.exception("segment fetch from %s failed", kv_address)
        error = f"{type(e).__name__}: {e}"
    finally:
        channel.close()
    return SegmentFetchResult(assembly.whole(), assembly.moved, time.monotonic() - started, error)
