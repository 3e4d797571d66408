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
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from p2pnode.kv.tier.worker import BlockCopyWorker

__all__ = ["HostTierSpec"]


class HostTierSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with a private host tensor per engine tensor and the block-copying worker."""

    def _uses_shared_region(self) -> bool:
        return False  # the engine's KV is host memory already: nothing to pin, no region shared with a GPU

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = BlockCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
