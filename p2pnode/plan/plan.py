"""The shared rate plan: which destinations serve each warm key, numbered by epoch, and how it travels.

A ``Plan`` is built by one planner (``planner.py``) and spread by gossip under ``PLAN_KEY``; every router uses the
newest plan it holds. "Newest" is the total order ``(epoch, planner_id)`` (``newer``): a planner numbers its plan
one above the newest it has seen, so after a failover the new planner's plans supersede the old one's, and two
planners that briefly coexist (membership views differ for a gossip round or two) still agree on which of their
plans wins. A plan is never replaced by an older one, and a plan keeps working after its planner dies, until a
newer one arrives: it is only advice, a dead destination is skipped by the policy.

Invariants of a Plan (checked at construction and on decode):
- ``assignments`` and ``key_load`` have the same keys; every key has >= 1 destination, all distinct;
- every assigned destination has an entry in ``dest_load``; loads are finite and >= 0;
- every hold is of a warm key, with 1 <= kb <= its destinations;
- the encoded form is at most ``DEFAULT_MAX_PLAN_BYTES`` when built by the planner (it trims the warm set).

The shadow gate's verdict travels in the plan (``verdict``: the replay's numbers and reason), so that every node
shows the verdict of the plan in force, and a new planner -- whose own gate has no evidence yet -- carries the
previous plan's verdict (and its affinity) forward until its own replay decides.

Loads are in the plan's own work unit (``work.py``): ``prefill_token_cost`` per uncached prompt token and
``decode_token_cost`` per generated token, from its planner's cost profile; the plan carries both, so that what the
destinations serve is scored in the same unit (``served.py``).

A warm key that needed k_b >= 2 destinations carries a *hold* (``KbHold``: that k_b, when it last needed it, its rate
then): the planner gives it no fewer for ``PlanConfig.kb_hold_s`` while its rate holds (``planner.py``, step 4). It
travels in the plan, so a new planner keeps it.

What one period serves is a sample: requests arrive at random and a key's requests all go where the plan put them,
so over a short period the destinations' loads scatter around the expected ones. The plan carries, per destination,
the variance rate of its load (``dest_var``: each piece's Poisson arrivals and each prefix build's chance of
happening) and the work of one cold request, so that ``period_imbalance(seconds)`` predicts the max/mean one period
of that length serves -- the figure a period's served max/mean is compared with (``served.py``).

Wire format (msgpack arrays, no maps; floats are float64 so a decoded plan equals the encoded one):

    [3, epoch, planner_id, created_at, period_s, q_cap, total_load, affinity, [node_id, ...], [dest_load, ...],
     [key, key_load, [node index, ...], hold, key, key_load, [...], hold, ...], verdict,
     prefill_token_cost, decode_token_cost, [dest_var, ...], cold_request_work]

with ``hold`` nil or ``[kb, since, rate]`` and ``verdict`` nil or ``[enabled, reason, requests, destinations,
plan_kv_hit, flat_kv_hit, plan_p99_ttft_s, flat_p99_ttft_s, at]``. Versions 1 (no verdict) and 2 (no holds, no
costs: the defaults') are still read.

Node ids are listed once (sorted) and referenced by index, so a key with k_b destinations costs a few bytes each.

Churn (``churn``): CacheRoute's replan table reports, between consecutive plans, *cache churn* = 1 - Jaccard of
the two sets of (key, destination) pairs -- the share of pinned prefixes that must be (re)built somewhere -- and
*count churn* = the fraction of keys present in both plans whose number of destinations k_b changed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgpack

from p2pnode.config import DEFAULT_DECODE_TOKEN_COST, DEFAULT_MAX_PLAN_BYTES, DEFAULT_PREFILL_TOKEN_COST

__all__ = [
    "DEFAULT_MAX_PLAN_BYTES",
    "PLAN_KEY",
    "KbHold",
    "MalformedPlan",
    "Plan",
    "PlanChurn",
    "churn",
    "decode_plan",
    "encode_plan",
    "newer",
    "newest",
]

#: The gossip key the planner publishes the plan under (the newest epoch wins on every reader).
PLAN_KEY = "plan"
#: Bounds a decoder enforces (far above what the planner builds; they cap the work a bad peer can cause).
MAX_PLAN_KEYS = 4096
MAX_PLAN_NODES = 4096
MAX_ID_CHARS = 256
MAX_REASON_CHARS = 512
_WIRE_VERSION = 3
#: Elements of a plan on the wire, by version.
_WIRE_LENGTHS = {1: 11, 2: 12, 3: 16}
#: Draws of the Monte Carlo estimate of ``Plan.period_imbalance`` (a fixed seed: every node gets the same figure).
PERIOD_IMBALANCE_DRAWS = 256
_U64 = 1 << 64


class MalformedPlan(ValueError):
    """The bytes (or the fields) are not a valid plan."""


def _check_load(x: Any, what: str) -> float:
    if type(x) not in (float, int) or not math.isfinite(x) or x < 0:
        raise MalformedPlan(f"{what} must be a finite non-negative number, got {x!r}")
    return float(x)


@dataclass(frozen=True)
class GateReport:
    """One shadow replay's verdict and the numbers behind it (``gate.py``); a plan carries the one it follows."""

    enabled: bool
    reason: str
    requests: int
    destinations: int
    plan_kv_hit: float = 0.0
    flat_kv_hit: float = 0.0
    plan_p99_ttft_s: float = 0.0
    flat_p99_ttft_s: float = 0.0
    at: float = 0.0  # the planner's wall clock when the replay finished


@dataclass(frozen=True, slots=True)
class KbHold:
    """A key needed ``kb`` destinations at ``since`` (the planner's clock), at ``rate`` requests/s: until
    ``kb_hold_s`` later, no plan gives it fewer while its rate stays within the hysteresis of ``rate``."""

    kb: int
    since: float
    rate: float


@dataclass(frozen=True, slots=True)
class Plan:
    """One epoch of the shared rate plan. Immutable; mappings are read-only views of private copies."""

    epoch: int
    planner_id: str
    created_at: float  # the planner's clock when built (wall time in a node, sim time in the simulator)
    period_s: float  # the planner's replan period: a reader may treat a plan older than a few periods as stale
    assignments: Mapping[str, tuple[str, ...]]  # warm key -> its k_b destinations, in placement order
    key_load: Mapping[str, float]  # warm key -> expected load (prefill-token units per second)
    #: destination -> expected warm load placed on it, with the prefixes it builds for keys new to it (every
    #: destination considered)
    dest_load: Mapping[str, float]
    q_cap: float = 0.0  # one destination's share: keys above it got k_b > 1
    total_load: float = 0.0  # expected load of ALL traffic (warm and cold) the plan was sized for
    #: The shadow-replay gate's verdict: False tells every router to ignore the assignments (route every key by
    #: the fallback) while the plan still carries the numbers ``p2pnode status`` shows. True until a gate says no.
    affinity: bool = True
    #: The gate verdict ``affinity`` follows (None: no gate, or none yet).
    verdict: GateReport | None = None
    #: The work unit of every load above (``work.py``): cost of one uncached prompt token and of one generated token.
    prefill_token_cost: float = DEFAULT_PREFILL_TOKEN_COST
    decode_token_cost: float = DEFAULT_DECODE_TOKEN_COST
    #: warm key -> the k_b it is held at (keys that needed k_b >= 2 within ``kb_hold_s``).
    holds: Mapping[str, KbHold] = field(default_factory=dict)
    #: destination -> variance of its warm load per second (load units^2 / s; absent: 0).
    dest_var: Mapping[str, float] = field(default_factory=dict)
    #: Work of one cold request (its variance share: cold requests are Poisson too).
    cold_request_work: float = 0.0
    _pairs: frozenset[tuple[str, str]] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.epoch) is not int or not 0 <= self.epoch < _U64:
            raise MalformedPlan(f"epoch must be an unsigned 64-bit integer, got {self.epoch!r}")
        if type(self.planner_id) is not str or not 0 < len(self.planner_id) <= MAX_ID_CHARS:
            raise MalformedPlan("planner_id must be a non-empty string of at most 256 characters")
        assignments = {k: tuple(v) for k, v in self.assignments.items()}
        key_load = {k: _check_load(v, f"load of {k!r}") for k, v in self.key_load.items()}
        dest_load = {d: _check_load(v, f"load of destination {d!r}") for d, v in self.dest_load.items()}
        if assignments.keys() != key_load.keys():
            raise MalformedPlan("assignments and key_load must have the same keys")
        for key, dests in assignments.items():
            if not dests or len(set(dests)) != len(dests):
                raise MalformedPlan(f"key {key!r} needs >= 1 distinct destinations, got {dests!r}")
            missing = [d for d in dests if d not in dest_load]
            if missing:
                raise MalformedPlan(f"destinations {missing!r} of {key!r} have no dest_load entry")
        if type(self.affinity) is not bool:
            raise MalformedPlan("affinity must be a boolean")
        _check_load(self.q_cap, "q_cap")
        _check_load(self.total_load, "total_load")
        _check_load(self.prefill_token_cost, "prefill_token_cost")
        _check_load(self.decode_token_cost, "decode_token_cost")
        holds = dict(self.holds)
        dest_var = {d: _check_load(v, f"variance of destination {d!r}") for d, v in self.dest_var.items()}
        if not dest_var.keys() <= dest_load.keys():
            raise MalformedPlan("dest_var names a destination without a dest_load entry")
        _check_load(self.cold_request_work, "cold_request_work")
        for key, hold in holds.items():
            if key not in assignments:
                raise MalformedPlan(f"hold of {key!r}, which is not warm")
            if type(hold.kb) is not int or not 1 <= hold.kb <= len(assignments[key]):
                raise MalformedPlan(f"hold of {key!r}: kb must be an integer in 1..its destinations, got {hold.kb!r}")
            if type(hold.since) is not float or not math.isfinite(hold.since):
                raise MalformedPlan(f"hold of {key!r}: since must be a finite float")
            _check_load(hold.rate, f"hold rate of {key!r}")
        object.__setattr__(self, "assignments", MappingProxyType(assignments))
        object.__setattr__(self, "key_load", MappingProxyType(key_load))
        object.__setattr__(self, "dest_load", MappingProxyType(dest_load))
        object.__setattr__(self, "holds", MappingProxyType(holds))
        object.__setattr__(self, "dest_var", MappingProxyType(dest_var))
        object.__setattr__(self, "_pairs", frozenset((k, d) for k, ds in assignments.items() for d in ds))

    def __contains__(self, key: object) -> bool:
        return key in self.assignments

    def destinations(self, key: str) -> tuple[str, ...]:
        """The key's destinations; empty when the key is not warm."""
        return self.assignments.get(key, ())

    def kb(self, key: str) -> int:
        """How many destinations the key has (0 when not warm)."""
        return len(self.assignments.get(key, ()))

    @property
    def pairs(self) -> frozenset[tuple[str, str]]:
        """Every (key, destination) assignment: what cache churn compares."""
        return self._pairs

    def warm_imbalance(self) -> float:
        """max / mean of the warm load per destination (1.0 when perfectly balanced or empty)."""
        loads = list(self.dest_load.values())
        mean = math.fsum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean > 0 else 1.0

    def expected_loads(self) -> dict[str, float]:
        """Expected *total* load per destination: its warm pieces, plus cold traffic filling the valleys.

        Cold keys follow a load-balancing fallback, so their load (``total_load`` minus the warm load) is
        water-filled onto the least-loaded destinations. What the destinations serve while the plan is in force is
        scored against this (``served.py``).
        """
        loads = sorted(self.dest_load.values())
        n = len(loads)
        if not n:
            return {}
        warm = math.fsum(loads)
        cold, level = max(self.total_load, warm) - warm, loads[0]
        for i in range(n):  # raise the lowest i+1 destinations to the next level while cold load remains
            nxt = loads[i + 1] if i + 1 < n else math.inf
            room = (nxt - loads[i]) * (i + 1) if nxt < math.inf else math.inf
            if cold <= room:
                level = loads[i] + cold / (i + 1)
                break
            cold -= room
        return {d: max(load, level) for d, load in self.dest_load.items()}

    def period_imbalance(self, seconds: float) -> float:
        """Expected max / mean of the load the destinations serve over one period of ``seconds``: each one's load
        is its expected load plus a normal deviation of its variance (warm pieces', and its cold share's as
        Poisson requests of ``cold_request_work``), averaged over ``PERIOD_IMBALANCE_DRAWS`` draws of a fixed seed.
        Above ``imbalance()``, and tends to it as the period grows."""
        expected = self.expected_loads()
        if not expected or not seconds > 0:
            return self.imbalance()
        means, sds = [], []
        for d in sorted(expected):
            cold = expected[d] - self.dest_load[d]
            means.append(expected[d] * seconds)
            sds.append(math.sqrt(max(self.dest_var.get(d, 0.0) + cold * self.cold_request_work, 0.0) * seconds))
        total = math.fsum(means)
        if not total > 0:
            return 1.0
        rng = random.Random(0)
        ratios = []
        for _ in range(PERIOD_IMBALANCE_DRAWS):
            draw = [max(m + sd * rng.gauss(0.0, 1.0), 0.0) for m, sd in zip(means, sds, strict=True)]
            s = math.fsum(draw)
            ratios.append(max(draw) / (s / len(draw)) if s > 0 else 1.0)
        return math.fsum(ratios) / len(ratios)

    def imbalance(self) -> float:
        """Expected max / mean of *total* load per destination (``expected_loads``): what the plan leaves to
        chance. Equals ``warm_imbalance`` when the warm set carries all the traffic."""
        expected = self.expected_loads()
        total = max(self.total_load, math.fsum(self.dest_load.values()))
        if not expected or total <= 0:
            return 1.0
        return max(expected.values()) / (total / len(expected))


def newer(a: Plan | None, b: Plan | None) -> bool:
    """Whether ``a`` should replace ``b``: strictly higher ``(epoch, planner_id)``.

    The planner id breaks ties between two planners that published the same epoch (a membership flap), so every
    node converges on the same plan; an older epoch never replaces a newer one.
    """
    if a is None:
        return False
    return b is None or (a.epoch, a.planner_id) > (b.epoch, b.planner_id)


def newest(*plans: Plan | None) -> Plan | None:
    """The newest of several plans (None if all are None)."""
    best: Plan | None = None
    for p in plans:
        if newer(p, best):
            best = p
    return best


# --- churn ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanChurn:
    """How much one replan changed, as in CacheRoute's replan table."""

    cache_churn: float  # 1 - Jaccard of the (key, destination) pair sets; 0 when both plans are empty
    count_churn: float  # fraction of keys in both plans whose k_b changed; 0 when they share no key
    admitted: int  # keys warm now and not before
    evicted: int  # keys warm before and not now
    moved_pairs: int  # (key, destination) pairs that are new (prefixes that must be built at a destination)


def churn(previous: Plan | None, current: Plan) -> PlanChurn:
    """Churn between consecutive plans (everything counts as new when there is no previous plan)."""
    prev_pairs = previous.pairs if previous is not None else frozenset()
    cur_pairs = current.pairs
    union = len(prev_pairs | cur_pairs)
    jaccard = len(prev_pairs & cur_pairs) / union if union else 1.0
    prev_keys = previous.assignments.keys() if previous is not None else set()
    cur_keys = current.assignments.keys()
    common = prev_keys & cur_keys
    changed = sum(1 for k in common if previous is not None and previous.kb(k) != current.kb(k))
    return PlanChurn(
        cache_churn=1.0 - jaccard,
        count_churn=changed / len(common) if common else 0.0,
        admitted=len(cur_keys - prev_keys),
        evicted=len(prev_keys - cur_keys),
        moved_pairs=len(cur_pairs - prev_pairs),
    )


# --- wire ---------------------------------------------------------------------------------------------------------


def encode_plan(plan: Plan, max_bytes: int = DEFAULT_MAX_PLAN_BYTES) -> bytes:
    """The plan as canonical bytes (same plan -> same bytes); ValueError if they exceed ``max_bytes``."""
    nodes = sorted(plan.dest_load)
    index = {n: i for i, n in enumerate(nodes)}
    flat: list[Any] = []
    for key in sorted(plan.assignments):
        flat.append(key)
        flat.append(plan.key_load[key])
        flat.append([index[d] for d in plan.assignments[key]])
        hold = plan.holds.get(key)
        flat.append(None if hold is None else [hold.kb, float(hold.since), float(hold.rate)])
    obj = [
        _WIRE_VERSION,
        plan.epoch,
        plan.planner_id,
        float(plan.created_at),
        float(plan.period_s),
        float(plan.q_cap),
        float(plan.total_load),
        bool(plan.affinity),
        nodes,
        [plan.dest_load[n] for n in nodes],
        flat,
        _encode_verdict(plan.verdict),
        float(plan.prefill_token_cost),
        float(plan.decode_token_cost),
        [float(plan.dest_var.get(n, 0.0)) for n in nodes],
        float(plan.cold_request_work),
    ]
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > max_bytes:
        raise ValueError(f"plan of {len(data)} bytes exceeds {max_bytes}")
    return data


def _encode_verdict(v: GateReport | None) -> list[Any] | None:
    if v is None:
        return None
    return [
        bool(v.enabled), v.reason[:MAX_REASON_CHARS], int(v.requests), int(v.destinations), float(v.plan_kv_hit),
        float(v.flat_kv_hit), float(v.plan_p99_ttft_s), float(v.flat_p99_ttft_s), float(v.at),
    ]


def _decode_verdict(obj: Any) -> GateReport | None:
    if obj is None:
        return None
    if type(obj) is not list or len(obj) != 9:
        raise MalformedPlan("verdict must be nil or a 9-element array")
    enabled, reason, requests, destinations, *numbers = obj
    if type(enabled) is not bool or type(reason) is not str or len(reason) > MAX_REASON_CHARS:
        raise MalformedPlan("verdict: bad enabled flag or reason")
    if type(requests) is not int or type(destinations) is not int or requests < 0 or destinations < 0:
        raise MalformedPlan("verdict: request and destination counts must be non-negative integers")
    if not all(type(x) is float and math.isfinite(x) for x in numbers):
        raise MalformedPlan("verdict: numbers must be finite floats")
    return GateReport(enabled, reason, requests, destinations, *numbers)


def _id(x: Any, what: str) -> str:
    if type(x) is not str or not 0 < len(x) <= MAX_ID_CHARS:
        raise MalformedPlan(f"{what} must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return x


def decode_plan(data: bytes, max_bytes: int = DEFAULT_MAX_PLAN_BYTES) -> Plan:
    """Parse and validate a published plan; MalformedPlan for anything else (nothing else escapes)."""
    if len(data) > max_bytes:
        raise MalformedPlan(f"plan of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = _unpack(data)
        version = obj[0]
        _, epoch, planner_id, created_at, period_s, q_cap, total_load, affinity, nodes, loads, flat = obj[:11]
        verdict = _decode_verdict(obj[11]) if version >= 2 else None
        costs, variances, cold_work = _decode_costs(obj, nodes)
        if type(affinity) is not bool:
            raise MalformedPlan("affinity must be a boolean")
        if type(created_at) is not float or not math.isfinite(created_at):
            raise MalformedPlan("created_at must be a finite float")
        nodes = _decode_nodes(nodes, loads)
        assignments, key_load, holds = _decode_assignments(flat, nodes, stride=4 if version >= 3 else 3)
        return Plan(
            epoch=epoch,
            planner_id=_id(planner_id, "planner id"),
            created_at=created_at,
            period_s=_check_load(period_s, "period_s"),
            assignments=assignments,
            key_load=key_load,
            dest_load=dict(zip(nodes, loads, strict=True)),
            q_cap=_check_load(q_cap, "q_cap"),
            total_load=_check_load(total_load, "total_load"),
            affinity=affinity,
            verdict=verdict,
            prefill_token_cost=costs[0],
            decode_token_cost=costs[1],
            holds=holds,
            dest_var={n: v for n, v in zip(nodes, variances, strict=True) if v},
            cold_request_work=cold_work,
        )
    except MalformedPlan:
        raise
    except Exception as exc:  # msgpack's error types, wrong arity, ...
        raise MalformedPlan(f"undecodable plan: {type(exc).__name__}") from None


def _unpack(data: bytes) -> list[Any]:
    """The plan's top-level array, its length that of its wire version (``_WIRE_LENGTHS``); msgpack's limits bound
    the work a bad peer can cause."""
    obj = msgpack.unpackb(
        data,
        raw=False,
        use_list=True,
        max_str_len=MAX_ID_CHARS * 4,
        max_bin_len=0,
        max_array_len=max(MAX_PLAN_KEYS * 4, MAX_PLAN_NODES),
        max_map_len=0,
        max_ext_len=0,
    )
    if type(obj) is not list or not obj or type(obj[0]) is not int or _WIRE_LENGTHS.get(obj[0]) != len(obj):
        raise MalformedPlan("not a p2pnode plan (version 1, 2 or 3)")
    return obj


def _decode_costs(obj: list[Any], nodes: Any) -> tuple[list[Any], list[Any], Any]:
    """The token costs, the variances of the node table's destinations and a cold request's work: version 3's, or
    before it the defaults' (no variances, no cold work)."""
    version = obj[0]
    costs = obj[12:14] if version >= 3 else [DEFAULT_PREFILL_TOKEN_COST, DEFAULT_DECODE_TOKEN_COST]
    if not all(type(c) is float for c in costs):
        raise MalformedPlan("token costs must be floats")
    variances, cold_work = (obj[14], obj[15]) if version >= 3 else ([0.0] * len(nodes), 0.0)
    if type(variances) is not list or len(variances) != len(nodes) or type(cold_work) is not float:
        raise MalformedPlan("destination variances must be an array as long as the node table")
    return costs, variances, cold_work


def _decode_nodes(nodes: Any, loads: Any) -> list[str]:
    """The node table's ids: unique, at most ``MAX_PLAN_NODES``, one load each."""
    if type(nodes) is not list or type(loads) is not list or len(nodes) != len(loads):
        raise MalformedPlan("node table and loads must be arrays of equal length")
    ids = [_id(n, "node id") for n in nodes]
    if len(ids) > MAX_PLAN_NODES or len(set(ids)) != len(ids):
        raise MalformedPlan("node table must hold unique ids")
    return ids


def _decode_assignments(
    flat: Any, nodes: list[str], stride: int
) -> tuple[dict[str, tuple[str, ...]], dict[str, float], dict[str, KbHold]]:
    """The warm keys' destinations, loads and holds from the flat ``(key, load, [node index...][, hold])`` tuples of
    ``stride`` elements (4 from version 3, with the hold)."""
    if type(flat) is not list or len(flat) % stride or len(flat) // stride > MAX_PLAN_KEYS:
        raise MalformedPlan("assignments must be (key, load, [node index...], hold) tuples")
    assignments: dict[str, tuple[str, ...]] = {}
    key_load: dict[str, float] = {}
    holds: dict[str, KbHold] = {}
    for i in range(0, len(flat), stride):
        key, load, idx = _id(flat[i], "key"), flat[i + 1], flat[i + 2]
        if key in assignments:
            raise MalformedPlan(f"duplicate key {key!r}")
        if type(idx) is not list or not all(type(j) is int and 0 <= j < len(nodes) for j in idx):
            raise MalformedPlan(f"destinations of {key!r} must be indices into the node table")
        assignments[key] = tuple(nodes[j] for j in idx)
        key_load[key] = load
        hold = flat[i + 3] if stride == 4 else None
        if hold is not None:
            if type(hold) is not list or len(hold) != 3:
                raise MalformedPlan(f"hold of {key!r} must be nil or [kb, since, rate]")
            holds[key] = KbHold(*hold)
    return assignments, key_load, holds
