"""The host tier's worker on vLLM's CPU build: whole KV blocks copied between the engine's KV tensors and host tensors.

vLLM's own CPU-offloading worker (``v1/kv_offload/cpu/gpu_worker.py``) moves blocks with CUDA streams and asserts CUDA
tensors; on the CPU build the engine's KV cache already lives in host memory, so a copy is plain tensor indexing, done
synchronously when vLLM submits it (a store at the start of the step after the blocks were computed, a load before the
request it serves runs) and reported finished at the next ``get_finished``.

Blocks are opaque bytes here (each engine tensor viewed as ``[blocks, page bytes]``), so whatever the attention kernel
packs into a block comes back bit for bit.

A copy that fails never becomes a wrong token: a host chunk whose store failed is marked unwritten, and a load from it
(or a load that fails) reports its destination blocks as load errors, which vLLM recomputes
(``kv_load_failure_policy = recompute``). vLLM's offloading connector asserts that every transfer succeeded, so a
failure is reported that way and never as ``success=False``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

log = logging.getLogger("p2pnode.kv.tier")

__all__ = ["BlockCopyWorker"]


class BlockCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's KV tensors and one host tensor per engine tensor (module docstring).

    ``num_chunks`` host chunks of ``blocks_per_chunk`` engine blocks each; host chunk ``c`` holds engine-sized pages
    ``c * blocks_per_chunk .. + blocks_per_chunk`` of every tensor.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        host_views: list[torch.Tensor] | None = None,
        region: Any = None,
    ) -> None:
        """``host_views``: where the host tier lives, one ``[chunks, blocks_per_chunk * page]`` int8 view per engine
        tensor (a shared region other processes read, for a tier below this one); None: private tensors. ``region``:
        the shared region they are views of, released at ``shutdown``."""
        self._region = region
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        #: Each engine KV tensor as [engine blocks, page bytes] (int8 views, no copy).
        self.engine: list[torch.Tensor] = []
        #: Each host tensor as [host chunks, blocks_per_chunk, page bytes].
        self.host: list[torch.Tensor] = []
        for i, t in enumerate(kv_caches.tensors):
            page = int(t.page_size_bytes)
            self.engine.append(t.tensor.view(torch.int8).view(-1, page))
            if host_views is not None:
                self.host.append(host_views[i].unflatten(1, (blocks_per_chunk, page)))
            else:
                self.host.append(torch.zeros((num_chunks, blocks_per_chunk, page), dtype=torch.int8))
        #: The tensors each KV cache group's layers live in (a hybrid model's groups cover different layers).
        self.group_tensors = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        self.bytes_per_block = sum(t.shape[2] for t in self.host)
        # Host chunks whose last store completed. In a shared region other processes write chunks too (vLLM's
        # tiers below this one promote theirs into it, unseen here): there only a failed store of this worker's
        # marks a chunk unloadable, until this worker stores into it again.
        self._written = np.full(num_chunks, host_views is not None, dtype=bool)
        self._finished: list[TransferResult] = []
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        log.info("host KV tier: %d chunks of %d block(s), %.1f MiB", num_chunks, blocks_per_chunk,
                 num_chunks * blocks_per_chunk * self.bytes_per_block / 2**20)

    # --- vLLM's OffloadingWorker -------------------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        started = time.perf_counter()
        moved = 0
        chunks = _ids(dst_spec)
        try:
            for g, (src, dst) in enumerate(self._pairs(src_spec, chunks)):
                for t in self.group_tensors[g]:
                    self.host[t][dst] = self.engine[t][src]
                    moved += len(src) * self.host[t].shape[2]
            self._written[chunks] = True
        except Exception:
            log.exception("host KV tier: a store failed; its chunks are never loaded")
            self._written[chunks] = False
        self._finish(job_id, moved, time.perf_counter() - started)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        started = time.perf_counter()
        moved = 0
        chunks = _ids(src_spec)
        try:
            if not self._written[chunks].all():
                raise RuntimeError("a chunk to load was never written whole")
            for g, (dst, src) in enumerate(self._pairs(dst_spec, chunks)):
                for t in self.group_tensors[g]:
                    self.engine[t][dst] = self.host[t][src]
                    moved += len(dst) * self.host[t].shape[2]
        except Exception as e:
            log.warning("host KV tier: a load failed (%s); its blocks are recomputed", e)
            with self._lock:
                self._load_errors.update(int(b) for b in _ids(dst_spec))
        self._finish(job_id, moved, time.perf_counter() - started)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done by the time it is submitted

    def shutdown(self) -> None:
        if self._region is not None:
            self.host.clear()  # the views hold the mapping open
            self._region.cleanup()
            self._region = None

    # --- p2pnode's additions ----------------------------------------------------------------------------------

    def take_load_errors(self) -> set[int]:
        """Engine blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _finish(self, job_id: int, moved: int, seconds: float) -> None:
        with self._lock:
            self._finished.append(TransferResult(job_id, True, moved, seconds))

    def _pairs(self, gpu: GPULoadStoreSpec, chunks: np.ndarray) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """Per KV cache group: the engine blocks, and the host (chunk, block in chunk) each pairs with, in order.

        The engine side lists each group's blocks one after the other (``group_sizes``); the host side lists whole
        chunks, a group's first chunk possibly starting ``block_indices[g] % blocks_per_chunk`` blocks in (vLLM loads
        and stores from a request's logical block ``block_indices[g]`` on)."""
        bpc = self.blocks_per_chunk
        blocks = _ids(gpu)
        pairs: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
        at_block = at_chunk = 0
        for size, first in zip(gpu.group_sizes, gpu.block_indices, strict=True):
            size = int(size)
            skip = int(first) % bpc
            n_chunks = -(-(size + skip) // bpc) if size else 0
            slots = np.arange(n_chunks * bpc)[skip : skip + size]  # the group's blocks among its chunks' slots
            in_chunk = chunks[at_chunk : at_chunk + n_chunks][slots // bpc]
            engine = blocks[at_block : at_block + size]
            if len(in_chunk) != size or len(engine) != size:
                raise ValueError(f"a transfer of {len(blocks)} blocks and {len(chunks)} chunks does not pair up")
            index = (torch.as_tensor(in_chunk, dtype=torch.long), torch.as_tensor(slots % bpc, dtype=torch.long))
            pairs.append((torch.as_tensor(engine, dtype=torch.long), index))
            at_block += size
            at_chunk += n_chunks
        if at_block != len(blocks) or at_chunk != len(chunks):
            raise ValueError(f"a transfer of {len(blocks)} blocks and {len(chunks)} chunks does not pair up")
        return pairs


def _ids(spec: Any) -> np.ndarray:
    """The block or chunk ids of a vLLM load/store spec."""
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"unexpected transfer spec {type(spec).__name__}")
    return np.asarray(spec.block_ids, dtype=np.int64)

