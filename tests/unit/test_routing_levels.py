"""The router's shortcuts over many peers give the answers of the plain passes they replace.

With estimates grouped by depth (``ClusterView.estimate_levels``) the router draws holders, finds the common prefix and
the deepest match without sorting every peer's estimate; with each alive peer's position in the load order
(``PeerTable.alive_position``) a decision's retry order is cut from it by slices. Each is checked here against the plain
version on random inputs, ties and clamps included.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from unittest import mock

import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.summary import SUMMARY_META_KEY, SummaryMeta, encode_meta
from p2pnode.cache.summary_log import SummaryWriter, summary_key
from p2pnode.gossip import GossipConfig, SimClock
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership
from p2pnode.gossip.state import ClusterState
from p2pnode.load import LOAD_KEY, NodeLoad, encode_load
from p2pnode.routing import estimates as estimates_module
from p2pnode.routing.candidates import CandidateSet
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.estimates import CUT_REMEMBERED_ABOVE, LevelCuts, raised_levels
from p2pnode.routing.peer_table import LevelMemo, PeerTable
from p2pnode.routing.policies import types
from p2pnode.routing.policies.types import (
    DRAW_FROM_SORTED_ABOVE,
    Decision,
    draw_holders,
    draw_holders_by_depth,
)
from p2pnode.routing.router import common_match

BS = 16


def grouped(estimates: dict[str, int], rng: random.Random) -> list[tuple[int, tuple[str, ...]]]:
    """``estimates`` by depth, deepest first, each depth's ids in a random order."""
    by_depth: dict[int, list[str]] = {}
    for node_id, depth in estimates.items():
        by_depth.setdefault(depth, []).append(node_id)
    for ids in by_depth.values():
        rng.shuffle(ids)
    return [(depth, tuple(by_depth[depth])) for depth in sorted(by_depth, reverse=True)]


def random_estimates(rng: random.Random) -> dict[str, int]:
    peers = rng.choice([1, 3, 9, 40, 200])
    depths = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
    return {f"p{i:03d}": rng.choice(depths) for i in range(peers) if rng.random() < 0.8}


def test_holders_drawn_by_depth_are_the_ones_drawn_by_sorting() -> None:
    rng = random.Random(3)
    for t in range(2000):
        estimates = random_estimates(rng)
        n_blocks = rng.choice([8, 20, 64])  # deeper estimates are clamped to the prompt
        exclude = {k for k in estimates if rng.random() < 0.1}
        alive = frozenset(k for k in estimates if rng.random() < 0.9).__contains__
        holders = rng.choice([1, 2, 4])
        expected = draw_holders(estimates, n_blocks, t, exclude, alive, holders)
        got = draw_holders_by_depth(grouped(estimates, rng), n_blocks, t, exclude, alive, holders)
        assert got == expected, t


def test_holders_drawn_from_sorted_levels_are_the_ones_drawn_by_filtering() -> None:
    """A level of a prefix cached mesh-wide is drawn from by bisection in its sorted alive ids
    (``draw_holders_by_depth``'s ``sorted_alive``): the same holders as the filter and sort of every peer of it, with
    excluded and dead peers anywhere in it, equal clamped depths merged, and runs shorter than the draw."""
    rng = random.Random(8)
    for t in range(1500):
        ids = [f"p{i:04d}" for i in rng.sample(range(5000), rng.choice([70, 200, 600]))]
        levels: list[tuple[int, tuple[str, ...]]] = []
        depth = 60
        while ids:
            size = rng.choice([1, 2, DRAW_FROM_SORTED_ABOVE, DRAW_FROM_SORTED_ABOVE + 1, 300])
            depth -= rng.choice([1, 1, 2])
            levels.append((depth, tuple(ids[:size])))
            ids = ids[size:]
        every = [node_id for _, level in levels for node_id in level]
        dead = set(rng.sample(every, rng.choice([0, 1, 5, len(every) // 2])))
        exclude = set(rng.sample(every, rng.choice([0, 1, 3]))) | {"self"}
        if rng.random() < 0.2:  # every one of a level excluded or dead
            dead |= set(levels[0][1])

        def alive(node_id: str, dead: set[str] = dead) -> bool:
            return node_id not in dead

        def sorted_alive(level: tuple[str, ...], alive: Callable[[str], bool] = alive) -> list[str]:
            return sorted(node_id for node_id in level if alive(node_id))

        n_blocks = rng.choice([20, 58, 100])  # clamped: deeper levels merge at the prompt's length
        holders, tiebreak = rng.choice([1, 2, 4, 40]), rng.getrandbits(64)
        expected = draw_holders_by_depth(levels, n_blocks, tiebreak, exclude, alive, holders)
        got = draw_holders_by_depth(levels, n_blocks, tiebreak, exclude, alive, holders, sorted_alive)
        assert got == expected, t


def python_draw(*args: object) -> tuple[str, ...]:
    """``draw_holders_by_depth`` as its Python definition draws."""
    with mock.patch.object(types, "_native_draw", None):
        return draw_holders_by_depth(*args)  # type: ignore[arg-type]


def test_the_c_draw_is_the_python_one() -> None:
    """``draw_holders_by_depth`` in C (``_p2p.draw_by_depth``) gives the Python definition's holders -- levels of
    every size, with and without ``sorted_alive``, clamped depths merged, excluded ids in and out of the levels, dead
    peers, any tiebreak (past 64 bits, negative), any count -- and where it cannot (a level or an id of another
    type), the Python answers, as the definition does (or raises as it does)."""
    assert types._native_draw is not None, "p2pnode.routing._p2p was not built: run scripts/bootstrap.sh"
    rng = random.Random(21)
    for t in range(3000):
        ids = [f"p{i:04d}" for i in rng.sample(range(5000), rng.choice([0, 3, 20, 70, 300]))]
        levels: list[tuple[int, object]] = []
        depth = 60
        while ids:
            size = rng.choice([1, 2, 5, DRAW_FROM_SORTED_ABOVE, DRAW_FROM_SORTED_ABOVE + 1, 200])
            depth -= rng.choice([0, 1, 1, 2, 30])  # 0: a depth twice (merged levels), 30: to 0 and below
            chunk = ids[:size]
            levels.append((depth, tuple(chunk) if rng.random() < 0.8 else list(chunk)))
            ids = ids[size:]
        every = [node_id for _, level in levels for node_id in level]  # type: ignore[attr-defined]
        dead = set(rng.sample(every, min(len(every), rng.choice([0, 1, 5, 40]))))
        exclude = set(rng.sample(every, min(len(every), rng.choice([0, 1, 3])))) | {"self", "p9999"}
        odd = rng.random()
        if odd < 0.03 and levels:  # the Python's path: an id of another type, a float depth, a list of levels' ids
            levels[0] = (levels[0][0], (*levels[0][1], 7))  # type: ignore[misc]
        elif odd < 0.06 and levels:
            levels[-1] = (float(levels[-1][0]), levels[-1][1])  # type: ignore[assignment]

        def alive(node_id: str, dead: set[str] = dead) -> bool:
            return node_id not in dead

        def sorted_alive(level: tuple[str, ...], alive: Callable[[str], bool] = alive) -> list[str]:
            return sorted(node_id for node_id in level if alive(node_id))

        n_blocks = rng.choice([0, 20, 58, 100])
        holders = rng.choice([0, 1, 2, 4, 40, 1000])
        tiebreak = rng.choice([rng.getrandbits(64), rng.getrandbits(80), -rng.randrange(1, 10**6), 0])
        for sorter in (None, sorted_alive):
            args = (levels, n_blocks, tiebreak, frozenset(exclude) if t % 7 == 0 else exclude, alive, holders, sorter)
            try:
                expected: object = python_draw(*args)
            except TypeError as e:
                expected = f"TypeError: {e}"
            try:
                got: object = draw_holders_by_depth(*args)  # type: ignore[arg-type]
            except TypeError as e:
                got = f"TypeError: {e}"
            assert got == expected, (t, sorter)


def outcome_of(draw: Callable[..., object], *args: object) -> object:
    try:
        return draw(*args)
    except Exception as e:  # compared, not handled
        return f"{type(e).__name__}: {e}"


def test_the_c_draw_reads_the_levels_as_the_python_does_when_a_callback_changes_them() -> None:
    """``alive`` growing a level's list, replacing a later level, raising before a malformed level of the same
    depth, or adding a non-str id: the C and the Python draw alike (each case built twice, fresh). Before, the C
    read a list's size at each step, read a copy of the levels, asked ``alive`` level by level and handed back to
    the Python after ``alive`` ran (so it ran twice)."""

    def growing() -> tuple:
        ids = ["b", "a"]

        def alive(node_id: str) -> bool:
            if len(ids) < 4:
                ids.append(f"c{len(ids)}")
            return True

        return [(5, ids)], 10, 0, set(), alive, 10, None

    def replacing() -> tuple:
        levels: list = [(5, ("a",)), (3, ("b",))]

        def alive(node_id: str) -> bool:
            levels[1] = (3, ("zzz",))
            return True

        return levels, 10, 0, set(), alive, 10, None

    def raising() -> tuple:
        return [(5, ("a",)), (5, ("b",)), (5, 5)], 10, 1, set(), lambda _: 1 / 0, 5, None

    def odd_id() -> tuple:
        ids: list = ["a", "b"]

        def alive(node_id: str) -> bool:
            if len(ids) == 2:
                ids.append(7)
            return True

        return [(5, ids)], 10, 0, set(), alive, 5, None

    def odd_exclude() -> tuple:
        calls = []
        return [(5, ("a", "b"))], 10, 0, {"a", 3}, lambda n: calls.append(n) or len(calls) < 9, 5, None

    for case in (growing, replacing, raising, odd_id, odd_exclude):
        assert outcome_of(draw_holders_by_depth, *case()) == outcome_of(python_draw, *case()), case.__name__


def test_the_c_draw_passes_on_errors_of_its_callbacks() -> None:
    def boom(node_id: str) -> bool:
        raise RuntimeError(f"boom {node_id}")

    levels = [(5, ("a", "b")), (3, tuple(f"p{i:03d}" for i in range(80)))]
    with pytest.raises(RuntimeError, match="boom a"):
        draw_holders_by_depth(levels, 10, 1, set(), boom, 4)
    with pytest.raises(RuntimeError, match="boom"):
        draw_holders_by_depth(levels[1:], 10, 1, set(), lambda _: True, 4, boom)  # type: ignore[arg-type]


def test_a_tables_sorted_levels_follow_liveness() -> None:
    """``PeerTable.sorted_alive`` remembers a level's alive ids until a peer's liveness changes."""
    view = mesh_view(80, lambda p: True, lambda p: NodeLoad(running=p % 3))
    table = PeerTable("self", "127.0.0.1:1", served_rates=False)
    table.refresh(view, 0.0, 1.0)
    level = tuple(f"p{p:03d}" for p in range(79, -1, -2))
    assert table.sorted_alive(level) == sorted(level)
    assert table.sorted_alive(level) is table.sorted_alive(level)  # remembered
    view.on_key_changed("p001", ADDRESS_KEY, b"")  # no address: not alive
    table.refresh(view, 0.1, 1.0)
    assert table.sorted_alive(level) == sorted(set(level) - {"p001"})


def test_common_match_by_depth_is_the_one_found_by_sorting() -> None:
    rng = random.Random(4)
    for t in range(2000):
        estimates = random_estimates(rng)
        own = rng.choice([0, 0, 1, 7, 20, 45])
        nodes = len(estimates) + 1 + rng.choice([0, 0, 1, 5, 50])  # some alive peers hold nothing
        expected = common_match(estimates, own, nodes)
        assert common_match(estimates, own, nodes, grouped(estimates, rng)) == expected, t
        # this node's own gossiped estimate among them (a node's directory holds it): left out either way
        me = rng.choice([*estimates, "absent"])
        expected = common_match({k: v for k, v in estimates.items() if k != me}, own, nodes)
        assert common_match(estimates, own, nodes, None, me) == expected, t
        assert common_match(estimates, own, nodes, grouped(estimates, rng), me) == expected, t


def test_levels_raised_by_the_speculative_index_are_the_raised_estimates_grouped() -> None:
    """A few peers raised deeper (a prompt just sent there), some held nothing before: the levels moved by
    ``raised_levels`` are the raised estimates grouped by depth -- deepest first, one per depth, each peer once --,
    a large level's cut remembered (``LevelCuts``) or not, asked again with the same raises or others."""
    rng = random.Random(6)
    cuts = LevelCuts(limit=8)  # small: cuts are forgotten as it fills
    for t in range(3000):
        estimates = random_estimates(rng)
        levels = grouped(estimates, rng)
        before = list(levels)
        ids = [*estimates, *(f"new{i}" for i in range(3))]
        for _ in range(3):  # the same levels, raised in several ways (a remembered cut answers only its own)
            raised: dict[str, int] = {}
            left: dict[int, list[str]] = {}
            for node_id in rng.sample(ids, rng.randrange(1, min(6, len(ids)) + 1)):
                was = estimates.get(node_id, 0)
                depth = rng.choice([was + 1, was + rng.randrange(1, 50), 45])
                if depth > was:
                    raised[node_id] = depth
                    if was:
                        left.setdefault(was, []).append(node_id)
            want = {**estimates, **raised}
            for _ in range(2):  # a second time: the remembered cuts
                moved = raised_levels(levels, raised, left, cuts if t % 2 else None)
                assert [depth for depth, _ in moved] == sorted({*want.values()}, reverse=True), t
                assert {depth: sorted(ids) for depth, ids in moved} == {
                    depth: sorted(ids) for depth, ids in grouped(want, rng)
                }, t
        assert levels == before, t  # the directory's levels are not written


def test_levels_that_lack_a_raised_peer_are_given_up_not_corrupted() -> None:
    """A raised peer missing from the level its estimate names (levels and estimates out of step): no level is
    made up -- None, and the router reads the estimates as a whole."""
    levels = [(9, ("a", "b")), (3, ("c",))]
    assert raised_levels(levels, {"x": 12}, {3: ["x"]}) is None
    assert raised_levels(levels, {"x": 12}, {5: ["x"]}) is None  # no level at its depth at all
    assert raised_levels(levels, {"c": 12}, {3: ["c"]}) == [(12, ("c",)), (9, ("a", "b"))]
    wide = [(9, tuple(f"p{i:03d}" for i in range(100)))]  # a mesh-wide level, moved through the remembered cuts
    assert raised_levels(wide, {"x": 12}, {9: ["x"]}, LevelCuts()) is None
    moved = raised_levels(wide, {"p007": 12}, {9: ["p007"]}, LevelCuts())
    assert moved is not None and moved[0] == (12, ("p007",)) and len(moved[1][1]) == 99


def test_raised_levels_in_c_are_the_definition() -> None:
    """``raised_levels`` in C (``_p2p.raised_levels``) gives the Python definition's answer -- the same levels in the
    same order, each level's ids in the same order, None where it gives None -- for raises that join levels, leave
    them, make new ones and empty old ones, of wide levels moved through remembered cuts (each side its own) or not,
    and for raises the levels disagree with (a peer missing from its level, a depth with no level); off its common
    path (levels out of order, an id that is not a str) it answers NotImplemented and the Python decides."""
    native = estimates_module._native_raised_levels
    assert native is not None, "p2pnode.routing._p2p was not built: run scripts/bootstrap.sh"
    definition = estimates_module._raised_levels
    rng = random.Random(12)
    c_cuts, py_cuts = LevelCuts(limit=8), LevelCuts(limit=8)
    nones = wide = 0
    for t in range(4000):
        estimates = random_estimates(rng)
        levels = grouped(estimates, rng)
        ids = [*estimates, *(f"new{i}" for i in range(3))]
        raised: dict[str, int] = {}
        left: dict[int, list[str]] = {}
        for node_id in rng.sample(ids, rng.randrange(1, min(20, len(ids)) + 1)):
            was = estimates.get(node_id, 0)
            depth = rng.choice([was + 1, was + rng.randrange(1, 50), 45])
            if rng.random() < 0.03:  # out of step with the levels: claimed at a depth it does not hold
                was = rng.choice([was + 1, 77])
            if depth > was:
                raised[node_id] = depth
                if was:
                    left.setdefault(was, []).append(node_id)
        with_cuts = t % 2 == 1
        want = definition(levels, raised, left, py_cuts if with_cuts else None)
        got = native(levels, raised, left, c_cuts if with_cuts else None, CUT_REMEMBERED_ABOVE)
        assert got == want, t
        nones += want is None
        wide += any(len(level_ids) > CUT_REMEMBERED_ABOVE for _, level_ids in levels)
    assert nones > 20 and wide > 100  # both paths exercised
    levels = [(9, ("a", "b")), (3, ("c",))]
    for off_path in (
        ([(3, ("c",)), (9, ("a", "b"))], {"c": 12}, {3: ["c"]}),  # levels not deepest first
        (levels, {"c": 12.0}, {3: ["c"]}),  # a depth that is not an int
        (levels, {"c": 12}, {3: [7]}),  # a left id that is not a str
    ):
        assert native(*off_path, None, CUT_REMEMBERED_ABOVE) is NotImplemented
        assert raised_levels(*off_path) == definition(*off_path)


def position_in(alive: tuple[str, ...]) -> Callable[[str], int]:
    """``PeerTable.alive_position`` of a table whose load order is ``alive``."""
    positions = {node_id: i for i, node_id in enumerate(alive)}
    return lambda node_id: positions.get(node_id, -1)


def test_retry_order_cut_by_positions_is_the_one_cut_by_removal() -> None:
    rng = random.Random(5)
    for t in range(500):
        alive = tuple(f"p{i:03d}" for i in rng.sample(range(300), rng.choice([1, 5, 40, 300])))
        ranked = tuple(rng.sample(alive, rng.randrange(1, min(len(alive), 16) + 1)))
        if rng.random() < 0.5:
            ranked = ("self", *ranked)
        decision = Decision(ranked, "p2p", 3, "why")
        plain = CandidateSet([], {}, True, alive)
        cut = CandidateSet([], {}, True, alive, position_in(alive))
        assert cut.complete(decision, "self") == plain.complete(decision, "self"), t


def test_a_ranked_peer_that_is_not_alive_or_twice_fails_as_before() -> None:
    alive = ("a", "b", "c")
    for ranked in (("a", "gone"), ("b", "self", "b")):  # not alive, or ranked twice
        decision = Decision(ranked, "p2p", 0, "why")
        with pytest.raises(ValueError):
            CandidateSet([], {}, True, alive).complete(decision, "self")
        with pytest.raises(ValueError):
            CandidateSet([], {}, True, alive, position_in(alive)).complete(decision, "self")


def view_of(membership: Membership) -> ClusterView:
    return ClusterView(ClusterState("self", 1), membership, SimClock(), block_size=BS)


def mesh_view(peers: int, addressed: Callable[[int], bool], load_of: Callable[[int], NodeLoad]) -> ClusterView:
    """A directory of ``peers`` peers ``p000``..., each with an address where ``addressed`` says and a load."""
    membership = Membership("self", GossipConfig(cluster_secret=b"s" * 32))
    view = view_of(membership)
    for p in range(peers):
        node = f"p{p:03d}"
        view.on_node_added(node, 1)
        membership.on_node(node, 1, 0.0)
        if addressed(p):
            view.on_key_changed(node, ADDRESS_KEY, f"10.0.0.{p}:1".encode())
        view.on_key_changed(node, LOAD_KEY, encode_load(load_of(p)))
    return view


def test_alive_position_is_the_index_in_the_load_order() -> None:
    rng = random.Random(7)
    view = mesh_view(  # many equal loads; every 7th peer has no address: not alive
        80, lambda p: p % 7 != 0, lambda p: NodeLoad(running=rng.randrange(4), waiting=rng.randrange(2))
    )
    table = PeerTable("self", "127.0.0.1:1")
    table.refresh(view, 0.0, 1.0)
    for node in ("p007", "p008", "p079"):  # a few loads change: the order is kept by insertion
        view.on_key_changed(node, LOAD_KEY, encode_load(NodeLoad(running=rng.randrange(4))))
    table.refresh(view, 0.5, 1.0)
    alive = table.alive_ids
    assert 0 < len(alive) < 80
    for node in (f"p{p:03d}" for p in range(80)):
        assert table.alive_position(node) == (alive.index(node) if node in alive else -1)
    assert table.alive_position("unknown") == -1


def test_estimate_levels_group_the_estimates_of_every_stride() -> None:
    rng = random.Random(6)
    membership = Membership("self", GossipConfig(cluster_secret=b"s" * 32))
    view = view_of(membership)
    docs = [[rng.randrange(3, 500) for _ in range(256)] for _ in range(3)]
    chains = [block_hashes(doc, BS) for doc in docs]
    for p in range(60):
        node = f"p{p:03d}"
        stride = rng.choice([1, 2, 4, 8])
        view.on_node_added(node, 1)
        membership.on_node(node, 1, 0.0)
        view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(stride, BS)))
        published = [
            summary_key(chain[d - 1])
            for chain in chains
            for d in range(stride, rng.randrange(0, len(chain) + 1) + 1, stride)
        ]
        for key, value in SummaryWriter().update(published, []):
            view.on_key_changed(node, key, value)
    for chain in chains:
        estimates, levels = view.estimate_levels(chain)
        assert estimates == view.estimate_matches(chain)
        depths = [depth for depth, _ in levels]
        assert depths == sorted(set(depths), reverse=True)  # one group per depth, deepest first
        assert sorted((node_id, depth) for depth, ids in levels for node_id in ids) == sorted(estimates.items())


def test_level_memos_are_bounded_and_never_answer_for_another_tuple() -> None:
    sets: LevelMemo[frozenset[str]] = LevelMemo(limit=3)
    held = [tuple(f"n{i}-{j}" for j in range(40)) for i in range(10)]
    for ids in held:
        assert sets.get(ids, frozenset) == frozenset(ids)
        assert len(sets) <= 3
    twin = tuple(held[9])  # equal, another object: its own set
    assert sets.get(twin, frozenset) == frozenset(held[9])
