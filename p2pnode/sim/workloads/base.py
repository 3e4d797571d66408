"""What every workload shares: the Workload protocol, run limits, random helpers, and token streams.

A workload is a deterministic generator: ``requests(qps, seed, space, limit)`` yields ``SimRequest``s in arrival
order, lazily (a million-request run never holds its whole workload in memory). Requests released by a
completion (an agent's next step) hang off their predecessor's ``follow`` and are not yielded.

Content ids (see ``p2pnode/sim/blocks.py``) are namespaced so that distinct content never shares an id:
``cid(ns, entity, i)`` = namespace (4 bits) | entity (40 bits) | block index (20 bits). A shared prefix (a system
prompt, few-shot examples) is an entity whose blocks every user of it repeats; a stream (a conversation, an agent
session, a one-off prompt) is an entity of its own, so its blocks are reusable only by its own later turns.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

import xxhash

from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace

__all__ = [
    "Limit",
    "PrefixTable",
    "Stream",
    "Workload",
    "cid",
    "cumulative",
    "geometric",
    "hashed_lognormal",
    "lognormal_int",
    "pick",
    "zipf_weights",
]

NS_PREFIX = 1
NS_STREAM = 2
_ENTITY_BITS = 40
_INDEX_BITS = 20
_MAX_ENTITY = (1 << _ENTITY_BITS) - 1
_MAX_INDEX = (1 << _INDEX_BITS) - 1


def cid(ns: int, entity: int, i: int) -> int:
    """Content id of block ``i`` of ``entity`` in namespace ``ns``."""
    if not (0 <= entity <= _MAX_ENTITY and 0 <= i <= _MAX_INDEX):
        raise ValueError(f"content id out of range: entity {entity}, block {i}")
    return (ns << (_ENTITY_BITS + _INDEX_BITS)) | (entity << _INDEX_BITS) | i


@dataclass(frozen=True)
class Limit:
    """When a workload stops: after ``duration_s`` of arrivals, or ``max_requests`` requests, whichever first."""

    duration_s: float | None = None
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if self.duration_s is None and self.max_requests is None:
            raise ValueError("a run needs a duration or a request count")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"request count must be >= 1, got {self.max_requests}")

    def reached(self, t: float, n: int) -> bool:
        return (self.duration_s is not None and t > self.duration_s) or (
            self.max_requests is not None and n >= self.max_requests
        )

    def window_s(self, qps: float) -> float:
        """Expected span of arrivals (for warm-up sizing)."""
        if self.duration_s is not None:
            return self.duration_s if self.max_requests is None else min(self.duration_s, self.max_requests / qps)
        assert self.max_requests is not None
        return self.max_requests / qps


class Workload(Protocol):
    name: str
    description: str
    #: The block size this workload is simulated at unless told otherwise (a block is the unit of caching: it should
    #: be small next to the reusable segments, and large enough to keep the per-request block count down).
    block_size: int

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        """Requests in arrival order; ``qps`` None means the workload's native rate (traces)."""
        ...


# --- random helpers ------------------------------------------------------------------------------------------------


def lognormal_int(draw: Callable[[float, float], float], median: float, sigma: float, lo: int, hi: int) -> int:
    """``draw`` is ``random.Random.lognormvariate``; the result is clipped to [lo, hi]."""
    v = int(draw(math.log(median), sigma))
    return lo if v < lo else hi if v > hi else v


_NORMAL = NormalDist()
_U64 = float(1 << 64)


def geometric(rng: random.Random, mean: float) -> int:
    """Failures before the first success, with the given mean (extra turns or steps of a session)."""
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def hashed_lognormal(seed: int, entity: int, median: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal length that is a pure function of (seed, entity): a key's prompt has one length in a run."""
    u = (xxhash.xxh3_64_intdigest(entity.to_bytes(8, "little"), seed) + 0.5) / _U64
    v = int(math.exp(math.log(median) + sigma * _NORMAL.inv_cdf(u)))
    return lo if v < lo else hi if v > hi else v


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def cumulative(weights: Sequence[float]) -> list[float]:
    return list(itertools.accumulate(weights))


def pick(u: float, cum: list[float]) -> int:
    """Index drawn from cumulative weights ``cum`` by a uniform ``u`` in [0, 1)."""
    i = bisect.bisect_right(cum, u * cum[-1])
    return i if i < len(cum) else len(cum) - 1


# --- shared prefixes and streams -----------------------------------------------------------------------------------


class PrefixTable:
    """Shared prefixes by entity: their length, and the hash chain of their full blocks (memoised, bounded)."""

    def __init__(self, space: BlockSpace, length_of: Callable[[int], int], ns: int = NS_PREFIX, memo: int = 20_000):
        self.space = space
        self.length_of = length_of
        self.ns = ns
        self._memo: OrderedDict[int, tuple[int, list[int], list[int]]] = OrderedDict()
        self._max = memo

    def get(self, entity: int) -> tuple[int, list[int], list[int]]:
        """(length in tokens, chain, cids) of the entity's full blocks."""
        hit = self._memo.get(entity)
        if hit is not None:
            self._memo.move_to_end(entity)
            return hit
        length = self.length_of(entity)
        chain: list[int] = []
        cids: list[int] = []
        self.space.extend(chain, cids, [cid(self.ns, entity, i) for i in range(length // self.space.block_size)])
        hit = (length, chain, cids)
        self._memo[entity] = hit
        if len(self._memo) > self._max:
            self._memo.popitem(last=False)
        return hit


class Stream:
    """A growing token stream -- an optional shared prefix, then the stream's own tokens, turn after turn.

    Each ``request`` appends the new input tokens, makes a request whose prompt is the whole stream so far, then
    appends the output (the next turn sees it, as a chat history does). Blocks past the shared prefix's full blocks
    belong to this stream (``NS_STREAM``, its entity), including the block that straddles the boundary.
    """

    __slots__ = ("bs", "chain", "cids", "entity", "length", "space")

    def __init__(self, space: BlockSpace, entity: int, prefix: tuple[int, list[int], list[int]] | None = None):
        self.space = space
        self.bs = space.block_size
        self.entity = entity
        if prefix is None:
            self.length = 0
            self.chain: list[int] = []
            self.cids: list[int] = []
        else:
            self.length, chain, cids = prefix
            self.chain = list(chain)
            self.cids = list(cids)

    def request(self, rid: int, arrival: float, key: str, new_tokens: int, output_tokens: int, cls: str) -> SimRequest:
        self.length += new_tokens
        prompt = self.length
        need = (prompt + output_tokens) // self.bs
        have = len(self.chain)
        if need > have:
            e = self.entity
            if 0 <= e <= _MAX_ENTITY and need - 1 <= _MAX_INDEX:  # cid(NS_STREAM, e, i), checked once
                base = (NS_STREAM << (_ENTITY_BITS + _INDEX_BITS)) | (e << _INDEX_BITS)
                new_cids = [base | i for i in range(have, need)]
            else:
                new_cids = [cid(NS_STREAM, e, i) for i in range(have, need)]  # raises
            self.space.extend(self.chain, self.cids, new_cids)
        self.length += output_tokens
        r = SimRequest(rid, arrival, key, prompt, output_tokens, self.chain, self.cids, self.bs, cls)
        r.session = self.entity
        return r
