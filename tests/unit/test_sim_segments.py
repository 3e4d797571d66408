"""Segments in the simulator: the RAG workload keeps its pinned parameters; ``exact`` reuses documents behind another
context through the node's own layout; ``approximate`` loads what a node's segment store holds (not prefilled, one
step per phase at least), under a cache salt the index never sees; every mode holds the same KV per node; small
meshes serve every request in every mode with results keyed ``POLICY/segments=MODE``; the trace script writes what the
workload generates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.report import aggregate
from p2pnode.sim.runner import Experiment, run_experiment
from p2pnode.sim.workloads import Limit, get_workloads
from p2pnode.sim.workloads.rag import (
    DOC_TOKENS_MAX,
    DOC_TOKENS_MIN,
    DOCS_MAX,
    DOCS_MIN,
    FIXED_PREFIX_TOKENS,
    Piece,
    Rag,
    RagPrompt,
)
from tests.scripts import load_script

BS = 64
#: A node's KV in these tests: a few documents' worth, so stores and caches evict.
CAPACITY = 64 * BS * 4


def test_the_rag_workload_keeps_its_pinned_parameters() -> None:
    rag = Rag()
    prompts = list(rag.prompts(50.0, 0, Limit(max_requests=4000)))
    counts: Counter[int] = Counter()
    fixed = 0
    unsorted = 0
    for p in prompts:
        docs = [x for x in p.prompt if x.kind == "doc"]
        assert DOCS_MIN <= len(docs) <= DOCS_MAX and len({d.ident for d in docs}) == len(docs)
        assert all(DOC_TOKENS_MIN <= d.tokens <= DOC_TOKENS_MAX for d in docs)
        assert p.prompt[0].kind in ("prefix", "system", "history") and p.prompt[-1].kind == "question"
        fixed += p.prompt[0].kind == "prefix" and p.prompt[0].tokens == FIXED_PREFIX_TOKENS
        unsorted += [d.ident for d in docs] != sorted(d.ident for d in docs)
        counts.update(d.ident for d in docs)
    assert 0.18 < fixed / len(prompts) < 0.22  # a fixed 512-token prefix on 20% of requests
    assert unsorted > len(prompts) // 2  # retrieval order, not sorted
    assert counts.most_common(1)[0][0] == 0 and 5 < counts[0] / counts[9] < 15  # Zipf(1.0): 1 / (k + 1)
    assert [p.pieces for p in rag.prompts(50.0, 0, Limit(max_requests=50))] == [p.pieces for p in prompts[:50]]
    r = rag.request(0, prompts[0], BS)
    seg = r.segments
    assert seg is not None and r.chain == block_hashes(seg.tokens, BS) and len(r.chain) == r.n_blocks
    for (start, end), piece in zip(seg.spans, [x for x in prompts[0].prompt if x.kind == "doc"], strict=True):
        assert seg.tokens[start:end] == piece.token_ids()


def prompt_of(arrival: float, context: Piece, docs: list[int], question: int) -> RagPrompt:
    pieces = (context, *(Piece("doc", d, 600 + 37 * d) for d in docs), Piece("question", question, 40),
              Piece("answer", question + 1, 8))
    return RagPrompt(arrival, pieces, "test")


def serve(mode: str, prompts: list[RagPrompt], **cfg: object) -> tuple[Cluster, list[SimRequest]]:
    settings = SimConfig(nodes=1, block_size=BS, segments=mode, **cfg)  # type: ignore[arg-type]
    cluster = Cluster(settings.with_routing(cost_profile="llama-3.1-8b-h100"))
    cluster.recorder.keep_rids = True
    rag = Rag()
    requests = [rag.request(i, p, BS) for i, p in enumerate(prompts)]
    cluster.run(iter(requests))
    assert all(r.t_done >= 0 and not r.dropped for r in requests)
    return cluster, requests


def test_exact_mode_reuses_documents_cached_behind_another_context() -> None:
    first = prompt_of(0.0, Piece("system", 1, 200), [3, 5], 100)
    second = prompt_of(5.0, Piece("history", 7, 333), [5, 3], 200)  # other context, other retrieval order
    for mode, hit in (("none", 0), ("exact", (600 + 37 * 3 + 600 + 37 * 5) // BS * BS)):
        _, (a, b) = serve(mode, [first, second])
        assert a.cached_tokens == 0 and b.cached_tokens == hit, mode
    cluster, (a, b) = serve("exact", [first, second])
    laid = [[r.segments.keys[i] for i in r.segments.order] for r in (a, b)]  # type: ignore[union-attr]
    assert laid[0] == laid[1]  # the second laid its documents out as the first was: a plain prefix hit
    index = cluster.engines[0].cache.index
    assert set(cluster.engines[0].cache.refs) == {h for h, _ in index.iter_blocks()}  # the index stays exact


def test_approximate_mode_loads_stored_documents_under_a_salt_the_index_never_sees() -> None:
    first = prompt_of(0.0, Piece("system", 1, 200), [3, 5], 100)
    # another context; document 3 held, then an unheld one, then document 5: two phases reach them
    second = prompt_of(5.0, Piece("history", 7, 333), [3, 8, 5], 200)
    cluster, (a, b) = serve("approximate", [first, second])
    assert a.loaded_tokens == 0 and b.cached_tokens == 0  # its context is its own: no salted prefix hit
    assert b.loaded_tokens == (600 + 37 * 3) + (600 + 37 * 5)
    assert b.segments.phases == 2 and b.phase_stops is None  # type: ignore[union-attr]  # both stops were passed
    engine = cluster.engines[0]
    assert engine.cache.hidden and not len(engine.cache.index)  # every block salted: none reached the index
    assert set(engine.cache.refs) == engine.cache.hidden
    assert sorted(engine.segments.holdings().values()) == sorted([600 + 37 * 3, 600 + 37 * 5, 600 + 37 * 8])  # type: ignore[union-attr]
    kv_hit = (b.cached_tokens + b.loaded_tokens) / b.prompt_tokens
    assert cluster.recorder.summary(cluster.engines, arrived=2, last_arrival=5.0, sim_time=6.0, gossip_bytes=0,
                                    events=0)["kv_hit"] == pytest.approx(kv_hit * b.prompt_tokens /
                                                                         (a.prompt_tokens + b.prompt_tokens))


def test_each_phase_costs_at_least_one_engine_step() -> None:
    warm = prompt_of(0.0, Piece("system", 1, 200), [3, 5], 100)
    steps = {}
    for docs in ([3, 5], [3, 8, 5]):  # adjacent held documents: one phase; separated: two
        cluster, (_, r) = serve("approximate", [warm, prompt_of(5.0, Piece("history", 9, 300), docs, 300)])
        engine = cluster.engines[0]
        steps[len(docs)] = (r.segments.phases, engine.steps)  # type: ignore[union-attr]
    (phases_a, steps_a), (phases_b, steps_b) = steps[2], steps[3]
    assert (phases_a, phases_b) == (1, 2)
    assert steps_b >= steps_a + 1  # same output, one more phase: one more step at least


def test_every_mode_holds_the_same_kv_per_node() -> None:
    for mode in ("none", "exact", "approximate"):
        cluster = Cluster(SimConfig(nodes=2, block_size=BS, segments=mode, kv_capacity_tokens=CAPACITY,
                                    segment_store_share=0.25))
        for engine in cluster.engines:
            store = engine.segments.store if engine.segments is not None else None
            held = engine.cache.num_blocks * BS + (store.capacity_tokens if store is not None else 0)
            assert CAPACITY - BS < held <= CAPACITY, mode
            assert (store is not None) == (mode == "approximate")
    with pytest.raises(ValueError, match="segments must be one of"):
        Cluster(SimConfig(segments="fuzzy"))


def test_a_small_mesh_serves_every_request_in_every_mode_keyed_by_mode() -> None:
    exp = Experiment(
        workloads=get_workloads("rag"),
        policies=["p2p", "flat"],
        evictions=["lru"],
        qps_ladder=[8.0],
        seeds=[0],
        base=SimConfig(nodes=3, kv_capacity_tokens=CAPACITY * 8),
        limit=Limit(max_requests=250),
        jobs=1,
        segments=["none", "exact", "approximate"],
    )
    runs = run_experiment(exp)
    assert len(runs) == 6 and all(r["completed"] == r["requests"] == 250 and not r["dropped"] for r in runs)
    agg = aggregate(runs, 3.5, exp.policies)["rag"]
    assert list(agg) == [f"{p}/segments={m}" for p in ("p2p", "flat") for m in ("none", "exact", "approximate")]
    hit = {label: a["at_capacity"]["kv_hit"] for label, a in agg.items()}
    assert hit["p2p/segments=exact"] > 3 * hit["p2p/segments=none"]
    assert hit["p2p/segments=approximate"] > 3 * hit["p2p/segments=none"]
    assert agg["p2p/segments=approximate"]["at_capacity"]["segment_loaded_frac"] > 0
    again = run_experiment(Experiment(**{**exp.__dict__, "policies": ["p2p"], "segments": ["approximate"]}))
    assert again[0]["kv_hit"] == next(r for r in runs if r["policy"] == "p2p" and r["segments"] == "approximate")[
        "kv_hit"]  # deterministic per seed


def _trace_module():  # type: ignore[no-untyped-def]
    return load_script("make_rag_trace")


def test_the_trace_holds_each_requests_segments_and_rebuilds_its_tokens(tmp_path: Path) -> None:
    path = tmp_path / "rag.jsonl"
    n = _trace_module().write_trace(path, 10.0, Limit(max_requests=60), 3, vocab_size=32_000)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert n == len(records) == 60
    generated = list(Rag().prompts(10.0, 3, Limit(max_requests=60)))
    docs: dict[int, list[int]] = {}
    for record, prompt in zip(records, generated, strict=True):
        pieces = [Piece(kind, ident, tokens) for kind, ident, tokens in record["pieces"]]
        assert tuple(pieces) == prompt.prompt and record["input_length"] == sum(p.tokens for p in pieces)
        tokens = record["prompt_token_ids"]
        assert len(tokens) == record["input_length"] and max(tokens) < 32_000
        assert len(record["hash_ids"]) == record["input_length"] // 64
        for (start, end), piece in zip(record["segments"], [p for p in pieces if p.kind == "doc"], strict=True):
            assert docs.setdefault(piece.ident, tokens[start:end]) == tokens[start:end]  # a document's ids everywhere
    assert len(docs) > 20


def test_a_store_threshold_of_two_keeps_a_document_from_its_second_computation_on() -> None:
    prompts = [prompt_of(5.0 * i, Piece("history", 7 + i, 300), [3, 5], 100 * (i + 1)) for i in range(3)]
    for threshold, loaded in ((1, [0, 2, 2]), (2, [0, 0, 2])):
        cluster, requests = serve("approximate", prompts, segment_store_threshold=threshold)
        assert [len(r.segments.loaded) for r in requests] == loaded, threshold  # type: ignore[union-attr]
        assert cluster.engines[0].segments.stored == 2  # type: ignore[union-attr]


def test_the_store_threshold_flags_reach_the_simulator_and_the_node(tmp_path: Path) -> None:
    from p2pnode.cli import build_parser
    from p2pnode.cli.serve import node_config_of
    from p2pnode.cost import get_profile
    from p2pnode.kv.settings import ConnectorSettings
    from p2pnode.sim.cli import _base_config

    parser = build_parser()
    args = parser.parse_args(["sim", "--workload", "rag", "--segment-store-threshold", "3"])
    assert _base_config(args, get_profile("llama-3.1-8b-h100")).segment_store_threshold == 3
    args = parser.parse_args(["sim", "--workload", "rag"])
    assert _base_config(args, get_profile("llama-3.1-8b-h100")).segment_store_threshold == 1
    args = parser.parse_args(["serve", "--model", "m", "--node-id", "n1", "--segment-store-threshold", "2"])
    node = node_config_of(args)
    assert node.segments.store_threshold == 2
    assert node.segments.policy == "s3fifo" and node.segments.summary_bytes == 64 * 1024  # the defaults
    args = parser.parse_args(
        ["serve", "--model", "m", "--node-id", "n1", "--segment-summary-kb", "8", "--segment-policy", "lru"]
    )
    assert node_config_of(args).segments.summary_bytes == 8 * 1024
    assert node_config_of(args).segments.policy == "lru"
    settings = ConnectorSettings.of(node.kv_setup, "", tmp_path / "port", 1 << 20)
    assert ConnectorSettings.from_extra(settings.to_extra()).segment_store_threshold == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--segment-store-threshold", "0"])


def test_a_segment_summary_past_what_peers_take_of_a_member_is_refused_at_start() -> None:
    """Before: ``--segment-summary-kb 1024`` (65,536 keys) passed every peer's bound of keys per member, and from then
    on every peer refused every update of the node as oversized: its load and prefix summary stale for good while its
    heartbeat, in the digests, still said it was alive."""
    from p2pnode.cache.segment_summary import SEGMENT_ENTRY_BYTES
    from p2pnode.cli import build_parser
    from p2pnode.cli.serve import node_config_of
    from p2pnode.config import MAX_SEGMENT_SUMMARY_BYTES
    from p2pnode.gossip.config import DEFAULT_MAX_NODE_KEYS

    assert MAX_SEGMENT_SUMMARY_BYTES // SEGMENT_ENTRY_BYTES <= DEFAULT_MAX_NODE_KEYS // 4
    parser = build_parser()
    top = MAX_SEGMENT_SUMMARY_BYTES // 1024
    args = parser.parse_args(["serve", "--model", "m", "--node-id", "n1", "--segment-summary-kb", str(top)])
    assert node_config_of(args).segments.summary_bytes == MAX_SEGMENT_SUMMARY_BYTES
    args = parser.parse_args(["serve", "--model", "m", "--node-id", "n1", "--segment-summary-kb", "1024"])
    with pytest.raises(SystemExit, match="--segment-summary-kb at most 256"):
        node_config_of(args)


def test_the_store_keeps_its_own_order_and_by_default_one_off_documents_pass_through_it() -> None:
    # document 1 reused twice, then a run of documents retrieved once each, then document 1 again: S3-FIFO (the store's
    # default, apart from the paged cache's eviction) admits the one-offs to its small queue only, LRU lets them push
    # document 1 out
    prompts = [prompt_of(5.0 * i, Piece("history", 100 + i, 300), [1], 10 * i) for i in range(3)]
    prompts += [prompt_of(15.0 + 5.0 * i, Piece("history", 200 + i, 300), [20 + i], 500 + i) for i in range(12)]
    prompts.append(prompt_of(85.0, Piece("history", 300, 300), [1], 900))
    loaded = {}
    for policy in ("lru", "s3fifo", None):
        cfg = {"segment_policy": policy} if policy else {}
        _, requests = serve("approximate", prompts, kv_capacity_tokens=CAPACITY, segment_store_share=0.5,
                            eviction="lru", **cfg)
        loaded[policy] = len(requests[-1].segments.loaded)  # type: ignore[union-attr]
    assert loaded == {"lru": 0, "s3fifo": 1, None: 1}
