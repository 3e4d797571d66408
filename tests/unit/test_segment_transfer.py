"""Stored segments between engines, the parts that run without vLLM: the holder's block server streaming a segment
lease over real gRPC (loopback) and the puller assembling it (``kv/segment_transfer.py``); the connector's scheduler
side lending entries and admitting the ones that arrived (``kv/connector.py``); the node's export of segments and
its pull, which never raises (``serving/pulls.py``, engine and channel faked); the force flag of the price."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import SegmentReuse, SegmentSpans
from p2pnode.config import MAX_SEGMENTS, KvPullConfig
from p2pnode.engine.base import ModelInfo
from p2pnode.kv import params
from p2pnode.kv.blocks import BlockServer
from p2pnode.kv.connector import PeerPullConnector
from p2pnode.kv.segment_transfer import fetch_segments
from p2pnode.kv.segments import SegmentStore
from p2pnode.routing.policies.p2p import PullPrice
from p2pnode.routing.policies.types import PeerSnapshot
from p2pnode.routing.segments import SegmentPull, segment_pulls
from p2pnode.serving.errors import ServeCode, ServeError, TargetFailed
from p2pnode.serving.pulls import KvPulls
from p2pnode.v1 import forward_pb2

LAYOUT = "test-layout"
LAYERS, HEADS, HEAD, BS = 2, 2, 8, 4
DTYPE = torch.bfloat16


def entry(tokens: int, seed: int) -> tuple[list[Any], list[Any]]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(tokens, HEADS, HEAD, generator=g).to(DTYPE) for _ in range(LAYERS)]
    values = [torch.randn(tokens, HEADS, HEAD, generator=g).to(DTYPE) for _ in range(LAYERS)]
    return keys, values


@pytest.fixture
def server() -> Any:
    layers = [torch.zeros(4, HEADS, BS, 2 * HEAD, dtype=DTYPE) for _ in range(LAYERS)]
    s = BlockServer(layers, LAYOUT, "127.0.0.1", None, max_streams=2)
    yield s
    s.stop()


def fetch(server: BlockServer, lease: str, lengths: list[int], layout: str = LAYOUT) -> Any:
    return fetch_segments(f"127.0.0.1:{server.port}", lease, layout, lengths, LAYERS, (HEADS, HEAD), DTYPE, 10.0)


def test_a_lent_segment_arrives_byte_for_byte_even_when_its_store_dropped_it_meanwhile(server: BlockServer) -> None:
    store = {1: entry(10, 1), 2: entry(3, 2)}  # 10 tokens: three chunks of at most one block (4 tokens) per layer
    server.grant_segments("lease", [store[1], store[2]], ttl_s=10)
    del store[1]  # the store drops the entry: the lease still holds its K/V
    got = fetch(server, "lease", [10, 3])
    assert got.error == "" and sorted(got.entries) == [0, 1]
    for i, seed, n in ((0, 1, 10), (1, 2, 3)):
        want = entry(n, seed)
        for part in (0, 1):
            for layer in range(LAYERS):
                assert torch.equal(got.entries[i][part][layer].view(torch.uint8), want[part][layer].view(torch.uint8))
    assert got.bytes == 2 * 13 * LAYERS * HEADS * HEAD * 2
    again = fetch(server, "lease", [10, 3])  # single use
    assert "NOT_FOUND" in again.error and again.entries == {}


def test_an_entry_the_holder_lacks_or_another_layout_delivers_nothing_of_it(server: BlockServer) -> None:
    server.grant_segments("partial", [entry(6, 3), ([], [])], ttl_s=10)
    got = fetch(server, "partial", [6, 5])
    assert sorted(got.entries) == [0] and "incomplete" in got.error
    server.grant_segments("other", [entry(6, 3)], ttl_s=10)
    refused = fetch(server, "other", [6], layout="another-layout")
    assert "FAILED_PRECONDITION" in refused.error and refused.entries == {}


def test_a_holder_sending_other_sizes_than_asked_fails_the_fetch(server: BlockServer) -> None:
    server.grant_segments("short", [entry(6, 4)], ttl_s=10)
    got = fetch(server, "short", [5])  # the puller expects 5 tokens: a 6-token entry does not fit
    assert got.entries == {} and "not asked for" in got.error


def fake_connector(store: SegmentStore) -> Any:
    c = SimpleNamespace(_store=store, _store_error="", _segment_ops=[], _fetches={}, _fetched={})
    return c


def test_the_holder_lends_the_entries_it_holds_with_their_positions_and_the_puller_admits_whole_ones() -> None:
    holder = SegmentStore(1000)
    holder.admit(7, list(range(20)), start=40)
    c = fake_connector(holder)
    ask = params.SegmentExportAsk("L", (7, 8), (20, 5), (*range(20), 1, 2, 3, 4, 5), 10.0)
    lease = PeerPullConnector._lend_segments(c, ask)
    assert (lease.keys, lease.starts, lease.lengths, lease.error) == ((7,), (40,), (20,), "")
    assert [(op.kind, op.keys) for op in c._segment_ops] == [("lend", [7])]
    wrong = params.SegmentExportAsk("M", (7,), (20,), tuple(range(1, 21)), 10.0)  # same key, other tokens: a miss
    assert PeerPullConnector._lend_segments(c, wrong).error

    puller = SegmentStore(1000)
    puller.admit(9, list(range(100, 120)), start=0)  # computed here already: kept, the arrival is not adopted
    p = fake_connector(puller)
    fetch = params.SegmentFetch("a", "addr", "L", (7, 9), (40, 3), (20, 20), tuple(range(20)) + tuple(range(100, 120)))
    p._fetches["r"] = fetch
    PeerPullConnector._fetch_ended(p, "r", "ok", (7, 9), 1234, 0.5)
    assert [(op.kind, op.key) for op in p._segment_ops] == [("adopt", 7), ("unstage", 0)]
    assert puller.get(7, range(20)).start == 40  # its keys stay rotated where the holder computed them
    assert p._fetched["r"] == params.SegmentFetched("ok", (7,), (), 20, 1234, 0.5)


def test_an_aborted_fetch_unstages_what_arrived() -> None:
    p = fake_connector(SegmentStore(1000))
    PeerPullConnector._fetch_ended(p, "gone", "ok", (7,), 10, 0.1)
    assert [op.kind for op in p._segment_ops] == ["unstage"] and p._fetched == {}


def test_the_force_flag_pulls_what_the_price_would_compute() -> None:
    seg = SegmentSpans(SegmentReuse.APPROXIMATE, ((10, 60),), (1,))
    slow = {"a": PeerSnapshot(node_id="a", kv_layout="L", link_bytes_per_s=1e3)}
    price = PullPrice(kv_bytes_per_token=1024, prefill_s_per_token=1e-3)
    assert segment_pulls(seg, lambda key: False, {"a": [0]}, slow, price) == ()
    forced = PullPrice(kv_bytes_per_token=1024, prefill_s_per_token=1e-3, force=True)
    assert segment_pulls(seg, lambda key: False, {"a": [0]}, slow, forced) == (SegmentPull(0, "a", 50),)
    assert segment_pulls(seg, lambda key: key == 1, {"a": [0]}, slow, forced) == ()  # held here: never pulled


# --- the node's side: the holder's export, the puller's pull (serving/pulls.py) -------------------------------------


class FakeEngine:
    """Holds segment 7 (tokens 0..19, computed at position 40); fetches whatever it is lent."""

    def __init__(self, layout: str = LAYOUT) -> None:
        self.info = ModelInfo("tiny", 512, 1024, BS, kv_layout=layout, kv_address="127.0.0.1:9")
        self.asked: list[params.SegmentExportAsk] = []

    async def export_segments(self, request_id: str, ask: params.SegmentExportAsk) -> params.SegmentLease:
        self.asked.append(ask)
        if 7 not in ask.keys:
            return params.SegmentLease(ask.lease, error="none of the segments is stored here")
        return params.SegmentLease(ask.lease, (7,), (40,), (20,))

    async def fetch_segments(self, request_id: str, fetch: params.SegmentFetch) -> params.SegmentFetched:
        return params.SegmentFetched("ok", fetch.keys, (), sum(fetch.lengths), 100, 0.1)


class FakeForwarder:
    def __init__(self, holder: KvPulls | None) -> None:
        self.holder = holder

    async def export(
        self, holder: str, address: str, request: forward_pb2.ExportRequest, timeout: float, tokens: object = ()
    ) -> forward_pb2.ExportReply:
        if self.holder is None:
            raise TargetFailed(holder, ServeCode.UNAVAILABLE, "connection refused", retryable=False)
        try:
            return await self.holder.export(request)
        except ServeError as e:
            raise TargetFailed(holder, e.code, e.message, retryable=False) from e


def export_request(*keys: int, layout: str = LAYOUT) -> forward_pb2.ExportRequest:
    request = forward_pb2.ExportRequest(origin="b", kv_layout=layout)
    for key in keys:
        request.segments.add(key=key, token_ids=list(range(20)))
    return request


async def test_the_holder_lends_what_its_store_holds_and_refuses_other_layouts_or_nothing_held() -> None:
    holder = KvPulls("a", FakeEngine(), PrefixIndex(BS), None, KvPullConfig())  # type: ignore[arg-type]
    reply = await holder.export(export_request(7, 8))
    assert [(s.key, s.start, s.tokens) for s in reply.segments] == [(7, 40, 20)] and reply.lease
    with pytest.raises(ServeError) as evicted:
        await holder.export(export_request(8))
    assert evicted.value.code is ServeCode.FAILED_PRECONDITION and evicted.value.message.startswith("evicted")
    with pytest.raises(ServeError) as other:
        await holder.export(export_request(7, layout="another"))
    assert other.value.code is ServeCode.FAILED_PRECONDITION and "kv_layout" in other.value.message
    with pytest.raises(ServeError) as too_many:
        await holder.export(export_request(*range(MAX_SEGMENTS + 1)))
    assert too_many.value.code is ServeCode.INVALID_ARGUMENT and "segments" in too_many.value.message
    assert holder.counters.exports == {"ok": 1, "evicted": 1, "kv_layout": 1, "segments": 1}


async def test_a_pull_reports_what_arrived_and_never_raises_when_the_holder_fails() -> None:
    holder = KvPulls("a", FakeEngine(), PrefixIndex(BS), None, KvPullConfig())  # type: ignore[arg-type]
    puller = KvPulls("b", FakeEngine(), PrefixIndex(BS), FakeForwarder(holder), KvPullConfig())  # type: ignore[arg-type]
    whole, _ = await puller.pull_segments("a", "addr", [(7, list(range(20)))])
    assert (whole.outcome, whole.tokens, whole.asked) == ("ok", 20, 20)
    part, _ = await puller.pull_segments("a", "addr", [(7, list(range(20))), (8, list(range(5)))])
    assert part.outcome.startswith("failed") and part.tokens == 20  # 8 was not held there: computed here
    none, _ = await puller.pull_segments("a", "addr", [(8, list(range(5)))])
    assert none.outcome.startswith("refused") and "evicted" in none.outcome and none.tokens == 0
    dead = KvPulls("b", FakeEngine(), PrefixIndex(BS), FakeForwarder(None), KvPullConfig())  # type: ignore[arg-type]
    gone, _ = await dead.pull_segments("a", "addr", [(7, list(range(20)))])
    assert gone.outcome.startswith("failed: UNAVAILABLE") and gone.tokens == 0


async def test_a_holder_lending_one_segment_many_times_is_refused_before_anything_is_fetched() -> None:
    """Each copy of a key in an Export reply was assembled on its own (its K/V tensors made in the engine's worker):
    a reply of a few MiB repeating one key could exhaust the puller's memory."""

    class Repeats(FakeForwarder):
        async def export(self, *args: object, **kwargs: object) -> forward_pb2.ExportReply:
            reply = await super().export(*args, **kwargs)  # type: ignore[arg-type]
            reply.segments.extend([reply.segments[0]] * 1000)
            return reply

    holder = KvPulls("a", FakeEngine(), PrefixIndex(BS), None, KvPullConfig())  # type: ignore[arg-type]
    engine = FakeEngine()
    fetched: list[params.SegmentFetch] = []

    async def fetch_segments(request_id: str, fetch: params.SegmentFetch) -> params.SegmentFetched:
        fetched.append(fetch)
        return params.SegmentFetched("ok", fetch.keys, (), sum(fetch.lengths), 100, 0.1)

    engine.fetch_segments = fetch_segments  # type: ignore[method-assign]
    puller = KvPulls("b", engine, PrefixIndex(BS), Repeats(holder), KvPullConfig())  # type: ignore[arg-type]
    got, _ = await puller.pull_segments("a", "addr", [(7, list(range(20)))])
    assert got.outcome.startswith("refused") and got.tokens == 0 and fetched == []
