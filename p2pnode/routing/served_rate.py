"""Each peer's recent served work per second, as one ingress reads it off the peers' gossiped loads.

Why: the plan gives a whale k_b equal pieces, but what each destination serves scatters around its expected load
(each key's requests arrive at random, and a small key's all go to its one destination). ``cacheroute`` lets a
whale's split lean away from the destinations that served more than their peers lately and towards those that
served less (the whale fills the others' noise), and it needs each destination's recent work to do so. Every node
gossips its cumulative served counts with its load (``load.py``: requests, uncached prompt tokens, completion tokens,
as of ``served_at``); this keeps, per peer, an exponentially weighted rate of each over the last ``tau_s`` seconds,
bias-corrected for a short history (so a rate is usable after ``min_span_s`` of reports, not after ``tau_s``).

Invariants: a rate is None until a peer's reports span ``min_span_s``; counts or a clock that go backwards (the peer
restarted) start its history again; one entry per peer the caller keeps (``forget`` bounds it by the membership).
The rates are of work already served, as of the peer's own clock: what gossip delivered, never a guess of what it
serves since.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pnode.config import DEFAULT_SERVED_RATE_MIN_SPAN_S, DEFAULT_SERVED_RATE_TAU_S
from p2pnode.frozen import fast_init
from p2pnode.load import NodeLoad

__all__ = ["ServedRate", "ServedRates"]


@fast_init
@dataclass(frozen=True, slots=True)
class ServedRate:
    """A peer's served requests, uncached prompt tokens and completion tokens per second over its recent past."""

    requests: float
    uncached_tokens: float
    completion_tokens: float

    def work(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        """Work per second in a plan's unit (``plan/work.py``)."""
        return self.uncached_tokens * prefill_token_cost + self.completion_tokens * decode_token_cost


class _Track:
    __slots__ = ("at", "counts", "first_at", "rate", "sums", "weight")

    def __init__(self, at: float, counts: tuple[int, int, int]) -> None:
        self.at = at
        self.first_at = at
        self.counts = counts
        self.sums = (0.0, 0.0, 0.0)  # exponentially decayed counts since first_at
        self.weight = 0.0  # the seconds they span, decayed alike: sums / weight is the rate
        self.rate: ServedRate | None = None  # sums / weight once the reports span min_span_s


class ServedRates:
    """Per peer, the recent rates of its gossiped served counts (module docstring)."""

    def __init__(self, tau_s: float = DEFAULT_SERVED_RATE_TAU_S, min_span_s: float = DEFAULT_SERVED_RATE_MIN_SPAN_S):
        if not tau_s > 0 or min_span_s < 0:
            raise ValueError(f"need tau_s > 0 and min_span_s >= 0, got {tau_s}, {min_span_s}")
        self.tau_s = tau_s
        self.min_span_s = min_span_s
        self._tracks: dict[str, _Track] = {}

    def __len__(self) -> int:
        return len(self._tracks)

    def observe(self, node_id: str, load: NodeLoad) -> ServedRate | None:
        """Take a peer's load as gossip delivered it (a repeat changes nothing); its rate now, or None."""
        at = load.served_at
        track = self._tracks.get(node_id)
        # no report yet, or one already taken (the router's own load comes with every request)
        if not at > 0 or (track is not None and at == track.at):
            return track.rate if track is not None else None
        requests, uncached = load.served_requests, load.served_uncached_tokens
        completion = load.served_completion_tokens
        if track is None:
            self._tracks[node_id] = _Track(at, (requests, uncached, completion))
            return None
        p_requests, p_uncached, p_completion = track.counts
        if at < track.at or requests < p_requests or uncached < p_uncached or completion < p_completion:
            self._tracks[node_id] = _Track(at, (requests, uncached, completion))
            return None
        # Unrolled over the three counts (this runs for every peer report a router reads): the same operations in the
        # same order as one expression per count, so the rates are the same to the last bit.
        decay = math.exp(-(at - track.at) / self.tau_s)
        s_requests, s_uncached, s_completion = track.sums
        s_requests = s_requests * decay + (requests - p_requests)
        s_uncached = s_uncached * decay + (uncached - p_uncached)
        s_completion = s_completion * decay + (completion - p_completion)
        track.sums = (s_requests, s_uncached, s_completion)
        weight = track.weight = track.weight * decay + (at - track.at)  # weighted as the counts are: exact if steady
        track.at, track.counts = at, (requests, uncached, completion)
        if at - track.first_at >= self.min_span_s and weight > 0:
            track.rate = ServedRate(s_requests / weight, s_uncached / weight, s_completion / weight)
        return track.rate

    def rate(self, node_id: str) -> ServedRate | None:
        track = self._tracks.get(node_id)
        return track.rate if track is not None else None

    def retain(self, node_ids: set[str]) -> None:
        """Forget every peer not in ``node_ids``."""
        for node_id in [n for n in self._tracks if n not in node_ids]:
            self.forget(node_id)

    def forget(self, node_id: str) -> None:
        self._tracks.pop(node_id, None)
