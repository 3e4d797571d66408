"""Per-key request rates: a bounded, time-decayed heavy-hitter sketch per node, and what a node publishes of it.

Why a sketch: the planner only needs the hot keys (the top-K warm set, default 128) and their rates, but a node
sees an unbounded key space (every conversation, every tenant). Each node therefore counts arrivals per routing
key in a **Space-Saving** summary (Metwally, Agrawal, El Abbadi, "Efficient Computation of Frequent and Top-k
Elements in Data Streams", ICDT 2005) with **forward exponential decay** (Cormode, Shkapenyuk, Srivastava, Xu,
"Forward Decay: A Practical Time Decay Model for Streaming Systems", ICDE 2009).

Space-Saving rather than a decayed count-min sketch + top-k heap, because:
- it keeps *exactly* ``capacity`` counters and nothing else (no width x depth hash table beside the heap);
- it is deterministic (no hash seeds): the same stream gives the same summary on every node and in tests;
- its error is one-sided and reported per key: a monitored key's count overestimates the truth by at most its
  ``error`` (the count it inherited when it took over a slot), which is at most N / capacity (N the total decayed
  weight); and every key whose true count exceeds N / capacity is monitored. Count-min + heap gives an additive
  error too, but misses keys that were evicted from the heap while their sketch cells still grew;
- with forward decay every count is divided by the same factor as time passes, so the order of counts (and hence
  the min-replacement rule) is unaffected by decay: the classic algorithm runs unchanged on decayed weights.

Forward decay: an arrival at time t adds ``exp(lam * (t - landmark))`` to its key (``lam = ln 2 / half_life``);
reading at ``now`` multiplies by ``exp(-lam * (now - landmark))``. When the exponent grows past
``RENORMALIZE_EXPONENT`` every stored value is rescaled and the landmark moves to now (no overflow, no loss).

Rate: a decayed count C of a Poisson stream of rate r observed for T seconds has mean ``r (1 - e^(-lam T)) / lam``,
so ``rate = lam C / (1 - e^(-lam T))`` -- unbiased from the first second instead of ramping up over several
half-lives. T is at least ``min_window_s`` so that the first request does not read as a huge rate.

Work: besides requests the sketch keeps, per monitored key, decayed sums of the uncached prompt tokens
(``prompt - cached``) and of the decode tokens of the requests it actually saw (not the inherited count), so
``KeyRate.uncached_tokens`` / ``decode_tokens`` are true per-request averages; and the same totals over *all*
requests, so the planner knows the whole node's load, not just its top keys'. A node counts each request when it has
been served, with what its engine reported (``work.py``: the cached tokens the engine found, the tokens it
generated), not when it routes it with the router's estimate and ``max_tokens``.

Resident work: per key the sketch also keeps the same sums over the requests that found part of their prompt cached
(*hits*), and the cached tokens of those: ``KeyRate.hit_rate``, ``hit_uncached_tokens`` (the prefill of a request
while the key's prefix is resident where it is served) and ``prefix_tokens`` (what a destination builds once when it
first serves the key). A warm key stays on its destinations, so its misses are transients -- its first requests
anywhere, a destination the plan moved it to -- and a key's average over all its requests carries them for a few
half-lives: on a live mesh the small keys' first-minute misses made the plan weigh a key with half the traffic at
~18-36x a small key's load while it carried 50x their requests (docs/plan.md, "Work"). The planner weighs a warm key by
its resident work and counts each new destination's prefix once (``planner.py``).

Invariants: at most ``capacity`` keys are monitored; the lazy min-heap holds at most ``2 * capacity +
HEAP_SLACK`` entries; time never runs backwards (an earlier ``now`` is treated as the latest one seen).
Not thread-safe: one event loop calls ``observe`` (the ingress) and ``summary`` (the gossip round).

Wire format of a published ``RateSummary`` (the value of gossip key ``RATES_KEY``; msgpack, no maps, floats as
float32 -- rates need no more than 7 digits):

    [2, total_rate, total_uncached_tps, total_decode_tps,
     [key, rate, error, uncached_tokens, decode_tokens, hit_rate, hit_uncached_tokens, prefix_tokens, key, ...]]

Version 1 (five fields per key, no hits) is still read: its keys have no resident figures.

``encode_summary`` drops the lowest-rate keys until the bytes fit ``max_bytes``; ``decode_summary`` validates
everything (types, finite non-negative numbers, key lengths, counts, byte size) and raises ``MalformedRates``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from p2pnode.config import (
    DEFAULT_HALF_LIFE_S,
    DEFAULT_MAX_RATES_BYTES,
    DEFAULT_MIN_WINDOW_S,
    DEFAULT_PUBLISH_TOP,
    DEFAULT_SKETCH_CAPACITY,
    MAX_ROUTING_KEY_CHARS,
)

__all__ = [
    "DEFAULT_HALF_LIFE_S",
    "DEFAULT_MAX_RATES_BYTES",
    "DEFAULT_MIN_WINDOW_S",
    "DEFAULT_PUBLISH_TOP",
    "DEFAULT_SKETCH_CAPACITY",
    "RATES_KEY",
    "RATES_PREFIX",
    "KeyRate",
    "MalformedRates",
    "RateSketch",
    "RateSummary",
    "decode_summary",
    "encode_summary",
    "merge_summaries",
    "summary_from_counts",
]

#: Prefix of the rate plan's gossip keys (its rate summaries and the plan itself).
RATES_PREFIX = "rates/"
#: The gossip key a node publishes its summary under.
RATES_KEY = f"{RATES_PREFIX}top"
#: Longest routing key accepted on the wire: the API's own bound (a longer one never reaches a router).
MAX_KEY_CHARS = MAX_ROUTING_KEY_CHARS
#: Most keys a decoded summary may hold (bounds the work a malicious or misconfigured peer can cause).
MAX_SUMMARY_KEYS = 4096
#: Exponent of the forward-decay weight beyond which all stored values are rescaled (e^40 ~ 2e17: far from float
#: overflow, and float64 keeps 15 digits of every count relative to the newest weight).
RENORMALIZE_EXPONENT = 40.0
#: Extra stale entries the lazy heap may hold beyond ``2 * capacity`` before it is rebuilt.
HEAP_SLACK = 64
_WIRE_VERSION = 2
#: Fields per key on the wire, by version.
_FIELDS = {1: 5, 2: 8}


class MalformedRates(ValueError):
    """The bytes are not a valid published rate summary."""


@dataclass(frozen=True, slots=True)
class KeyRate:
    """One key's arrival rate and average work per request, as one node (or the merge of several) saw it."""

    key: str
    rate: float  # requests/s (estimate; Space-Saving never underestimates a monitored key's decayed count)
    #: requests/s: the estimate exceeds the truth by at most this much -- Space-Saving's inherited count, plus one
    #: arrival's worth: a key seen once is no evidence of a rate, so ``rate - error`` (what the planner admits on)
    #: needs at least two arrivals to be above 0 (a lone request in the first seconds reads as 0.2 req/s otherwise).
    error: float
    uncached_tokens: float  # mean prompt tokens per request the engine did not find cached (prompt - cached)
    decode_tokens: float  # mean tokens generated per request
    hit_rate: float = 0.0  # requests/s that found part of their prompt cached (a subset of ``rate``'s)
    hit_uncached_tokens: float = 0.0  # mean uncached prompt tokens of those
    prefix_tokens: float = 0.0  # mean cached tokens of those: what a destination builds once for the key

    def work(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        """Work of one request in prefill-token units, averaged over all of them (misses included)."""
        return self.uncached_tokens * prefill_token_cost + self.decode_tokens * decode_token_cost

    def resident_work(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        """Work of one request while the key's prefix is resident where it is served (its hits), or ``work`` for
        a key that never hit (nothing of it is reused)."""
        if not self.hit_rate > 0:
            return self.work(prefill_token_cost, decode_token_cost)
        return self.hit_uncached_tokens * prefill_token_cost + self.decode_tokens * decode_token_cost


@dataclass(frozen=True, slots=True)
class RateSummary:
    """What one node publishes (or the merge of several): its top keys plus totals over *all* its arrivals.

    ``keys`` is ordered by rate, descending, ties by key; the totals let the planner size one destination's
    share (q_cap) from the whole mesh's load, not just the warm keys'.
    """

    keys: tuple[KeyRate, ...]
    total_rate: float  # requests/s over every key
    total_uncached_tps: float  # uncached prompt tokens/s over every key
    total_decode_tps: float  # decode tokens/s over every key

    def total_work(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        """Total load in prefill-token units per second."""
        return self.total_uncached_tps * prefill_token_cost + self.total_decode_tps * decode_token_cost



class RateSketch:
    """Space-Saving over forward-decayed weights, with per-key work sums. See the module docstring."""

    __slots__ = (
        "_entries",
        "_heap",
        "_lam",
        "_landmark",
        "_last",
        "_start",
        "_tot_decode",
        "_tot_uncached",
        "_tot_weight",
        "capacity",
        "half_life_s",
        "min_window_s",
    )

    def __init__(
        self,
        capacity: int = DEFAULT_SKETCH_CAPACITY,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        *,
        min_window_s: float = DEFAULT_MIN_WINDOW_S,
        start: float | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.capacity = capacity
        self.half_life_s = half_life_s
        self.min_window_s = max(min_window_s, 1e-9)
        self._lam = math.log(2.0) / half_life_s
        self._start = start  # time of the first observation (or as given): T of the rate estimate
        self._landmark = 0.0 if start is None else start
        self._last = self._landmark
        # key -> [count, error, own weight, uncached sum, decode sum, hit weight, hit uncached sum, hit cached sum],
        # all in forward-decay (landmark) units
        self._entries: dict[str, list[float]] = {}
        self._heap: list[tuple[float, str]] = []  # (count, key); stale when the key's count moved on
        self._tot_weight = 0.0
        self._tot_uncached = 0.0
        self._tot_decode = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    # --- time ------------------------------------------------------------------------------------------------

    def _advance(self, now: float) -> float:
        """Clamp ``now`` to be monotonic, start the clock, rescale if needed; returns the effective now."""
        if self._start is None:
            self._start = self._landmark = self._last = now
        now = max(now, self._last)
        self._last = now
        if self._lam * (now - self._landmark) > RENORMALIZE_EXPONENT:
            self._rescale(math.exp(-self._lam * (now - self._landmark)))
            self._landmark = now
        return now

    def _rescale(self, f: float) -> None:
        for e in self._entries.values():
            e[0] *= f
            e[1] *= f
            e[2] *= f
            e[3] *= f
            e[4] *= f
            e[5] *= f
            e[6] *= f
            e[7] *= f
        self._tot_weight *= f
        self._tot_uncached *= f
        self._tot_decode *= f
        self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(e[0], k) for k, e in self._entries.items()]
        heapq.heapify(self._heap)

    def _to_rate(self, now: float) -> float:
        """Factor turning a stored (landmark-unit) count into requests/s at ``now``."""
        start = self._start if self._start is not None else now
        window = max(now - start, self.min_window_s)
        return self._lam * math.exp(-self._lam * (now - self._landmark)) / -math.expm1(-self._lam * window)

    # --- counting ----------------------------------------------------------------------------------------------

    def observe(self, key: str, now: float, prompt_tokens: int, cached_tokens: int, decode_tokens: int) -> None:
        """Count one request of ``key`` at ``now`` (seconds, any monotonic clock) and its work.

        A node passes what the engine reported when the request was served (``work.ServedWork``): its cached
        tokens -- the uncached part (``prompt_tokens - cached_tokens``, at least 0) is the prefill it cost -- and
        the tokens it generated.
        """
        now = self._advance(now)
        w = math.exp(self._lam * (now - self._landmark))
        uncached = max(prompt_tokens - cached_tokens, 0) * w
        decode = max(decode_tokens, 0) * w
        hit = cached_tokens > 0
        self._tot_weight += w
        self._tot_uncached += uncached
        self._tot_decode += decode
        e = self._entries.get(key)
        if e is None:
            if len(self._entries) < self.capacity:
                e = [0.0] * 8
            else:  # Space-Saving: take over the smallest counter, inheriting its count as this key's error
                floor = self._pop_min()
                e = [floor, floor, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
            self._entries[key] = e
        e[0] += w
        e[2] += w
        e[3] += uncached
        e[4] += decode
        if hit:
            e[5] += w
            e[6] += uncached
            e[7] += min(cached_tokens, prompt_tokens) * w
        heapq.heappush(self._heap, (e[0], key))
        if len(self._heap) > 2 * self.capacity + HEAP_SLACK:
            self._rebuild_heap()

    def _pop_min(self) -> float:
        """Remove the key with the smallest count (ties: smallest key) and return its count."""
        entries, heap = self._entries, self._heap
        while True:
            count, key = heapq.heappop(heap)
            e = entries.get(key)
            if e is not None and e[0] == count:
                del entries[key]
                return count

    # --- reading -----------------------------------------------------------------------------------------------

    def top(self, k: int, now: float) -> list[KeyRate]:
        """The ``k`` keys of highest rate at ``now``, by rate descending, ties by key."""
        now = self._advance(now)
        if k <= 0 or not self._entries:
            return []
        f = self._to_rate(now)
        one = f * math.exp(self._lam * (now - self._landmark))  # the rate one arrival at ``now`` reads as
        best = heapq.nsmallest(k, self._entries.items(), key=lambda kv: (-kv[1][0], kv[0]))
        out = []
        for key, (count, err, own, unc, dec, hits, hit_unc, hit_cached) in best:
            rate = count * f
            out.append(
                KeyRate(
                    key=key,
                    rate=rate,
                    error=err * f + one,
                    uncached_tokens=unc / own if own > 0 else 0.0,
                    decode_tokens=dec / own if own > 0 else 0.0,
                    hit_rate=min(rate, rate * hits / own) if own > 0 else 0.0,  # its share of hits, over its rate
                    hit_uncached_tokens=hit_unc / hits if hits > 0 else 0.0,
                    prefix_tokens=hit_cached / hits if hits > 0 else 0.0,
                )
            )
        return out

    def rate(self, key: str, now: float) -> float:
        """One key's estimated rate (0 when not monitored)."""
        now = self._advance(now)
        e = self._entries.get(key)
        return 0.0 if e is None else e[0] * self._to_rate(now)

    def summary(self, now: float, k: int = DEFAULT_PUBLISH_TOP) -> RateSummary:
        """What this node publishes: its top ``k`` keys and the totals over all its arrivals."""
        keys = tuple(self.top(k, now))
        f = self._to_rate(self._last)
        return RateSummary(keys, self._tot_weight * f, self._tot_uncached * f, self._tot_decode * f)


# --- merging ------------------------------------------------------------------------------------------------


def merge_summaries(summaries: Iterable[RateSummary], top: int | None = None) -> RateSummary:
    """Sum several nodes' summaries: rates and errors add; work averages are rate-weighted. The merged keys are
    ordered by rate descending, ties by key; with ``top`` only the ``top`` highest are kept (the planner needs no
    more, and skips combining the tail's work averages).

    Order-independent to the last bit (``math.fsum`` is correctly rounded), so every node merging the same
    summaries in any order gets the same numbers, and hence the same plan. A key missing from some node's top
    is counted as 0 there: the merged rate of a tail key is an underestimate by at most the rate of the
    smallest key that node published.
    """
    parts: dict[str, list[KeyRate]] = {}
    tot: list[list[float]] = [[], [], []]
    for s in summaries:
        tot[0].append(s.total_rate)
        tot[1].append(s.total_uncached_tps)
        tot[2].append(s.total_decode_tps)
        for kr in s.keys:
            lst = parts.get(kr.key)
            if lst is None:
                parts[kr.key] = [kr]
            else:
                lst.append(kr)
    fsum = math.fsum
    rate = {key: krs[0].rate if len(krs) == 1 else fsum([k.rate for k in krs]) for key, krs in parts.items()}
    order = lambda key: (-rate[key], key)  # noqa: E731
    keys = sorted(rate, key=order) if top is None else heapq.nsmallest(top, rate, key=order)
    merged = []
    for key in keys:
        krs = parts[key]
        if len(krs) == 1:  # one contributor: the merge is the contribution itself
            merged.append(krs[0])
            continue
        r = rate[key]
        if r > 0:
            unc = fsum([k.rate * k.uncached_tokens for k in krs]) / r
            dec = fsum([k.rate * k.decode_tokens for k in krs]) / r
        else:
            unc = fsum([k.uncached_tokens for k in krs]) / len(krs)
            dec = fsum([k.decode_tokens for k in krs]) / len(krs)
        hits = fsum([k.hit_rate for k in krs])
        hit_unc = fsum([k.hit_rate * k.hit_uncached_tokens for k in krs]) / hits if hits > 0 else 0.0
        prefix = fsum([k.hit_rate * k.prefix_tokens for k in krs]) / hits if hits > 0 else 0.0
        merged.append(KeyRate(key, r, fsum([k.error for k in krs]), unc, dec, hits, hit_unc, prefix))
    return RateSummary(tuple(merged), fsum(tot[0]), fsum(tot[1]), fsum(tot[2]))


def summary_from_counts(counts: Iterable[tuple[str, int, float, float]], window_s: float) -> RateSummary:
    """A summary from exact per-key counts over a window: ``(key, requests, uncached tokens, decode tokens)``, the
    token numbers summed over the window's requests.

    For the simulator and tests, where exact counts exist (no sketch, no decay, error 0); a node publishes
    ``RateSketch.summary`` instead. Keys without requests are skipped; totals cover every key given.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    keys, tot = [], [0.0, 0.0, 0.0]
    for key, n, unc, dec in counts:
        tot[0] += n
        tot[1] += unc
        tot[2] += dec
        if n > 0:
            keys.append(KeyRate(key, n / window_s, 0.0, unc / n, dec / n))
    keys.sort(key=lambda k: (-k.rate, k.key))
    return RateSummary(tuple(keys), tot[0] / window_s, tot[1] / window_s, tot[2] / window_s)


# --- wire ---------------------------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, use_single_float=True)


def encode_summary(summary: RateSummary, max_bytes: int = DEFAULT_MAX_RATES_BYTES) -> bytes:
    """The summary as bytes of at most ``max_bytes``; the lowest-rate keys are dropped until it fits.

    Keys longer than ``MAX_KEY_CHARS`` are skipped (the API refuses them anyway). ValueError if even the empty
    summary does not fit.
    """
    keys = sorted((k for k in summary.keys if 0 < len(k.key) <= MAX_KEY_CHARS), key=lambda k: (-k.rate, k.key))
    keys = keys[:MAX_SUMMARY_KEYS]
    head = [_WIRE_VERSION, summary.total_rate, summary.total_uncached_tps, summary.total_decode_tps]
    items = [
        [k.key, k.rate, k.error, round(k.uncached_tokens), round(k.decode_tokens), k.hit_rate,
         round(k.hit_uncached_tokens), round(k.prefix_tokens)]
        for k in keys
    ]  # fmt: skip
    base = len(_pack([*head, []]))
    if base > max_bytes:
        raise ValueError(f"max_bytes={max_bytes} cannot hold an empty rate summary ({base} bytes)")
    # Each item's flattened fields cost exactly their packed size; the array header grows by at most 4 bytes.
    sizes = [len(_pack(it)) - 1 for it in items]
    room, n = max_bytes - base - 4, 0
    while n < len(items) and sizes[n] <= room:
        room -= sizes[n]
        n += 1
    flat = [x for it in items[:n] for x in it]
    data = _pack([*head, flat])
    assert len(data) <= max_bytes, (len(data), max_bytes)
    return data


#: The largest rate or token figure a summary may carry (an honest one is below ~1e8): past it the planner's sums and
#: quotients overflow to inf and NaN (a summary of 1e308 requests a second stopped every planner's plans for good).
MAX_FIGURE = 1e12


def _finite(x: Any, what: str) -> float:
    if type(x) not in (float, int) or not 0 <= x <= MAX_FIGURE:  # NaN fails both comparisons
        raise MalformedRates(f"{what} must be a number in [0, {MAX_FIGURE:g}]")
    return float(x)


def decode_summary(data: bytes, max_bytes: int = DEFAULT_MAX_RATES_BYTES) -> RateSummary:
    """Parse and validate a published summary; MalformedRates for anything else (nothing else escapes)."""
    if len(data) > max_bytes:
        raise MalformedRates(f"rate summary of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            max_str_len=MAX_KEY_CHARS * 4,
            max_bin_len=0,
            max_array_len=MAX_SUMMARY_KEYS * max(_FIELDS.values()),
            max_map_len=0,
            max_ext_len=0,
        )
        if type(obj) is not list or len(obj) != 5 or type(obj[0]) is not int or obj[0] not in _FIELDS:
            raise MalformedRates("not a p2pnode rate summary (version 1 or 2)")
        fields = _FIELDS[obj[0]]
        flat = obj[4]
        if type(flat) is not list or len(flat) % fields:
            raise MalformedRates(f"keys must be tuples of {fields} fields (key, rate, error, uncached, decode, ...)")
        keys = []
        seen: set[str] = set()
        for i in range(0, len(flat), fields):
            key, *numbers = flat[i : i + fields]
            if type(key) is not str or not 0 < len(key) <= MAX_KEY_CHARS or key in seen:
                raise MalformedRates("key must be a unique non-empty string of at most 256 characters")
            seen.add(key)
            names = ("rate", "error", "uncached", "decode", "hit_rate", "hit_uncached", "prefix")
            rate, err, unc, dec, *resident = (_finite(x, name) for x, name in zip(numbers, names, strict=False))
            if resident and resident[0] > rate * (1 + 1e-6):
                raise MalformedRates("hit_rate must not exceed rate")
            keys.append(KeyRate(key, rate, err, unc, dec, *resident))
        return RateSummary(
            tuple(keys), _finite(obj[1], "total_rate"), _finite(obj[2], "total_uncached_tps"),
            _finite(obj[3], "total_decode_tps"),
        )
    except MalformedRates:
        raise
    except Exception as exc:  # msgpack's error types, wrong arity, ...
        raise MalformedRates(f"undecodable rate summary: {type(exc).__name__}") from None

