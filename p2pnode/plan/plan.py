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
- the encoded form is at most ``DEFAULT_MAX_PLAN_BYTES`` when built by the planner (it trims the warm set).

The shadow gate's verdict travels in the plan (``verdict``: the replay's numbers and reason), so that every node
shows the verdict of the plan in force, and a new planner -- whose own gate has no evidence yet -- carries the
previous plan's verdict (and its affinity) forward until its own replay decides.

Wire format (msgpack arrays, no maps; floats are float64 so a decoded plan equals the encoded one):

    [2, epoch, planner_id, created_at, period_s, q_cap, total_load, affinity, [node_id, ...], [dest_load, ...],
     [key, key_load, [node index, ...], key, key_load, [...], ...], verdict]

with ``verdict`` nil or ``[enabled, reason, requests, destinations, plan_kv_hit, flat_kv_hit, plan_p99_ttft_s,
flat_p99_ttft_s, at]``. Version 1 (no verdict) is still read.

Node ids are listed once (sorted) and referenced by index, so a key with k_b destinations costs a few bytes each.

Churn (``churn``): CacheRoute's replan table reports, between consecutive plans, *cache churn* = 1 - Jaccard of
the two sets of (key, destination) pairs -- the share of pinned prefixes that must be (re)built somewhere -- and
*count churn* = the fraction of keys present in both plans whose number of destinations k_b changed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgpack

from p2pnode.config import DEFAULT_MAX_PLAN_BYTES

__all__ = [
    "DEFAULT_MAX_PLAN_BYTES",
    "PLAN_KEY",
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
_WIRE_VERSION = 2
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
class Plan:
    """One epoch of the shared rate plan. Immutable; mappings are read-only views of private copies."""

    epoch: int
    planner_id: str
    created_at: float  # the planner's clock when built (wall time in a node, sim time in the simulator)
    period_s: float  # the planner's replan period: a reader may treat a plan older than a few periods as stale
    assignments: Mapping[str, tuple[str, ...]]  # warm key -> its k_b destinations, in placement order
    key_load: Mapping[str, float]  # warm key -> expected load (prefill-token units per second)
    dest_load: Mapping[str, float]  # destination -> expected warm load placed on it (every destination considered)
    q_cap: float = 0.0  # one destination's share: keys above it got k_b > 1
    total_load: float = 0.0  # expected load of ALL traffic (warm and cold) the plan was sized for
    #: The shadow-replay gate's verdict: False tells every router to ignore the assignments (route every key by
    #: the fallback) while the plan still carries the numbers ``p2pnode status`` shows. True until a gate says no.
    affinity: bool = True
    #: The gate verdict ``affinity`` follows (None: no gate, or none yet).
    verdict: GateReport | None = None
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
        object.__setattr__(self, "assignments", MappingProxyType(assignments))
        object.__setattr__(self, "key_load", MappingProxyType(key_load))
        object.__setattr__(self, "dest_load", MappingProxyType(dest_load))
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

    def imbalance(self) -> float:
        """Expected max / mean of *total* load per destination once cold traffic fills the valleys.

        Cold keys follow a load-balancing fallback, so their load (``total_load`` minus the warm load) is
        water-filled onto the least-loaded destinations; the result is what the plan leaves to chance. Equals
        ``warm_imbalance`` when the warm set carries all the traffic.
        """
        loads = sorted(self.dest_load.values())
        n = len(loads)
        if not n:
            return 1.0
        warm = math.fsum(loads)
        total = max(self.total_load, warm)
        if total <= 0:
            return 1.0
        cold, level = total - warm, loads[0]
        for i in range(n):  # raise the lowest i+1 destinations to the next level while cold load remains
            nxt = loads[i + 1] if i + 1 < n else math.inf
            room = (nxt - loads[i]) * (i + 1) if nxt < math.inf else math.inf
            if cold <= room:
                level = loads[i] + cold / (i + 1)
                break
            cold -= room
        return max(loads[-1], level) / (total / n)


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
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            max_str_len=MAX_ID_CHARS * 4,
            max_bin_len=0,
            max_array_len=max(MAX_PLAN_KEYS * 3, MAX_PLAN_NODES),
            max_map_len=0,
            max_ext_len=0,
        )
        if type(obj) is not list or not obj or type(obj[0]) is not int or (obj[0], len(obj)) not in ((1, 11), (2, 12)):
            raise MalformedPlan("not a p2pnode plan (version 1 or 2)")
        _, epoch, planner_id, created_at, period_s, q_cap, total_load, affinity, nodes, loads, flat = obj[:11]
        verdict = _decode_verdict(obj[11]) if len(obj) == 12 else None
        if type(affinity) is not bool:
            raise MalformedPlan("affinity must be a boolean")
        if type(created_at) is not float or not math.isfinite(created_at):
            raise MalformedPlan("created_at must be a finite float")
        if type(nodes) is not list or type(loads) is not list or len(nodes) != len(loads):
            raise MalformedPlan("node table and loads must be arrays of equal length")
        nodes = [_id(n, "node id") for n in nodes]
        if len(nodes) > MAX_PLAN_NODES or len(set(nodes)) != len(nodes):
            raise MalformedPlan("node table must hold unique ids")
        if type(flat) is not list or len(flat) % 3 or len(flat) // 3 > MAX_PLAN_KEYS:
            raise MalformedPlan("assignments must be (key, load, [node index...]) triples")
        assignments: dict[str, tuple[str, ...]] = {}
        key_load: dict[str, float] = {}
        for i in range(0, len(flat), 3):
            key, load, idx = _id(flat[i], "key"), flat[i + 1], flat[i + 2]
            if key in assignments:
                raise MalformedPlan(f"duplicate key {key!r}")
            if type(idx) is not list or not all(type(j) is int and 0 <= j < len(nodes) for j in idx):
                raise MalformedPlan(f"destinations of {key!r} must be indices into the node table")
            assignments[key] = tuple(nodes[j] for j in idx)
            key_load[key] = load
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
        )
    except MalformedPlan:
        raise
    except Exception as exc:  # msgpack's error types, wrong arity, ...
        raise MalformedPlan(f"undecodable plan: {type(exc).__name__}") from None
