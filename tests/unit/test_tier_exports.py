"""A holder lends a prefix its engine evicted to its host tier (``serving/pulls.py``): the engine loads it back before
leasing it; without the tier's index the same export is refused as evicted."""

from __future__ import annotations

import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockStored
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.tier_index import TierIndexes
from p2pnode.cache.tiers import Medium
from p2pnode.config import KvPullConfig
from p2pnode.engine.base import ModelInfo
from p2pnode.kv import params
from p2pnode.serving.errors import ServeError
from p2pnode.serving.pulls import KvPulls
from p2pnode.v1 import forward_pb2

BS = 4
LAYOUT = "tiny/b4"
PROMPT = list(range(3, 3 + 6 * BS + 1))


class LendingEngine:
    def __init__(self) -> None:
        self.info = ModelInfo("tiny", 512, 1024, BS, kv_layout=LAYOUT, kv_address="127.0.0.1:9")
        self.asked: list[params.ExportAsk] = []

    async def export(self, request_id: str, prompt: list[int], ask: params.ExportAsk) -> params.ExportLease:
        self.asked.append(ask)
        return params.ExportLease(ask.lease, tuple(range(ask.blocks)), cached_blocks=ask.blocks)


def request(blocks: int) -> forward_pb2.ExportRequest:
    return forward_pb2.ExportRequest(
        origin="b", prompt_token_ids=PROMPT[: blocks * BS + 1], blocks=blocks, kv_layout=LAYOUT
    )


def holder(with_tier: bool) -> tuple[KvPulls, LendingEngine]:
    gpu = PrefixIndex(BS)
    gpu.apply(BlockStored((10, 11), None, tuple(PROMPT[: 2 * BS]), BS))  # the engine holds blocks 0-1
    tiers = TierIndexes.for_engine(gpu, host_tier=True)
    for i in range(6):  # the host tier 0-5, a block per event
        tiers.apply(BlockStored((10 + i,), 10 + i - 1 if i else None, tuple(PROMPT[i * BS : (i + 1) * BS]), BS,
                                medium=Medium.HOST))
    assert tiers.depths(list(block_hashes(PROMPT, BS))[:6]).host == 6
    engine = LendingEngine()
    pulls = KvPulls("a", engine, gpu, None, KvPullConfig(), tiers=tiers if with_tier else None)  # type: ignore[arg-type]
    return pulls, engine


async def test_a_prefix_in_the_host_tier_is_lent_and_counted() -> None:
    pulls, engine = holder(with_tier=True)
    reply = await pulls.export(request(5))
    assert list(reply.block_ids) == list(range(5)) and engine.asked[0].blocks == 5
    assert (pulls.counters.tier_exports, pulls.counters.tier_export_blocks) == (1, 3)
    await pulls.export(request(2))  # all in the engine: not the tier's
    assert pulls.counters.tier_exports == 1


async def test_without_the_tier_the_same_export_is_refused_as_evicted() -> None:
    pulls, engine = holder(with_tier=False)
    with pytest.raises(ServeError, match="evicted: 2 of the 5 blocks"):
        await pulls.export(request(5))
    assert engine.asked == [] and pulls.counters.exports["evicted"] == 1
