"""The host tier's ``OffloadingSpec`` on vLLM's CPU build: vLLM's own CPU spec with p2pnode's block-copying worker.

vLLM chooses a spec by ``spec_name`` (and ``spec_module_path`` for one outside vLLM) in the offloading connector's
extra config. ``CPUOffloadingSpec`` refuses the CPU backend in ``get_worker`` ("only supported on CUDA-alike and XPU
GPUs") and maps its host buffer through a shared region meant for GPU pinning; everything else it does -- sizing the
tier from ``cpu_bytes_to_use``, the scheduler-side manager with its LRU/ARC policy and store threshold, the KV events --
runs unchanged on the CPU build, so this spec overrides exactly those two choices. A GPU build uses vLLM's spec as is
(``kv/settings.py`` picks).
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from p2pnode.kv.tier.worker import BlockCopyWorker

__all__ = ["HostTierSpec", "TieredHostSpec"]


class HostTierSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with a private host tensor per engine tensor and the block-copying worker."""

    def _uses_shared_region(self) -> bool:
        return False  # the engine's KV is host memory already: nothing to pin, no region shared with a GPU

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = BlockCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


class TieredHostSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (the host tier with secondary tiers below it: the disk tier, ``disk.py``) on
    the CPU build, with the block-copying worker.

    vLLM's tiering spec keeps the host tier in a shared memory region (``cpu/shared_offload_region.py``, a file in
    /dev/shm) on every platform -- its secondary tiers read and write chunks there from the scheduler process -- but
    its worker is the CUDA one, and ``get_worker`` refuses the CPU build. This spec keeps the region and gives the
    block-copying worker views of it (one per engine tensor, the same strided views vLLM's worker gets)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self._create_block_copy_worker(kv_caches)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]

    def _create_block_copy_worker(self, kv_caches: CanonicalKVCaches) -> BlockCopyWorker:
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            views = [region.create_next_worker_view(int(t.page_size_bytes) * self.blocks_per_chunk)
                     for t in kv_caches.tensors]  # fmt: skip
            return BlockCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, host_views=views, region=region)
        except Exception:
            region.cleanup()
            raise
