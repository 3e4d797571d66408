"""Arrival processes: Poisson, or a Gamma renewal process with a given coefficient of variation (bursty).

Gamma inter-arrivals with shape k = 1 / CV^2 and mean 1 / rate: CV 1 is Poisson, CV 1.9 (CacheRoute's aggregate)
clusters arrivals into bursts separated by lulls at the same mean rate.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from p2pnode.config import DEFAULT_ARRIVAL_CV

__all__ = ["ARRIVAL_PROCESSES", "arrival_times"]

ARRIVAL_PROCESSES = ("poisson", "gamma")


def arrival_times(
    rng: random.Random, rate: float, process: str = "poisson", cv: float = DEFAULT_ARRIVAL_CV
) -> Iterator[float]:
    """An endless increasing sequence of arrival times starting after 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    t = 0.0
    if process == "poisson":
        expo = rng.expovariate
        while True:
            t += expo(rate)
            yield t
    elif process == "gamma":
        if cv <= 0:
            raise ValueError(f"cv must be positive, got {cv}")
        shape = 1.0 / (cv * cv)
        scale = 1.0 / (rate * shape)
        gamma = rng.gammavariate
        while True:
            t += gamma(shape, scale)
            yield t
    else:
        raise ValueError(f"unknown arrival process {process!r}; valid: {', '.join(ARRIVAL_PROCESSES)}")
