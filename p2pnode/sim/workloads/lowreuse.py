"""``low-reuse``: unique prompts with little shared prefix -- the case where cache affinity has little to win.

CacheRoute's caveat: affinity pays only where prefixes recur; on traffic without reuse it can only cost balance.
Half of the requests (``TENANT_SHARE``) come from 64 tenants (Zipf(1.0) popularity: the top tenant sends ~21% of
the tenants' requests, ~11% of all) and carry the tenant's short system prompt (lognormal, median 384 tokens,
256..1024: one or two 256-token blocks) and the tenant as their client routing key. The other half carry no
shared prefix and no client key (routers derive one from the leading blocks, which are the request's own). Every
request then has a unique body (lognormal, median 2048 tokens) and an answer (lognormal, median 200).
Single-turn, Poisson (or Gamma) arrivals.

The reusable part is therefore at most the tenants' full prefix blocks: ~7% of prompt tokens (a tenant prompt
has 1.6 full blocks of 256 tokens on average, behind a body of ~2.4k tokens, in half of the requests).
A policy that follows the key sends a hot tenant's whole traffic (a tenth of the mesh's) to one node for that
small gain.
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

__all__ = ["LowReuse"]

NAME = "low-reuse"
#: Share of requests that carry a tenant's system prompt and key (the rest share nothing).
TENANT_SHARE = 0.5
N_TENANTS = 64
TENANT_ZIPF = 1.0
TENANT_PREFIX_MEDIAN, TENANT_PREFIX_SIGMA, TENANT_PREFIX_RANGE = 384, 0.4, (256, 1024)
BODY_MEDIAN, BODY_SIGMA, BODY_RANGE = 2048, 0.6, (64, 16_384)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 200, 0.7, (8, 2048)


def tenant_weights() -> list[float]:
    return zipf_weights(N_TENANTS, TENANT_ZIPF)


class LowReuse:
    #: Preferred simulation block size (as the other synthetic workloads; prompts of ~2-3k tokens).
    block_size = DEFAULT_SIM_BLOCK_SIZE
    name = NAME
    description = "unique prompts; half behind a short tenant prompt (64 tenants, Zipf 1.0), half sharing nothing"

    def __init__(self, arrival: str = "poisson", cv: float = DEFAULT_ARRIVAL_CV) -> None:
        self.arrival = arrival
        self.cv = cv
        self._cum = cumulative(tenant_weights())

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{NAME} needs a request rate")
        rng = random.Random(seed)
        draw = rng.lognormvariate
        lo, hi = TENANT_PREFIX_RANGE
        prefixes = PrefixTable(
            space, lambda k: hashed_lognormal(seed, k, TENANT_PREFIX_MEDIAN, TENANT_PREFIX_SIGMA, lo, hi)
        )
        for rid, t in enumerate(arrival_times(random.Random(seed ^ 0x10E5), qps, self.arrival, self.cv)):
            if limit.reached(t, rid):
                return
            if rng.random() < TENANT_SHARE:
                k = pick(rng.random(), self._cum)
                stream, key, cls = Stream(space, rid + 1, prefixes.get(k)), f"s{seed}t{k}", "tenant"
            else:
                stream, key, cls = Stream(space, rid + 1), "", "unique"
            yield stream.request(
                rid,
                t,
                key,
                lognormal_int(draw, BODY_MEDIAN, BODY_SIGMA, *BODY_RANGE),
                lognormal_int(draw, OUTPUT_MEDIAN, OUTPUT_SIGMA, *OUTPUT_RANGE),
                cls,
            )
