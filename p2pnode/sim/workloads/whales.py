"""``whales``: a few very hot keys over a long tail -- the case where pure affinity overloads one node.

Four whale keys carry 25%, 15%, 10% and 5% of requests (55% together); 20,000 tail keys share the other 45% by a
Zipf(0.8) law. Every request is single-turn: the key's shared prefix (whales: 4096 tokens, an agent's tool schema
or a long document; tail keys: lognormal, median 1024) plus a unique suffix (median 256) and an answer (median 150).
Poisson arrivals. A whale's load exceeds what one node serves at high rates, so a policy must split it over
several destinations (CacheRoute's k_b > 1) or lose either its hits or its latency.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from p2pnode.config import DEFAULT_ARRIVAL_CV, DEFAULT_SIM_BLOCK_SIZE
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import (
    Limit,
    PrefixTable,
    Stream,
    cumulative,
    hashed_lognormal,
    lognormal_int,
    pick,
    zipf_weights,
)

__all__ = ["Whales"]

NAME = "whales"
WHALE_SHARES = (0.25, 0.15, 0.10, 0.05)
N_TAIL = 20_000
TAIL_ZIPF = 0.8
WHALE_PREFIX = 4096
TAIL_PREFIX_MEDIAN, TAIL_PREFIX_SIGMA = 1024, 0.5
SUFFIX_MEDIAN, SUFFIX_SIGMA = 256, 0.8
OUTPUT_MEDIAN, OUTPUT_SIGMA = 150, 0.7


def key_weights() -> list[float]:
    tail = zipf_weights(N_TAIL, TAIL_ZIPF)
    scale = (1 - sum(WHALE_SHARES)) / sum(tail)
    return list(WHALE_SHARES) + [w * scale for w in tail]


class Whales:
    #: Preferred simulation block size (``--block-size`` overrides it): 4k-token whale prefixes, ~1.3k-token tails.
    block_size = DEFAULT_SIM_BLOCK_SIZE
    name = NAME
    description = "4 whale keys with 55% of traffic over 20k tail keys; single-turn, long shared prefixes"

    def __init__(self, arrival: str = "poisson", cv: float = DEFAULT_ARRIVAL_CV) -> None:
        self.arrival = arrival
        self.cv = cv
        self._cum = cumulative(key_weights())

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{NAME} needs a request rate")
        rng = random.Random(seed)
        draw = rng.lognormvariate
        n_whales = len(WHALE_SHARES)

        def prefix_len(k: int) -> int:
            if k < n_whales:
                return WHALE_PREFIX
            return hashed_lognormal(seed, k, TAIL_PREFIX_MEDIAN, TAIL_PREFIX_SIGMA, 128, 8192)

        prefixes = PrefixTable(space, prefix_len)
        for rid, t in enumerate(arrival_times(random.Random(seed ^ 0xA5A5), qps, self.arrival, self.cv)):
            if limit.reached(t, rid):
                return
            k = pick(rng.random(), self._cum)
            stream = Stream(space, rid + 1, prefixes.get(k))
            yield stream.request(
                rid,
                t,
                f"s{seed}w{k}" if k < n_whales else f"s{seed}k{k}",
                lognormal_int(draw, SUFFIX_MEDIAN, SUFFIX_SIGMA, 8, 4096),
                lognormal_int(draw, OUTPUT_MEDIAN, OUTPUT_SIGMA, 8, 1024),
                "whale" if k < n_whales else "tail",
            )
