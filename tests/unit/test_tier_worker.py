"""The host tier's block-copying worker (``kv/tier/worker.py``): blocks come back bit for bit, chunks of several
blocks pair up with a request's logical blocks, and a failed copy becomes a recompute, never wrong KV."""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from p2pnode.kv.tier.worker import BlockCopyWorker

BLOCKS = 8
PAGE = 16


def engine_kv(layers: int = 2) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    tensors = [torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8) for _ in range(layers)]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        [[CanonicalKVCacheRef(i, PAGE) for i in range(layers)]],
    )
    return tensors, caches


def gpu(blocks: list[int], first_block: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[first_block])


def test_a_stored_block_loads_back_bit_for_bit() -> None:
    tensors, caches = engine_kv()
    worker = BlockCopyWorker(caches, blocks_per_chunk=1, num_chunks=4)
    before = [t[[2, 5]].clone() for t in tensors]
    assert worker.submit_store(1, gpu([2, 5]), CPULoadStoreSpec([3, 0]))
    for t in tensors:
        t[[2, 5]] = 0  # the engine reuses the blocks
    assert worker.submit_load(2, CPULoadStoreSpec([3, 0]), gpu([6, 7]))
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[[6, 7]], b)
    done = {r.job_id: r for r in worker.get_finished()}
    assert set(done) == {1, 2} and all(r.success for r in done.values())
    assert done[2].transfer_size == 2 * 2 * PAGE
    assert worker.take_load_errors() == set()


def test_chunks_of_several_blocks_pair_with_a_requests_logical_blocks() -> None:
    tensors, caches = engine_kv(layers=1)
    worker = BlockCopyWorker(caches, blocks_per_chunk=2, num_chunks=2)
    # the request's logical blocks 1..3 (engine blocks 4, 5, 6) go to chunk 0's second half and chunk 1
    assert worker.submit_store(1, gpu([4, 5, 6], first_block=1), CPULoadStoreSpec([0, 1]))
    expected = tensors[0][[4, 5, 6]].clone()
    assert worker.submit_load(2, CPULoadStoreSpec([0, 1]), gpu([0, 1, 2], first_block=1))
    assert torch.equal(tensors[0][[0, 1, 2]], expected)
    assert worker.take_load_errors() == set()


def test_a_load_of_a_chunk_never_written_is_a_load_error() -> None:
    tensors, caches = engine_kv()
    worker = BlockCopyWorker(caches, blocks_per_chunk=1, num_chunks=4)
    before = tensors[0][3].clone()
    assert worker.submit_load(1, CPULoadStoreSpec([2]), gpu([3]))
    assert torch.equal(tensors[0][3], before)  # nothing written into the engine's block
    assert worker.take_load_errors() == {3}  # vLLM recomputes it
    assert worker.take_load_errors() == set()
    assert [r.success for r in worker.get_finished()] == [True]  # vLLM's connector asserts success


def test_a_failed_store_leaves_its_chunk_unloadable() -> None:
    _, caches = engine_kv()
    worker = BlockCopyWorker(caches, blocks_per_chunk=1, num_chunks=4)
    assert worker.submit_store(1, gpu([1]), CPULoadStoreSpec([2]))
    assert worker.submit_store(2, gpu([1, 2]), CPULoadStoreSpec([2]))  # does not pair up: fails, chunk 2 unwritten
    assert worker.submit_load(3, CPULoadStoreSpec([2]), gpu([4]))
    assert worker.take_load_errors() == {4}
