"""The disk KV tier under a real engine: a prefix pushed out of the engine's cache and out of the host tier comes back
from disk, after a restart too, with the tokens of the engine's own cache hit; a corrupt entry is recomputed and
counted; entries of another KV layout beside its own are reported and left unread; a disk that takes no more writes
costs the disk's copies, never a token.

One engine embedded in the test (as a node embeds it), with a 64-block KV cache, a host tier of 32 blocks and a disk
tier below it (``TierConfig.disk_path``), then a second one on the same folder: the disk tier's behaviour needs no
mesh, and two engine starts are its whole cost (the host tier's module, test_kv_tier.py, runs ``p2pnode serve``
meshes whose tiers have no disk below them).

Greedy tokens: a prompt loaded from the disk tier splits as the engine's own cache hit splits it (the prefix cached,
the tail computed) over the same bytes, so their tokens are identical; a prompt whose disk entries are corrupt is
computed whole, as the first time, so its tokens are the first answer's.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.cache.events import BlockStored
from p2pnode.cache.tiers import Medium
from p2pnode.config import EngineConfig, KvSetup, SegmentConfig, TierConfig
from p2pnode.engine.vllm_engine import VllmEngine
from p2pnode.kv.tier.disk_store import ENTRY_HEADER_BYTES
from p2pnode.request import Request, SamplingOptions
from tests.integration.conftest import BLOCK_SIZE, KV_CACHE_BYTES, MAX_MODEL_LEN, MULTI_ENGINE_ENV
from tests.polling import until

pytestmark = pytest.mark.integration

VOCAB = 500
#: The prompt's full blocks; the host tier holds 32 blocks, the scans push 80 through it.
BLOCKS = 8
SCANS, SCAN_BLOCKS = 8, 10
HOST_BYTES = 1 << 20  # 32 blocks of the tiny model (32 KiB each)
DISK_BYTES = 64 << 20


def tokens(seed: str, blocks: int, tail: int = 5) -> list[int]:
    rng = random.Random(f"kv-disk-tier-{seed}")
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


@dataclass
class Served:
    token_ids: list[int]
    cached: int
    from_host: int
    from_disk: int


class Engine:
    """An engine with a host tier and the disk tier below it, and the KV events it sent."""

    def __init__(self, model: Path, disk: Path) -> None:
        config = EngineConfig(
            model=model, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES,
            enforce_eager=True, engine_nice=0,
        )  # fmt: skip
        tier = TierConfig(host_bytes=HOST_BYTES, disk_path=str(disk), disk_bytes=DISK_BYTES)
        self.engine = VllmEngine(config, kv=KvSetup(None, "", SegmentConfig(store_bytes=0), tier))
        self.events: list = []
        self.n = 0

    async def start(self) -> Engine:
        with pytest.MonkeyPatch.context() as env:  # for the engine core it starts
            for key, value in MULTI_ENGINE_ENV.items():
                env.setenv(key, os.environ.get(key, value))
            await self.engine.start(self.events.extend)
        return self

    async def serve(self, prompt: list[int], max_tokens: int = 8) -> Served:
        self.n += 1
        options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0)
        out: list[int] = []
        last = None
        async for chunk in self.engine.generate(Request(f"d{self.n}", prompt, options)):
            out.extend(chunk.token_ids)
            last = chunk
        assert last is not None
        return Served(out, last.cached_tokens, last.host_tier_tokens, last.disk_tier_tokens)

    async def evict(self, seed: str) -> None:
        """Push every earlier prefix out of the engine's cache and out of the host tier (the disk tier keeps them)."""
        for k in range(SCANS):
            await self.serve(tokens(f"scan-{seed}-{k}", SCAN_BLOCKS), max_tokens=1)

    def disk_io(self) -> tuple[int, int]:
        status = self.engine.tier_status()
        assert status is not None
        return status.io.disk_load_bytes, status.io.disk_failures

    @staticmethod
    def counted(name: str, **labels: str) -> float:
        """vLLM's Prometheus counter ``name`` (what the node's /metrics shows), summed over the samples with
        ``labels``."""
        text = generate_latest(REGISTRY).decode()
        return sum(
            s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == f"{name}_total" and labels.items() <= s.labels.items()
        )  # fmt: skip

    def disk_stored(self) -> set[int]:
        return {h for e in self.events if isinstance(e, BlockStored) and e.medium is Medium.DISK
                for h in e.engine_block_hashes}  # fmt: skip


async def test_a_prefix_evicted_from_engine_and_host_tier_comes_back_from_disk_and_a_corrupt_one_is_recomputed(
    tiny_model: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "kv-disk"
    prompt = tokens("prompt", BLOCKS)
    first = await Engine(tiny_model, disk).start()
    try:
        computed = await first.serve(prompt)
        cached = await first.serve(prompt)
        assert (computed.cached, cached.cached) == (0, BLOCKS * BLOCK_SIZE)
        await first.evict("1")
        loaded = await first.serve(prompt)
        assert loaded.cached == BLOCKS * BLOCK_SIZE and (loaded.from_disk, loaded.from_host) == (loaded.cached, 0)
        load_bytes, _ = await until(first.disk_io, "the disk tier's load to be counted", holds=lambda io: io[0] > 0)
        assert load_bytes >= BLOCKS * 32 * 1024  # vLLM's count of the bytes read from disk: every block of it
        assert loaded.token_ids == cached.token_ids
        assert len(first.disk_stored()) >= BLOCKS + SCANS * SCAN_BLOCKS  # the node learns what the disk holds
    finally:
        await first.engine.shutdown()

    entries = sorted(disk.rglob("*.kv"))
    assert entries and all(p.stat().st_size == ENTRY_HEADER_BYTES + 32 * 1024 for p in entries)
    # What a node of another KV layout left on the same disk (a copy under another layout's folder name): the restart
    # below reports it, counted and logged, and never reads or removes it.
    [own] = [p for p in disk.iterdir() if p.is_dir()]
    other = disk / ("0" * len(own.name))
    shutil.copytree(own, other)
    other_files = {p: p.read_bytes() for p in other.rglob("*.kv")}
    again = await Engine(tiny_model, disk).start()  # a restart of the same layout reuses what the first wrote
    try:
        restarted = await again.serve(prompt)
        assert restarted.cached == BLOCKS * BLOCK_SIZE and restarted.from_disk == restarted.cached
        assert restarted.token_ids == cached.token_ids
        await until(
            lambda: again.counted("vllm:prompt_tokens_cached_by_source", source="disk"),
            "vLLM to count the prefix as loaded from disk", holds=lambda n: n >= BLOCKS * BLOCK_SIZE,
        )  # fmt: skip
        for path in own.rglob("*.kv"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        await again.evict("2")
        recomputed = await again.serve(prompt)
        assert recomputed.cached == 0 and recomputed.token_ids == computed.token_ids
        await until(again.disk_io, "the corrupt entry to be counted", holds=lambda io: io[1] >= 1)
        failures = again.counted("vllm:kv_offload_p2pnode_disk_tier_failures", reason="corrupt")
        other_layouts = again.counted("vllm:kv_offload_p2pnode_disk_tier_failures", reason="layout")
        assert failures >= 1 and other_layouts == 1
        assert failures + other_layouts == again.disk_io()[1]  # in /metrics too, and nothing else failed
        assert {p: p.read_bytes() for p in other.rglob("*.kv")} == other_files  # the other layout's, untouched

        # A disk that takes no more writes (its folder replaced by a file: every store fails, as on a full or
        # read-only disk) costs the disk's copies: the stores are counted, and a prefix pushed out of the engine and
        # the host tier is computed again, to the tokens of its first computation.
        shutil.rmtree(own)
        own.write_bytes(b"")
        fresh = tokens("unwritable", BLOCKS)
        first_time = await again.serve(fresh)
        await again.evict("3")
        second_time = await again.serve(fresh)
        assert (first_time.cached, second_time.cached) == (0, 0)
        assert second_time.token_ids == first_time.token_ids
        await until(
            lambda: again.counted("vllm:kv_offload_p2pnode_disk_tier_failures", reason="store"),
            "the failed stores to be counted", holds=lambda n: n >= 1,
        )  # fmt: skip
    finally:
        await again.engine.shutdown()
