"""KV blocks between engines: the block server in a holder's worker process and the fetch a puller's worker runs.

Both run inside vLLM's worker process, beside the KV tensors (``register_kv_caches``): one tensor per attention layer,
block id first. A block moves as its raw bytes, one message per (block, layer) (``p2pnode/v1/kv.proto``), and is
written into the puller's tensor as it arrives -- byte for byte, so both engines' layouts must be equal
(``layout.py``; the server refuses a puller of another layout).

Holder side (``BlockServer``): serves the blocks of a **lease** -- granted by the holder's scheduler when its export
request finished (``connector.py``), so those blocks are held by vLLM and never rewritten while the lease lasts. A
lease is single use: it ends when its stream ends, however it ends, or when it expires unpulled; the connector then
tells vLLM to free the blocks. Bounded: at most ``max_streams`` pulls at once (each on its own thread), leases
expire. It serves stored segments too (``segment_transfer.py``): a **segment lease** holds references to the
entries' K/V tensors, taken when the lease was granted, so an entry the store drops meanwhile still streams whole
(the store replaces entries, never writes into them); the references go when the lease ends.

Puller side (``fetch``): one stream per pull; a block counts only once every layer of it is written; whatever is
missing when the stream ends (the holder died, the lease expired, a timeout) is reported so that vLLM recomputes it
(``kv_load_failure_policy = recompute``): a failed pull costs time, never a wrong token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from p2pnode.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger("p2pnode.kv")

__all__ = ["BlockServer", "FetchResult", "Lease", "fetch"]

#: How long a pull waits for its lease to reach the block server: the holder's node learns the lease from its
#: engine's output, the worker from the next step's metadata, a few milliseconds later.
LEASE_WAIT_S = 2.0
#: gRPC message bound of the block stream (one layer of one block is far smaller).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def block_bytes(layer: Any, block_id: int) -> bytes:
    """One block of one layer's KV tensor as raw bytes (copied to host memory first on an accelerator)."""
    import torch

    return layer[block_id].contiguous().cpu().view(torch.uint8).numpy().tobytes()


def write_block(layer: Any, block_id: int, data: bytes) -> None:
    """Overwrite one block of one layer with raw bytes of the same size."""
    import torch

    dst = layer[block_id]
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dst.view(torch.uint8).view(-1).copy_(src.to(dst.device))


@dataclass
class Lease:
    """Blocks granted to one puller: ``export_id`` is the holder's finished export request holding them."""

    export_id: str
    block_ids: tuple[int, ...]
    expires_at: float
    taken: bool = False
    done: bool = False


@dataclass
class SegmentLease:
    """Stored segments lent to one puller: each entry's K/V per layer (references, never written)."""

    entries: list[tuple[list[Any], list[Any]]]
    expires_at: float
    taken: bool = False
    done: bool = False


@dataclass
class _Leases:
    """Every lease this worker knows, behind one lock (the worker's main thread adds them, streams end them)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_token: dict[str, Lease] = field(default_factory=dict)
    segments: dict[str, SegmentLease] = field(default_factory=dict)
    arrived: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)


class BlockServer(kv_pb2_grpc.KvBlocksServicer):
    """The holder's block server (module docstring)."""

    def __init__(
        self,
        layers: Sequence[Any],
        layout: str,
        host: str,
        port_file: Path | None,
        *,
        max_streams: int,
        block_delay_s: float = 0.0,
    ) -> None:
        self.layers = list(layers)
        self.layout = layout
        self.block_delay_s = block_delay_s
        self._leases = _Leases()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="kv-blocks"),
            maximum_concurrent_rpcs=max_streams,
            options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)],
        )
        kv_pb2_grpc.add_KvBlocksServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        if port_file is not None:  # how the node learns where its engine serves blocks
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(port_file)

    def grant(self, token: str, export_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        """A lease from the scheduler (this step's metadata)."""
        with self._leases.lock:
            self._leases.by_token[token] = Lease(export_id, tuple(block_ids), time.monotonic() + ttl_s)
            self._leases.arrived.notify_all()

    def grant_segments(self, token: str, entries: Sequence[tuple[list[Any], list[Any]]], ttl_s: float) -> None:
        """A segment lease from the scheduler (this step's metadata): the entries' K/V as they are now."""
        with self._leases.lock:
            self._leases.segments[token] = SegmentLease(list(entries), time.monotonic() + ttl_s)
            self._leases.arrived.notify_all()

    def finished_exports(self) -> set[str]:
        """The export requests whose lease ended (pulled, failed or expired) since the last call: their blocks may be
        freed. Ended segment leases are forgotten here too (they hold no blocks)."""
        now = time.monotonic()
        out: set[str] = set()
        with self._leases.lock:
            for token, seg in list(self._leases.segments.items()):
                if seg.done or (not seg.taken and now > seg.expires_at):
                    del self._leases.segments[token]
            for token, lease in list(self._leases.by_token.items()):
                if lease.done or (not lease.taken and now > lease.expires_at):
                    out.add(lease.export_id)
                    del self._leases.by_token[token]
        return out

    def stop(self) -> None:
        self._server.stop(grace=None)

    # --- the RPC ------------------------------------------------------------------------------------------------

    def _take(self, token: str, context: grpc.ServicerContext, segments: bool = False) -> Any:
        deadline = time.monotonic() + LEASE_WAIT_S
        table: dict[str, Any] = self._leases.segments if segments else self._leases.by_token
        with self._leases.lock:
            while True:
                lease = table.get(token)
                if lease is not None or time.monotonic() >= deadline:
                    break
                self._leases.arrived.wait(timeout=max(0.0, deadline - time.monotonic()))
            if lease is None or lease.taken or lease.done or time.monotonic() > lease.expires_at:
                context.abort(grpc.StatusCode.NOT_FOUND, "lease: unknown, already used or expired")
            lease.taken = True
            return lease

    def Pull(self, request: kv_pb2.BlockPullRequest, context: grpc.ServicerContext) -> Iterator[kv_pb2.BlockData]:
        if request.kv_layout != self.layout:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv_layout: {request.kv_layout!r} is not this engine's {self.layout!r}",
            )
        lease = self._take(request.lease, context)
        try:
            end = request.first_block + request.count
            if request.count == 0 or end > len(lease.block_ids):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"first_block, count: blocks {request.first_block}..{end} of a lease of {len(lease.block_ids)}",
                )
            for index in range(request.first_block, end):
                block_id = lease.block_ids[index]
                for layer_index, layer in enumerate(self.layers):
                    yield kv_pb2.BlockData(block=index, layer=layer_index, data=block_bytes(layer, block_id))
                if self.block_delay_s:  # fault injection: a pull that takes long enough to be killed mid-way
                    time.sleep(self.block_delay_s)
        finally:
            with self._leases.lock:
                lease.done = True

    def PullSegments(
        self, request: kv_pb2.SegmentPullRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_pb2.SegmentChunk]:
        from p2pnode.kv.segment_transfer import segment_chunks

        if request.kv_layout != self.layout:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv_layout: {request.kv_layout!r} is not this engine's {self.layout!r}",
            )
        lease = self._take(request.lease, context, segments=True)
        try:
            chunk_tokens = int(self.layers[0].shape[2]) if self.layers else 16  # one block's worth of tokens
            for n, chunk in enumerate(segment_chunks(lease.entries, chunk_tokens)):
                yield chunk
                if self.block_delay_s and (n + 1) % len(self.layers) == 0:  # fault injection, as for blocks
                    time.sleep(self.block_delay_s)
        finally:
            with self._leases.lock:
                lease.done = True
                lease.entries = []


@dataclass(frozen=True, slots=True)
class FetchResult:
    """How a fetch ended: the leading ``blocks`` arrived whole (``bytes`` in ``seconds``); ``error`` says why the
    rest did not ("" when every block arrived)."""

    blocks: int
    bytes: int
    seconds: float
    error: str = ""


def fetch(
    layers: Sequence[Any],
    kv_address: str,
    lease: str,
    layout: str,
    first_block: int,
    dst_block_ids: Sequence[int],
    timeout_s: float,
) -> FetchResult:
    """Pull lease blocks ``first_block..`` into ``dst_block_ids`` of ``layers`` (module docstring). Never raises."""
    started = time.monotonic()
    count = len(dst_block_ids)
    layers_left = [len(layers)] * count
    received: set[tuple[int, int]] = set()  # (block, layer) written: a block counts once every layer is in
    complete = 0
    moved = 0
    error = ""
    channel = grpc.insecure_channel(kv_address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    try:
        stub = kv_pb2_grpc.KvBlocksStub(channel)
        request = kv_pb2.BlockPullRequest(lease=lease, kv_layout=layout, first_block=first_block, count=count)
        for message in stub.Pull(request, timeout=timeout_s):
            i = message.block - first_block
            if not 0 <= i < count or not 0 <= message.layer < len(layers) or layers_left[i] <= 0:
                error = f"holder sent block {message.block} layer {message.layer}, not asked for"
                break
            if (i, message.layer) in received:  # counted twice, a layer never sent would pass as written
                error = f"holder sent block {message.block} layer {message.layer} twice"
                break
            received.add((i, message.layer))
            layer = layers[message.layer]
            expected = layer[0].numel() * layer.element_size()
            if len(message.data) != expected:
                error = f"block {message.block} layer {message.layer}: {len(message.data)} bytes, expected {expected}"
                break
            write_block(layer, dst_block_ids[i], message.data)
            moved += len(message.data)
            layers_left[i] -= 1
            while complete < count and layers_left[complete] == 0:
                complete += 1
        else:
            if complete < count:
                error = f"stream ended after {complete} of {count} blocks"
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        error = f"{code.name if code is not None else 'RPC'}: {e.details() if hasattr(e, 'details') else e}"
    except Exception as e:  # a bug must fail the pull (recompute), never the engine
        log.exception("KV fetch from %s failed", kv_address)
        error = f"{type(e).__name__}: {e}"
    finally:
        channel.close()
    return FetchResult(complete, moved, time.monotonic() - started, error)
