"""A routing policy described once: its pure route function, its parameters, and what it reads.

Each policy module defines one ``SPEC``; the registry (``policies/__init__.py``) lists them. The router and the
simulator read a spec -- never a policy's name -- to know what to prepare for a request: whether the policy may be
handed only the candidates the request touches (``sparse``), whether it reads the routing key (``keyed``), how many
homes to name (``homes``), whether it routes by the rate plan (``plan``), whether the router may draw its holders
(``holders``). What a policy reads can depend on its parameters (``p2p`` with every peer a candidate needs the
least-loaded others handed; ``cacheroute`` reads homes only when its cold keys follow ``p2p``), so a spec computes it
from them (``reads``).
A policy that moves KV says through its spec too what the router needs of it: the parameter that forces every pull
(``force_pull_param``) and its price of a segment pull (``segment_pull_price``).

Each spec says where the policy comes from (``role``): a published algorithm (a baseline), this project's own, or a
reference no mesh can run -- so a comparison reads its rivals from the registry instead of a list of names.

What-ifs are the same spec with other parameters (``with_params``), named ``BASE@<letter><value>...`` through the
spec's ``variants`` letters (``p2p@w8`` is ``p2p`` with ``uncached_weight=8``) or by one of its ``named`` variants
(``cacheroute-chwbl``). Parameters that describe the engine's speed (``profile_params``: Preble's and DualMap's
prefill rate) are bound from the cost profile the router is given, on the node and in the simulator alike
(``for_profile``), so both run the very same policy. A policy that trades cache affinity for load above an estimated
TTFT names that parameter (``ttft_slo_param``: DualMap's), so a run sets every such threshold at once
(``with_ttft_slo``) and its results keep the policy's name.

Invariant: ``spec(request, peers, plan)`` is ``spec.route(request, peers, plan, **spec.params)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.types import Decision, PeerSnapshot, RouteRequest

if TYPE_CHECKING:
    from p2pnode.routing.segments import SegmentPullPrice

__all__ = ["LEAST_LOADED_CANDIDATES", "SAMPLED_PEERS", "CostModel", "PolicySpec", "Reads", "Role"]

#: Peers the router draws at random for a request (``RouteRequest.sampled``), handed to a sparse policy as candidates
#: (``p2p``'s power of choices: its default ``choices``).
SAMPLED_PEERS = 1
#: Untouched peers handed to a sparse policy besides the touched ones: the least loaded, ties spread by the request's
#: tiebreak. ``flat``'s target is one; the rest give the retry order (3 attempts by default) real alternatives.
LEAST_LOADED_CANDIDATES = 4


class Role(Enum):
    """Where a policy comes from, i.e. what a comparison makes of it."""

    #: A published algorithm (a peer router's, a paper's), its module citing its source: what ours are judged against.
    BASELINE = "baseline"
    #: This project's own: the default, and the rate plan's.
    OURS = "ours"
    #: Not deployable: a bound on what a rule reaches with perfect information (the simulator's ``upper-bound``).
    REFERENCE = "reference"


class CostModel(Protocol):
    """What a policy may read of the engine's speed (``cost.CostProfile`` is one)."""

    prefill_s_per_token: float

    def step_time(self, prefill_tokens: int, attn_units: float, decode_seqs: int, decode_ctx_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class Reads:
    """What a policy reads besides its candidates' snapshots, i.e. what the router prepares for it.

    ``sparse``: it may be handed only the candidates a request touches plus ``least_loaded`` untouched peers
    (``routing/candidates.py``); ``keyed``: it reads ``RouteRequest.routing_key`` (the router derives one before
    deciding); ``homes``: how many homes the router names (``RouteRequest.homes``; 0: none); ``plan``: it routes warm
    keys by the rate plan (the final message then names the plan's destinations); ``sampled``: how many random peers
    the router draws (``RouteRequest.sampled``); ``holders``: how many of the deepest holders the router may draw
    itself over every estimate (``types.draw_holders``; 0: none), so a prompt cached mesh-wide costs a snapshot for a
    few peers only; ``segments``: it prices what a request's segments reuse at each node (the router then estimates
    it for requests that name segments, ``routing/segments.py``; otherwise such a request routes by its prompt's
    prefix as sent); ``served_rates``: it reads ``PeerSnapshot.served_rate`` (the router keeps every peer's served
    rate, ``routing/served_rate.py``, only for a policy that does; every other one's snapshots carry None);
    ``sends_elsewhere`` (sparse only): it reads the sends in flight to peers nothing else makes its candidates -- the
    router then hands it every peer this ingress sent to since that peer's report, its sends counted (``flat``
    chooses by them) -- else only its candidates' sends: such a peer then only orders the retries past its candidates
    by reported load, and a decision at a busy ingress costs O(candidates), not O(peers with sends in flight).
    ``load_only`` (sparse only): it chooses by load alone, counting this ingress's sends (``flat``): besides its
    sample, plan and homes it is handed only the ``least_loaded`` peers least loaded with their sends counted, from an
    order kept as sends come and go (``routing/effective_load.py``), not every peer it touches -- a decision costs
    O(candidates) at a busy ingress and where a prompt is cached mesh-wide alike.
    """

    sparse: bool = False
    keyed: bool = False
    homes: int = 0
    plan: bool = False
    sampled: int = SAMPLED_PEERS
    holders: int = 0
    least_loaded: int = LEAST_LOADED_CANDIDATES
    segments: bool = False
    served_rates: bool = False
    sends_elsewhere: bool = True
    load_only: bool = False


def _no_reads(params: Mapping[str, Any]) -> Reads:
    return Reads()


@dataclass(frozen=True)
class PolicySpec:
    """One routing policy (see the module docstring)."""

    #: The name a node and the simulator know it by (``--routing-policy``, ``--policies``, results' keys).
    name: str
    #: The pure policy: ``route(request, peers, plan, **params) -> Decision``.
    route: Callable[..., Decision]
    #: Where it comes from (``Role``).
    role: Role
    #: Its tunable parameters with their defaults (keyword arguments of ``route``); ``params`` overrides them.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: The parameters bound for this spec (empty: every default).
    params: Mapping[str, Any] = field(default_factory=dict)
    #: What it reads, from its effective parameters (defaults updated by ``params``).
    reads_of: Callable[[Mapping[str, Any]], Reads] = _no_reads
    #: What-if letters: ``@<letter><value>`` sets a parameter, e.g. ``{"w": ("uncached_weight", float)}``.
    variants: Mapping[str, tuple[str, Callable[[str], Any]]] = field(default_factory=dict)
    #: Named what-ifs, e.g. ``{"cacheroute-chwbl": {"fallback": "chwbl"}}``.
    named: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Parameters that describe the engine's speed, from a cost profile (``for_profile``).
    profile_params: Callable[[CostModel], dict[str, Any]] | None = None
    #: Overrides of the rate planner's configuration (``plan/planner.PlanConfig``) for a plan-driven policy's
    #: what-ifs; ``planner_variants`` names the letters that set them.
    planner: Mapping[str, Any] = field(default_factory=dict)
    planner_variants: Mapping[str, tuple[str, Callable[[str], Any]]] = field(default_factory=dict)
    #: The parameter holding the estimated TTFT, in seconds, above which it trades cache affinity for load (None: it
    #: steers by no such threshold). Set through ``with_ttft_slo``, never from the SLO a run is judged by.
    ttft_slo_param: str | None = None
    #: The parameter that, set True, makes it take every KV pull it can, whatever the price (``--kv-pull-force``:
    #: tests and evidence); "": it has none.
    force_pull_param: str = ""
    #: How it prices pulling a request's segments to the node serving it (``routing/segments.segment_pulls``), from
    #: its effective parameters, the engine's cost profile and whether every pull is forced; None: it pulls none.
    segment_pull_price: Callable[[Mapping[str, Any], CostModel, bool], SegmentPullPrice] | None = None
    _bound: Callable[[RouteRequest, Sequence[PeerSnapshot], Plan | None], Decision] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in ("defaults", "params", "variants", "named", "planner", "planner_variants"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))  # read-only once built
        unknown = set(self.params) - set(self.defaults)
        if unknown:
            raise ValueError(f"policy {self.name!r} has no parameter {', '.join(sorted(unknown))}")
        if self.ttft_slo_param is not None and self.ttft_slo_param not in self.defaults:
            raise ValueError(f"policy {self.name!r} has no parameter {self.ttft_slo_param} (its ttft_slo_param)")
        route, params = self.route, dict(self.params)
        if params:

            def bound(request: RouteRequest, peers: Sequence[PeerSnapshot], plan: Plan | None) -> Decision:
                return route(request, peers, plan, **params)

        else:
            bound = route
        object.__setattr__(self, "_bound", bound)

    def __call__(self, request: RouteRequest, peers: Sequence[PeerSnapshot], plan: Plan | None = None) -> Decision:
        return self._bound(request, peers, plan)

    @property
    def effective(self) -> dict[str, Any]:
        """Every parameter's value: the defaults updated by ``params``."""
        return {**self.defaults, **self.params}

    @property
    def reads(self) -> Reads:
        return self.reads_of(self.effective)

    def with_params(self, name: str | None = None, **params: Any) -> PolicySpec:
        """This policy with these parameters (a what-if); ``name`` names it (default: this spec's name)."""
        route_params = {k: v for k, v in params.items() if k not in self.planner_keys}
        planner = {k: v for k, v in params.items() if k in self.planner_keys}
        return replace(
            self,
            name=name or self.name,
            params={**self.params, **route_params},
            planner={**self.planner, **planner},
        )

    def with_ttft_slo(self, seconds: float | None) -> PolicySpec:
        """This policy trading affinity for load above ``seconds`` of estimated TTFT, keeping its name; itself when
        ``seconds`` is None or it steers by no such threshold (``ttft_slo_param``)."""
        if seconds is None or self.ttft_slo_param is None:
            return self
        return self.with_params(**{self.ttft_slo_param: seconds})

    @property
    def what_ifs(self) -> tuple[str, ...]:
        """Its ``named`` what-ifs that are not itself under another name (``cacheroute-p2p`` is ``cacheroute``)."""
        own = {**self.effective, **self.planner}
        return tuple(
            name for name, params in self.named.items() if any(k not in own or own[k] != v for k, v in params.items())
        )

    @property
    def planner_keys(self) -> frozenset[str]:
        return frozenset(param for param, _ in self.planner_variants.values())

    def for_profile(self, profile: CostModel | None) -> PolicySpec:
        """This policy with its speed parameters taken from ``profile`` (unless set explicitly); itself when it has
        none or no profile is given."""
        if profile is None or self.profile_params is None:
            return self
        derived = {k: v for k, v in self.profile_params(profile).items() if k not in self.params}
        return replace(self, params={**derived, **self.params}) if derived else self

    def variant(self, name: str) -> PolicySpec:
        """The what-if ``name`` names: ``BASE[@<letter><value>...]`` where BASE is this spec's name or one of its
        ``named`` variants; ValueError naming the letters for a malformed one. Every value is a count, weight or
        bound: a finite number >= 0 (NaN or a negative one made ``p2p@anan`` fail every request)."""
        base, *mods = name.split("@")
        spec = self if base == self.name else self.with_params(**self.named[base])
        letters = {**self.variants, **self.planner_variants}
        params: dict[str, Any] = {}
        for mod in mods:
            param, conv = letters.get(mod[:1], (None, None))
            try:
                if param is None or conv is None or param in params:
                    raise ValueError
                value = conv(mod[1:])
                if isinstance(value, int | float) and not isinstance(value, bool) and not 0 <= value < math.inf:
                    raise ValueError
                params[param] = value
            except ValueError:
                valid = ", ".join(f"@{letter}<{p}>" for letter, (p, _) in letters.items()) or "none"
                raise ValueError(
                    f"bad override {mod!r} in {name!r}: expected one of {valid}, each a finite number >= 0"
                ) from None
        return spec.with_params(name=name, **params)
