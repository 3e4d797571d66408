"""``revisit``: popular documents and long conversations re-read after many other requests, between one-time scans.

The regime the WAKMan mixes lack: reuse that comes back only after many other requests, with the cache
under pressure from prompts that are never seen again. Three classes, shares of requests:
- **doc** (40%): one of 400 shared documents (Zipf 0.6: a flat popularity, so most documents are re-read every
  minute or two, not every second; lognormal median 2,000 tokens) + a unique question (median 100) -> 100 tokens.
  Reuse: the document, after hundreds of other requests.
- **chat** (20%): long conversations behind one of 50 system prompts (Zipf 1.0, median 1,000): 2 + Geometric(mean
  6) turns, user messages median 200, answers median 300, the next turn 90 s (exponential, >= 20 s) after the
  previous one arrived. Reuse: the whole history, minutes later.
- **scan** (40%): a unique prompt (median 3,000 tokens: batch summarisation, retrieval over fresh documents) ->
  100 tokens. Never reused: it only pushes the others out.
An LRU cache keeps the scans' recent blocks and loses the documents between two reads; a policy that protects
blocks read more than once (S3-FIFO, SIEVE, ARC) keeps them. Sessions start as a Poisson process at
``qps * sum(share_c / mean_len_c)``, so the request rate is ``qps`` in steady state (as ``wakman.py``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from p2pnode.config import DEFAULT_SIM_BLOCK_SIZE
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import (
    Limit,
    cumulative,
    geometric,
    hashed_lognormal,
    lognormal_int,
    pick,
    zipf_weights,
)
from p2pnode.sim.workloads.sessions import ChatTurns, Sessions

__all__ = ["NAME", "Revisit"]

NAME = "revisit"
SHARES = {"doc": 0.4, "chat": 0.2, "scan": 0.4}
N_DOCS, DOC_ZIPF, DOC_MEDIAN = 400, 0.6, 2000
QUESTION_MEDIAN, DOC_OUTPUT_MEDIAN = 100, 100
N_SYSTEMS, SYSTEM_ZIPF, SYSTEM_MEDIAN = 50, 1.0, 1000
CHAT_EXTRA_TURNS_MEAN, CHAT_USER_MEDIAN, CHAT_OUTPUT_MEDIAN = 6.0, 200, 300
CHAT_THINK_MEAN_S, CHAT_THINK_MIN_S = 90.0, 20.0
SCAN_MEDIAN, SCAN_OUTPUT_MEDIAN = 3000, 100
MEAN_LEN = {"doc": 1.0, "chat": 2.0 + CHAT_EXTRA_TURNS_MEAN, "scan": 1.0}
_DOC_BASE, _SYSTEM_BASE = 0, 1 << 20
CHAT = ChatTurns(CHAT_USER_MEDIAN, CHAT_OUTPUT_MEDIAN, CHAT_THINK_MEAN_S, CHAT_THINK_MIN_S)


class Revisit:
    #: Preferred simulation block size (as the other synthetic workloads).
    block_size = DEFAULT_SIM_BLOCK_SIZE
    name = NAME
    description = "popular documents and long conversations re-read after many other requests, between one-time scans"

    def __init__(self) -> None:
        self._classes = list(SHARES)
        self._session_weights = cumulative([SHARES[c] / MEAN_LEN[c] for c in self._classes])
        self._docs = cumulative(zipf_weights(N_DOCS, DOC_ZIPF))
        self._sys = cumulative(zipf_weights(N_SYSTEMS, SYSTEM_ZIPF))

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{NAME} needs a request rate")
        sessions = Sessions(seed, space, lambda e: _prefix_len(seed, e), CHAT)
        start = {"doc": self._doc, "chat": self._chat, "scan": self._scan}
        session_rate = qps * sum(SHARES[c] / MEAN_LEN[c] for c in self._classes)
        starts = arrival_times(random.Random(seed ^ 0x5EE5), session_rate, "poisson")

        def session(t: float, entity: int) -> SimRequest:
            cls = self._classes[pick(sessions.rng.random(), self._session_weights)]
            return start[cls](sessions, entity, t)

        yield from sessions.run(starts, limit, session)

    def _doc(self, s: Sessions, entity: int, t: float) -> SimRequest:
        """A shared document and a unique question about it."""
        e = _DOC_BASE + pick(s.rng.random(), self._docs)
        stream = s.stream(entity, e)
        return s.request(
            stream, t, f"s{s.seed}d{e}",
            lognormal_int(s.draw, QUESTION_MEDIAN, 0.6, 8, 2000),
            lognormal_int(s.draw, DOC_OUTPUT_MEDIAN, 0.6, 4, 1000), "doc",
        )  # fmt: skip

    def _scan(self, s: Sessions, entity: int, t: float) -> SimRequest:
        """A prompt seen once."""
        stream = s.stream(entity)
        return s.request(
            stream, t, "",
            lognormal_int(s.draw, SCAN_MEDIAN, 0.5, 256, 16_000),
            lognormal_int(s.draw, SCAN_OUTPUT_MEDIAN, 0.6, 4, 1000), "scan",
        )  # fmt: skip

    def _chat(self, s: Sessions, entity: int, t: float) -> SimRequest:
        """A long conversation's first turn; the others come a think time apart (``Sessions.later``)."""
        e = _SYSTEM_BASE + pick(s.rng.random(), self._sys)
        stream = s.stream(entity, e)
        key = f"s{s.seed}c{e}"
        turns = 2 + geometric(s.rng, CHAT_EXTRA_TURNS_MEAN)
        r = s.chat_turn(stream, t, key)
        s.later(t, stream, key, turns - 1)
        return r


def _prefix_len(seed: int, e: int) -> int:
    """The length of shared prefix ``e``: a system prompt or a document, by its entity range."""
    if e >= _SYSTEM_BASE:
        return hashed_lognormal(seed, e, SYSTEM_MEDIAN, 0.5, 128, 6000)
    return hashed_lognormal(seed, e, DOC_MEDIAN, 0.5, 256, 12_000)
