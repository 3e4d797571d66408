"""KV-event subscriber tests against real ZMQ sockets: a fake engine that speaks vLLM's wire protocol, and
vLLM's own ``ZmqEventPublisher`` to pin wire compatibility with the real engine.

No fixed sleeps decide outcomes: tests wait for the subscriber's state (slow-joiner safe through warm-up
batches and replay-from-0) and assert on contents and counters, never on timing.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from p2pnode.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, CacheReset
from p2pnode.cache.namespace import CacheNamespace
from p2pnode.cache.tiers import Medium
from p2pnode.engine.kv_events import EventDecodeError, KVEventSubscriber, TierTracker, decode_batch
from tests.polling import until

TOPIC = "kv"
WAIT_S = 10.0  # upper bound for a state to be reached; tests normally get there in milliseconds


# --- payload builders ---------------------------------------------------------------------------------------


def pack(events: list[Any], dp_rank: int | None = 0) -> bytes:
    """A vLLM EventBatch payload: ``[ts, events, dp_rank]``; ts varies so payloads differ between batches."""
    return msgpack.packb([time.time(), events, dp_rank])


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], block_size: int, **extra: Any) -> dict:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra,
    }


def removed_map(hashes: list[Any]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


CLEARED_MAP = {"type": "AllBlocksCleared"}


def stored_batch(first_hash: int, n_blocks: int = 1, block_size: int = 4) -> tuple[bytes, BlockStored]:
    """A one-event batch and the event the subscriber must produce from it."""
    hashes = list(range(first_hash, first_hash + n_blocks))
    tokens = list(range(first_hash, first_hash + n_blocks * block_size))
    expected = BlockStored(tuple(hashes), None, tuple(tokens), block_size)
    return pack([stored_map(hashes, None, tokens, block_size)]), expected


# --- decode_batch -------------------------------------------------------------------------------------------


def test_decode_map_encoding_as_vllm_publishes() -> None:
    payload = pack([
        stored_map([1, 2**64 - 1], 7, list(range(8)), 4, group_idx=0, session_id="s"),
        removed_map([1]),
        CLEARED_MAP,
    ])
    assert decode_batch(payload) == [
        BlockStored((1, 2**64 - 1), 7, tuple(range(8)), 4),
        BlockRemoved((1,)),
        AllBlocksCleared(),
    ]


def test_decode_array_tagged_encoding() -> None:
    payload = msgpack.packb([1.5, [
        ["BlockStored", [3, 4], None, list(range(4)), 2, None, "GPU", None],
        ["BlockRemoved", [3], "GPU"],
        ["AllBlocksCleared"],
    ]])
    assert decode_batch(payload) == [
        BlockStored((3, 4), None, (0, 1, 2, 3), 2),
        BlockRemoved((3,)),
        AllBlocksCleared(),
    ]


def test_decode_bytes_hashes_match_vllms_int_form() -> None:
    # vLLM's int form is the low 64 bits of the big-endian hash bytes.
    full = bytes(range(32))
    low64 = int.from_bytes(full, "big") & (2**64 - 1)
    payload = pack([stored_map([full], full, [1, 2], 2), removed_map([full])])
    assert decode_batch(payload) == [BlockStored((low64,), low64, (1, 2), 2), BlockRemoved((low64,))]


def test_decode_skips_and_counts_what_cannot_be_indexed() -> None:
    skipped: Counter[str] = Counter()
    payload = pack([
        {"type": "BlockPinned", "block_hashes": [1]},
        ["SomeFutureEvent", 1, 2],
        stored_map([2], None, [1, 2, 3], 2),  # token count does not match the blocks
        # a string key on a block that does not start a chain is no salt: unknown, so from there on nothing
        stored_map([5, 6, 7], None, list(range(6)), 2, extra_keys=[None, ["salt"], None]),
        stored_map([9], None, [1, 2], 2, extra_keys=[[["image-1", 0]]]),  # a multimodal input's blocks
        stored_map([4], None, [1, 2], 2, lora_id=3),  # an adapter without its name
        removed_map([]),
        CLEARED_MAP,
    ])
    # Only the plain prefix (block 5) of the chain survives.
    assert decode_batch(payload, skipped) == [BlockStored((5,), None, (0, 1), 2), AllBlocksCleared()]
    assert sum(skipped.values()) == 8
    assert skipped["unknown event type BlockPinned"] == 1
    assert skipped["unknown event type SomeFutureEvent"] == 1


def test_adapter_and_salt_blocks_are_decoded_in_their_namespace() -> None:
    payload = pack([
        stored_map([1, 2], None, [1, 2, 3, 4], 2, lora_id=3, lora_name="a", extra_keys=[["a", "tenant"], ["a"]]),
        stored_map([8], None, [1, 2], 2, extra_keys=[["tenant"]]),
        stored_map([9], 2, [5, 6], 2, lora_id=3, lora_name="a", extra_keys=[["a"]]),  # continues its parent's
    ])
    assert decode_batch(payload) == [
        BlockStored((1, 2), None, (1, 2, 3, 4), 2, CacheNamespace("a", "tenant")),
        BlockStored((8,), None, (1, 2), 2, CacheNamespace("", "tenant")),
        BlockStored((9,), 2, (5, 6), 2, CacheNamespace("a", "")),
    ]


def cpu_placeholder(block_hash: int) -> dict:
    """A host tier's BlockStored when its events do not describe themselves (vLLM's placeholder payload)."""
    return stored_map([block_hash], None, [], 0, medium="CPU")


def test_a_tier_placeholder_never_drops_its_batch() -> None:
    skipped: Counter[str] = Counter()
    tiers = TierTracker()
    payload = pack([
        stored_map([1, 2], None, [1, 2, 3, 4], 2),
        cpu_placeholder(2),
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"},
        removed_map([1]),
    ])
    assert decode_batch(payload, skipped, tiers) == [
        BlockStored((1, 2), None, (1, 2, 3, 4), 2),  # the engine's events of the same batch all arrive
        BlockRemoved((2,), Medium.HOST),
        BlockRemoved((1,)),
    ]
    assert skipped["BlockStored: a tier's placeholder (its events do not describe themselves)"] == 1
    assert (tiers.stored[Medium.HOST], tiers.removed[Medium.HOST]) == (1, 1)  # counted all the same


def test_tier_chains_take_their_namespace_from_the_engines_events() -> None:
    skipped: Counter[str] = Counter()
    tiers = TierTracker()
    salted = CacheNamespace("", "tenant")
    payload = pack([
        stored_map([1, 2], None, [1, 2, 3, 4], 2, extra_keys=[["tenant"], None]),  # the engine: a salted chain
        stored_map([1], None, [1, 2], 2, medium="CPU"),  # its tier copy: no extra keys, yet in the salt's namespace
        stored_map([2], 1, [3, 4], 2, medium="CPU"),  # continues its parent's chain (its namespace with it)
        stored_map([7], None, [1, 2], 2, medium="CPU"),  # a chain the engine's events never showed: not indexed
        stored_map([8], None, [1, 2], 2, medium="OBJECT"),  # a medium p2pnode does not index
    ])
    assert decode_batch(payload, skipped, tiers) == [
        BlockStored((1, 2), None, (1, 2, 3, 4), 2, salted),
        BlockStored((1,), None, (1, 2), 2, salted, Medium.HOST),
        BlockStored((2,), 1, (3, 4), 2, medium=Medium.HOST),
    ]
    assert skipped["BlockStored: a tier chain whose namespace the engine's events never gave"] == 1
    assert skipped["BlockStored: medium 'OBJECT' not indexed"] == 1
    assert tiers.held_blocks(Medium.HOST) == 3
    # without the engine's memory of chains, no tier chain is placed
    assert decode_batch(pack([stored_map([1], None, [1, 2], 2, medium="CPU")])) == []


def test_tier_tracker_forgets_the_oldest_chains_and_empties_on_reset() -> None:
    tiers = TierTracker(max_chains=2)
    for first in (1, 2, 3):
        tiers.learn(first, CacheNamespace("", str(first)))
    assert tiers.namespace_of(1) is None and tiers.namespace_of(3) == CacheNamespace("", "3") and len(tiers) == 2
    tiers.stored[Medium.HOST] += 5
    tiers.reset()
    assert len(tiers) == 0 and tiers.held_blocks(Medium.HOST) == 0


def test_decode_batch_without_dp_rank() -> None:
    assert decode_batch(msgpack.packb([1.0, [CLEARED_MAP]])) == [AllBlocksCleared()]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "msgpack"),
        (msgpack.packb([1.0, []]) + b"\x00", "msgpack"),
        (msgpack.packb({"ts": 1.0}), "array"),
        (msgpack.packb([1.0]), "array"),
        (msgpack.packb(["now", [], 0]), "timestamp"),
        (msgpack.packb([1.0, {}, 0]), "events"),
        (msgpack.packb([1.0, [5], 0]), "map or an array"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}], 0]), "type"),
        (msgpack.packb([1.0, [[7, 1]], 0]), "tag"),
        (pack([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "block_size": 2}]),
         "token_ids"),
        (pack([stored_map(["abc"], None, [1, 2], 2)]), r"block_hashes\[0\]"),
        (pack([stored_map([True], None, [1, 2], 2)]), "bool"),
        (pack([stored_map([1], None, [1, 2], 0)]), "block_size"),
        (pack([stored_map([1], None, [1, "x"], 2)]), "token_ids"),
        (pack([removed_map(5)]), "block_hashes"),
        (pack([["BlockRemoved", [1], "GPU", 0, None, None, "one too many"]]), "fields"),
    ],
    ids=lambda value: value if isinstance(value, str) else "payload",  # stable: some payloads carry the clock
)
def test_decode_malformed_raises(payload: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload)


# --- a fake engine speaking vLLM's publisher protocol -------------------------------------------------------


class FakeEngine:
    """vLLM's ZmqEventPublisher in miniature: PUB ``[topic, seq, payload]`` plus a ROUTER replay socket served
    from a thread, replying ``[id, b"", topic, seq, payload]`` per buffered batch >= start, then seq -1."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, buffer_steps: int = 1000) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.topic = TOPIC.encode()
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.replay_delay_s = 0.0
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._thread = threading.Thread(target=self._serve_replay, args=(replay_endpoint,), daemon=True)
            self._thread.start()

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Buffer a batch for replay and (unless ``send`` is False: a batch lost on the wire) publish it."""
        seq = self.next_seq
        self.next_seq += 1
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.send_raw([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def forget(self, seq: int) -> None:
        with self.lock:
            self.buffer = deque((s, p) for s, p in self.buffer if s != seq)

    def restart(self) -> None:
        """What a new engine process looks like on the wire: seq from 0, an empty replay buffer."""
        with self.lock:
            self.buffer.clear()
        self.next_seq = 0

    def _serve_replay(self, replay_endpoint: str) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(replay_endpoint)
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                client, _empty, start_raw = router.recv_multipart()
                start = int.from_bytes(start_raw, "big")
                self.replay_requests.append(start)
                time.sleep(self.replay_delay_s)
                with self.lock:
                    batches = [(s, p) for s, p in self.buffer if s >= start]
                for seq, payload in batches:
                    router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.pub.close(linger=0)
        self.ctx.term()


class Running:
    """A subscriber running as a task, with everything it delivered."""

    def __init__(
        self, sub: KVEventSubscriber, received: list[CacheEvent], calls: list[list[CacheEvent]]
    ) -> None:
        self.sub = sub
        self.received = received
        self.calls = calls
        self.task: asyncio.Task[None] | None = None


async def applied(r: Running, seq: int) -> None:
    """Wait until the subscriber has applied batch ``seq`` (or later)."""
    await until(lambda: r.sub.stats.last_seq >= seq, lambda: f"seq {seq} to be applied: {r.sub.stats}", WAIT_S)


async def warm_up(engine: FakeEngine, r: Running) -> None:
    """Publish empty batches until the subscriber follows the live stream (ZMQ's slow joiner)."""
    engine.publish(pack([]))

    def following() -> bool:
        if r.sub.stats.last_seq == engine.last_seq:
            return True
        engine.publish(pack([]))  # the ones before may have gone out before it joined
        return False

    await until(following, lambda: f"the subscriber to connect: {r.sub.stats}", WAIT_S)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def endpoints(ipc_dir: Path) -> tuple[str, str]:
    return f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"


@pytest.fixture
def engine(endpoints: tuple[str, str]) -> Iterator[FakeEngine]:
    e = FakeEngine(*endpoints)
    yield e
    e.close()


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., Any]]:
    """Factory: start a subscriber task; every one is stopped (and checked to end cleanly) at teardown."""
    started: list[Running] = []

    async def _start(endpoint: str, replay_endpoint: str | None, *, fail_first_calls: int = 0,
                     **kwargs: Any) -> Running:
        received: list[CacheEvent] = []
        calls: list[list[CacheEvent]] = []

        def on_events(events: list[CacheEvent]) -> None:
            calls.append(events)
            if len(calls) <= fail_first_calls:
                raise RuntimeError("callback failure")
            received.extend(events)

        sub = KVEventSubscriber(endpoint, replay_endpoint, TOPIC, on_events, **kwargs)
        r = Running(sub, received, calls)
        r.task = asyncio.create_task(sub.run())
        started.append(r)
        return r

    yield _start
    for r in started:
        await r.sub.stop()
        assert r.task is not None and r.task.done()
        assert r.task.result() is None  # stopped normally, not cancelled, no error
        assert r.sub._sub is None and r.sub._dealer is None


# --- subscriber against the fake engine ---------------------------------------------------------------------


async def test_live_batches_decoded_in_order(engine: FakeEngine, endpoints: tuple[str, str], start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    engine.publish(pack([stored_map([1, 2], None, list(range(8)), 4)]))
    engine.publish(pack([removed_map([2]), removed_map([1])]))
    last = engine.publish(pack([CLEARED_MAP]))
    await applied(r, last)
    assert r.received == [
        BlockStored((1, 2), None, tuple(range(8)), 4),
        BlockRemoved((2,)),
        BlockRemoved((1,)),
        AllBlocksCleared(),
    ]
    stats = r.sub.stats
    assert stats.events == 4
    assert (stats.gaps, stats.unrecovered_gaps, stats.resets, stats.decode_errors) == (0, 0, 0, 0)


async def test_first_batch_replays_history_from_zero(engine: FakeEngine, endpoints: tuple[str, str],
                                                     start) -> None:
    # Published before the subscriber exists: only replay-from-0 can deliver these.
    early = [stored_batch(10 * i) for i in range(1, 4)]
    for payload, _ in early:
        engine.publish(payload, send=False)
    r = await start(*endpoints)
    await warm_up(engine, r)
    assert r.received == [event for _, event in early]
    assert engine.replay_requests[0] == 0
    assert r.sub.stats.replayed_batches >= 3
    assert r.sub.stats.gaps == 0


@pytest.mark.parametrize("max_pending", [1000, 1])  # 1: live batches beyond the bound wait in ZMQ's queue
async def test_gap_recovered_via_replay_exactly_once(engine: FakeEngine, endpoints: tuple[str, str],
                                                     start, max_pending: int) -> None:
    r = await start(*endpoints, max_pending_batches=max_pending)
    await warm_up(engine, r)
    before = r.sub.stats
    engine.replay_delay_s = 0.3  # live batches keep arriving while the replay is served
    batches = [stored_batch(100 * i) for i in range(1, 6)]
    engine.publish(batches[0][0], send=False)  # lost on the wire
    engine.publish(batches[1][0], send=False)  # lost on the wire
    for payload, _ in batches[2:]:
        engine.publish(payload)
    await applied(r, engine.last_seq)
    last, expected_last = stored_batch(1000)
    engine.publish(last)  # after the replay: the live stream goes on, nothing applied twice
    await applied(r, engine.last_seq)

    assert r.received == [event for _, event in batches] + [expected_last]
    stats = r.sub.stats
    assert stats.gaps == before.gaps + 1
    assert stats.unrecovered_gaps == 0 and stats.resets == 0
    # The two lost batches and the two that followed the gap-revealing one came from the replay.
    assert stats.replayed_batches - before.replayed_batches == 4
    assert stats.batches - before.batches == 6


async def test_gap_with_replay_buffer_rolled_over_resets(engine: FakeEngine, endpoints: tuple[str, str],
                                                         start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    lost = engine.publish(stored_batch(1)[0], send=False)
    engine.forget(lost)  # no longer in the publisher's replay buffer
    payload, expected = stored_batch(2)
    seq = engine.publish(payload)
    await applied(r, seq)
    assert len(r.received) == 2
    reset = r.received[0]
    assert isinstance(reset, CacheReset) and reset.reason.startswith("unrecoverable gap")
    assert r.received[1] == expected
    assert r.calls[-1] == r.received  # the reset is delivered together with the batch it precedes
    assert (r.sub.stats.gaps, r.sub.stats.unrecovered_gaps, r.sub.stats.resets) == (1, 1, 0)


@pytest.mark.parametrize("replay", ["none", "unanswered"])
async def test_gap_without_replay_resets(engine: FakeEngine, endpoints: tuple[str, str], ipc_dir: Path,
                                         start, replay: str) -> None:
    replay_endpoint = None if replay == "none" else f"ipc://{ipc_dir}/nobody-serves-this"
    r = await start(endpoints[0], replay_endpoint, replay_timeout_s=0.2)
    await warm_up(engine, r)
    engine.publish(stored_batch(1)[0], send=False)
    payload, expected = stored_batch(2)
    seq = engine.publish(payload)
    await applied(r, seq)
    assert len(r.received) == 2 and isinstance(r.received[0], CacheReset)
    assert r.received[0].reason.startswith("unrecoverable gap")
    assert r.received[1] == expected
    assert (r.sub.stats.gaps, r.sub.stats.unrecovered_gaps) == (1, 1)
    # Still following the stream afterwards.
    payload, expected = stored_batch(3)
    await applied(r, engine.publish(payload))
    assert r.received[-1] == expected


async def test_engine_restart_resets_then_applies(engine: FakeEngine, endpoints: tuple[str, str],
                                                  start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    engine.restart()
    payload, expected = stored_batch(5)
    assert engine.publish(payload) == 0
    await until(lambda: len(r.received) == 2, "two events", WAIT_S)
    reset = r.received[0]
    assert isinstance(reset, CacheReset) and reset.reason.startswith("engine restart")
    assert r.received[1] == expected
    payload, expected = stored_batch(6)
    await applied(r, engine.publish(payload))
    assert r.received[2:] == [expected]
    assert (r.sub.stats.resets, r.sub.stats.gaps, r.sub.stats.unrecovered_gaps) == (1, 0, 0)


async def test_engine_restart_replays_new_engines_history(engine: FakeEngine, endpoints: tuple[str, str],
                                                          start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    for _ in range(5):
        engine.publish(pack([]))
    await applied(r, engine.last_seq)
    engine.restart()
    batches = [stored_batch(10 * i) for i in range(1, 4)]
    engine.publish(batches[0][0], send=False)
    engine.publish(batches[1][0], send=False)
    engine.publish(batches[2][0])  # seq 2 < the old engine's seq: a restart, and 0..1 come from replay
    await until(lambda: len(r.received) == 4, "four events", WAIT_S)
    assert isinstance(r.received[0], CacheReset) and r.received[0].reason.startswith("engine restart")
    assert r.received[1:] == [event for _, event in batches]
    assert r.sub.stats.resets == 1 and r.sub.stats.last_seq == 2


async def test_undecodable_batch_counted_and_loop_survives(engine: FakeEngine, endpoints: tuple[str, str],
                                                           start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    engine.publish(b"\xc1 not msgpack")
    engine.send_raw([engine.topic, b"short"])  # wrong frame count
    engine.send_raw([engine.topic, b"\x00\x01", pack([])])  # wrong seq width
    engine.publish(pack([stored_map([5], None, [1, 2, 3, 4], 4, extra_keys=[5])]))  # an int where a list goes
    payload, expected = stored_batch(7)
    seq = engine.publish(payload)
    await applied(r, seq)
    # Each undecodable batch resets the view (what it stored or removed is unknown), then the stream goes on: the
    # int in extra_keys was a TypeError that ended the subscriber's task, every later event lost, nothing said.
    assert [type(e) for e in r.received] == [CacheReset, CacheReset, BlockStored] and r.received[-1] == expected
    stats = r.sub.stats
    assert stats.decode_errors == 4
    # The bad batches' seqs counted as seen: no gap, no engine restart.
    assert (stats.gaps, stats.unrecovered_gaps, stats.resets) == (0, 0, 0)


async def test_duplicate_seq_dropped(engine: FakeEngine, endpoints: tuple[str, str], start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    payload, expected = stored_batch(3)
    seq = engine.publish(payload)
    engine.send_raw([engine.topic, seq.to_bytes(8, "big"), payload])
    payload2, expected2 = stored_batch(4)
    await applied(r, engine.publish(payload2))
    assert r.received == [expected, expected2]
    assert (r.sub.stats.resets, r.sub.stats.gaps) == (0, 0)


async def test_callback_errors_counted_not_fatal(engine: FakeEngine, endpoints: tuple[str, str],
                                                 start) -> None:
    r = await start(*endpoints, fail_first_calls=1)
    await warm_up(engine, r)
    first, _ = stored_batch(1)
    payload, expected = stored_batch(2)
    engine.publish(first)
    await applied(r, engine.publish(payload))
    assert r.received == [expected]
    assert r.sub.stats.callback_errors == 1


async def test_other_topic_with_same_prefix_ignored(engine: FakeEngine, endpoints: tuple[str, str],
                                                    start) -> None:
    r = await start(*endpoints)
    await warm_up(engine, r)
    engine.send_raw([b"kv-other", (engine.last_seq + 1).to_bytes(8, "big"), stored_batch(1)[0]])
    payload, expected = stored_batch(2)
    await applied(r, engine.publish(payload))
    assert r.received == [expected]
    assert r.sub.stats.decode_errors == 0


async def test_stop_before_and_twice(endpoints: tuple[str, str]) -> None:
    sub = KVEventSubscriber(endpoints[0], endpoints[1], TOPIC, lambda events: None)
    await sub.stop()
    await sub.run()  # returns at once: already stopped
    sub2 = KVEventSubscriber(endpoints[0], None, TOPIC, lambda events: None)
    task = asyncio.create_task(sub2.run())
    await asyncio.sleep(0)
    await sub2.stop()
    await sub2.stop()
    assert task.done() and task.result() is None


# --- wire compatibility with vLLM's own publisher -----------------------------------------------------------


async def test_vllm_zmq_publisher_wire_compatibility(ipc_dir: Path, start) -> None:
    from vllm.distributed import kv_events as kv  # the engine extra is required (scripts/bootstrap.sh)

    endpoint, replay_endpoint = f"ipc://{ipc_dir}/vllm-pub", f"ipc://{ipc_dir}/vllm-replay"
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay_endpoint, buffer_steps=1000,
        topic=TOPIC,
    )
    try:
        r = await start(endpoint, replay_endpoint)
        # Hash bytes whose low 64 bits are 11: what vLLM sends with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
        bytes_11 = bytes(24) + (11).to_bytes(8, "big")
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockStored(block_hashes=[11, 2**64 - 1], parent_block_hash=7, token_ids=list(range(64)),
                           block_size=32, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
            kv.BlockRemoved(block_hashes=[bytes_11], medium="GPU", group_idx=0),
            kv.AllBlocksCleared(),
        ]))
        # The batch above (seq 0) was most likely published before the subscriber joined: empty batches until
        # it sees one, and the replay from seq 0 (served by vLLM's ROUTER) brings the first one.
        def received() -> bool:
            if r.received:
                return True
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=[]))
            return False

        await until(received, "the first batch", WAIT_S)
        await until(lambda: len(r.received) >= 3, "the first batch's three events", WAIT_S)
        assert r.received == [
            BlockStored((11, 2**64 - 1), 7, tuple(range(64)), 32),
            BlockRemoved((11,)),
            AllBlocksCleared(),
        ]
        assert r.sub.stats.decode_errors == 0 and r.sub.stats.skipped_events == 0
    finally:
        await asyncio.to_thread(publisher.shutdown)
