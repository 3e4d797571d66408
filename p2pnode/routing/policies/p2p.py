"""p2p (the default): send the request where its first token comes soon and the mesh's work stays small -- the
prefill a cached prefix saves at a node weighed against the work already queued there -- choosing among a few
candidates.

Cost of node n, in prefill-token units::

    work(n)  = backlog(n) + uncached(n)                # prompt tokens n prefills before this request's first token
    steps(n) = max(1, ceil(work(n) / STEP_TOKENS))     # engine steps that takes at vLLM's token budget per step
    cost(n)  = backlog(n) + UNCACHED_WEIGHT * uncached(n) + steps(n) * (STEP_OVERHEAD_TOKENS + SEQ_TOKENS * load(n))

With ``UNCACHED_WEIGHT`` = 1 the cost is this request's time to first token; a prefill, though, is also work every
request queued behind it waits for, so a token not served from cache is worth more than a token of queue. The weight
(4) is the one setting chosen by simulation: over the production workloads (docs/results-history.md, "Routing on
production shapes", the sweep of weights 1, 2, 4, 8) 4 holds the most load under the SLO on every workload, 1 loses the
conversation hits of platform-chat under bursts, 8 gains nothing more.

- ``uncached(n)`` = prompt tokens minus the estimated cached prefix at n: a match is worth exactly the prefill it
  saves, so a one-block match is worth one block, not a win. A prefix most of the mesh holds
  (``RouteRequest.common_match_blocks``: a platform system prompt, a popular application's tool definitions) counts
  as held everywhere: a node without it prefills it once and holds it from then on, so it never narrows the choice
  and never keeps a node that has not served yet from serving;
- ``backlog(n)`` = the uncached prompt tokens of n's requests that have not produced a first token yet, as n gossips
  it (``p2pnode/load.py``) plus what this ingress sent there since (the router's ledger); without a report, (waiting +
  in flight) requests each missing what this one would (``types.backlog_tokens``);
- ``load(n)`` = running + waiting + in flight: every step also decodes every running request, so running work
  counts too, and an idle node with no match is a real candidate (its cost is the bare prefill).

The three constants describe an engine step of the default profile (Llama-3.1-8B, BF16, one H100, vLLM v1 defaults;
``cost/profiles.py``): a prefill token costs ~40 us, a step's fixed part (weights read, scheduling) ~6.5 ms =
``STEP_OVERHEAD_TOKENS`` prefill tokens, one running sequence's decode with a 2k context ~115 us = ``SEQ_TOKENS``,
and a step computes at most ``STEP_TOKENS`` tokens (``max_num_batched_tokens``). Only their ratios matter, and they
are much the same across GPUs and model sizes; nothing here was fitted to a workload.

Candidates (power of d choices): this node (its load is live), the ``HOLDERS`` peers with the deepest estimated
match (among equal depths, entered at a ``tiebreak`` offset), ``CHOICES`` peers drawn at random for this request
(``RouteRequest.sampled``, else drawn here with ``sample_peers``), and the request's *home* (``RouteRequest.homes``,
``context_homes``). Other peers are never the target, only retries.
Why not every peer: loads come from gossip, seconds old, and every ingress reads the same ones; if every ingress sent
its requests to the mesh's cheapest-looking node, all would pile onto it until the next report (herding). Choosing
among a few random peers keeps old load information useful (Mitzenmacher, "How useful is old information?", IEEE
TPDS 2000); holding the deepest holders to a few does the same for a prefix held mesh-wide. ``choices=0`` /
``holders=0`` make every peer / every holder a candidate (the simulator's ``upper-bound`` reference uses both, on
exact state).

Target: among the candidates whose cost is within ``ALLOWANCE`` x the least cost + ``SLACK_TOKENS`` (one engine
step's budget: cost differences below it are noise in gossiped loads), the deepest effective match, then a home,
then the least cost, then this node (no hop), then ``tiebreak``: a conversation stays on the node holding its
history unless that node's queue is clearly longer, instead of moving on every small difference in stale loads.
The ranked list is those candidates in that order, the other candidates by cost, then every other alive peer by
load.

Empty nodes (``FILL_EMPTY``): the cost alone never starts a node that holds nothing while every request matches a
long prefix somewhere -- an application's tool definitions, say: a holder's queue costs less than the empty node's
whole prefill at ``UNCACHED_WEIGHT``, so on ``tool-agent`` the nodes that got no application prompt early served
nothing all run (1.3 of 16 nodes at 40 QPS on average, 4 in one seed) while the holders queued. So when the target
has a queue and an empty candidate (no cached blocks, nothing running, queued or in flight: a node that just joined,
or one never used) gives the first token sooner -- its bare prefill at weight 1, against the target's queue and
prefill -- the empty node goes first; from then on it holds that prefix and the cost judges it like any other node.
Not any idle node: that moves conversations off the nodes holding their histories whenever those queue
(``platform-chat`` KV hit 0.347 -> 0.330); an empty node has no history to lose.

The home is for the seconds before gossip tells: a conversation's next turn or an agent's next step often arrives
(at another ingress) before any report of where the previous one was cached, so past the common prefix every
candidate looks alike, and a pick by stale loads scatters a conversation's first turns over the mesh. ``context_homes``
hashes the request's first block past the deepest estimated match -- the first block of its own context -- to a node,
the same at every ingress, and among equally matched candidates within the bound the home wins: the next request of
a new context goes where the first went, as with consistent hashing, and the bound keeps it off a node that is
clearly busier (consistent hashing with bounded loads, Mirrokni et al., SODA 2018). Once gossip reports the history,
the deepest match decides as before. Measured (docs/results-history.md, 16 nodes, 3 seeds, the simulator's former 2 s
gossip delay, ~6x the agent's lag; at the agent's lag the home adds 0.4 points, not 1.7): KV hit at the lowest rung of
``platform-chat`` 0.330 without a home, 0.337 with the cheaper of two hashed homes (``HOMES`` = 2: a turn follows
its first turn only when both are judged on the same loads, ~3 in 4), 0.347 with one; no capacity lost on any
workload. Only a request whose context continues a cached prefix (a platform or application prompt, a document) has
a home: one that shares no cached block with anything is most often a one-off, and a one-off placed by its hash
alone loses the balance that this node's live load and a random peer give (homes for those too raise
``cacheroute-aggregate``'s hit from 0.423 to 0.443 but cut ``whales``' SLO capacity from 260 to ~130 QPS).

Pulls (only with a link figure: ``kv_bytes_per_token`` from the cost profile and a holder whose ``link_bytes_per_s``
and ``kv_layout`` are set, ``routing/links.py``): a candidate without the deepest holder's prefix may serve the
request with that prefix pulled from the holder instead of computing it. Its cost is then ``cost`` with the pulled
blocks counted as cached, plus ``pull_tokens``: the transfer at the holder's link figure and a round trip
(``PULL_RTT_S``), in prefill-token units, at weight 1 -- it delays this request only, where a prefill is work every
request queued behind it waits for -- and one engine step of the holder (its export runs in its next step). A
candidate takes the pull where that is cheaper than computing the prefix there. A candidate that would pull ranks by
the prefix it *holds*, not the one it would pull: the request leaves a holder within the bound for cost alone, as it
would without pulls, and a pull only makes the move cheaper when the holder is clearly behind. Ranked by the pulled
depth instead, every pulling candidate tied with the holder, and the home -- the hash of the request's newest block,
unrelated to where its history is -- or a cost difference the bound calls noise decided: in the simulator (16 nodes,
100 Gb/s, ``tool-agent`` at a quarter of the KV, 50 QPS) 73% of the pulls left a holder within the bound for the
home, each copying the history onto a second node (KV hit 0.709 without pulls, 0.642 with them; 0.728 ranked by the
held prefix, with a tenth of the bytes moved; docs/results-history.md, "Moving KV between nodes (pulls)").
``force_pull`` (tests and evidence) prices every pull at zero and prefers, among equal matches, a candidate that pulls.

KV tiers (a candidate whose host or disk tier holds the prompt's prefix past its engine's match:
``PeerSnapshot.est_host_blocks`` / ``est_disk_blocks``, cumulative; only with the tiers' rates, bound from the cost
profile): its engine loads those blocks instead of computing them (vLLM's offloading connector loads whatever its tier
holds past the engine's hit), so its effective match reaches the tiers' depth and its cost adds the load's time
(``cost/tiers.py``: bytes / host-to-device rate, a disk block read into host memory first), in prefill-token units at
weight 1 -- the load is asynchronous, it delays this request only. A conversation whose history sits in one node's host
tier ranks there as deep as on a node whose engine holds it, and goes there unless that node is clearly behind. A pull
can bring a prefix from a peer's tier as from its engine: the deepest candidate holder counts its tiers' depth, and a
pull from it adds the time its tier takes to read the blocks that are not in its engine; the pulling target's own tier
is then not used (a pull serves the request's whole load: the engine runs one connector's load per request, and the
pull's goes first), so a pull moves everything past the target's engine match.

Segments (a request that names reusable segments, ``RouteRequest.segment_mode``; the router estimates each node's
reuse, ``routing/segments.py``): a node's cached tokens are then its segment estimate (``est_segment_tokens``) times
the mode's weight, in place of its prefix estimate -- the serving engine reuses the laid-out chain of segments
(``exact``) or the stored segments wherever they sit (``approximate``, whose other blocks run under their own cache
salt), not the prompt's prefix as sent. Everything else is the rule above, in blocks of those tokens: holders are the
nodes with the most segment tokens, no prefix counts as common, a request with segments has no home (its context is
its own) and pulls nothing. ``EXACT_WEIGHT`` is 1: the layout's reuse is a plain prefix hit. ``APPROXIMATE_WEIGHT``
is 0.9: a loaded segment's tokens are not prefilled, but their KV comes from host memory (128 KiB a token for the 8B
profile, ~2.6 us at PCIe 5's ~50 GB/s against ~40 us to prefill it) and is re-rotated, and a held segment that does
not follow the cached prefix costs a one-token phase (an engine step) to reach (``kv/segments.py``).

Sources: the cost follows Mooncake's and Dynamo's KV routers (prefill to compute plus queued work; Dynamo:
``overlap_weight * prefill_blocks + active_blocks``) and Preble's E2 (exploit a cached prefix only when what it saves
outweighs the load it lands on), with the queue measured in tokens as LMetric argues (batch size and new prefill
tokens are the two indicators that matter). Unlike a central router's, the loads here are gossiped, hence the
sampling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from p2pnode.cache.segments import SegmentReuse
from p2pnode.cost.tiers import TierRates
from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.spec import (
    LEAST_LOADED_CANDIDATES,
    SAMPLED_PEERS,
    CostModel,
    PolicySpec,
    Reads,
    Role,
)
from p2pnode.routing.policies.types import (
    Decision,
    PeerSnapshot,
    Pull,
    RouteRequest,
    alive_peers,
    backlog_tokens,
    make_decision,
    match_blocks,
    rank_keyed,
    sample_peers,
)

try:  # the ranking below in C (routing/native/p2p_rank.c), for a request on the common path; this Python defines it
    from p2pnode.routing._p2p import rank as _native_rank
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_rank = None

NAME = "p2p"
#: Random peers among the candidates of every request (0: every alive peer). One: 2 or 3 herd more on stale loads.
CHOICES = SAMPLED_PEERS
#: Peers with a match among the candidates, deepest first (0: every holder).
HOLDERS = 2
#: Nodes a request's own context hashes to, among the candidates (``context_homes``: 1 or 2; module docstring for why
#: one).
HOMES = 1
#: Tokens one engine step computes at most (vLLM's max_num_batched_tokens for GPUs of >= 70 GiB).
STEP_TOKENS = 8192
#: A step's fixed cost in prefill tokens (8B on an H100: ~6.5 ms of weight reads and scheduling / ~40 us per token).
STEP_OVERHEAD_TOKENS = 160
#: One running sequence's share of a step in prefill tokens (its decode with a 2k context: ~115 us / ~40 us).
SEQ_TOKENS = 3


#: An empty node (nothing cached, nothing running or queued) takes a request it would start sooner than the chosen
#: target, which has a queue (module docstring).
FILL_EMPTY = True
#: Weight of the request's own uncached prefill against the queue it waits behind (1: pure time to first token;
#: module docstring for why 4).
UNCACHED_WEIGHT = 4.0
#: A candidate within this factor of the least cost (plus ``SLACK_TOKENS``) may be chosen for a longer match.
ALLOWANCE = 1.25
#: Cost differences below one engine step's token budget are noise in gossiped loads.
SLACK_TOKENS = STEP_TOKENS
#: Seconds of one prefill token (the default profile's: Llama-3.1-8B, BF16, one H100): converts a KV pull's transfer
#: time into the prefill-token units of ``cost``. A node binds its cost profile's value (``PolicySpec.for_profile``).
PREFILL_S_PER_TOKEN = 4.0e-5
#: KV bytes per token moved by a pull (0: no pull is ever priced); bound from the cost profile.
KV_BYTES_PER_TOKEN = 0
#: Fixed time of a pull (the holder's export call and the stream's set-up): a LAN round trip or two.
PULL_RTT_S = 0.002
#: A segment token reused at a node, against a prefix token, by mode (module docstring, "Segments").
EXACT_WEIGHT = 1.0
APPROXIMATE_WEIGHT = 0.9
#: Price every pull at zero (for tests and evidence: on a CPU test host recomputing a prefix is cheaper than moving
#: it, so the price alone would never pull).
FORCE_PULL = False
#: Bytes per second a node's host tier and disk tier load into its engine (0: none to price; bound from the cost
#: profile, ``cost/tiers.py``).
HOST_LOAD_BYTES_PER_S = 0.0
DISK_LOAD_BYTES_PER_S = 0.0


def cost(uncached: int, backlog: int, load: int, uncached_weight: float = UNCACHED_WEIGHT) -> float:
    """A node's cost for a request (module docstring), in prefill-token units."""
    work = backlog + uncached
    steps = -(-work // STEP_TOKENS) if work > STEP_TOKENS else 1
    return backlog + uncached_weight * uncached + steps * (STEP_OVERHEAD_TOKENS + SEQ_TOKENS * load)


def pull_tokens(
    blocks: int,
    bs: int,
    holder: PeerSnapshot,
    kv_bytes_per_token: int,
    prefill_s_per_token: float,
    pull_rtt_s: float,
) -> float:
    """What pulling ``blocks`` blocks from ``holder`` adds to the first token, in prefill-token units: the transfer
    at the holder's link speed plus a round trip, and one engine step of the holder (its export of the blocks runs in
    its next step, ahead of its queue)."""
    return transfer_tokens(blocks * bs, holder, kv_bytes_per_token, prefill_s_per_token, pull_rtt_s)


def transfer_tokens(
    tokens: int, holder: PeerSnapshot, kv_bytes_per_token: int, prefill_s_per_token: float, pull_rtt_s: float
) -> float:
    """What moving ``tokens`` tokens of KV from ``holder`` adds to the first token, in prefill-token units (the one
    price of every pull: a prefix's, ``pull_tokens``, and a segment's, ``routing/segments.segment_pulls``)."""
    transfer_s = tokens * kv_bytes_per_token / holder.link_bytes_per_s + pull_rtt_s
    return transfer_s / prefill_s_per_token + STEP_OVERHEAD_TOKENS + SEQ_TOKENS * holder.requests


@dataclass(frozen=True, slots=True)
class PullPrice:
    """A segment pull's price (``routing/segments.SegmentPullPrice``): the segment's KV moved as a prefix pull's is
    (``transfer_tokens``), against its prefill at ``uncached_weight``; the engine's KV bytes and prefill seconds per
    token come from its cost profile."""

    kv_bytes_per_token: int
    prefill_s_per_token: float
    rtt_s: float = PULL_RTT_S
    uncached_weight: float = UNCACHED_WEIGHT
    #: Pull every segment a peer holds, whatever it costs (``--kv-pull-force``).
    force: bool = False

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.prefill_s_per_token <= 0:
            raise ValueError(
                f"a segment pull needs KV bytes and prefill seconds per token, got {self.kv_bytes_per_token} B, "
                f"{self.prefill_s_per_token} s"
            )

    def transfer_tokens(self, tokens: int, holder: PeerSnapshot) -> float:
        return transfer_tokens(tokens, holder, self.kv_bytes_per_token, self.prefill_s_per_token, self.rtt_s)


def segment_pull_price(params: Mapping[str, Any], profile: CostModel, force: bool) -> PullPrice:
    """``PolicySpec.segment_pull_price``: a segment pull priced like this policy's prefix pulls, with ``params``'
    round trip and weight."""
    return PullPrice(
        profile.kv_bytes_per_token,  # type: ignore[attr-defined]
        profile.prefill_s_per_token,
        rtt_s=params["pull_rtt_s"],
        uncached_weight=params["uncached_weight"],
        force=force,
    )


def _with_pulls(
    costs: list[tuple[float, int, PeerSnapshot]],
    rows: list[tuple[int, int, PeerSnapshot]],
    prompt: int,
    bs: int,
    usable: int,
    uncached_weight: float,
    kv_bytes_per_token: int,
    prefill_s_per_token: float,
    pull_rtt_s: float,
    force: bool,
    rates: TierRates | None = None,
) -> tuple[list[tuple[float, int, PeerSnapshot]], dict[str, int], str]:
    """Each candidate's cost when it pulls the prefix from the deepest holder among the candidates instead of
    computing it, where that is cheaper (module docstring, "Pulls"); returns the costs with each candidate's effective
    match (what it holds, unless ``force``), the pulls taken (node id -> blocks of prefix it would then hold) and the
    holder. With ``rates``, a holder's depth counts its tiers, and a pull adds its tiers' read of the blocks it moves
    that are not in its engine (module docstring, "KV tiers")."""
    source: PeerSnapshot | None = None
    depth = 0
    for m, _, p in rows:
        held = _tier_depth(p, m, usable, rates) if rates is not None else m
        if p.link_bytes_per_s > 0 and p.kv_layout and held > depth:
            source, depth = p, held
    depth = min(depth, usable)
    if source is None or depth <= 0:
        return costs, {}, ""
    matches = {p.node_id: m for m, _, p in rows}
    out: list[tuple[float, int, PeerSnapshot]] = []
    pulls: dict[str, int] = {}
    for c, eff, p in costs:
        if p is source or p.kv_layout != source.kv_layout or eff >= depth:
            out.append((c, eff, p))
            continue
        uncached = prompt - depth * bs
        b = p.load.prefill_backlog_tokens
        backlog = (p.load.waiting + p.in_flight) * uncached if b is None else b
        pulled = cost(uncached, backlog, p.requests, uncached_weight)
        if not force:
            here = min(matches[p.node_id], depth)
            pulled += pull_tokens(depth - here, bs, source, kv_bytes_per_token, prefill_s_per_token, pull_rtt_s)
            if rates is not None:
                read_s = _tier_read_seconds(source, max(here, matches[source.node_id]), depth, usable, bs, rates)
                if read_s:
                    pulled += read_s / prefill_s_per_token
        if force or pulled < c:
            # Ranked by what it holds (module docstring, "Pulls"); a forced pull is wanted, so ranked as it would be.
            out.append((pulled, depth if force else eff, p))
            pulls[p.node_id] = depth
        else:
            out.append((c, eff, p))
    return out, pulls, source.node_id


def _tier_depth(p: PeerSnapshot, eff: int, usable: int, rates: TierRates) -> int:
    """How deep ``p`` reuses the prompt past its effective match ``eff`` with its tiers' blocks loaded (``eff``
    without a tier reaching further, or one the rates cannot price)."""
    if p.est_host_blocks <= eff and p.est_disk_blocks <= eff:
        return eff
    h = min(max(p.est_host_blocks, eff), usable)
    return min(max(p.est_disk_blocks, h), usable) if rates.disk else h


def _tier_read_seconds(p: PeerSnapshot, lo: int, hi: int, usable: int, bs: int, rates: TierRates) -> float:
    """Seconds ``p``'s tiers take to read blocks ``lo..hi-1`` of the prompt (those past its engine's match: host ones
    up to its host depth, disk ones past it)."""
    if hi <= lo:
        return 0.0
    h = min(max(p.est_host_blocks, lo), usable, hi)
    return rates.load_seconds((h - lo) * bs, (hi - h) * bs)


def _ttft_tokens(p: PeerSnapshot, eff: int, prompt: int, bs: int) -> float:
    """Time to first token at ``p`` in prefill-token units: ``cost`` with the uncached prefill at weight 1."""
    uncached = prompt - eff * bs
    return cost(uncached, backlog_tokens(p, uncached), p.requests, 1.0)


def _empty_first(
    ranked: list[PeerSnapshot],
    costs: list[tuple[float, int, PeerSnapshot]],
    prompt: int,
    bs: int,
    loads: dict[str, float] | None = None,
) -> list[PeerSnapshot]:
    """``FILL_EMPTY`` (module docstring): the empty candidate that gives the first token soonest goes first, when
    it gives it sooner than the chosen target, which has a queue."""
    target = ranked[0]
    if not (target.load.waiting or target.in_flight or target.load.prefill_backlog_tokens):
        return ranked
    empty = [
        (_ttft_tokens(p, 0, prompt, bs), p.node_id, p)  # holds nothing, not even a prefix counted as common
        for _, _, p in costs
        if p.cached_blocks == 0 and p.requests == 0 and not p.load.prefill_backlog_tokens  # None: not empty
    ]
    if not empty:
        return ranked
    ttft, _, first = min(empty, key=itemgetter(0, 1))
    target_eff = next(eff for _, eff, p in costs if p is target)
    target_ttft = _ttft_tokens(target, target_eff, prompt, bs)
    if loads:
        target_ttft += loads.get(target.node_id, 0.0)
    if ttft >= target_ttft:
        return ranked
    return [first, *(p for p in ranked if p is not first)]


#: The engine-step constants the C ranking reads (``_native_rank``), as the Python reads them.
_CONSTANTS = (STEP_TOKENS, STEP_OVERHEAD_TOKENS, SEQ_TOKENS)
#: A candidate before its cost: (its match in blocks, clamped to the prompt's; its load in requests; the peer).
_Row = tuple[int, int, PeerSnapshot]
#: A peer ranked by a key (``types.rank_keyed``): (key, node id, peer).
_Keyed = tuple[tuple[Any, ...], str, PeerSnapshot]


def _sampled(request: RouteRequest, alive: list[PeerSnapshot], choices: int) -> set[str] | None:
    """The ``choices`` random peers among the candidates: the router's draw (``RouteRequest.sampled``) when it drew
    enough, else drawn here over the alive peers; None: every alive peer is a candidate (``choices`` 0)."""
    if choices <= 0:
        return None
    if len(request.sampled) >= choices:
        return set(request.sampled[:choices])
    return set(sample_peers(sorted(p.node_id for p in alive if not p.is_self), request.tiebreak, choices))


def _split(
    alive: list[PeerSnapshot],
    sampled: set[str] | None,
    home: tuple[str, ...],
    n: int,
    bs: int,
    weight: float,
    segmented: bool,
) -> tuple[list[_Row], list[_Keyed], list[_Keyed]]:
    """Every alive peer, once: a candidate (this node, a sampled peer, a home) as a row; a peer with a match that is
    none of those among the holders to choose from, keyed deepest first (with segments by their tokens, as the router
    draws holders, ``draw_holders``); any other among the others, keyed by load (retries only)."""
    rows: list[_Row] = []
    matched: list[_Keyed] = []
    others: list[_Keyed] = []
    for p in alive:
        m = p.est_match_blocks if not segmented else int(weight * p.est_segment_tokens) // bs
        m = m if 0 <= m <= n else (0 if m < 0 else n)
        reported = p.load
        load = reported.running + reported.waiting + p.in_flight
        if sampled is None or p.is_self or p.node_id in sampled or p.node_id in home:
            rows.append((m, load, p))
            continue
        deep = m
        if not segmented and p.est_disk_blocks > m:  # a holder by its tiers' depth, as the router draws holders
            deep = min(p.est_disk_blocks, n)
        if deep:
            matched.append(((-deep if not segmented else -p.est_segment_tokens,), p.node_id, p))
        else:
            others.append(((load, 0), p.node_id, p))
    return rows, matched, others


def _add_holders(
    rows: list[_Row],
    others: list[_Keyed],
    matched: list[_Keyed],
    request: RouteRequest,
    holders: int,
    weight: float,
    segmented: bool,
) -> None:
    """Adds the ``holders`` deepest of the ``matched`` peers to the candidates' ``rows`` (0: every one), the rest to
    ``others``: the router's draw of them (``RouteRequest.holders``, by the same rule over every alive peer) when it
    drew some, else the deepest here, equal depths entered at a tiebreak offset."""
    n, bs = len(request.block_hashes), request.block_size
    drawn = request.holders
    if drawn and holders > 0:
        chosen = set(drawn)
        deepest = [t[2] for t in matched if t[1] in chosen]
        rest = [t[2] for t in matched if t[1] not in chosen]
    else:
        ranked_matched = rank_keyed(matched, request.tiebreak)
        keep = len(ranked_matched) if holders <= 0 else holders
        deepest, rest = ranked_matched[:keep], ranked_matched[keep:]
    for p in deepest:
        m = p.est_match_blocks if not segmented else int(weight * p.est_segment_tokens) // bs
        rows.append((m if m <= n else n, p.requests, p))
    others += [((p.requests, 0), p.node_id, p) for p in rest]


def _costs(
    rows: list[_Row],
    prompt: int,
    bs: int,
    usable: int,
    common: int,
    uncached_weight: float,
    rates: TierRates | None = None,
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
    loads: dict[str, float] | None = None,
) -> list[tuple[float, int, PeerSnapshot]]:
    """Each candidate's (cost, effective match, peer): ``cost`` inlined, with its match at least the ``common`` prefix
    and at most the ``usable`` blocks; with ``rates``, reaching its tiers' depth at the load's time (module docstring,
    "KV tiers"), which goes to ``loads`` (node id -> prefill tokens) where not 0."""
    costs: list[tuple[float, int, PeerSnapshot]] = []
    for m, load, p in rows:
        eff = m if m < usable else usable
        if eff < common:
            eff = common
        loaded = 0.0
        if rates is not None and (p.est_disk_blocks > eff or p.est_host_blocks > eff):
            deep = _tier_depth(p, eff, usable, rates)
            loaded = _tier_read_seconds(p, eff, deep, usable, bs, rates) / prefill_s_per_token
            eff = deep
        uncached = prompt - eff * bs
        b = p.load.prefill_backlog_tokens
        backlog = (p.load.waiting + p.in_flight) * uncached if b is None else b
        work = backlog + uncached
        steps = -(-work // STEP_TOKENS) if work > STEP_TOKENS else 1
        c = backlog + uncached_weight * uncached + steps * (STEP_OVERHEAD_TOKENS + SEQ_TOKENS * load)
        if loaded:
            c += loaded
            if loads is not None:
                loads[p.node_id] = loaded
        costs.append((c, eff, p))
    return costs


def _ranked(
    costs: list[tuple[float, int, PeerSnapshot]],
    others: list[_Keyed],
    bound: float,
    home: tuple[str, ...],
    forced_pulls: dict[str, int] | None,
    tiebreak: int,
) -> list[PeerSnapshot]:
    """The ranked list (module docstring, "Target"): the candidates within ``bound`` by effective match, home, cost,
    this node; then the other candidates by cost; then ``others``. ``forced_pulls``: the pulls ``force_pull`` takes,
    whose nodes go first among equal matches (a forced pull is wanted, not only allowed)."""
    if forced_pulls:
        allowed = [
            ((-eff, p.node_id not in forced_pulls, p.node_id not in home, c, not p.is_self), p.node_id, p)
            for c, eff, p in costs
            if c <= bound
        ]
    else:
        allowed = [((-eff, p.node_id not in home, c, not p.is_self), p.node_id, p) for c, eff, p in costs if c <= bound]
    ranked = rank_keyed(allowed, tiebreak) if len(allowed) > 1 else [allowed[0][2]]
    if len(allowed) < len(costs):
        ranked += rank_keyed([((c, -eff, not p.is_self), p.node_id, p) for c, eff, p in costs if c > bound], tiebreak)
    if others:
        ranked += rank_keyed(others, tiebreak)
    return ranked


def _reason(
    target: PeerSnapshot,
    chosen: PeerSnapshot,
    pull: Pull | None,
    m_target: int,
    m_best: int,
    candidates: int,
    best_cost: float,
) -> str:
    """Why ``target`` (``chosen`` before ``FILL_EMPTY``), for the decision's log line: ``m_target`` its match,
    ``m_best`` the deepest of the ``candidates``, ``best_cost`` the least cost."""
    best = round(best_cost)
    if pull is not None:
        return f"pull {pull.blocks} blocks from {pull.holder}: cheaper than its queue or a prefill, cost {best}"
    if target is not chosen:
        return f"empty node: starts sooner than {chosen.node_id}, which has a queue (least cost {best})"
    if m_best == 0:
        return f"no match: least cost {best} of {candidates} candidates"
    if m_target == m_best:
        return f"longest match {m_target} blocks, cost {best}"
    return f"cost: {m_best}-block match not worth its queue; {m_target} blocks, cost {best}"


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    choices: int = CHOICES,
    holders: int = HOLDERS,
    uncached_weight: float = UNCACHED_WEIGHT,
    allowance: float = ALLOWANCE,
    slack: int = SLACK_TOKENS,
    homes: int = HOMES,
    fill_empty: bool = FILL_EMPTY,
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
    pull_rtt_s: float = PULL_RTT_S,
    force_pull: bool = FORCE_PULL,
    exact_weight: float = EXACT_WEIGHT,
    approximate_weight: float = APPROXIMATE_WEIGHT,
    host_load_bytes_per_s: float = HOST_LOAD_BYTES_PER_S,
    disk_load_bytes_per_s: float = DISK_LOAD_BYTES_PER_S,
) -> Decision:
    """The least-cost candidate (module docstring). ``homes``: how many of ``request.homes`` to take (0: none; a
    what-if); ``fill_empty``: ``FILL_EMPTY`` (False: a what-if). Every step is one pass over the peers with the
    per-peer helpers of ``types`` inlined (``match_blocks``, ``requests``, ``uncached_tokens``, ``backlog_tokens``):
    this is the default policy on every request's path. On its common path (no segments, no tier or pull to price)
    the steps from ``alive_peers`` to ``_empty_first`` run in C (``_native_rank``, routing/native/p2p_rank.c, ~3x
    faster), which decides exactly as this Python (tests/unit/test_p2p_native.py); the Python runs wherever it
    returns None."""
    n, bs, prompt, tiebreak = len(request.block_hashes), request.block_size, request.prompt_tokens, request.tiebreak
    usable = (prompt - 1) // bs  # an engine never serves the last prompt token from its cache
    mode = request.segment_mode
    segmented = mode is not None  # a node's reuse is its segment estimate (module docstring, "Segments")
    weight = 0.0 if mode is None else exact_weight if mode is SegmentReuse.EXACT else approximate_weight
    common = min(request.common_match_blocks, usable) if not segmented else 0
    home = request.homes[:homes] if homes > 0 and not segmented else ()
    tiered = host_load_bytes_per_s > 0 and kv_bytes_per_token > 0 and not segmented
    if _native_rank is not None and not segmented and (choices <= 0 or len(request.sampled) >= choices):
        sampled = set(request.sampled[:choices]) if choices > 0 else None  # ``_sampled`` without the alive peers
        fast = _native_rank(
            peers, sampled, home, request.holders, n, bs, prompt, usable, common, uncached_weight, holders, allowance,
            slack, tiebreak, fill_empty, tiered, kv_bytes_per_token > 0 and request.kv_movable, _CONSTANTS,
        )
        if fast is not None:  # else off the common path (p2p_rank.c says where): the Python below decides
            ids, target, chosen, best_cost, m_best, candidates, depth = fast
            reason = _reason(target, chosen, None, match_blocks(request, target), m_best, candidates, best_cost)
            return Decision(ids, NAME, depth, reason)
    alive = alive_peers(peers)
    sampled = _sampled(request, alive, choices)
    rows, matched, others = _split(alive, sampled, home, n, bs, weight, segmented)
    if matched:
        _add_holders(rows, others, matched, request, holders, weight, segmented)
    if not rows:  # neither this node nor the sample can serve it (a LoRA adapter only a few nodes serve): all can
        rows = [(0, p.load.running + p.load.waiting + p.in_flight, p) for _, _, p in others]
        others = []
    rates = None
    loads: dict[str, float] = {}
    if tiered and any(p.est_disk_blocks > m or p.est_host_blocks > m for m, _, p in rows):  # a tier reaches on
        rates = TierRates(kv_bytes_per_token, host_load_bytes_per_s, disk_load_bytes_per_s)
    costs = _costs(rows, prompt, bs, usable, common, uncached_weight, rates, prefill_s_per_token, loads)
    pulls: dict[str, int] = {}
    source = ""
    # a request with segments pulls nothing, nor one whose KV cannot move (an adapter's, a salted one's)
    if kv_bytes_per_token > 0 and len(costs) > 1 and not segmented and request.kv_movable:
        costs, pulls, source = _with_pulls(
            costs, rows, prompt, bs, usable, uncached_weight, kv_bytes_per_token, prefill_s_per_token, pull_rtt_s,
            force_pull, rates,
        )
    best_cost = min(c[0] for c in costs)
    bound = max(allowance * best_cost + slack, best_cost)  # the cheapest always allowed (a what-if's allowance < 1)
    ranked = _ranked(costs, others, bound, home, pulls if force_pull else None, tiebreak)
    chosen = ranked[0]
    if fill_empty and len(costs) > 1:
        ranked = _empty_first(ranked, costs, prompt, bs, loads)
    target = ranked[0]
    pull = Pull(target.node_id, source, pulls[target.node_id]) if target.node_id in pulls else None
    m_target = match_blocks(request, target) if not segmented else next((m for m, _, p in rows if p is target), 0)
    reason = _reason(target, chosen, pull, m_target, max(r[0] for r in rows), len(rows), best_cost)
    return make_decision(NAME, request, ranked, reason, pull)


def reads(params: Mapping[str, Any]) -> Reads:
    """Sparse (its candidates are this node, the holders, the sampled peers and the homes), with ``homes`` homes and
    its ``choices`` sampled peers, whose ``holders`` the router draws (``types.draw_holders``); with every peer a
    candidate (``choices`` 0) it needs the least-loaded others too, every holder, and every peer's sends in flight.
    With a sample, another peer's sends in flight would only order the retries past the candidates: they are not
    read (``Reads.sends_elsewhere``), so a busy ingress decides in O(candidates)."""
    choices, holders = params["choices"], params["holders"]
    return Reads(
        sparse=True,
        homes=params["homes"],
        sampled=choices if choices > 0 else SAMPLED_PEERS,
        holders=holders if choices > 0 else 0,
        least_loaded=0 if choices > 0 else LEAST_LOADED_CANDIDATES,
        segments=True,
        sends_elsewhere=choices <= 0,
    )


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.OURS,
    defaults={
        "choices": CHOICES,
        "holders": HOLDERS,
        "uncached_weight": UNCACHED_WEIGHT,
        "allowance": ALLOWANCE,
        "slack": SLACK_TOKENS,
        "homes": HOMES,
        "fill_empty": FILL_EMPTY,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "prefill_s_per_token": PREFILL_S_PER_TOKEN,
        "pull_rtt_s": PULL_RTT_S,
        "force_pull": FORCE_PULL,
        "exact_weight": EXACT_WEIGHT,
        "approximate_weight": APPROXIMATE_WEIGHT,
        "host_load_bytes_per_s": HOST_LOAD_BYTES_PER_S,
        "disk_load_bytes_per_s": DISK_LOAD_BYTES_PER_S,
    },
    reads_of=reads,
    variants={
        "w": ("uncached_weight", float),
        "h": ("holders", int),
        "c": ("choices", int),
        "a": ("allowance", float),
        "s": ("slack", int),
        "o": ("homes", int),
        "e": ("fill_empty", lambda v: bool(int(v))),
        "f": ("force_pull", lambda v: bool(int(v))),
        "x": ("exact_weight", float),
        "y": ("approximate_weight", float),
    },
    profile_params=lambda profile: {
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "prefill_s_per_token": profile.prefill_s_per_token,
        "host_load_bytes_per_s": getattr(profile, "host_load_bytes_per_s", 0.0),
        "disk_load_bytes_per_s": getattr(profile, "disk_load_bytes_per_s", 0.0),
    },
    force_pull_param="force_pull",
    segment_pull_price=segment_pull_price,
)
