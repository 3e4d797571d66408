"""Token-level request streams for checking a real engine's eviction against the simulator's prediction.

Two regimes, served one request at a time so that the order the engine sees is the order predicted:
- ``recency``: conversations that grow one block per turn; the conversation that speaks next is drawn by how
  recently it spoke (its rank in recency order is geometric, LRU's stack model), 20% of turns open a new one.
  LRU is the best policy here.
- ``frequency``: a hot set of prompts (6 x 4 blocks), each read twice in a row, between bursts of prompts never
  seen again (a scan: 12 x 4 blocks, so hot set and burst overflow a 63-block cache). LRU loses the hot set to
  every burst; S3-FIFO, SIEVE and ARC keep it.
Every prompt is ``k`` full blocks plus one token, so the engine can reuse at most the ``k`` blocks (vLLM never
reuses the last prompt token) and, with one output token, no output block is ever cached: engine and simulator
cache exactly the prompt's full blocks.

``predict`` replays a stream through the simulator's paged cache (``engine/simulated/kvcache.py``: the cache the
simulated engine and ``p2pnode sim`` use) with the engine's block count, and returns the cached tokens per request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.eviction import get_eviction
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest

__all__ = ["STREAMS", "frequency_stream", "predict", "recency_stream"]

#: Token ids stay below this (the tiny test model's vocabulary is 512; 0-2 are its special tokens).
VOCAB = 500


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def recency_stream(n: int, block_size: int, seed: int = 1, max_blocks: int = 12) -> list[list[int]]:
    """``n`` prompts of growing conversations, the next speaker drawn by recency (see the module docstring); a
    conversation ends after ``max_blocks`` blocks."""
    rng = random.Random(seed)
    threads: list[tuple[int, int]] = []  # (conversation, blocks so far), most recent first
    out: list[list[int]] = []
    new = 0
    while len(out) < n:
        rank = 0
        while rng.random() > 0.3:
            rank += 1
        if rng.random() < 0.2 or rank >= len(threads):
            new += 1
            conv, blocks = seed * 100_000 + new, 2
        else:
            conv, blocks = threads.pop(rank)
            blocks += 1
        if blocks < max_blocks:
            threads.insert(0, (conv, blocks))
        body = _tokens(conv, blocks * block_size)
        out.append([*body, 1 + blocks % 2])  # the turn's last token: never reused
    return out


def frequency_stream(
    n: int, block_size: int, seed: int = 1, hot: int = 6, hot_blocks: int = 4, scan_burst: int = 12
) -> list[list[int]]:
    """``n`` prompts: rounds of ``hot`` prompts read twice each, then ``scan_burst`` one-time prompts."""
    out: list[list[int]] = []
    scan = 0
    while len(out) < n:
        for k in range(hot):
            prompt = [*_tokens(seed * 1000 + k, hot_blocks * block_size), 1]
            out += [prompt, prompt]
        for _ in range(scan_burst):
            scan += 1
            out.append([*_tokens(seed * 1_000_000 + scan, hot_blocks * block_size), 1])
    return out[:n]


STREAMS = {"recency": recency_stream, "frequency": frequency_stream}


def predict(stream: Sequence[Sequence[int]], num_blocks: int, block_size: int, policy: str) -> list[int]:
    """Cached tokens of each request of ``stream`` served alone, in order, by the simulator's cache of
    ``num_blocks`` blocks under ``policy`` (one output token each)."""
    cache = PagedPrefixCache(num_blocks, block_size, get_eviction(policy), lambda r, lo, hi: [], emit=lambda e: None)
    out = []
    for rid, prompt in enumerate(stream):
        chain = block_hashes(list(prompt), block_size)
        r = SimRequest(rid, 0.0, "", len(prompt), 1, chain, list(range(len(chain))), block_size)
        if not cache.admit(r):
            raise ValueError(f"request {rid} ({len(prompt)} tokens) does not fit {num_blocks} blocks")
        cache.store_prompt(r)
        cache.release(r)
        out.append(r.cached_tokens)
    return out
