"""One cache's bounds on segmented workloads (``sim/segment_bounds.py``, ``scripts/segment_bounds.py``)."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from p2pnode.sim.segment_bounds import PieceLRU, bounds, routed
from p2pnode.sim.workloads.segmented_trace import SegmentedPiece, SegmentedRecord
from tests.scripts import load_script

EXAMPLE = Path(__file__).resolve().parent / "fixtures" / "segmented_trace.jsonl"


def _rec(*pieces: tuple[str, str, int, bool]) -> SegmentedRecord:
    return SegmentedRecord(0.0, tuple(SegmentedPiece(*p) for p in pieces), 8)


SYS = ("sys", "0", 100, False)
OTHER_SYS = ("sys", "1", 100, False)
DOC = ("doc", "a", 50, True)
DOC_B = ("doc", "b", 30, True)


def _q(i: int) -> tuple[str, str, int, bool]:
    return ("question", str(i), 10, False)


def test_prefix_caching_hits_a_chain_and_segment_reuse_a_segment_anywhere() -> None:
    recs = [_rec(SYS, DOC, _q(0)), _rec(SYS, DOC, _q(1)), _rec(OTHER_SYS, DOC, _q(2))]
    (b,) = bounds(recs, [10_000], warmup=0.0)
    # prefix: request 1 reuses sys + doc (150); request 2 nothing. Segments: request 2 reuses doc (50) too
    assert b.prompt_tokens == 3 * 160
    assert b.prefix == pytest.approx(150 / 480)
    assert b.segments == pytest.approx(200 / 480)


def test_text_after_a_missed_piece_does_not_hit() -> None:
    # the same question after another document: its chain differs, so it misses in both bounds
    recs = [_rec(SYS, DOC, _q(0)), _rec(SYS, DOC_B, _q(0))]
    (b,) = bounds(recs, [10_000], warmup=0.0)
    assert b.prefix == pytest.approx(100 / 300)
    assert b.segments == pytest.approx(100 / 300)
    # and a plain piece after a hit segment hits when the whole prompt so far repeats
    (c,) = bounds([_rec(SYS, DOC, _q(0)), _rec(SYS, DOC, _q(0))], [10_000], warmup=0.0)
    assert c.prefix == c.segments == pytest.approx(160 / 320)


def test_the_lru_holds_pieces_whole_within_its_tokens() -> None:
    lru = PieceLRU(100)
    lru.use("a", 60)
    lru.use("b", 30)
    lru.use("a", 60)  # a most recent
    lru.use("c", 40)  # evicts b, the least recent
    assert "a" in lru and "c" in lru and "b" not in lru
    assert lru.held_tokens == 100
    lru.use("huge", 101)  # never held, evicts nothing
    assert "huge" not in lru and lru.held_tokens == 100


def test_a_small_cache_keeps_a_prompts_head_and_warmup_is_not_measured() -> None:
    # 160 tokens of cache hold sys (100) + doc (50); the question, used first, is evicted first
    recs = [_rec(SYS, DOC, _q(i)) for i in range(4)]
    (b,) = bounds(recs, [160], warmup=0.0)
    assert b.prefix == pytest.approx(3 * 150 / (4 * 160))
    (w,) = bounds(recs, [160], warmup=0.5)
    assert w.requests == 2 and w.prefix == pytest.approx(150 / 160)
    with pytest.raises(ValueError):
        bounds(recs, [160], warmup=1.0)


def test_more_cache_never_lowers_either_bound_and_segments_never_below_prefix() -> None:
    mod = load_script("segment_bounds")
    args = argparse.Namespace(
        trace=None, workload="ragpulse-shaped", trace_time_unit=None, requests=1500, seed=0,
        kv_tokens="20000,100000,400000", nodes=4, warmup=0.2, routed=False,
    )  # fmt: skip
    result = mod.run(args)
    one = result["one_cache"]
    assert [b["kv_tokens"] for b in result["mesh"]] == [80_000, 400_000, 1_600_000]
    for lo, hi in itertools.pairwise(one):
        assert hi["prefix"] >= lo["prefix"] and hi["segments"] >= lo["segments"]
    assert all(b["segments"] > b["prefix"] for b in one)
    assert result["mesh"][1] == {**one[2], "kv_tokens": 400_000}  # 4 x 100k is the one cache of 400k


def _docs(group: str) -> list[tuple[str, str, int, bool]]:
    return [("doc", f"{group}{k}", 100, True) for k in range(3)]


def test_routing_without_moving_kv_reaches_the_pooled_cache_only_where_each_node_can_specialise() -> None:
    # two groups of documents, each filling one node's 320 tokens, asked in turn: one cache of 320 thrashes, two
    # caches routed to their holders keep one group each -- the pooled cache of 640 tokens, reached without a pull
    recs = [_rec(*_docs("ab"[i % 2]), _q(i)) for i in range(40)]
    one, pooled = bounds(recs, [320, 640], warmup=0.2)
    assert one.segments == 0.0
    assert pooled.segments > 0.9
    assert routed(recs, 2, 320, warmup=0.2) == pytest.approx(pooled.segments)
    # one node is one cache
    assert routed(recs, 1, 320, warmup=0.2) == one.segments
    # documents drawn together from both groups: no node can hold them all, the pooled cache can
    mixed = [_rec(*_docs("a")[: 1 + i % 3], *_docs("b")[: 3 - i % 3], _q(i)) for i in range(40)]
    (m,) = bounds(mixed, [640], warmup=0.2)
    assert routed(mixed, 2, 320, warmup=0.2) < m.segments - 0.2
    with pytest.raises(ValueError):
        routed(recs, 0, 320)


def test_the_script_reads_a_segmented_trace_and_the_rag_workload(capsys: pytest.CaptureFixture[str]) -> None:
    mod = load_script("segment_bounds")
    assert mod.main(["--trace", str(EXAMPLE), "--kv-tokens", "100000", "--nodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 36 and out["one_cache"][0]["segments"] > out["one_cache"][0]["prefix"]
    assert mod.main(["--workload", "rag", "--requests", "300", "--kv-tokens", "400000", "--nodes", "1"]) == 0
    text = capsys.readouterr().out
    assert "| 400,000 |" in text and "mesh" not in text
    assert mod.main(["--trace", str(EXAMPLE), "--kv-tokens", "2000", "--nodes", "2", "--routed"]) == 0
    assert "routed, no KV moved" in capsys.readouterr().out
    assert mod.main(["--workload", "mmlu"]) == 2
