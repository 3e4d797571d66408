"""What a routing policy sees and what it answers, plus the few helpers every policy shares.

A policy is a pure function ``(RouteRequest, peers, plan) -> Decision``: the same inputs give the same decision
on every node and in the simulator, so nothing here reads a clock, a global or the ``random`` module; per-request
randomness comes from ``RouteRequest.tiebreak``.

Invariants of every Decision: ``ranked`` holds every alive peer exactly once and no dead one; ``ranked[0]`` is
the target and the rest is the retry order. No alive peer raises ``NoAliveCandidate``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from p2pnode.cache.block_hash import mix64
from p2pnode.cache.segments import SegmentReuse
from p2pnode.frozen import fast_init
from p2pnode.load import NO_LOAD, NodeLoad
from p2pnode.plan.plan import Plan
from p2pnode.routing.served_rate import ServedRate

__all__ = [
    "Decision",
    "NoAliveCandidate",
    "PeerSnapshot",
    "Policy",
    "Pull",
    "RouteRequest",
    "active_blocks",
    "alive_peers",
    "backlog_tokens",
    "context_homes",
    "draw_holders",
    "draw_holders_by_depth",
    "make_decision",
    "match_blocks",
    "rank",
    "rank_keyed",
    "request_blocks",
    "sample_peers",
    "tier_blocks",
    "uncached_tokens",
]


_U64 = (1 << 64) - 1


class NoAliveCandidate(RuntimeError):
    """No peer (self included) is alive: the request cannot be placed anywhere."""


@fast_init
@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as routing sees it: its prompt's block chain and sizes, never its tokens."""

    block_hashes: tuple[int, ...]  # p2pnode chained hashes of the prompt's full blocks
    prompt_tokens: int
    max_tokens: int  # expected decode length (upper bound)
    routing_key: str  # client-given, or derived (routing/keys.py; "request:<id>" for a policy that reads none)
    block_size: int
    tiebreak: int  # per-request 64-bit value (hash of the request id): the only source of randomness
    #: Peers (never the ingress itself) drawn at random for this request by the caller from every alive peer, with
    #: ``sample_peers``; empty: a policy that wants a sample draws it from the peers it is given (same result
    #: when it is given every peer). The router draws it because it may hand a policy only some peers.
    sampled: tuple[str, ...] = ()
    #: For ``p2p``: the peers with the deepest estimated match it takes as candidates, drawn by the caller from every
    #: alive peer's estimate with ``draw_holders`` (so a caller may hand it only those of the many holders of a
    #: prompt cached mesh-wide); empty: the policy draws them from the peers it is given (same result when it is
    #: given every peer).
    holders: tuple[str, ...] = ()
    #: The deepest estimated match that a majority of the alive nodes hold (this one included), in blocks: a
    #: prefix held mesh-wide (a platform system prompt) is worth a one-time prefill wherever it is missing, so it is
    #: no reason to prefer one node over another. 0 when the caller does not know.
    common_match_blocks: int = 0
    #: For ``p2p``: the nodes the request's own context hashes to (``context_homes``), the same at every
    #: ingress; empty when not known or when the whole prompt is cached somewhere.
    homes: tuple[str, ...] = ()
    #: For a key warm in the plan: this ingress's sends of the key to each of its destinations under that plan
    #: (``routing/split.py``), which ``cacheroute`` splits by; None when not known.
    plan_sends: Mapping[str, int] | None = None
    #: How the request reuses its segments (``exact`` or ``approximate``; None: prefix caching only). With a mode,
    #: what a node reuses is its ``PeerSnapshot.est_segment_tokens``, not its prefix estimate of the prompt as sent
    #: (``routing/segments.py``); set only for the policies that read segments (``Reads.segments``).
    segment_mode: SegmentReuse | None = None
    #: Whether the prompt's KV may move between nodes (a pull): only the default namespace's does. A pull leases the
    #: holder's blocks by tokens alone (``ExportRequest``), and a LoRA adapter's KV is not the base model's, so a
    #: policy that planned one for an adapter or a salted prompt would send it to a node that then computes it.
    kv_movable: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.routing_key:
            raise ValueError("routing_key must not be empty")
        if self.prompt_tokens < len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"prompt_tokens={self.prompt_tokens} is shorter than its {len(self.block_hashes)} full blocks "
                f"of {self.block_size}"
            )


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSnapshot:
    """One peer (or self) as this ingress believes it is now: the directory's estimate and load plus local counters.

    ``load`` is the peer's last report (this node's: live), its prefill backlog raised by the prompt tokens this
    ingress sent there since (which the report cannot hold yet); ``in_flight`` counts those sends. The two optional
    fields sharpen the cost-model policies (dynamo, sglang); ``None`` means "not known" and each policy documents its
    fallback, as for an unreported ``load.prefill_backlog_tokens``.
    """

    node_id: str
    is_self: bool = False
    alive: bool = True  # policies never choose a peer that is not alive
    est_match_blocks: int = 0  # estimated cached prefix of THIS request there (directory + speculative TTL index)
    load: NodeLoad = NO_LOAD
    in_flight: int = 0  # sent there by this ingress since its report and not finished (bursts between reports)
    info_age_s: float = 0.0
    #: KV blocks held by its running requests (vLLM: kv_usage x num_gpu_blocks); Dynamo's "active blocks".
    active_blocks: int | None = None
    #: Size of its (estimated) prefix cache in blocks; SGLang's and Dynamo's "tree size".
    cached_blocks: int | None = None
    #: Its KV layout's fingerprint (model, dtype, block size, engine version, kernel layout): only nodes of equal,
    #: non-empty layouts can move KV blocks between them ("": it takes part in no KV transfer).
    kv_layout: str = ""
    #: Bytes per second a KV pull from this peer is expected to move (0: never pull from it).
    link_bytes_per_s: float = 0.0
    #: For a request with segments (``RouteRequest.segment_mode``): the tokens of them it would reuse there
    #: (``routing/segments.py``); 0 otherwise.
    est_segment_tokens: int = 0
    #: Its KV tiers' estimated cumulative depths of this request's prefix (``cache/tiers.TierDepths``): the blocks in
    #: its engine or its host tier, and with its disk tier too -- what it would reuse loading the rest from its tiers
    #: (>= ``est_match_blocks`` when set); 0: no tier, or none reaching past its engine's match (``tier_blocks``).
    est_host_blocks: int = 0
    est_disk_blocks: int = 0
    #: Its recent served work per second, from its gossiped served counts (``routing/served_rate.py``); None until
    #: its reports span a few seconds. ``cacheroute`` leans a whale's split on it.
    served_rate: ServedRate | None = None

    @property
    def requests(self) -> int:
        """Requests there or on their way: ``running + waiting + in_flight``.

        ``in_flight`` overlaps ``running + waiting`` once gossip reports what this ingress sent; the router
        keeps the overlap small by counting only requests sent since the peer's last gossip update. Without
        it a burst between two updates would see the same stale load and herd onto one peer.
        """
        load = self.load
        return load.running + load.waiting + self.in_flight


@fast_init
@dataclass(frozen=True, slots=True)
class Pull:
    """Serve at ``target`` with the first ``blocks`` blocks of the prompt's KV pulled from ``holder`` (``blocks``
    counts from the start of the prompt: what ``target`` already holds is reused, the rest is moved)."""

    target: str
    holder: str
    blocks: int


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send a request and where to retry it."""

    ranked: tuple[str, ...]  # node ids in preference order: [0] is the target, the rest the retry order
    policy: str
    est_match_blocks: int  # of ranked[0], counting what it would pull or load from its KV tiers
    reason: str  # short and human-readable ("longest match 12 blocks", "load guard: ...")
    #: The target's prefix to pull before serving (only for ``ranked[0]``; a retry elsewhere computes it).
    pull: Pull | None = None

    @property
    def target(self) -> str:
        return self.ranked[0]


#: ``plan`` is the rate plan in force (``p2pnode.plan.plan``); only ``cacheroute`` reads it, every policy accepts it.
Policy = Callable[[RouteRequest, Sequence[PeerSnapshot], Plan | None], Decision]


def alive_peers(peers: Sequence[PeerSnapshot]) -> list[PeerSnapshot]:
    """The alive peers; NoAliveCandidate when there are none, ValueError on a duplicate node id.

    A duplicate id would break "every alive peer exactly once" in the ranked list, so it is refused here.
    """
    alive = [p for p in peers if p.alive]
    if not alive:
        raise NoAliveCandidate(f"no alive peer among {len(peers)} known (self included)")
    if len({p.node_id for p in peers}) != len(peers):
        raise ValueError("duplicate node_id in peers")
    return alive


def match_blocks(request: RouteRequest, peer: PeerSnapshot) -> int:
    """The peer's estimated match, clamped to the request's own length (an estimate can't exceed the prompt)."""
    m, n = peer.est_match_blocks, len(request.block_hashes)
    return m if 0 <= m <= n else (0 if m < 0 else n)


def tier_blocks(request: RouteRequest, peer: PeerSnapshot) -> tuple[int, int, int]:
    """The peer's (engine, host, disk) cumulative estimates, clamped to the request's length: what it reuses from its
    engine's KV, and loading from its host tier and then its disk tier too (both the engine's match without tiers)."""
    m = match_blocks(request, peer)
    host, disk = peer.est_host_blocks, peer.est_disk_blocks
    if host <= m and disk <= m:
        return m, m, m
    n = len(request.block_hashes)
    host = min(max(host, m), n)
    return m, host, min(max(disk, host), n)


def uncached_tokens(request: RouteRequest, peer: PeerSnapshot) -> int:
    """Prompt tokens the peer would have to prefill (everything past its estimated match)."""
    return request.prompt_tokens - match_blocks(request, peer) * request.block_size


def request_blocks(request: RouteRequest) -> int:
    """Blocks the prompt will occupy, the partial last one included."""
    return -(-request.prompt_tokens // request.block_size)


def active_blocks(peer: PeerSnapshot, request_blocks: int) -> int:
    """KV blocks held by the peer's requests: the reported value, else ``requests`` of ``request_blocks``.

    The fallback assumes the peer's requests resemble this one; it keeps cost models load-aware when the
    ClusterView has no block counts (it is exact for a homogeneous workload).
    """
    return peer.requests * request_blocks if peer.active_blocks is None else peer.active_blocks


def backlog_tokens(peer: PeerSnapshot, uncached: int) -> int:
    """Uncached prompt tokens queued at the peer: the reported value, else ``waiting + in_flight`` requests that
    each miss ``uncached`` tokens there, as this one would.

    Same assumption as ``active_blocks``, applied per peer: requests queued at a peer that holds this prefix
    mostly share it (that is why they were sent there), so they are mostly hits too.
    """
    backlog = peer.load.prefill_backlog_tokens
    if backlog is None:
        return (peer.load.waiting + peer.in_flight) * uncached
    return backlog


def rank(peers: Sequence[PeerSnapshot], key: Callable[[PeerSnapshot], Any], tiebreak: int) -> list[PeerSnapshot]:
    """Peers by ascending ``key``; each run of equal keys rotated by ``tiebreak``.

    Peers are first ordered by node id within a run, so the result does not depend on the input order; the
    rotation spreads equal choices over the run (round robin when the caller passes a counter, uniform when
    it passes a hash of the request id).
    """
    return rank_keyed([(key(p), p.node_id, p) for p in peers], tiebreak)


def rank_keyed(keyed: list[tuple[Any, str, PeerSnapshot]], tiebreak: int) -> list[PeerSnapshot]:
    """``rank`` over ``(key, node_id, peer)`` triples the caller built (a hot path builds them in one pass).

    Sorts ``keyed`` in place.
    """
    keyed.sort()  # node ids are unique, so the peers themselves are never compared
    out: list[PeerSnapshot] = []
    i, n = 0, len(keyed)
    while i < n:
        k, j = keyed[i][0], i + 1
        while j < n and keyed[j][0] == k:
            j += 1
        if j - i == 1:
            out.append(keyed[i][2])
        else:
            shift = i + tiebreak % (j - i)
            out.extend(t[2] for t in keyed[shift:j])
            out.extend(t[2] for t in keyed[i:shift])
        i = j
    return out


def sample_peers(ids: Sequence[str], tiebreak: int, count: int) -> tuple[str, ...]:
    """``count`` distinct ids drawn uniformly from ``ids`` (sorted by the caller, so every caller draws alike),
    from a splitmix64 stream seeded by the request's tiebreak; every id when there are not more than ``count``."""
    n = len(ids)
    if count >= n:
        return tuple(ids)
    out: list[str] = []
    x = tiebreak & _U64
    while len(out) < count:
        pick = ids[mix64(x) % n]
        x = (x + 0x9E3779B97F4A7C15) & _U64
        if pick not in out:
            out.append(pick)
    return tuple(out)


def draw_holders(
    estimates: dict[str, int],
    n_blocks: int,
    tiebreak: int,
    exclude: set[str],
    alive: Callable[[str], bool],
    holders: int,
) -> tuple[str, ...]:
    """The ``holders`` peers with the deepest estimated match (clamped to the prompt's ``n_blocks``), among equal
    depths entered at a ``tiebreak`` offset -- exactly whom ``p2p.route`` takes from the peers it is given -- computed
    over every peer's estimate (``exclude``: this node and the sampled peers) without a snapshot per peer. One C
    sort of the estimates; ``alive`` is asked only of the deepest few."""
    by_depth = sorted(estimates.items(), key=itemgetter(1), reverse=True)
    levels = [(depth, (node_id,)) for node_id, depth in by_depth]  # equal depths are merged there
    return draw_holders_by_depth(levels, n_blocks, tiebreak, exclude, alive, holders)


#: A level of more peers than this is drawn from through ``draw_holders_by_depth``'s ``sorted_alive``, when given.
DRAW_FROM_SORTED_ABOVE = 64

try:  # the draw in C: the same holders (tests/unit/test_routing_levels.py); without it, the Python below
    from p2pnode.routing._p2p import draw_by_depth as _native_draw
except ImportError:  # pragma: no cover - built by make bootstrap
    _native_draw = None


def draw_holders_by_depth(
    levels: Sequence[tuple[int, Sequence[str]]],
    n_blocks: int,
    tiebreak: int,
    exclude: set[str],
    alive: Callable[[str], bool],
    holders: int,
    sorted_alive: Callable[[Sequence[str]], Sequence[str]] | None = None,
) -> tuple[str, ...]:
    """``draw_holders`` from the estimates grouped by depth, deepest first (``(depth, node ids)``, one per depth, as
    ``ClusterView.estimate_levels`` gives them): the same holders, reading only the deepest few groups instead of
    sorting every peer's estimate. ``sorted_alive(ids)``: a level's alive ids, sorted (remembered by the caller):
    a level of a prefix cached mesh-wide is then drawn from by a few bisections instead of a sort of its peers. This
    Python is the definition; the C (``routing/native/p2p_rank.c``) draws the same on the common path."""
    if _native_draw is not None:
        drawn = _native_draw(levels, n_blocks, tiebreak, exclude, alive, holders, sorted_alive, DRAW_FROM_SORTED_ABOVE)
        if drawn is not None:
            return drawn  # type: ignore[no-any-return]
    out: list[str] = []
    i, count = 0, len(levels)
    while i < count and len(out) < holders:
        depth = min(levels[i][0], n_blocks)
        if depth <= 0:
            break
        if sorted_alive is not None and len(levels[i][1]) > DRAW_FROM_SORTED_ABOVE and (
            i + 1 == count or min(levels[i + 1][0], n_blocks) != depth
        ):
            out += _rotated_head(sorted_alive(levels[i][1]), exclude, tiebreak, holders - len(out))
            i += 1
            continue
        ids = list(levels[i][1])
        j = i + 1
        while j < count and min(levels[j][0], n_blocks) == depth:
            ids += levels[j][1]
            j += 1
        run = sorted(node_id for node_id in ids if node_id not in exclude and alive(node_id))
        if run:
            shift = tiebreak % len(run)
            out += run[shift:] + run[:shift]
        i = j
    return tuple(out[:holders])


def _rotated_head(run: Sequence[str], exclude: set[str], tiebreak: int, count: int) -> list[str]:
    """The first ``count`` ids of ``draw_holders_by_depth``'s rotated run -- ``run`` (sorted) without ``exclude``,
    rotated by ``tiebreak`` -- found by bisection: the few excluded ids are skipped by their positions."""
    removed = []
    for node_id in exclude:
        at = bisect_left(run, node_id)
        if at < len(run) and run[at] == node_id:
            removed.append(at)
    removed.sort()
    size = len(run) - len(removed)
    if size <= 0:
        return []
    shift = tiebreak % size
    out = []
    for rank in range(shift, shift + min(count, size)):
        at = rank % size
        for gap in removed:  # the rank-th kept id: past each removed position at or before it
            if gap > at:
                break
            at += 1
        out.append(run[at])
    return out


def context_homes(
    block_hashes: Sequence[int], deepest: int, nodes: Sequence[str], count: int
) -> tuple[str, ...]:
    """The ``count`` (1 or 2) nodes the request's own context hashes to (``p2p``'s docstring says why): from its
    first block past ``deepest`` (the deepest estimated match anywhere, this node's included), distinct nodes of
    ``nodes`` (every alive node, this one included, sorted: every ingress names the same ones). Empty when nothing
    of the prompt is cached anywhere (most likely a one-off), when all of it is, or when no node is known. A
    membership change moves most homes; that costs nothing lasting, because homes only matter until gossip reports
    where the context is cached."""
    n = len(nodes)
    if deepest <= 0 or deepest >= len(block_hashes) or not n or count <= 0:
        return ()
    h = mix64(block_hashes[deepest])
    first = h % n
    if n == 1 or count == 1:
        return (nodes[first],)
    second = (first + 1 + (h >> 32) % (n - 1)) % n  # any node but the first, uniformly
    return (nodes[first], nodes[second])


def make_decision(
    policy: str, request: RouteRequest, ranked: Sequence[PeerSnapshot], reason: str, pull: Pull | None = None
) -> Decision:
    """Package an ordered list of peers as a Decision."""
    return Decision(
        ranked=tuple(p.node_id for p in ranked),
        policy=policy,
        est_match_blocks=pull.blocks if pull is not None else tier_blocks(request, ranked[0])[2],
        reason=reason,
        pull=pull,
    )
