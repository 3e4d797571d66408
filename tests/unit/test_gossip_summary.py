"""The cache summary and ClusterView estimates, on hand-built exact indexes: the estimate is the exact match rounded
down to the stride, the stride adapts to the cap, removals and dead peers stop counting, and ``estimate_all``
agrees with the per-peer estimate."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockRemoved, BlockStored
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.summary import (
    SUMMARY_META_KEY,
    SummaryMeta,
    SummaryPublisher,
    decode_meta,
    encode_meta,
    hash_key,
    key_hash,
)
from p2pnode.cache.summary_log import SummaryReader, SummaryWriter, summary_key
from p2pnode.gossip.clock import SimClock
from p2pnode.gossip.config import GossipConfig
from p2pnode.gossip.keys import ADDRESS_KEY
from p2pnode.gossip.membership import Membership, MemberState
from p2pnode.gossip.state import ClusterState
from p2pnode.routing import cluster_view
from p2pnode.routing.cluster_view import ClusterView
from p2pnode.routing.mask_table import DictMaskTable, MaskTable

BS = 4


class FakeEngine:
    """Feeds a PrefixIndex like vLLM's KV events would: each prompt's new full blocks as one BlockStored."""

    def __init__(self, index: PrefixIndex, seed: int = 0) -> None:
        self.index = index
        self.rng = random.Random(seed)
        self.engine_hash: dict[tuple[int, ...], int] = {}  # token prefix (whole blocks) -> engine hash

    def store(self, tokens: list[int]) -> None:
        n = len(tokens) // BS
        known = 0
        while known < n and tuple(tokens[: (known + 1) * BS]) in self.engine_hash:
            known += 1
        if known == n:
            return
        new = [self.rng.getrandbits(63) for _ in range(n - known)]
        for i, h in enumerate(new):
            self.engine_hash[tuple(tokens[: (known + i + 1) * BS])] = h
        parent = self.engine_hash[tuple(tokens[: known * BS])] if known else None
        self.index.apply(BlockStored(tuple(new), parent, tuple(tokens[known * BS : n * BS]), BS))

    def evict_block(self, tokens: list[int], depth: int) -> None:
        h = self.engine_hash.pop(tuple(tokens[: depth * BS]))
        self.index.apply(BlockRemoved((h,)))


class Owner:
    """One node's publishing side: index -> publisher -> its own ClusterState."""

    def __init__(self, node_id: str, stride: int = 4, cap: int = 8192) -> None:
        self.index = PrefixIndex(block_size=BS)
        self.engine = FakeEngine(self.index, seed=hash(node_id) & 0xFFFF)
        self.publisher = SummaryPublisher(self.index, stride, cap)
        self.state = ClusterState(node_id, 1)
        self.state.set(ADDRESS_KEY, f"{node_id}:1".encode(), 0.0)

    def publish(self) -> None:
        change = self.publisher.poll()
        if change is None:
            return
        self.state.set("summary", encode_meta(change.meta), 0.0)
        for key, value in self.publisher.log.update(change.added, change.removed):
            if value is None:
                self.state.delete(key, 0.0)
            else:
                self.state.set(key, value, 0.0)


def make_view(owners: list[Owner]) -> tuple[ClusterView, Membership]:
    """A ClusterView over copies of the owners' states (as gossip would deliver them)."""
    state = ClusterState("router", 1)
    membership = Membership("router", GossipConfig(cluster_secret=b"x" * 16))
    view = ClusterView(state, membership, SimClock(), block_size=BS)
    for owner in owners:
        view.on_node_added(owner.state.self_id, 1)
        membership.on_node(owner.state.self_id, 1, 0.0)
        for key, value in owner.state.self_node.items():
            view.on_key_changed(owner.state.self_id, key, value)
    return view, membership


def refresh(view: ClusterView, owner: Owner, before: dict[str, bytes]) -> dict[str, bytes]:
    now = dict(owner.state.self_node.items())
    for key in before.keys() - now.keys():
        view.on_key_changed(owner.state.self_id, key, None)
    for key, value in now.items():
        if before.get(key) != value:
            view.on_key_changed(owner.state.self_id, key, value)
    return now


def prompt(rng: random.Random, n_blocks: int, prefix: list[int] | None = None) -> list[int]:
    tokens = list(prefix or [])
    while len(tokens) < n_blocks * BS:
        tokens.append(rng.randrange(1000))
    return tokens


def test_keys_round_trip_and_refuse_other_spellings() -> None:
    rng = random.Random(0)
    for _ in range(200):
        h = rng.getrandbits(64)
        assert key_hash(hash_key(h, "h/"), "h/") == h
    assert key_hash("h/short", "h/") is None and key_hash("x/AAAAAAAAAAA", "h/") is None
    assert key_hash("h/AAAAAAAAAAB", "h/") is None  # same bytes as ...AAA: only the canonical spelling counts
    assert decode_meta(b"\x92\x04\x20").stride == 4 and decode_meta(b"junk") is None


def test_the_published_version_says_whether_the_summary_is_behind_its_index() -> None:
    owner = Owner("a")
    assert owner.publisher.published_version == 0  # nothing published yet
    owner.engine.store(prompt(random.Random(2), 8))
    behind = owner.index.version
    assert owner.publisher.published_version != behind  # a change not yet in the summary: a reader must wait
    owner.publish()
    assert owner.publisher.published_version == owner.index.version == behind
    owner.engine.store(prompt(random.Random(3), 8))
    assert owner.publisher.published_version == behind < owner.index.version


def test_a_colliding_summary_key_raises_an_estimate_by_one_stride_at_most() -> None:
    """Summaries publish 32-bit keys, so another prefix's key can equal a request's. A peer whose summary holds such
    a key alone (its own prefixes elsewhere) is not matched for it; one that truly holds the request's first 8
    blocks and a colliding key at 24 is estimated at 8 (12 only where the collision sits right past its match), as
    the C match and the Python definition both say."""
    rng = random.Random(9)
    request = block_hashes(prompt(rng, 32), BS)
    alien = [summary_key(rng.getrandbits(64)) for _ in range(8)]  # another node's prefixes
    # the request's keys at depth 24 and 12, as a collision would make them: same low 32 bits, other high bits
    phantom_24, phantom_12 = summary_key(request[23] ^ 1 << 50), summary_key(request[11] ^ 1 << 63)
    view, membership = make_view([])
    for node, keys in {
        "alone": [*alien, phantom_24],
        "deeper": [summary_key(request[3]), summary_key(request[7]), phantom_24],
        "adjacent": [summary_key(request[3]), summary_key(request[7]), phantom_12],
    }.items():
        view.on_node_added(node, 1)
        membership.on_node(node, 1, 0.0)
        view.on_key_changed(node, ADDRESS_KEY, node.encode())
        view.on_key_changed(node, SUMMARY_META_KEY, encode_meta(SummaryMeta(4, BS)))
        for key, value in SummaryWriter().update(keys, []):
            view.on_key_changed(node, key, value)
    # (the deepest key alone would have claimed 24 for both "alone" and "deeper")
    assert view.estimate_all(request) == {"alone": 0, "deeper": 8, "adjacent": 12}
    assert {node: view.estimate_match_blocks(node, request) for node in ("alone", "deeper", "adjacent")} == {
        "alone": 0,
        "deeper": 8,
        "adjacent": 12,
    }


def test_estimate_is_the_exact_match_rounded_down_to_the_stride() -> None:
    owner = Owner("a", stride=4)
    rng = random.Random(1)
    system = prompt(rng, 6)
    docs = [prompt(rng, rng.randrange(6, 30), system) for _ in range(20)]
    for doc in docs:
        owner.engine.store(doc)
    owner.publish()
    view, _ = make_view([owner])
    peer = view.peer("a")
    assert peer is not None and peer.stride == 4
    for doc in docs:
        for cut in range(0, len(doc) // BS + 3):
            request = doc[: cut * BS] + prompt(rng, 3)  # then diverge
            chain = block_hashes(request, BS)
            exact = owner.index.match_blocks(chain)
            assert peer.estimate_match_blocks(chain) == exact - exact % 4
    cold = block_hashes(prompt(rng, 20), BS)
    assert peer.estimate_match_blocks(cold) == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), stride=st.sampled_from([1, 2, 4, 8]), cap=st.integers(4, 200))
def test_published_set_is_bounded_and_error_stays_below_the_current_stride(seed: int, stride: int, cap: int) -> None:
    rng = random.Random(seed)
    owner = Owner("a", stride=stride, cap=cap)
    docs = []
    for _ in range(rng.randrange(1, 25)):
        base = rng.choice(docs) if docs and rng.random() < 0.5 else []
        doc = prompt(rng, rng.randrange(1, 40), base[: rng.randrange(0, len(base) + 1) // BS * BS])
        docs.append(doc)
        owner.engine.store(doc)
    owner.publish()
    assert len(owner.publisher.published) <= cap
    current = owner.publisher.stride
    assert current % stride == 0 and (current // stride) & (current // stride - 1) == 0  # base * 2^k
    view, _ = make_view([owner])
    for doc in docs:
        chain = block_hashes(doc, BS)
        exact = owner.index.match_blocks(chain)
        est = view.estimate_match_blocks("a", chain)
        assert exact - current < est <= exact


def test_stride_doubles_past_the_cap_and_halves_back_with_hysteresis() -> None:
    owner = Owner("a", stride=2, cap=10)
    rng = random.Random(2)
    docs = [prompt(rng, 8) for _ in range(3)]  # 3 chains x 4 sampled depths (2, 4, 6, 8) = 12 > 10
    for doc in docs:
        owner.engine.store(doc)
    owner.publish()
    assert owner.publisher.stride == 4 and len(owner.publisher.published) == 6

    def evict(doc: list[int], *depths: int) -> int:
        for depth in depths:
            owner.engine.evict_block(doc, depth)
        owner.publish()
        return owner.publisher.stride

    assert evict(docs[0], 8, 7) == 4  # 11 sampled at stride 2: over the cap
    assert evict(docs[1], 8, 7) == 4  # 10: fits the cap, not 3/4 of it
    assert evict(docs[2], 8, 7, 6, 5) == 4  # 8: still over 7.5
    assert evict(docs[0], 6, 5) == 2  # 7: room to spare, finer again
    assert len(owner.publisher.published) == 7


def test_evictions_reach_the_view_and_dead_peers_are_not_used() -> None:
    owners = [Owner(f"n{i}") for i in range(3)]
    rng = random.Random(3)
    shared = prompt(rng, 12)
    for owner in owners:
        owner.engine.store(shared)
        owner.publish()
    view, membership = make_view(owners)
    chain = block_hashes(shared, BS)
    assert view.estimate_all(chain) == {"n0": 12, "n1": 12, "n2": 12}
    before = dict(owners[1].state.self_node.items())
    owners[1].engine.evict_block(shared, 12)
    owners[1].engine.evict_block(shared, 11)
    owners[1].publish()
    refresh(view, owners[1], before)
    assert view.estimate_match_blocks("n1", chain) == 8
    membership.update(1000.0)  # nobody heartbeats: everyone else is dead
    assert view.peer("n2").state is MemberState.DEAD
    view.on_liveness("n2", MemberState.DEAD)
    assert view.estimate_match_blocks("n2", chain) == 0
    assert view.estimate_all(chain) == {}


@pytest.mark.parametrize("peers", [12, 80])
@pytest.mark.parametrize("table", [MaskTable, DictMaskTable])
def test_estimate_all_agrees_with_per_peer_estimates(
    peers: int, table: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view's estimates for every peer at once (its summary table, in C or its definition; past 64 peers the
    masks' further words) are each peer's own, before and after evictions and a peer leaving."""
    monkeypatch.setattr(cluster_view, "MaskTable", table)
    rng = random.Random(4)
    owners = [Owner(f"n{i}", stride=rng.choice([2, 4])) for i in range(peers)]
    pool = [prompt(rng, rng.randrange(4, 40)) for _ in range(15)]
    stored: dict[str, list[list[int]]] = {}
    for owner in owners:
        for doc in rng.sample(pool, 6):
            kept = doc[: rng.randrange(1, len(doc) // BS + 1) * BS]
            owner.engine.store(kept)
            stored.setdefault(owner.state.self_id, []).append(kept)
        owner.publish()
    view, _ = make_view(owners)
    assert type(view._inverted) is table

    def check() -> int:
        hits = 0
        for doc in pool:
            chain = block_hashes(doc + prompt(rng, 2), BS)
            together = view.estimate_all(chain)
            assert together == {p.node_id: p.estimate_match_blocks(chain) for p in view.usable_peers()}
            hits += sum(1 for v in together.values() if v)
        return hits

    assert check() > 20
    for owner in rng.sample(owners, peers // 3):  # evictions: the last blocks of a stored prefix withdrawn
        before = dict(owner.state.self_node.items())
        for kept in stored[owner.state.self_id][:3]:
            for depth in range(len(kept) // BS, max(len(kept) // BS - 5, 0), -1):
                owner.engine.evict_block(kept, depth)
        owner.publish()
        refresh(view, owner, before)
    view.on_node_removed(owners[-1].state.self_id)
    assert check() > 10


def test_a_peer_with_another_block_size_is_never_matched() -> None:
    owner = Owner("a")
    owner.engine.store(prompt(random.Random(5), 8))
    owner.publish()
    owner.state.set("summary", encode_meta(owner.publisher.meta.__class__(4, 16)), 0.0)
    view, _ = make_view([owner])
    doc_chain = [h for h, _ in owner.index.iter_blocks()]
    assert view.estimate_match_blocks("a", doc_chain) == 0 and view.estimate_all(doc_chain)["a"] == 0


def test_forgetting_a_peer_clears_its_hashes_from_the_inverted_index() -> None:
    owners = [Owner("a"), Owner("b")]
    doc = prompt(random.Random(6), 8)
    for owner in owners:
        owner.engine.store(doc)
        owner.publish()
    view, _ = make_view(owners)
    view.on_node_removed("a")
    view.on_node_removed("b")
    assert len(view._inverted) == 0 and view._inverted.items() == []
    assert "a" not in view and view.estimate_all(block_hashes(doc, BS)) == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(0, 200)), st.sets(st.integers(0, 200))), max_size=25), st.randoms())
def test_the_summary_log_brings_every_reader_to_the_owners_set(rounds, rng) -> None:
    """Whatever the rounds add and withdraw, a reader fed the log's entries holds exactly the owner's live set --
    in order, after a reset (only the live keys), and with each round's entries shuffled (a message may reorder
    them, or carry only part of a round)."""
    writer = SummaryWriter()
    in_order, shuffled = SummaryReader(), SummaryReader()
    live: set[int] = set()
    state: dict[str, bytes] = {}
    for added, removed in rounds:
        entries = writer.update(sorted(added), sorted(removed))
        live = (live - removed) | added
        for key, value in entries:
            in_order.apply(key, value)
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        rng.shuffle(entries)
        for key, value in entries:
            shuffled.apply(key, value)
        assert set(in_order.hashes) == live == set(shuffled.hashes) and len(writer) == len(live)
        reset = SummaryReader()
        for key, value in state.items():  # a new peer gets the live keys in the order they were last written
            reset.apply(key, value)
        assert set(reset.hashes) == live
        # every batch kept is at least a third live, so a reset costs at most 3 x 4 B per published key
        assert sum(len(v) for k, v in state.items() if k.startswith("gb/")) <= 3 * 4 * max(1, len(live)) + 4 * 64


def test_the_summary_log_costs_bytes_per_hash_not_keys_per_hash() -> None:
    """A round of 25 new hashes and 25 withdrawn (a batch of 5 documents stored, the oldest 5 evicted) is one batch
    of 4-byte summary keys and a delete, not 50 keys."""
    writer = SummaryWriter()
    rng = random.Random(1)
    batches = [[summary_key(rng.getrandbits(64)) for _ in range(25)] for _ in range(6)]
    for batch in batches[:5]:
        writer.update(batch, [])
    entries = writer.update(batches[5], batches[0])
    assert [key for key, _ in entries] == ["gb/5", "gb/0"]
    assert len(entries[0][1]) == 25 * 4 and entries[1][1] is None
    entries = writer.update([], batches[1][:3])  # a few of a batch: its bitmap
    assert entries == [("gd/1", (0b111).to_bytes(4, "little"))]
    assert SummaryReader().apply("gb/01", b"x" * 8) is None and SummaryReader().apply("load", b"") is None
    assert SummaryReader().apply("gb/1", b"short") == ([], [])  # malformed values change nothing
    assert SummaryReader().apply("hb/1", b"x" * 8) is None  # the 64-bit log of earlier versions: not ours to read
    with pytest.raises(ValueError, match="32-bit summary keys"):
        writer.update([rng.getrandbits(64) | 1 << 63], [])  # a block hash, not its key


@pytest.mark.parametrize("stride", [2**31, 2**63, 2**64 - 1])
def test_a_peers_meta_with_an_absurd_stride_is_ignored_and_every_estimate_still_answers(stride: int) -> None:
    """A stride of 2**63 in one peer's meta was accepted; the estimates' C walk then raised OverflowError for every
    request on every node (the router has no except there): one value under one peer's own key stopped routing."""
    import msgpack

    from p2pnode.cache.tiers import Medium

    view, membership = make_view([])
    view.on_node_added("p0", 1)
    membership.on_node("p0", 1, 0.0)
    chain = [random.Random(stride).getrandbits(64) for _ in range(40)]
    batch = b"".join((h & 0xFFFFFFFF).to_bytes(4, "big") for h in chain[:10])
    view.on_key_changed("p0", "summary", msgpack.packb([stride, BS]))
    view.on_key_changed("p0", "gb/0", batch)
    view.on_key_changed("p0", "summary/host", msgpack.packb([stride, BS]))
    view.on_key_changed("p0", "cb/0", batch)
    assert view.estimate_matches(chain) == {}  # no meta it can read: no estimate, and no exception
    view.estimate_levels(chain)
    view.estimate_tier_matches(chain, Medium.HOST)
    assert decode_meta(msgpack.packb([stride, BS])) is None


def test_a_reader_holds_a_bounded_number_of_a_peers_keys() -> None:
    """Each batch is capped at 64 keys but nothing capped the batches: 16 MiB of them (the gossip bound of one
    member's state) made ~4M keys in every peer's reader, ~550 MB. A batch past MAX_READER_KEYS is ignored."""
    from p2pnode.cache.summary_log import MAX_READER_KEYS

    reader = SummaryReader()
    rng = random.Random(3)
    added = 0
    for seq in range(MAX_READER_KEYS // 64 + 100):
        batch = b"".join(rng.getrandbits(32).to_bytes(4, "big") for _ in range(64))
        got = reader.apply(f"{reader.keys.batch}{seq:x}", batch)
        assert got is not None
        added += len(got[0])
    assert len(reader.hashes) <= MAX_READER_KEYS and added == len(reader.hashes)
    with pytest.raises(ValueError, match="summary_max_hashes"):
        GossipConfig(cluster_secret=b"x" * 16, summary_max_hashes=100_000)


def test_a_reader_holds_a_bounded_number_of_batch_keys_live_or_not() -> None:
    """The live-key cap counted distinct live keys only: batches that all repeat the same 64 keys were all kept (a
    member's 16 MiB of them: ~4M positions, ~160 MB in every peer). Past MAX_READER_POSITIONS a batch is ignored, and
    the batches held never exceed it; what is live is still read right."""
    from p2pnode.cache.summary_log import MAX_READER_POSITIONS

    reader = SummaryReader()
    same = b"".join((0x1000 + i).to_bytes(4, "big") for i in range(64))
    for seq in range(MAX_READER_POSITIONS // 64 + 500):
        reader.apply(f"{reader.keys.batch}{seq:x}", same)
    assert sum(map(len, reader._batches.values())) <= MAX_READER_POSITIONS
    assert sorted(reader.hashes) == [0x1000 + i for i in range(64)]
    for seq in range(100):  # deleting batches frees their room: new ones are taken again
        reader.apply(f"{reader.keys.batch}{seq:x}", None)
    fresh = b"".join((0x9000 + i).to_bytes(4, "big") for i in range(64))
    added, _ = reader.apply(f"{reader.keys.batch}{10**6:x}", fresh)
    assert added == [0x9000 + i for i in range(64)]
