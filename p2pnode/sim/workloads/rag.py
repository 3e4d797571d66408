"""``rag``: retrieval-augmented prompts, the workload of KV-Repurpose's evaluation -- documents reused behind contexts
that differ, so that prefix caching finds little and reuse beyond prefixes finds much.

Parameters (KV-Repurpose's, as the project's issue pins them, then ours where they are silent):
- documents: 10,000 (``N_DOCS``), drawn by popularity Zipf(1.0) (``ZIPF_S``: document k, counted from 0, weighs
  1 / (k + 1)); 3 to 6 per request (uniform), distinct, in **retrieval order** (the order drawn, not sorted); each
  500 to 2,000 tokens long (uniform, one length per document and seed);
- before them, on 20% of requests (``FIXED_PREFIX_SHARE``) a fixed 512-token prefix (``FIXED_PREFIX_TOKENS``), the
  same for all of them; otherwise a varying system prompt or history (ours: with equal odds one of 1,000 system
  prompts, uniform, or a conversation history of the request's own; 100 to 600 tokens, uniform);
- after them (ours): the question, 20 to 100 tokens, the request's own; the answer: lognormal, median 128 tokens,
  sigma 0.6, 16 to 512;
- arrivals (ours): Poisson at the run's rate (``--arrival gamma`` for bursts); no routing key (routers derive one).

Every request names its documents as segments (``SegmentedPrompt``: token spans and keys, ``cache/segments.
segment_key`` of each document's tokens), and the run decides what to do with them (``--segments``): nothing (prefix
caching of the prompt as sent), ``exact`` or ``approximate`` reuse (``engine/simulated/segments.py``). Tokens are real
uint32 ids, hashed into blocks by the node's own ``block_hashes``, so a document has the same tokens -- the same
blocks when it starts a block -- in every prompt: document d's token j is ``DOC_BASE + d * 2048 + j``, the fixed
prefix's ``PREFIX_BASE + j``, system prompt v's ``SYSTEM_BASE + v * 1024 + j``; text of a request's own (a
history, a question, an answer) starts with a token no other piece has (``UNIQUE_BASE`` + a counter).

Simulated at 64-token blocks (``block_size``): a block is the unit of prefix caching, and at 64 an exact-mode layout
loses under 64 tokens at the end of its reused chain (documents are 500-2,000 tokens) while a 6,000-token prompt is
~95 blocks to hash and cache.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from p2pnode.cache.block_hash import block_hashes
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.simulated.segments import SegmentedPrompt, segment_key
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import Limit, cumulative, lognormal_int, pick, zipf_weights

__all__ = ["NAME", "Piece", "Rag", "RagPrompt", "hashed_token_ids"]

NAME = "rag"
N_DOCS = 10_000
ZIPF_S = 1.0
DOCS_MIN, DOCS_MAX = 3, 6
DOC_TOKENS_MIN, DOC_TOKENS_MAX = 500, 2000
FIXED_PREFIX_SHARE = 0.2
FIXED_PREFIX_TOKENS = 512
SYSTEM_PROMPTS = 1000
CONTEXT_TOKENS_MIN, CONTEXT_TOKENS_MAX = 100, 600
QUESTION_TOKENS_MIN, QUESTION_TOKENS_MAX = 20, 100
ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_MIN, ANSWER_MAX = 128, 0.6, 16, 512
BLOCK_SIZE = 64

#: Token ids of each kind of text (module docstring); every id fits a uint32.
PREFIX_BASE = 16
SYSTEM_BASE = 1 << 20
DOC_BASE = 1 << 22
DOC_STRIDE = 2048
UNIQUE_BASE = 1 << 28
FILLER = 3


def hashed_token_ids(name: str, n: int, vocab_size: int) -> list[int]:
    """``n`` tokens named ``name``: token j a hash of (name, j) into ``[FILLER, vocab_size)``, so text of one name
    has the same tokens wherever it appears (a shorter run of it is a prefix of a longer one) and texts of two names
    share none but by chance."""
    seed = xxhash.xxh3_64_intdigest(name.encode())
    span = vocab_size - FILLER
    return [FILLER + xxhash.xxh3_64_intdigest(j.to_bytes(4, "little"), seed) % span for j in range(n)]


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of a prompt's text: ``kind`` is ``prefix``, ``system``, ``history``, ``doc``, ``question`` or
    ``answer``; ``ident`` the document, system prompt or unique counter; ``tokens`` its length."""

    kind: str
    ident: int
    tokens: int

    def token_ids(self, vocab_size: int | None = None) -> list[int]:
        """Its tokens: the simulator's (module docstring), or with ``vocab_size`` ids a real model takes -- each a
        hash of (kind, ident, position) into ``[FILLER, vocab_size)``, so equal pieces have equal tokens and others
        share none (but by chance) -- for replaying a trace against a real mesh."""
        if vocab_size is not None:
            return hashed_token_ids(f"{self.kind}:{self.ident}", self.tokens, vocab_size)
        if self.kind == "doc":
            base = DOC_BASE + self.ident * DOC_STRIDE
            return list(range(base, base + self.tokens))
        if self.kind == "prefix":
            return list(range(PREFIX_BASE, PREFIX_BASE + self.tokens))
        if self.kind == "system":
            base = SYSTEM_BASE + self.ident * 1024
            return list(range(base, base + self.tokens))
        return [UNIQUE_BASE + self.ident, *(FILLER for _ in range(self.tokens - 1))]


@dataclass(frozen=True, slots=True)
class RagPrompt:
    """One request as generated: its pieces (the prompt's, then the answer), arrival and class."""

    arrival: float
    pieces: tuple[Piece, ...]
    cls: str

    @property
    def prompt(self) -> tuple[Piece, ...]:
        return self.pieces[:-1]

    @property
    def answer(self) -> Piece:
        return self.pieces[-1]


class Rag:
    """The RAG workload (module docstring)."""

    name = NAME
    description = "RAG: 3-6 of 10,000 Zipf(1.0) documents behind a fixed prefix (20%) or varying contexts"
    block_size = BLOCK_SIZE

    def __init__(self, arrival: str = "poisson", cv: float = 1.0) -> None:
        self.arrival = arrival
        self.cv = cv
        self._cum = cumulative(zipf_weights(N_DOCS, ZIPF_S))
        self._keys: dict[int, int] = {}

    @staticmethod
    def doc_tokens(seed: int, doc: int) -> int:
        """Document ``doc``'s length: one per document and seed."""
        u = xxhash.xxh3_64_intdigest(doc.to_bytes(8, "little"), seed) / float(1 << 64)
        return DOC_TOKENS_MIN + int(u * (DOC_TOKENS_MAX - DOC_TOKENS_MIN + 1))

    @staticmethod
    def system_tokens(seed: int, prompt: int) -> int:
        u = xxhash.xxh3_64_intdigest(prompt.to_bytes(8, "little"), seed ^ 0x5157) / float(1 << 64)
        return CONTEXT_TOKENS_MIN + int(u * (CONTEXT_TOKENS_MAX - CONTEXT_TOKENS_MIN + 1))

    def prompts(self, qps: float, seed: int, limit: Limit) -> Iterator[RagPrompt]:
        """The requests as pieces, in arrival order (``requests`` makes them simulated requests; the trace script
        writes them)."""
        if qps is None:
            raise ValueError(f"{NAME} needs a request rate")
        rng = random.Random(seed)
        unique = 0
        for n, t in enumerate(arrival_times(random.Random(seed ^ 0xA5A5), qps, self.arrival, self.cv)):
            if limit.reached(t, n):
                return
            pieces: list[Piece] = []
            if rng.random() < FIXED_PREFIX_SHARE:
                cls = "fixed-prefix"
                pieces.append(Piece("prefix", 0, FIXED_PREFIX_TOKENS))
            elif rng.random() < 0.5:
                cls = "system-prompt"
                v = rng.randrange(SYSTEM_PROMPTS)
                pieces.append(Piece("system", v, self.system_tokens(seed, v)))
            else:
                cls = "history"
                unique += 1
                pieces.append(Piece("history", unique, rng.randint(CONTEXT_TOKENS_MIN, CONTEXT_TOKENS_MAX)))
            docs: list[int] = []
            want = rng.randint(DOCS_MIN, DOCS_MAX)
            while len(docs) < want:
                d = pick(rng.random(), self._cum)
                if d not in docs:
                    docs.append(d)
            pieces += [Piece("doc", d, self.doc_tokens(seed, d)) for d in docs]
            unique += 1
            pieces.append(Piece("question", unique, rng.randint(QUESTION_TOKENS_MIN, QUESTION_TOKENS_MAX)))
            unique += 1
            answer = lognormal_int(rng.lognormvariate, ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_MIN, ANSWER_MAX)
            pieces.append(Piece("answer", unique, answer))
            yield RagPrompt(t, tuple(pieces), cls)

    def key_of(self, piece: Piece, tokens: list[int]) -> int:
        """A document's segment key (memoised: a document's tokens never change)."""
        key = self._keys.get(piece.ident)
        if key is None:
            key = self._keys[piece.ident] = segment_key("", tokens)
        return key

    def request(self, rid: int, prompt: RagPrompt, block_size: int) -> SimRequest:
        """A generated prompt as a simulated request with its segments (``SegmentedPrompt``)."""
        tokens: list[int] = []
        spans: list[tuple[int, int]] = []
        keys: list[int] = []
        for piece in prompt.prompt:
            ids = piece.token_ids()
            if piece.kind == "doc":
                spans.append((len(tokens), len(tokens) + len(ids)))
                keys.append(self.key_of(piece, ids))
            tokens += ids
        n_prompt = len(tokens)
        tokens += prompt.answer.token_ids()
        r = SimRequest(rid, prompt.arrival, "", n_prompt, prompt.answer.tokens, block_hashes(tokens, block_size), [],
                       block_size, prompt.cls)
        r.segments = SegmentedPrompt(tokens, tuple(spans), tuple(keys))
        return r

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{NAME} needs a request rate")
        for rid, prompt in enumerate(self.prompts(qps, seed, limit)):
            yield self.request(rid, prompt, space.block_size)
