"""The ``ragpulse-shaped`` workload: the shape statistics its docstring promises, per seed, and its determinism."""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads import Limit, RagPulseShaped, get_workloads
from p2pnode.sim.workloads.ragpulse import N_PASSAGES, passage_tokens

REQUESTS = 7000


def _records(seed: int, history_segments: bool = False) -> list:
    w = RagPulseShaped(history_segments=history_segments)
    return [rec for _, rec in w.records_for(1.0, seed, Limit(max_requests=REQUESTS))]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_shape_is_ragpulses(seed: int) -> None:
    recs = _records(seed)
    tokens: Counter[str] = Counter()
    seen: Counter[tuple[str, str]] = Counter()
    passages: Counter[int] = Counter()
    for rec in recs:
        for p in rec.pieces:
            tokens[p.kind] += p.tokens
            seen[(p.kind, p.ident)] += 1
        passages[sum(p.kind == "passage" for p in rec.pieces)] += 1
    total = sum(tokens.values())
    assert tokens["sys_prompt"] / total == pytest.approx(0.47, abs=0.03)
    assert tokens["history"] / total == pytest.approx(0.09, abs=0.015)
    assert tokens["user_input"] / total < 0.03
    # the service's first chunk starts ~77% of requests, and a system prompt is more than one chunk
    assert sum(rec.pieces[0].ident == "first" for rec in recs) / len(recs) == pytest.approx(0.77, abs=0.015)
    assert all(rec.pieces[0].kind == rec.pieces[1].kind == "sys_prompt" for rec in recs)
    assert passages[6] / len(recs) == pytest.approx(0.77, abs=0.015)
    assert passages[0] / len(recs) == pytest.approx(0.21, abs=0.015)
    history = [n for (kind, _), n in seen.items() if kind == "history"]
    assert sum(n == 1 for n in history) / len(history) == pytest.approx(0.92, abs=0.015)
    questions = [n for (kind, _), n in seen.items() if kind == "user_input"]
    assert questions and max(questions) == 1  # each request's own
    # a skewed popularity: the most requested passage far above the median one
    drawn = sorted((n for (kind, _), n in seen.items() if kind == "passage"), reverse=True)
    assert drawn[0] > 50 * drawn[len(drawn) // 2]
    assert all(p.segment == (p.kind == "passage") for rec in recs for p in rec.pieces)


@pytest.mark.parametrize("seed", [0, 3])
def test_passage_lengths_have_ragpulses_quantiles(seed: int) -> None:
    lengths = sorted(passage_tokens(seed, p) for p in range(N_PASSAGES))
    assert statistics.median(lengths) == pytest.approx(255, abs=6)
    assert lengths[N_PASSAGES * 5 // 100] == pytest.approx(67, abs=4)
    assert lengths[N_PASSAGES * 95 // 100] == pytest.approx(355, abs=12)  # few lengths above it: a wide draw


def test_history_segments_names_history_chunks_and_nothing_else_changes() -> None:
    plain, named = _records(0)[:500], _records(0, history_segments=True)[:500]
    assert [[(p.kind, p.ident, p.tokens) for p in r.pieces] for r in plain] == [
        [(p.kind, p.ident, p.tokens) for p in r.pieces] for r in named
    ]
    assert any(p.segment for r in named for p in r.pieces if p.kind == "history")
    assert all(p.segment == (p.kind in ("passage", "history")) for r in named for p in r.pieces)


def test_seeded_and_deterministic() -> None:
    (w,) = get_workloads("ragpulse-shaped")
    space = BlockSpace(w.block_size)
    a = [
        (r.arrival, r.prompt_tokens, r.chain[:4], r.segments.keys if r.segments else None)
        for r in w.requests(2.0, 5, space, Limit(max_requests=200))
    ]
    (w2,) = get_workloads("ragpulse-shaped")
    b = [
        (r.arrival, r.prompt_tokens, r.chain[:4], r.segments.keys if r.segments else None)
        for r in w2.requests(2.0, 5, BlockSpace(w2.block_size), Limit(max_requests=200))
    ]
    assert a == b
    other = [(r.arrival, r.prompt_tokens) for r in w.requests(2.0, 6, space, Limit(max_requests=200))]
    assert other != [(x[0], x[1]) for x in a]
    # a passage is one segment key in every prompt that names it
    keys = {}
    for rec, r in zip(_records(5)[:200], w.requests(1.0, 5, space, Limit(max_requests=200)), strict=True):
        segs = [p for p in rec.pieces if p.segment]
        assert r.segments is None if not segs else len(r.segments.keys) == len(segs)
        for p, k in zip(segs, r.segments.keys if r.segments else (), strict=True):
            assert keys.setdefault(p.ident, k) == k
