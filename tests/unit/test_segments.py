"""Segments: finding them in a prompt, exact-mode layouts, the store's bookkeeping and the phases of approximate
reuse (pure parts; the engine path is tests/integration/test_segments_engine.py)."""

from __future__ import annotations

import pytest

from p2pnode.cache.segments import FrequencySketch, exact_layout, find_span, segment_key
from p2pnode.kv.segments import MIN_SEGMENT_TOKENS, SegmentStore, phase_cuts, plan_loads, tail_key

BS = 4
NS = "|salt"


def test_a_segment_key_depends_on_tokens_and_namespace_not_position() -> None:
    doc = [5, 6, 7, 8]
    assert segment_key(NS, doc) == segment_key(NS, list(doc))
    assert segment_key(NS, doc) != segment_key("|other", doc)
    assert segment_key(NS, doc) != segment_key(NS, doc[:-1])
    assert 0 <= segment_key(NS, doc) < 2**63


def test_find_span_finds_the_segment_or_its_inner_tokens() -> None:
    prompt = [1, 2, 3, 10, 11, 12, 13, 4, 10, 11, 12, 13]
    assert find_span(prompt, [10, 11, 12, 13]) == (3, 7)
    assert find_span(prompt, [10, 11, 12, 13], start=7) == (8, 12)
    # the tokenizer merged the segment's first token with the text before it: its inner tokens are found
    assert find_span(prompt, [99, 11, 12, 13]) == (4, 7)
    assert find_span(prompt, [99, 11, 12, 98]) == (4, 6)
    assert find_span(prompt, [42, 43]) is None
    assert find_span(prompt, []) is None


def test_find_span_answers_as_a_token_by_token_search_whatever_the_prompt() -> None:
    """The search runs over bytes (linear: token by token, a prompt of 128k copies of one token and a segment
    differing in its middle held the event loop 5.3 s); it answers as the token-by-token definition on random prompts
    built to hold near misses, and on ids too large for its bytes (the definition answers those)."""
    import random

    from p2pnode.cache import segments as segments_module

    def by_tokens(prompt: list[int], segment: list[int], start: int = 0) -> tuple[int, int] | None:
        n = len(segment)
        for lo, hi in ((0, n), (1, n), (0, n - 1), (1, n - 1)):
            needle = segment[lo:hi]
            if not needle:
                continue
            for h in range(start, len(prompt) - len(needle) + 1):
                if prompt[h : h + len(needle)] == needle:
                    return h, h + len(needle)
        return None

    rng = random.Random(5)
    for _ in range(500):
        alphabet = rng.choice([[0, 1], [7, 8, 9], list(range(300)), [2**27, 2**28 - 1, 5], [2**28, 3]])
        prompt = [rng.choice(alphabet) for _ in range(rng.randrange(0, 60))]
        segment = [rng.choice(alphabet) for _ in range(rng.randrange(0, 6))]
        if prompt and rng.random() < 0.5:  # a real occurrence, maybe with an edge changed
            at = rng.randrange(len(prompt))
            segment = prompt[at : at + rng.randrange(1, 8)]
            if segment and rng.random() < 0.3:
                segment[0] = 999
        start = rng.randrange(0, len(prompt) + 1)
        assert find_span(prompt, segment, start) == by_tokens(prompt, segment, start), (prompt, segment, start)
    same = [7] * 2_000
    assert find_span(same, [7] * 50 + [8] + [7] * 50) is None
    assert segments_module._unit_codable(segments_module.np.asarray(same))


def test_exact_layout_puts_the_deepest_cached_chain_first_and_keeps_the_rest_in_order() -> None:
    # prompt: BOS, system (20, 21), doc A (30..33), sep (22), doc B (40..43), question (50, 51)
    prompt = [1, 20, 21, 30, 31, 32, 33, 22, 40, 41, 42, 43, 50, 51]
    spans = [(3, 7), (8, 12)]
    keys = [segment_key(NS, prompt[s:e]) for s, e in spans]
    held = [1, 40, 41, 42, 43, 30, 31, 32, 33]  # a cache holding BOS + B + A as a prefix

    def cached(tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and n < len(held) and tokens[n] == held[n]:
            n += 1
        return n

    layout = exact_layout(prompt, spans, keys, cached, lambda key: 0.0, head=1)
    assert layout.order == (1, 0)
    assert layout.token_ids == [1, 40, 41, 42, 43, 30, 31, 32, 33, 20, 21, 22, 50, 51]
    assert layout.cached == 9
    assert sorted(layout.token_ids) == sorted(prompt)  # nothing lost, nothing added


def test_exact_layout_without_a_cached_segment_orders_by_frequency_then_key() -> None:
    prompt = [1, 30, 31, 40, 41, 50]
    spans = [(1, 3), (3, 5)]
    keys = [7, 3]
    seen = FrequencySketch()
    seen.observe([7, 7, 3])
    layout = exact_layout(prompt, spans, keys, lambda tokens: 0, seen.__getitem__, head=1)
    assert layout.order == (0, 1)
    assert exact_layout(prompt, spans, keys, lambda tokens: 0, lambda key: 0.0, head=1).order == (1, 0)


def prefix_cache(*held: list[int]):  # type: ignore[no-untyped-def]
    """``cached`` of a cache holding each of ``held`` as a prompt: the longest common prefix with any of them."""

    def cached(tokens: list[int]) -> int:
        best = 0
        for prompt in held:
            n = 0
            while n < len(tokens) and n < len(prompt) and tokens[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    return cached


#: BOS, a system prompt (20..23), doc A (30..33), doc B (40..43), a question (50, 51)
SYSTEM_PROMPT = [1, 20, 21, 22, 23, 30, 31, 32, 33, 40, 41, 42, 43, 50, 51]
SYSTEM_SPANS = [(5, 9), (9, 13)]
SYSTEM_KEYS = [segment_key(NS, SYSTEM_PROMPT[s:e]) for s, e in SYSTEM_SPANS]
LEAD_KEY = segment_key(NS, SYSTEM_PROMPT[1:5])


def test_exact_layout_keeps_a_system_prompt_that_recurs_more_than_its_documents_in_front() -> None:
    """Before, the documents always went ahead of the system prompt, so a system prompt every request shares was
    never a cached prefix in exact mode (a RAG service's week: exact 3x below plain prefix caching)."""
    seen = FrequencySketch()
    seen.observe([LEAD_KEY, LEAD_KEY, SYSTEM_KEYS[1]])
    cold = exact_layout(SYSTEM_PROMPT, SYSTEM_SPANS, SYSTEM_KEYS, prefix_cache(), seen.__getitem__, 1, BS, LEAD_KEY)
    assert cold.token_ids == [1, 20, 21, 22, 23, 40, 41, 42, 43, 30, 31, 32, 33, 50, 51] and cold.order == (1, 0)
    # once laid out so, the system prompt is what a cache holds: kept in front by what it reuses, however rare
    warm = exact_layout(
        SYSTEM_PROMPT, SYSTEM_SPANS, SYSTEM_KEYS, prefix_cache([1, 20, 21, 22, 23, 99]), lambda key: 0.0, 1, BS,
        LEAD_KEY,
    )
    assert warm.token_ids[:5] == [1, 20, 21, 22, 23] and warm.cached == 5


def test_exact_layout_puts_documents_first_when_they_reuse_more_or_the_lead_recurs_less() -> None:
    seen = FrequencySketch()
    seen.observe([SYSTEM_KEYS[0], SYSTEM_KEYS[0], LEAD_KEY])
    layout = exact_layout(SYSTEM_PROMPT, SYSTEM_SPANS, SYSTEM_KEYS, prefix_cache(), seen.__getitem__, 1, BS, LEAD_KEY)
    assert layout.token_ids == [1, 30, 31, 32, 33, 40, 41, 42, 43, 20, 21, 22, 23, 50, 51]  # today's rule on a tie
    held = prefix_cache([1, 40, 41, 42, 43, 30, 31, 32, 33], [1, 20, 21, 22, 23])
    deeper = exact_layout(SYSTEM_PROMPT, SYSTEM_SPANS, SYSTEM_KEYS, held, lambda key: 9.0, 1, BS, LEAD_KEY)
    assert deeper.order == (1, 0) and deeper.token_ids[:9] == [1, 40, 41, 42, 43, 30, 31, 32, 33]
    assert deeper.cached == 9  # the documents' chain (9) beats the system prompt's (5), however often it recurs


def test_exact_layout_weighs_a_tie_by_recurrence_times_the_tokens_each_head_would_reuse() -> None:
    """A long system prompt a few apps share, beside a short document that recurs more often: recurrence alone laid
    the document first, so the prompt was never a cached prefix (a RAG service's less common system prompts: exact
    mode below plain prefix caching)."""
    prompt = [1, 20, 21, 22, 23, 24, 25, 26, 27, 30, 31, 40, 41, 50]  # BOS, 8-token lead, docs A and B, a question
    spans = [(9, 11), (11, 13)]
    keys = [segment_key(NS, prompt[s:e]) for s, e in spans]
    lead_key = segment_key(NS, prompt[1:5])
    seen = FrequencySketch()
    seen.observe([keys[0], keys[0], keys[0], lead_key, lead_key])  # A 3 x 2 tokens < the lead's 2 x 8
    layout = exact_layout(prompt, spans, keys, prefix_cache(), seen.__getitem__, 1, BS, lead_key)
    assert layout.token_ids == prompt and layout.order == (0, 1) and layout.cached == 0
    seen.observe([keys[0]] * 6)  # A 9 x 2 tokens > 16: the documents go first
    layout = exact_layout(prompt, spans, keys, prefix_cache(), seen.__getitem__, 1, BS, lead_key)
    assert layout.token_ids == [1, 30, 31, 40, 41, 20, 21, 22, 23, 24, 25, 26, 27, 50] and layout.order == (0, 1)
    # a leading text never seen before (a request's own context) never goes first on a tie, however long
    unseen = exact_layout(prompt, spans, keys, prefix_cache(), lambda key: 1.0 if key == keys[1] else 0.0, 1, BS, 7)
    assert unseen.order == (1, 0) and unseen.token_ids[:5] == [1, 40, 41, 30, 31]


def test_exact_layout_weighs_documents_by_how_often_they_came_first_and_keeps_a_recurring_lead_over_a_short_hit():
    """A document that recurs mostly behind a shared system prompt is seldom a prefix: weighed by how often it was
    laid out first. A recurring system prompt the cache lost is laid out again rather than a shorter document the
    cache holds: its next recurrences reuse more than the document gives now."""
    prompt = [1, 20, 21, 22, 23, 24, 25, 26, 27, 30, 31, 32, 33, 40, 41, 42, 43, 50]  # BOS, 8-token lead, A, B, ?
    spans = [(9, 13), (13, 17)]
    keys = [segment_key(NS, prompt[s:e]) for s, e in spans]
    lead_key = segment_key(NS, prompt[1:5])
    seen, heads = FrequencySketch(), FrequencySketch()
    seen.observe([keys[0]] * 9 + [lead_key] * 2)  # A 9 x 4 tokens > the lead's 2 x 8, but A came first once
    heads.observe([keys[0]])

    def layout(cached, **kw):  # type: ignore[no-untyped-def]
        return exact_layout(prompt, spans, keys, cached, seen.__getitem__, 1, BS, lead_key, **kw)

    assert layout(prefix_cache()).order == (0, 1) and layout(prefix_cache()).token_ids[1:5] == [30, 31, 32, 33]
    kept = layout(prefix_cache(), head_frequency=heads.__getitem__)
    assert kept.token_ids == prompt and not kept.segments_first
    # the cache holds A first (5 tokens) and not the lead: the lead (8 tokens) is laid out again all the same
    short = layout(prefix_cache([1, 30, 31, 32, 33, 99]), head_frequency=heads.__getitem__)
    assert short.token_ids == prompt and short.cached == 1  # its BOS
    # A and B held first (9 tokens), more than the lead: the documents go first
    long = layout(prefix_cache([1, 30, 31, 32, 33, 40, 41, 42, 43, 99]), head_frequency=heads.__getitem__)
    assert long.segments_first and long.order == (0, 1) and long.cached == 9


def test_exact_layout_takes_the_prompt_as_sent_when_a_cache_holds_more_of_it() -> None:
    """A conversation's next turn, whose earlier turn was served as sent: its whole history is held that way (a
    layout would move the history, 60 and 61, behind the documents)."""
    prompt = [1, 20, 21, 22, 23, 30, 31, 32, 33, 60, 61, 40, 41, 42, 43, 50, 51]
    spans = [(5, 9), (11, 15)]
    keys = [segment_key(NS, prompt[s:e]) for s, e in spans]
    layout = exact_layout(prompt, spans, keys, prefix_cache(prompt[:16]), lambda key: 0.0, 1, BS, LEAD_KEY)
    assert layout.token_ids == prompt and layout.order == (0, 1) and layout.cached == 16


def test_frequency_sketch_is_bounded_and_fades() -> None:
    sketch = FrequencySketch(capacity=4)
    sketch.observe([1, 1, 2])
    assert sketch[1] == 2 and sketch[2] == 1
    sketch.observe([3])  # 4 observations: every count halves
    assert sketch[1] == 1.0
    sketch.observe([4, 5, 6, 7])
    assert sketch[1] == 0.0  # forgotten: only 4 keys kept


def test_store_evicts_by_policy_within_capacity_and_never_a_pinned_entry() -> None:
    store = SegmentStore(capacity_tokens=10, policy="lru")
    assert store.admit(1, [1] * 4, 0) == (True, [])
    assert store.admit(2, [2] * 4, 0) == (True, [])
    store.pin([1])
    ok, evicted = store.admit(3, [3] * 4, 0)
    assert ok and evicted == [2]  # 1 is pinned
    assert store.held_tokens == 8
    assert store.admit(4, [4] * 8, 0) == (False, [])  # would need 1 (pinned) gone too: nothing is evicted
    assert 1 in store and 3 in store
    store.unpin([1])
    ok, evicted = store.admit(5, [5] * 8, 0)
    assert ok and set(evicted) == {1, 3}
    assert store.held_tokens == 8
    assert store.admit(6, [6] * 11, 0) == (False, [])  # larger than the store
    assert store.held_tokens <= store.capacity_tokens


def test_store_threshold_keeps_a_segment_once_offered_that_many_times() -> None:
    doc = [7] * 20
    once = SegmentStore(capacity_tokens=100)
    assert once.offer(1, doc, 0) == (True, [])  # the default: every segment computed
    twice = SegmentStore(capacity_tokens=100, store_threshold=2)
    assert twice.offer(1, doc, 0) == (False, []) and 1 not in twice
    assert twice.offer(1, doc, 5) == (True, []) and twice.get(1, doc) is not None
    assert twice.offer(1, doc, 0) == (False, [])  # held already
    assert twice.offer(2, [1] * (MIN_SEGMENT_TOKENS - 1), 0) == (False, [])
    assert twice.offer(2, [1] * (MIN_SEGMENT_TOKENS - 1), 0) == (False, [])  # shorter than the connector stores
    assert once.offer(3, [1] * (MIN_SEGMENT_TOKENS - 1), 0) == (False, []) and 3 not in once
    assert twice.admit(4, doc, 0) == (True, [])  # a pulled segment is admitted at once
    with pytest.raises(ValueError, match="store_threshold"):
        SegmentStore(capacity_tokens=100, store_threshold=0)


def test_a_segment_a_peer_holds_counts_as_one_offer_more() -> None:
    """Routing spreads a request's documents over the mesh, so a node seldom computes one twice itself: a peer's
    gossiped keys holding it is evidence of reuse too."""
    doc = [7] * 20
    twice = SegmentStore(capacity_tokens=100, store_threshold=2)
    assert twice.offer(1, doc, 0, held_elsewhere=True) == (True, []) and 1 in twice
    assert twice.offer(2, doc, 0) == (False, []) and 2 not in twice  # neither held by a peer nor offered before
    thrice = SegmentStore(capacity_tokens=100, store_threshold=3)
    assert thrice.offer(1, doc, 0, held_elsewhere=True) == (False, [])
    assert thrice.offer(1, doc, 0, held_elsewhere=True) == (True, [])  # two offers here, one peer
    assert thrice.offer(2, doc, 0) == (False, []) and thrice.offer(2, doc, 0, held_elsewhere=True) == (True, [])
    once = SegmentStore(capacity_tokens=100)
    assert once.offer(1, [7] * (MIN_SEGMENT_TOKENS - 1), 0, held_elsewhere=True) == (False, [])


def test_the_engine_is_told_the_keys_a_peer_holds_with_its_segments() -> None:
    from p2pnode.cache.segments import SegmentReuse, SegmentSpans
    from p2pnode.engine.vllm_engine import _segment_ask
    from p2pnode.kv import params

    segments = SegmentSpans(SegmentReuse.APPROXIMATE, ((0, 20), (20, 40)), (11, 22), held_elsewhere=(1,))
    ask = params.read(params.wrap(_segment_ask(segments, tail=False)), "segments")
    assert ask.elsewhere == (22,) and ask.keys == (11, 22) and ask.spans == (0, 20, 20, 40)


def test_store_threshold_counts_a_bounded_number_of_keys_and_retries_a_refused_admission() -> None:
    store = SegmentStore(capacity_tokens=40, store_threshold=2, offer_keys=2)
    for key in (1, 2, 3):  # 1 is forgotten: its next offer is its first again
        store.offer(key, [key] * 20, 0)
    assert store.offer(1, [1] * 20, 0) == (False, [])
    assert store.offer(3, [3] * 20, 0) == (True, [])
    store.pin([3])
    store.offer(5, [5] * 30, 0)
    assert store.offer(5, [5] * 30, 0) == (False, [])  # no room: 3 is pinned
    store.unpin([3])
    assert store.offer(5, [5] * 30, 0) == (True, [3])  # its second offer stays counted


def test_store_lookup_checks_the_tokens() -> None:
    store = SegmentStore(capacity_tokens=100)
    store.admit(9, [1, 2, 3], 0)
    assert store.get(9, [1, 2, 3]) is not None
    assert store.get(9, [1, 2, 4]) is None  # a hash collision is a miss, never another segment's KV


def _prompt() -> tuple[list[int], list[tuple[int, int]], list[int]]:
    # [context 0..5][doc A 6..13][sep 14][doc B 15..22][question 23..25]
    prompt = list(range(100, 106)) + list(range(200, 208)) + [300] + list(range(400, 408)) + [500, 501, 502]
    spans = [(6, 14), (15, 23)]
    keys = [segment_key(NS, prompt[s:e]) for s, e in spans]
    return prompt, spans, keys


def test_plan_loads_bridges_a_tail_then_a_segment_and_stops_at_text_nothing_covers() -> None:
    prompt, spans, keys = _prompt()
    store = SegmentStore(capacity_tokens=100)
    store.admit(keys[0], prompt[6:14], start=40)  # doc A was computed at position 40 elsewhere
    store.admit(keys[1], prompt[15:23], start=15)
    # a previous phase over [context] left its tail (tokens 4, 5 of the last partial block)
    store.add_tail(tail_key(NS, prompt[:6]), prompt[4:6], 4)
    pieces = plan_loads(prompt, 4, spans, keys, store, BS, NS)
    assert [(p.dst, p.count, p.delta, p.tail) for p in pieces] == [(4, 2, 0, True), (6, 8, 6 - 40, False)]
    # the separator (14) is covered by nothing: doc B needs another phase
    assert sum(p.count for p in pieces) == 10


def test_plan_loads_without_the_tail_loads_nothing_and_never_the_last_token() -> None:
    prompt, spans, keys = _prompt()
    store = SegmentStore(capacity_tokens=100)
    store.admit(keys[0], prompt[6:14], start=6)
    assert plan_loads(prompt, 4, spans, keys, store, BS, NS) == []
    # a prompt that ends with a stored segment: its last token is left to the engine
    short = prompt[:14]
    store.add_tail(tail_key(NS, short[:6]), short[4:6], 4)
    pieces = plan_loads(short, 4, spans[:1], keys[:1], store, BS, NS)
    assert pieces[-1].dst + pieces[-1].count == len(short) - 1


def test_plan_loads_continues_inside_a_partly_cached_segment() -> None:
    prompt, spans, keys = _prompt()
    store = SegmentStore(capacity_tokens=100)
    store.admit(keys[0], prompt[6:14], start=6)
    pieces = plan_loads(prompt, 8, spans, keys, store, BS, NS)
    assert [(p.offset, p.dst, p.count) for p in pieces] == [(2, 8, 6)]


def test_plan_loads_computes_each_segments_first_tokens_when_asked() -> None:
    prompt, spans, keys = _prompt()
    store = SegmentStore(capacity_tokens=100)
    store.admit(keys[0], prompt[6:14], start=6)
    # recompute 2: the phase ended at 8 (inside doc A, block-aligned: cached whole), doc A loads from its 3rd token
    pieces = plan_loads(prompt, 8, spans, keys, store, BS, NS, recompute=2)
    assert [(p.offset, p.dst, p.count) for p in pieces] == [(2, 8, 6)]
    # the first two tokens are never loaded: from 4 nothing covers 4..8 but a phase that computed them
    assert plan_loads(prompt, 4, spans, keys, store, BS, NS, recompute=2) == []
    # recompute 3: the phase over prompt[:9] left token 8 as its tail
    store.add_tail(tail_key(NS, prompt[:9]), prompt[8:9], 8)
    pieces = plan_loads(prompt, 8, spans, keys, store, BS, NS, recompute=3)
    assert [(p.offset, p.dst, p.count, p.tail) for p in pieces] == [(0, 8, 1, True), (3, 9, 5, False)]


def test_phase_cuts_end_a_phase_before_every_held_segment_that_does_not_follow_a_loaded_one() -> None:
    spans = [(6, 14), (15, 23), (23, 30)]
    assert phase_cuts(spans, lambda i: True) == [6, 15]  # 23 follows 15..23 directly
    assert phase_cuts(spans, lambda i: i == 1) == [15]
    assert phase_cuts(spans, lambda i: False) == []
    assert phase_cuts([(0, 8)], lambda i: True) == []  # a prompt that starts with the segment needs no phase
    assert phase_cuts(spans, lambda i: True, recompute=2) == [8, 17, 25]


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "sieve", "arc"])
def test_every_eviction_policy_keeps_the_store_within_capacity(policy: str) -> None:
    store = SegmentStore(capacity_tokens=50, policy=policy)
    for key in range(200):
        store.admit(key, [key] * (5 + key % 7), 0)
        if key % 3 == 0:
            store.pin([key])
        if key % 3 == 0 and key >= 3:
            store.unpin([key - 3])
        assert store.held_tokens <= 50
    assert len(store) > 0


def test_a_tail_just_added_is_never_the_one_dropped_for_room() -> None:
    """With every older tail pinned (requests loading them), making room dropped the tail just added -- whose KV the
    connector then captured anyway: a tail in the worker the store no longer knew, never dropped."""
    store = SegmentStore(capacity_tokens=100)
    store.max_tails = 2
    for key in (1, 2):
        assert store.add_tail(key, [5, 6], 0) == []
        store.pin([key])
    assert store.add_tail(3, [7, 8], 0) == []  # held, above the bound while the others are pinned
    store.unpin([1, 2])
    assert store.add_tail(4, [9, 9], 0) == [1, 2]  # the oldest unpinned go first


def test_frequency_sketch_halves_once_per_capacity_observations_whatever_the_batches() -> None:
    """A batch crossing the threshold halved once and forgot its overshoot: 8 observations at capacity 4 left a
    count of 4 where two halvings leave 2."""
    sketch = FrequencySketch(capacity=4)
    sketch.observe([1] * 8)
    assert sketch[1] == 2.0
    sketch.observe([1] * 3)  # 3 more: no halving yet
    assert sketch[1] == 5.0


def test_exact_layout_counts_a_chain_ending_on_a_block_boundary_whole() -> None:
    """A prefix the prompt continues past was looked up as a prompt (its last token left to compute): a chain ending
    on a block boundary lost its last block, two orders tied, and the one reusing less could win."""
    from p2pnode.cache.block_hash import block_hashes
    from p2pnode.cache.prefix_index import PrefixIndex

    bs = 4
    c, a, q = list(range(10, 18)), list(range(20, 28)), list(range(30, 35))  # two 2-block documents, a question
    index = PrefixIndex(bs)
    index.store_hashed(block_hashes([*a, *c, 1, 2, 3, 4], bs), None)  # an earlier request laid out A, C
    index.store_hashed(block_hashes([*c, *a[:4]], bs), None)  # another laid out C first, one block of A behind it
    layout = exact_layout([*c, *a, *q], [(0, 8), (8, 16)], keys=[111, 222], cached=index.match,
                          frequency=lambda k: 0.0, block_size=bs)
    assert layout.order == (1, 0) and layout.cached == 16 == index.match(layout.token_ids)
