"""Approximate segment reuse on a real vLLM engine (the tiny model): the connector's store, its loads and phases.

The mechanics are checked where the answer is known exactly: a document loaded from the store back into the same
context at the same place (after the prefix cache was emptied) must give the very tokens a full prefill gives --
any slot, packing or phase error changes them. Reuse after another context is approximate by design; its
divergence is measured by scripts/segment_divergence.py, not asserted.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from p2pnode.cache.namespace import APPROXIMATE_SALT, CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import SegmentReuse, SegmentSpans, segment_key
from p2pnode.engine.base import GenerationChunk
from p2pnode.engine.vllm_engine import VllmEngine
from p2pnode.request import Request, SamplingOptions
from tests.greedy import assert_same_greedy, chunk_margins
from tests.integration.conftest import STORE_TOKENS, InProcess
from tests.polling import until

BLOCK_SIZE = 32
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, logprobs=5)
#: Log-probabilities of the same KV agree exactly here (measured 0.0); a key rotated one position off moves them
#: by ~4e-3 while the tiny model's greedy tokens stay the same, so the tokens alone would not catch it.
LOGPROB_TOLERANCE = 1e-4

pytestmark = pytest.mark.integration


@dataclass
class Served:
    engine: VllmEngine
    index: PrefixIndex
    n: int = 0

    async def run(self, prompt: list[int], segments: list[tuple[int, int]] | None = None) -> list[GenerationChunk]:
        self.n += 1
        spans = None
        if segments is not None:
            keys = tuple(segment_key("", prompt[s:e]) for s, e in segments)
            spans = SegmentSpans(SegmentReuse.APPROXIMATE, tuple(segments), keys)
        return [c async for c in self.engine.generate(Request(f"s{self.n}", prompt, GREEDY, segments=spans))]


@pytest.fixture(scope="module")
def served(in_process: InProcess) -> Served:
    return Served(in_process.engine, in_process.index)


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _out(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _same_logprobs(a: list[GenerationChunk], b: list[GenerationChunk]) -> bool:
    """Every position's top alternatives: the same tokens with the same log-probabilities."""
    pa = [p for c in a for p in c.logprobs]
    pb = [p for c in b for p in c.logprobs]
    return len(pa) == len(pb) > 0 and all(
        [t.token_id for t in x.top] == [t.token_id for t in y.top]
        and all(abs(s.logprob - t.logprob) <= LOGPROB_TOLERANCE for s, t in zip(x.top, y.top, strict=True))
        for x, y in zip(pa, pb, strict=True)
    )


async def test_a_document_loaded_back_into_its_own_context_gives_the_full_prefills_tokens(served: Served) -> None:
    system, doc, question = _tokens(1, 45), _tokens(2, 200), _tokens(3, 9)
    first = await served.run(system + doc + question, [(45, 245)])
    assert first[-1].segments is not None and first[-1].segments.loaded_tokens == 0  # computed, then stored
    assert await served.engine.reset_prefix_cache()  # only the segment store still holds the document
    again = system + doc + _tokens(4, 9)
    loaded = await served.run(again, [(45, 245)])
    outcome = loaded[-1].segments
    assert outcome is not None and outcome.error == ""
    assert outcome.segments == 1 and outcome.phases == 1
    assert outcome.loaded_tokens >= 200  # the document, and the tail bridging the system prompt's last block
    assert loaded[-1].cached_tokens >= 200  # counted as the engine's cache hit, the phase's own work not
    assert await served.engine.reset_prefix_cache()
    full = await served.run(again)  # a plain prompt: a full prefill
    assert _out(loaded) == _out(full)  # the same KV in the same places: the same numbers (below), so the same choices
    assert _same_logprobs(loaded, full)


async def _indexed_in(served: Served, prompt: list[int], namespace: CacheNamespace) -> int:
    return await until(lambda: served.index.match(prompt, namespace), "the salted blocks' KV events in the index")


async def test_approximate_blocks_never_answer_a_plain_lookup_and_stay_in_their_namespace(served: Served) -> None:
    prompt = _tokens(5, 45) + _tokens(6, 150) + _tokens(23, 9)  # a question whose first steps are decided by far
    await served.run(prompt, [(45, 195)])
    await served.run(prompt, [(45, 195)])
    # the engine's events index them under the approximate salt's namespace, where no plain request looks
    assert await _indexed_in(served, prompt, CacheNamespace("", APPROXIMATE_SALT)) > 0
    assert served.index.match(prompt) == 0
    plain = await served.run(prompt)
    assert plain[-1].cached_tokens == 0
    assert plain[-1].segments is None
    repeat = await served.run(prompt)
    assert repeat[-1].cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert_same_greedy(_out(plain), chunk_margins(plain), _out(repeat))  # the tail computed alone: other steps


async def test_the_store_stays_within_its_bytes_and_reports_what_it_dropped(served: Served) -> None:
    before = served.engine.segment_holdings()
    docs = [_tokens(100 + k, 300) for k in range(5)]  # 1,500 tokens through a 1,024-token store
    for k, doc in enumerate(docs):
        await served.run(_tokens(200 + k, 40) + doc + _tokens(300 + k, 5), [(40, 340)])
    held = served.engine.segment_holdings()
    assert sum(held.values()) <= STORE_TOKENS
    newest = segment_key("", docs[-1])
    assert newest in held and held[newest] == 300
    assert not set(before) <= set(held) or len(before) == 0  # something older was evicted to make room
    # an evicted document is computed again, correctly: no load, same tokens as a plain prompt
    prompt = _tokens(400, 40) + docs[0] + _tokens(407, 5)  # a tail whose first steps are decided by far
    reused = await served.run(prompt, [(40, 340)])
    assert segment_key("", docs[0]) not in held
    assert reused[-1].segments is not None and reused[-1].segments.loaded_tokens == 0
    plain = await served.run(prompt)
    assert_same_greedy(_out(plain), chunk_margins(plain), _out(reused))
