"""The default policy's ranking and the retry order's completion in C (``routing/native/p2p_rank.c``) decide exactly
as their Python definitions: the same decision, field by field, on random candidate sets that cover every branch (ties
at every key, homes, the sample, drawn holders, tiers, pulls, empty nodes, dead peers, out-of-range values), and the
same error where the Python raises."""

from __future__ import annotations

import random
from collections.abc import Callable
from unittest import mock

import pytest

from p2pnode.load import NodeLoad
from p2pnode.routing import candidates
from p2pnode.routing.candidates import CandidateSet
from p2pnode.routing.policies import p2p
from p2pnode.routing.policies.types import Decision, NoAliveCandidate, PeerSnapshot, RouteRequest

BS = 16


def random_peer(rng: random.Random, node_id: str, n: int, is_self: bool = False) -> PeerSnapshot:
    if rng.random() < 0.15:  # an empty node: FILL_EMPTY's candidates, equal among themselves
        return PeerSnapshot(node_id=node_id, is_self=is_self, cached_blocks=0, est_match_blocks=rng.choice([0, 1]))
    small = rng.random() < 0.6  # small ranges: ties on every key
    count = (lambda: rng.choice([0, 0, 1, 2])) if small else (lambda: rng.randrange(0, 40))
    match = rng.choice([0, 0, 1, n // 2, n, n + 3, -1]) if small else rng.randrange(-2, n + 5)
    backlog = rng.choice([None, None, 0, 1, 5000, 3 * p2p.STEP_TOKENS])
    if rng.random() < 0.01:
        backlog = 1 << 51  # past what the C reads: the Python decides
    load = NodeLoad(running=count(), waiting=count(), prefill_backlog_tokens=backlog)
    tiers = rng.random() < 0.25
    host = max(match, 0) + rng.randrange(0, 4) if tiers else 0
    return PeerSnapshot(
        node_id=node_id,
        is_self=is_self,
        alive=rng.random() < 0.9 or is_self,
        est_match_blocks=match,
        load=load,
        in_flight=count(),
        cached_blocks=rng.choice([None, 0, 0, 3]),
        est_host_blocks=host,
        est_disk_blocks=host + rng.randrange(0, 3) if tiers else 0,
        link_bytes_per_s=rng.choice([0.0, 0.0, 1e9]),
        kv_layout=rng.choice(["", "", "layout-a"]),
    )


def random_case(rng: random.Random) -> tuple[RouteRequest, list[PeerSnapshot], dict[str, object]]:
    n = rng.choice([0, 1, 4, 9, 40])
    prompt = n * BS + rng.choice([0, 1, 7])
    count = rng.choice([1, 2, 3, 6, 12, 40])
    ids = [f"n{i:02d}" for i in rng.sample(range(99), count)]
    peers = [random_peer(rng, node_id, n, is_self=(i == 0 and rng.random() < 0.8)) for i, node_id in enumerate(ids)]
    rng.shuffle(peers)
    others = [p.node_id for p in peers if not p.is_self]
    choices = rng.choice([p2p.CHOICES, 0, 1, 3])
    drawn = rng.choice([choices, choices, 0, 1, 3])  # the router draws the policy's choices; a caller may draw none
    sampled = tuple(rng.sample(others, min(len(others), drawn)))
    holders = tuple(rng.sample(others, min(len(others), rng.choice([0, 0, 2]))))
    homes = tuple(rng.sample(ids, 1)) if rng.random() < 0.4 else ()
    request = RouteRequest(
        block_hashes=tuple(range(n)),
        prompt_tokens=prompt,
        max_tokens=16,
        routing_key="k",
        block_size=BS,
        tiebreak=rng.choice([0, 1, rng.getrandbits(64), rng.getrandbits(40)]),
        sampled=sampled,
        holders=holders,
        common_match_blocks=rng.choice([0, 0, 1, n // 2]),
        homes=homes,
        kv_movable=rng.random() < 0.8,
    )
    params: dict[str, object] = {
        "choices": choices,
        "holders": rng.choice([p2p.HOLDERS, 0, 1]),
        "allowance": rng.choice([p2p.ALLOWANCE, 1.0, 2.0]),
        "slack": rng.choice([p2p.SLACK_TOKENS, 0, 100]),
        "fill_empty": rng.random() < 0.8,
        "uncached_weight": rng.choice([p2p.UNCACHED_WEIGHT, 1.0, 2.5]),
        "homes": rng.choice([p2p.HOMES, 0]),
    }
    if rng.random() < 0.3:  # a profile with pulls, sometimes tiers
        params.update(kv_bytes_per_token=131072, prefill_s_per_token=4e-5)
        if rng.random() < 0.5:
            params.update(host_load_bytes_per_s=5e10, disk_load_bytes_per_s=5e9)
    return request, peers, params


def decide(request: RouteRequest, peers: list[PeerSnapshot], params: dict[str, object]) -> Decision | str:
    try:
        return p2p.route(request, peers, None, **params)  # type: ignore[arg-type]
    except (NoAliveCandidate, ValueError, IndexError) as e:
        return f"{type(e).__name__}: {e}"


def test_the_c_ranking_decides_as_the_python_on_random_candidates() -> None:
    assert p2p._native_rank is not None, "p2pnode.routing._p2p was not built: run scripts/bootstrap.sh"
    rng = random.Random(11)
    taken = 0
    native = p2p._native_rank

    def counted(*args: object) -> object:
        nonlocal taken
        out = native(*args)
        taken += out is not None
        return out

    for t in range(6000):
        request, peers, params = random_case(rng)
        with mock.patch.object(p2p, "_native_rank", counted):
            got = decide(request, peers, params)
        with mock.patch.object(p2p, "_native_rank", None):  # the definition
            expected = decide(request, peers, params)
        assert got == expected, (t, request, peers, params)
    assert taken > 3000  # the common path is the C one: most cases (those without pulls and tiers) did not fall back


def test_candidates_past_the_bound_at_equal_cost_rank_deepest_first_in_c_too() -> None:
    """Equal costs past the bound from different matches (a deeper match behind a longer reported queue): rare in
    random cases, so built here; deepest first, then this node, then the tiebreak's rotation."""
    weight = p2p.UNCACHED_WEIGHT
    me = PeerSnapshot(node_id="me", is_self=True, load=NodeLoad(prefill_backlog_tokens=0))
    peers = [me] + [  # backlog + weight x uncached: the same for all peers, 999 more than at this node
        PeerSnapshot(
            node_id=f"p{i}", est_match_blocks=m, load=NodeLoad(prefill_backlog_tokens=int(weight * BS * m) + 999)
        )
        for i, m in enumerate([1, 3, 2, 3, 1])
    ]
    for tiebreak in range(6):
        request = RouteRequest(tuple(range(4)), 4 * BS + 1, 8, "k", BS, tiebreak)
        params = {"choices": 0, "allowance": 1.0, "slack": 0}
        with mock.patch.object(p2p, "_native_rank", None):
            expected = decide(request, peers, params)
        assert decide(request, peers, params) == expected
        assert isinstance(expected, Decision) and expected.ranked[0] == "me"
        assert {expected.ranked[1], expected.ranked[2]} == {"p1", "p3"} and expected.ranked[-2:] in (
            ("p0", "p4"), ("p4", "p0"))


def both(request: RouteRequest, peers: list[PeerSnapshot], **params: object) -> tuple[object, object]:
    """The decision with the C ranking, and the Python's."""
    got = decide(request, peers, params)
    with mock.patch.object(p2p, "_native_rank", None):
        return got, decide(request, peers, params)


def test_what_the_c_cannot_read_as_the_python_does_is_left_to_the_python() -> None:
    """Found in review: an int weight (the Python's costs stay exact ints past 2**53, where doubles round), an engine
    step count near the top of a C integer, and homes or holders as lists each decide as the Python does."""
    huge = 2**50
    for prompt in (5, 6):  # costs past 2**53: with weight 1 the ranking turns on their last unit
        request = RouteRequest((1, 2), prompt, 1, "k", 2, 0)
        busy = NodeLoad(running=huge, waiting=huge, prefill_backlog_tokens=0)
        me = PeerSnapshot(node_id="a", is_self=True, load=busy, in_flight=huge - 1)
        holder = PeerSnapshot(node_id="b", est_match_blocks=1, load=busy, in_flight=huge)
        for weight in (1, 1.0):
            got, expected = both(request, [me, holder], choices=0, uncached_weight=weight, allowance=1.0, slack=0,
                                 fill_empty=False)
            assert got == expected, (prompt, weight)
    deep = -(2**49 - 2)  # a negative match and common prefix: the work of a step near 2**63
    request = RouteRequest((1,), 16284, 1, "k", 8192, 0, sampled=("zz",), common_match_blocks=deep)
    holder = PeerSnapshot(node_id="h", est_match_blocks=deep, est_disk_blocks=1, load=NodeLoad(waiting=1))
    got, expected = both(request, [holder], choices=1)
    assert got == expected
    request = RouteRequest((1,), 20, 1, "k", 16, 0, homes=["a"], holders=["b"])  # type: ignore[arg-type]
    peers = [PeerSnapshot(node_id="a", is_self=True), PeerSnapshot(node_id="b", est_match_blocks=1)]
    got, expected = both(request, peers, choices=0)
    assert isinstance(got, Decision) and got == expected


class DeeperOnRead(PeerSnapshot):
    """A snapshot whose match reads one block deeper than its slot holds: the C reads a field from its slot only
    where getattr would read that slot."""

    __slots__ = ()

    @property  # type: ignore[override]
    def est_match_blocks(self) -> int:
        return PeerSnapshot.est_match_blocks.__get__(self) + 1  # type: ignore[attr-defined]

    @est_match_blocks.setter
    def est_match_blocks(self, value: int) -> None:
        PeerSnapshot.est_match_blocks.__set__(self, value)  # type: ignore[attr-defined]


def test_a_field_read_through_a_property_is_read_as_the_python_reads_it() -> None:
    request = RouteRequest(tuple(range(8)), 8 * BS + 1, 1, "k", BS, 0, sampled=("a", "b"))
    for cls in (PeerSnapshot, DeeperOnRead):  # a plain snapshot first: the C's slot cache has seen the base type
        peers = [
            PeerSnapshot(node_id="me", is_self=True, est_match_blocks=2),
            cls(node_id="a", est_match_blocks=3),
            PeerSnapshot(node_id="b", est_match_blocks=3),
        ]
        got, expected = both(request, peers)
        assert got == expected
    assert isinstance(got, Decision) and got.ranked[0] == "a"  # 4 blocks read: deeper than b's 3


def test_a_decision_with_a_duplicate_or_no_alive_peer_fails_as_before() -> None:
    request = RouteRequest((1, 2), 2 * BS, 8, "k", BS, 5, sampled=("b",))  # as the router asks: a sample drawn
    twice = [PeerSnapshot(node_id="a", is_self=True), PeerSnapshot(node_id="b"), PeerSnapshot(node_id="b")]
    many = [PeerSnapshot(node_id=f"n{i}") for i in range(20)] + [PeerSnapshot(node_id="n3", alive=False)]
    dead = [PeerSnapshot(node_id="a", alive=False)]
    for peers, error in ((twice, ValueError), (many, ValueError), (dead, NoAliveCandidate)):
        for native in (p2p._native_rank, None):
            for choices in (1, 0):
                with mock.patch.object(p2p, "_native_rank", native), pytest.raises(error):
                    p2p.route(request, peers, choices=choices)


def position_in(alive: tuple[str, ...]) -> Callable[[str], int]:
    """``PeerTable.alive_position`` of a table whose load order is ``alive``."""
    positions = {node_id: i for i, node_id in enumerate(alive)}
    return lambda node_id: positions.get(node_id, -1)


def test_the_c_retry_order_is_the_python_one() -> None:
    assert candidates._native_complete is not None, "p2pnode.routing._p2p was not built: run scripts/bootstrap.sh"
    rng = random.Random(12)
    for t in range(3000):
        alive = tuple(f"p{i:03d}" for i in rng.sample(range(300), rng.choice([0, 1, 5, 40, 300])))
        ranked = list(rng.sample(alive, rng.randrange(0, min(len(alive), 20) + 1)))
        if rng.random() < 0.1:  # this node among the alive peers (never a peer table's): the C leaves it to the Python
            at = rng.randrange(len(alive) + 1)
            alive = (*alive[:at], rng.choice(["self", "".join(["se", "lf"])]), *alive[at:])
        if rng.random() < 0.5:
            ranked.insert(rng.randrange(len(ranked) + 1), "self")
        if ranked and rng.random() < 0.3:  # equal ids that are other objects than the table's
            ranked = ["".join(list(node_id)) for node_id in ranked]
        if rng.random() < 0.1:
            ranked.append(rng.choice(["gone", *ranked[:1]]))  # not alive, or ranked twice
        if not ranked:
            continue
        decision = Decision(tuple(ranked), "p2p", 3, "why")
        for position_of in (None, position_in(alive)):
            cut = CandidateSet([], {}, True, alive, position_of)
            outcomes = []
            for native in (candidates._native_complete, None):
                with mock.patch.object(candidates, "_native_complete", native):
                    try:
                        outcomes.append(cut.complete(decision, "self"))
                    except ValueError as e:
                        outcomes.append(f"ValueError: {e}")
            assert outcomes[0] == outcomes[1], (t, ranked, alive)
    assert candidates._native_complete(("p1",), ("p1", "p2", "self"), "self") is None
    assert candidates._native_complete(("p1",), ("p1", "p2", "q"), "self") == ("p1", "p2", "q")
