"""``ragpulse-shaped``: a RAG service's traffic with the shape RAGPulse published -- most of each prompt a system
prompt the service shares, retrieved passages reused behind it, a little history and a short question.

The ``rag`` workload (``rag.py``) is KV-Repurpose's: documents behind contexts that differ, so nearly all reuse is
beyond prefixes. A RAG service's traffic is not: its system prompt is half of every prompt and the longest prefix
requests share, so a layout or a store that reuses documents must not throw that prefix away. This workload is that
traffic, generated to RAGPulse's published statistics (as the project pins them; ours where they are silent):

- **system prompt**, ~47% of prompt tokens, in chunks: on 77% of requests (``MAIN_SHARE``) the service's first chunk
  (``FIRST_CHUNK_TOKENS``), then one of ``INSTRUCTION_VARIANTS`` instruction chunks (Zipf(1.0): some apps more
  common), then a short chunk of the request's own (a date, a user profile); on the others one of ``OTHER_PROMPTS``
  other first chunks (Zipf(1.0), 400 to 900 tokens), then the request's own chunk (ours: the chunk sizes);
- **passages**: 6 on 77% of requests (``PASSAGE_SHARE``), none on 21% (``NO_PASSAGE_SHARE``), 1 to 5 on the rest;
  distinct, drawn by a skewed popularity (ours: Zipf(1.0)) over 8,000 passages whose lengths have RAGPulse's median
  255 tokens and 5-95% range 67-355 (each passage's length one draw of ``passage_tokens``, linear between those
  quantiles); named as segments;
- **history**, ~9% of prompt tokens: on 60% of requests 1 to 4 chunks (lognormal, median 130 tokens); each chunk is a
  new one, except that with probability ``HISTORY_REPEAT`` it is one of the last ``HISTORY_POOL`` chunks (a session
  going on), so that ~92% of chunks are seen once; plain text (``history_segments`` names them as segments: the
  case where a store filled by one-off pieces loses documents);
- **question**: 8 to 80 tokens, the request's own; the answer lognormal (median 200 tokens, sigma 0.7, 16 to 1,024);
- arrivals: Poisson at the run's rate (``--arrival gamma`` for bursts). RAGPulse's web search results (segments in
  its converter, ``scripts/convert_ragpulse.py``) are not generated: its published shape gives them no share.

Pieces in RAGPulse's order -- system prompt chunks, passages, history, question -- as the records of a segmented
trace (``segmented_trace.py``): the same tokens (a hash of kind, id and position), keys and replay, so that a trace
converted from RAGPulse and this generator run through the same code and the same bounds
(``scripts/segment_bounds.py``). Deterministic per seed; simulated at 64-token blocks, as ``rag``.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Iterator

import xxhash

from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import Limit, cumulative, lognormal_int, pick, zipf_weights
from p2pnode.sim.workloads.rag import BLOCK_SIZE
from p2pnode.sim.workloads.segmented_trace import SegmentedPiece, SegmentedRecord, SegmentedRequests

__all__ = ["HISTORY_NAME", "NAME", "RagPulseShaped", "passage_tokens"]

NAME = "ragpulse-shaped"
#: The same traffic with history chunks named as segments.
HISTORY_NAME = "ragpulse-shaped-history"

MAIN_SHARE = 0.77
FIRST_CHUNK_TOKENS = 500
INSTRUCTION_VARIANTS = 4
INSTRUCTION_TOKENS_MIN, INSTRUCTION_TOKENS_MAX = 250, 450
OTHER_PROMPTS = 20
OTHER_TOKENS_MIN, OTHER_TOKENS_MAX = 400, 900
OWN_CHUNK_TOKENS_MIN, OWN_CHUNK_TOKENS_MAX = 200, 500

N_PASSAGES = 8000
ZIPF_S = 1.0
PASSAGES = 6
PASSAGE_SHARE = 0.77
NO_PASSAGE_SHARE = 0.21
#: Passage length quantiles (share, tokens): RAGPulse's 5%, median and 95%, ours at the ends.
PASSAGE_QUANTILES = ((0.0, 24), (0.05, 67), (0.5, 255), (0.95, 355), (1.0, 480))

HISTORY_SHARE = 0.6
HISTORY_CHUNKS_MIN, HISTORY_CHUNKS_MAX = 1, 4
HISTORY_MEDIAN, HISTORY_SIGMA, HISTORY_MIN, HISTORY_MAX = 130, 0.6, 16, 800
HISTORY_REPEAT = 0.075
HISTORY_POOL = 1000

QUESTION_TOKENS_MIN, QUESTION_TOKENS_MAX = 8, 80
ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_MIN, ANSWER_MAX = 200, 0.7, 16, 1024

_U64 = float(1 << 64)


def _unit(seed: int, salt: int, ident: int) -> float:
    """A uniform in [0, 1) that is a pure function of (seed, salt, ident): one length per piece and seed."""
    return xxhash.xxh3_64_intdigest(ident.to_bytes(8, "little"), seed ^ salt) / _U64


def passage_tokens(seed: int, passage: int) -> int:
    """Passage ``passage``'s length: linear between ``PASSAGE_QUANTILES`` at a uniform drawn per passage and seed."""
    u = _unit(seed, 0x9A55, passage)
    shares = [q for q, _ in PASSAGE_QUANTILES]
    i = min(len(shares) - 1, max(1, bisect.bisect_right(shares, u)))
    (q0, t0), (q1, t1) = PASSAGE_QUANTILES[i - 1], PASSAGE_QUANTILES[i]
    return round(t0 + (t1 - t0) * (u - q0) / (q1 - q0))


class RagPulseShaped(SegmentedRequests):
    """The workload (module docstring); ``records_for`` gives its requests as a segmented trace's records."""

    description = "RAG service shaped like RAGPulse: a shared multi-chunk system prompt, 6 of 8,000 passages, history"
    block_size = BLOCK_SIZE
    has_segments = True

    def __init__(self, arrival: str = "poisson", cv: float = 1.0, history_segments: bool = False) -> None:
        super().__init__()
        self.arrival = arrival
        self.cv = cv
        self.history_segments = history_segments
        self.name = HISTORY_NAME if history_segments else NAME
        self._passages = cumulative(zipf_weights(N_PASSAGES, ZIPF_S))
        self._instructions = cumulative(zipf_weights(INSTRUCTION_VARIANTS, 1.0))
        self._others = cumulative(zipf_weights(OTHER_PROMPTS, 1.0))

    def _system(self, rng: random.Random, seed: int, own: int) -> list[SegmentedPiece]:
        own_chunk = SegmentedPiece(
            "sys_prompt", f"own-{own}", rng.randint(OWN_CHUNK_TOKENS_MIN, OWN_CHUNK_TOKENS_MAX), False
        )
        if rng.random() < MAIN_SHARE:
            v = pick(rng.random(), self._instructions)
            span = INSTRUCTION_TOKENS_MAX - INSTRUCTION_TOKENS_MIN + 1
            instruction = INSTRUCTION_TOKENS_MIN + int(_unit(seed, 0x1257, v) * span)
            return [
                SegmentedPiece("sys_prompt", "first", FIRST_CHUNK_TOKENS, False),
                SegmentedPiece("sys_prompt", f"instruction-{v}", instruction, False),
                own_chunk,
            ]
        o = pick(rng.random(), self._others)
        other = OTHER_TOKENS_MIN + int(_unit(seed, 0x07E5, o) * (OTHER_TOKENS_MAX - OTHER_TOKENS_MIN + 1))
        return [SegmentedPiece("sys_prompt", f"other-{o}", other, False), own_chunk]

    def _passages_of(self, rng: random.Random, seed: int) -> list[SegmentedPiece]:
        u = rng.random()
        want = PASSAGES if u < PASSAGE_SHARE else 0 if u < PASSAGE_SHARE + NO_PASSAGE_SHARE else rng.randint(1, 5)
        drawn: list[int] = []
        while len(drawn) < want:
            p = pick(rng.random(), self._passages)
            if p not in drawn:
                drawn.append(p)
        return [SegmentedPiece("passage", str(p), passage_tokens(seed, p), True) for p in drawn]

    def records_for(self, qps: float | None, seed: int, limit: Limit) -> Iterator[tuple[float, SegmentedRecord]]:
        """(arrival in seconds, request as a segmented trace's record), in arrival order."""
        if qps is None:
            raise ValueError(f"{self.name} needs a request rate")
        rng = random.Random(seed)
        pool: deque[SegmentedPiece] = deque(maxlen=HISTORY_POOL)
        chunks = 0
        for n, t in enumerate(arrival_times(random.Random(seed ^ 0xA5A5), qps, self.arrival, self.cv)):
            if limit.reached(t, n):
                return
            pieces = self._system(rng, seed, n) + self._passages_of(rng, seed)
            if rng.random() < HISTORY_SHARE:
                named: set[str] = set()
                for _ in range(rng.randint(HISTORY_CHUNKS_MIN, HISTORY_CHUNKS_MAX)):
                    if pool and rng.random() < HISTORY_REPEAT:
                        chunk = pool[rng.randrange(len(pool))]
                    else:
                        chunks += 1
                        size = lognormal_int(
                            rng.lognormvariate, HISTORY_MEDIAN, HISTORY_SIGMA, HISTORY_MIN, HISTORY_MAX
                        )
                        chunk = SegmentedPiece("history", str(chunks), size, self.history_segments)
                        pool.append(chunk)
                    if chunk.ident not in named:  # a request names a segment once
                        named.add(chunk.ident)
                        pieces.append(chunk)
            pieces.append(
                SegmentedPiece("user_input", str(n), rng.randint(QUESTION_TOKENS_MIN, QUESTION_TOKENS_MAX), False)
            )
            answer = lognormal_int(rng.lognormvariate, ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_MIN, ANSWER_MAX)
            yield t, SegmentedRecord(t * 1000.0, tuple(pieces), answer, None)

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{self.name} needs a request rate")
        for rid, (t, rec) in enumerate(self.records_for(qps, seed, limit)):
            yield self.request(rid, t, rec, space.block_size)
