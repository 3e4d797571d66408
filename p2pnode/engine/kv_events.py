"""vLLM KV-cache event subscriber: vLLM's ZMQ event stream -> p2pnode's engine-neutral ``CacheEvent``s.

Wire format (checked against vllm/distributed/kv_events.py, vLLM 0.32):

- PUB frames are ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian, counting from 0 per publisher
  (i.e. per engine process), so it restarts at 0 when the engine restarts.
- ``payload`` is msgpack of ``EventBatch`` (a msgspec ``array_like`` struct): ``[ts, [events...], dp_rank]``
  (``dp_rank`` may be absent). Each event is a msgspec ``tag=True`` struct *without* ``array_like``, i.e. a
  map ``{"type": "BlockStored", "block_hashes": [...], ...}``; fields equal to their default may be omitted.
  The array form ``["BlockStored", hashes, parent, ...]`` is accepted too, in case a later vLLM switches.
- Block hashes are ints (low 64 bits of vLLM's sha256 hash) unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``,
  in which case they are raw hash bytes; those are reduced exactly as vLLM does for its ints
  (``int.from_bytes(b, "big") & (2**64 - 1)``), so both settings yield the same ids.
- Replay: a ROUTER socket. A DEALER sends ``[b"", start_seq (8 bytes big-endian)]`` and receives
  ``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq`` (in order), then the end
  marker ``[b"", b"", seq=-1 (8 bytes, signed), b""]``. Only the last ``buffer_steps`` batches are held.

Tiers (vLLM's offloading connector, ``kv/tier/``): events carry a ``medium`` ("GPU" for the engine's own cache, "CPU"
for its host tier, "STORAGE" for a secondary one), decoded into ``cache.tiers.Medium``. A tier's ``BlockStored`` is a
placeholder (one hash, block size 0, no tokens) unless the tier's events describe themselves (the node turns that on);
a placeholder is skipped and counted, never a reason to drop its batch. A tier's events carry no ``extra_keys``, so a
tier chain's namespace cannot be read from them: it is taken from the engine's own event of the chain's first block
(``TierTracker``, a bounded memory of them), and a tier chain whose first block the node never saw in the engine
is not indexed -- a salted or adapter block's tier copy is never a hit for another namespace.

Invariants kept by ``KVEventSubscriber``:
- Within one engine run, each seq is applied at most once and in increasing order (live and replayed batches
  are deduplicated by seq).
- Whenever the subscriber cannot vouch for continuity (engine restart, events lost beyond replay), it emits
  ``CacheReset`` before any later event, so consumers never hold a silently stale view.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from p2pnode.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, CacheReset
from p2pnode.cache.namespace import CacheNamespace
from p2pnode.cache.tiers import Medium
from p2pnode.config import DEFAULT_MAX_PENDING_BATCHES, DEFAULT_REPLAY_TIMEOUT_S, TIER_NAMESPACE_CHAINS

logger = logging.getLogger("p2pnode.kv_events")

END_OF_REPLAY_SEQ = -1
_SEQ_BYTES = 8
_HASH_MASK = (1 << 64) - 1

# Positional field order of vLLM's event structs, for the array-tagged encoding ``[tag, field0, ...]``.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
        "ownership", "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


class EventDecodeError(ValueError):
    """A KV-event payload (or frame) that does not have the shape vLLM publishes."""


# --- decoding -----------------------------------------------------------------------------------------------


def _block_hash(value: Any, what: str) -> int:
    """One engine block hash as a 64-bit int, whichever of vLLM's two encodings (int or bytes) it came in."""
    if isinstance(value, bool):
        raise EventDecodeError(f"{what}: expected int or bytes, got bool")
    if isinstance(value, int):
        return value & _HASH_MASK
    if isinstance(value, bytes | bytearray):
        if not value:
            raise EventDecodeError(f"{what}: empty bytes")
        return int.from_bytes(value, "big") & _HASH_MASK
    raise EventDecodeError(f"{what}: expected int or bytes, got {type(value).__name__}")


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise EventDecodeError(f"{what}: expected a list of ints")
    return value


def _event_fields(raw: Any, index: int) -> tuple[str, dict[str, Any]]:
    """(type name, fields) of one event, from either the map-with-"type" or the array-tagged encoding."""
    if isinstance(raw, dict):
        name = raw.get("type")
        if not isinstance(name, str):
            raise EventDecodeError(f"event {index}: map without a string 'type' key")
        return name, raw
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise EventDecodeError(f"event {index}: array without a string type tag")
        name = raw[0]
        names = _ARRAY_FIELDS.get(name)
        if names is None:
            return name, {}
        values = raw[1:]
        if len(values) > len(names):
            raise EventDecodeError(f"event {index} ({name}): {len(values)} fields, {len(names)} known")
        return name, dict(zip(names, values, strict=False))
    raise EventDecodeError(f"event {index}: expected a map or an array, got {type(raw).__name__}")


def _require(fields: dict[str, Any], key: str, name: str, index: int) -> Any:
    if key not in fields:
        raise EventDecodeError(f"event {index} ({name}): missing field {key!r}")
    return fields[key]


def _skip(skipped: Counter[str] | None, reason: str) -> None:
    if skipped is not None:
        skipped[reason] += 1


class TierTracker:
    """What the subscriber remembers about the engine's tiers across batches: the namespace of each prefix chain the
    engine stored, by the engine hash of the chain's first block (the newest ``max_chains``; what places a tier's copy
    of the chain, whose events carry no cache salt), and the blocks each tier stored and dropped (every one, placed or
    not: what the tier holds)."""

    def __init__(self, max_chains: int = TIER_NAMESPACE_CHAINS) -> None:
        self.max_chains = max_chains
        self._chains: OrderedDict[int, CacheNamespace] = OrderedDict()
        self.stored: Counter[Medium] = Counter()
        self.removed: Counter[Medium] = Counter()

    def learn(self, first_block: int, namespace: CacheNamespace) -> None:
        self._chains[first_block] = namespace
        self._chains.move_to_end(first_block)
        while len(self._chains) > self.max_chains:
            self._chains.popitem(last=False)

    def namespace_of(self, first_block: int) -> CacheNamespace | None:
        return self._chains.get(first_block)

    def held_blocks(self, medium: Medium) -> int:
        """Blocks the tier holds now, by its events."""
        return max(0, self.stored[medium] - self.removed[medium])

    def reset(self) -> None:
        """The engine restarted: its chains and its tiers are gone (the counters of what moved stay)."""
        self._chains.clear()
        for medium in list(self.stored):
            self.removed[medium] = self.stored[medium]

    def __len__(self) -> int:
        return len(self._chains)


def _medium(fields: dict[str, Any], name: str, skipped: Counter[str] | None) -> Medium | None:
    medium = Medium.of_event(fields.get("medium"))
    if medium is None:
        _skip(skipped, f"{name}: medium {fields.get('medium')!r} not indexed")
    return medium


def _block_stored(
    fields: dict[str, Any], index: int, skipped: Counter[str] | None, tiers: TierTracker | None = None
) -> BlockStored | None:
    """Convert one BlockStored; None when it carries nothing p2pnode can index (counted in ``skipped``).

    A block's engine hash depends on its tokens and on extra keys: the request's LoRA adapter (every block), its
    cache salt (a chain's first block) and multimodal inputs or prompt embeddings (the blocks they cover). The first
    two are a cache namespace (``cache/namespace.py``): such blocks are indexed in theirs, where only requests of
    the same adapter and salt look. The others cannot be told from tokens, so blocks that carry them -- and,
    since every block's hash chains its parent's, everything after them -- are left out: indexing them under their
    bare tokens would claim cache hits the engine cannot give. A tier's blocks: see the module docstring (``tiers``
    remembers, and places, the chains' namespaces).
    """
    name = "BlockStored"
    medium = _medium(fields, name, skipped)
    if medium is None:
        return None
    if medium is not Medium.GPU and not fields.get("token_ids") and not fields.get("block_size"):
        _skip(skipped, "BlockStored: a tier's placeholder (its events do not describe themselves)")
        return None
    hashes_raw = _require(fields, "block_hashes", name, index)
    if not isinstance(hashes_raw, list):
        raise EventDecodeError(f"event {index} ({name}): block_hashes is not a list")
    hashes = [_block_hash(h, f"event {index} ({name}) block_hashes[{i}]") for i, h in enumerate(hashes_raw)]
    parent_raw = _require(fields, "parent_block_hash", name, index)
    parent = None if parent_raw is None else _block_hash(parent_raw, f"event {index} ({name}) parent hash")
    tokens = _int_list(_require(fields, "token_ids", name, index), f"event {index} ({name}) token_ids")
    block_size = _require(fields, "block_size", name, index)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise EventDecodeError(f"event {index} ({name}): block_size is not a positive int: {block_size!r}")
    if len(tokens) != len(hashes) * block_size:
        # vLLM leaves null / masked-out blocks (sliding window) out of block_hashes but not out of token_ids:
        # the tokens of each hash can no longer be told apart.
        _skip(skipped, "BlockStored: token count does not match block count")
        return None
    adapter = fields.get("lora_name")
    if adapter is not None and not isinstance(adapter, str):
        raise EventDecodeError(f"event {index} ({name}): lora_name is not a string")
    if adapter is None and fields.get("lora_id") is not None:
        _skip(skipped, "BlockStored: LoRA blocks without an adapter name")
        return None
    plain, salt = _plain_blocks(
        fields.get("extra_keys"), len(hashes), adapter, parent is None, f"event {index} ({name})"
    )
    if plain < len(hashes):
        _skip(skipped, "BlockStored: blocks with multimodal or embedding hash keys")
        hashes, tokens = hashes[:plain], tokens[: plain * block_size]
    if not hashes:
        _skip(skipped, "BlockStored: no plain blocks")
        return None
    namespace = CacheNamespace(adapter or "", salt)
    if parent is None:
        if medium is Medium.GPU:
            if tiers is not None:
                tiers.learn(hashes[0], namespace)
        else:
            known = tiers.namespace_of(hashes[0]) if tiers is not None else None
            if known is None:
                _skip(skipped, "BlockStored: a tier chain whose namespace the engine's events never gave")
                return None
            namespace = known
    return BlockStored(
        engine_block_hashes=tuple(hashes),
        parent_engine_hash=parent,
        token_ids=tuple(tokens),
        block_size=block_size,
        namespace=namespace,
        medium=medium,
    )


def _plain_blocks(
    extra_keys: Any, blocks: int, adapter: str | None, chain_start: bool, where: str
) -> tuple[int, str]:
    """(how many leading blocks of a BlockStored carry no hash key but the adapter's and the cache salt, the salt):
    the blocks ``_block_stored`` may index, and the namespace's salt. ``chain_start``: the event's first block
    starts a chain (it has no parent), the one block that carries the salt."""
    if extra_keys is None:
        return blocks, ""
    if not isinstance(extra_keys, list):
        raise EventDecodeError(f"{where}: extra_keys is not a list")
    salt = ""
    for i, keys in enumerate(extra_keys[:blocks]):
        rest = list(keys or ())
        if adapter and rest and rest[0] == adapter:
            rest = rest[1:]  # vLLM lists the adapter's name first, in every block of a LoRA request
        if i == 0 and chain_start and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]  # a chain's first block carries the request's cache salt
            rest = []
        if rest:
            return i, salt
    return blocks, salt


def _block_removed(fields: dict[str, Any], index: int, skipped: Counter[str] | None) -> BlockRemoved | None:
    hashes_raw = _require(fields, "block_hashes", "BlockRemoved", index)
    if not isinstance(hashes_raw, list):
        raise EventDecodeError(f"event {index} (BlockRemoved): block_hashes is not a list")
    if not hashes_raw:
        _skip(skipped, "BlockRemoved: no blocks")
        return None
    medium = _medium(fields, "BlockRemoved", skipped)
    if medium is None:
        return None
    return BlockRemoved(
        engine_block_hashes=tuple(
            _block_hash(h, f"event {index} (BlockRemoved) block_hashes[{i}]")
            for i, h in enumerate(hashes_raw)
        ),
        medium=medium,
    )


def decode_batch(
    payload: bytes, skipped: Counter[str] | None = None, tiers: TierTracker | None = None
) -> list[CacheEvent]:
    """Decode one vLLM ``EventBatch`` payload into engine-neutral events, in the batch's order.

    All-or-nothing: a malformed payload raises ``EventDecodeError`` (so a batch is never half-applied);
    event types we do not know (and blocks p2pnode cannot index, see ``_block_stored``) are skipped, counted
    per reason in ``skipped`` when given, so a new vLLM event kind does not stop the stream. ``tiers``: the chains'
    namespaces learned so far (the engine's events add to it; a tier's read it) and the tiers' block counts (None: no
    tier chain is placed).
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (ValueError, ExtraData, FormatError...)
        raise EventDecodeError(f"payload is not valid msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise EventDecodeError("payload is not an array [ts, events, dp_rank]")
    ts, raw_events = batch[0], batch[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EventDecodeError(f"batch timestamp is not a number: {ts!r}")
    if not isinstance(raw_events, list):
        raise EventDecodeError(f"batch events is not an array: {type(raw_events).__name__}")
    try:
        return _decode_events(raw_events, skipped, tiers)
    except EventDecodeError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as exc:  # a field of an
        # unexpected type deep in an event (an int where a list is): malformed, as any other
        raise EventDecodeError(f"malformed event: {type(exc).__name__}: {exc}") from exc


def _decode_events(
    raw_events: list[Any], skipped: Counter[str] | None, tiers: TierTracker | None
) -> list[CacheEvent]:
    out: list[CacheEvent] = []
    moved: Counter[tuple[Medium, bool]] = Counter()  # a tier's blocks (stored or not), counted once the batch decodes
    for index, raw in enumerate(raw_events):
        name, fields = _event_fields(raw, index)
        event: CacheEvent | None
        if name == "BlockStored":
            event = _block_stored(fields, index, skipped, tiers)
        elif name == "BlockRemoved":
            event = _block_removed(fields, index, skipped)
        elif name == "AllBlocksCleared":
            event = AllBlocksCleared()
        else:
            _skip(skipped, f"unknown event type {name}")
            continue
        if name != "AllBlocksCleared":
            medium = Medium.of_event(fields.get("medium"))
            if medium is not None and medium is not Medium.GPU:
                moved[medium, name == "BlockStored"] += len(fields.get("block_hashes") or ())
        if event is not None:
            out.append(event)
    if tiers is not None:
        for (medium, stored), blocks in moved.items():
            (tiers.stored if stored else tiers.removed)[medium] += blocks
    return out


def _seq_from_bytes(raw: bytes) -> int:
    if len(raw) != _SEQ_BYTES:
        raise EventDecodeError(f"sequence number is {len(raw)} bytes, expected {_SEQ_BYTES}")
    return int.from_bytes(raw, "big", signed=True)


# --- subscriber ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """A snapshot of the subscriber's counters.

    ``batches`` counts batches applied (live or replayed, decodable or not); ``events`` the events decoded
    from them (synthesised ``CacheReset``s not included); ``gaps`` sequence gaps seen, of which
    ``unrecovered_gaps`` could not be filled by replay; ``resets`` engine restarts detected; ``last_seq`` the
    last applied seq (-1: none yet); ``skipped_events`` events dropped by ``decode_batch``;
    ``callback_errors`` exceptions raised by ``on_events``.
    """

    batches: int = 0
    events: int = 0
    decode_errors: int = 0
    gaps: int = 0
    replayed_batches: int = 0
    unrecovered_gaps: int = 0
    resets: int = 0
    last_seq: int = -1
    skipped_events: int = 0
    callback_errors: int = 0


class KVEventSubscriber:
    """Follows one vLLM engine's KV events and hands them, in order and gap-checked, to ``on_events``.

    ``on_events`` is called synchronously on the event loop, once per applied batch that yields events (a
    ``CacheReset`` is prepended to the batch it precedes); it should be fast and must not block.

    Sequence rules (``last_live``: the last seq read from the SUB socket; ``last_applied``: the last seq
    applied, possibly ahead of ``last_live`` thanks to replay):
    - seq == last_applied + 1: apply.
    - seq > last_applied + 1: gap; replay from last_applied + 1, else ``CacheReset`` and go on from seq.
    - last_live < seq <= last_applied: already applied through replay; dropped.
    - seq == last_live with identical bytes: a duplicate; dropped.
    - any other seq <= last_live: the engine restarted (vLLM sends nothing else): ``CacheReset``, then as for
      the first batch.
    - the first batch (of an engine run): if seq > 0, replay from 0 to get what came before we were connected.
    Limitation: a restart is only visible while the new engine's seq is still at or below the old one's.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_events: Callable[[list[CacheEvent]], None],
        *,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        max_pending_batches: int = DEFAULT_MAX_PENDING_BATCHES,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be positive")
        if max_pending_batches < 1:
            raise ValueError("max_pending_batches must be at least 1")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._on_events = on_events
        self._replay_timeout_s = replay_timeout_s
        self._max_pending = max_pending_batches
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()

        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stopping = False

        self._last_live: int | None = None
        self._last_live_payload: bytes | None = None
        self._last_applied: int | None = None
        # Live batches read while a replay was running, in arrival order; seqs unique.
        self._pending: deque[tuple[int, bytes]] = deque()
        self._pending_seqs: set[int] = set()

        self._skipped: Counter[str] = Counter()
        #: The engine's tiers as its events tell them (chains' namespaces, blocks held): ``tiers.held_blocks``.
        self.tiers = TierTracker()
        self._batches = 0
        self._events = 0
        self._decode_errors = 0
        self._gaps = 0
        self._replayed = 0
        self._unrecovered = 0
        self._resets = 0
        self._callback_errors = 0

    @property
    def stats(self) -> SubscriberStats:
        return SubscriberStats(
            batches=self._batches,
            events=self._events,
            decode_errors=self._decode_errors,
            gaps=self._gaps,
            replayed_batches=self._replayed,
            unrecovered_gaps=self._unrecovered,
            resets=self._resets,
            last_seq=-1 if self._last_applied is None else self._last_applied,
            skipped_events=sum(self._skipped.values()),
            callback_errors=self._callback_errors,
        )

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Receive and apply batches until ``stop()``; returns normally when stopped, sockets closed."""
        if self._task is not None:
            raise RuntimeError("KVEventSubscriber.run() is already running")
        if self._stopping:
            return
        task = asyncio.current_task()
        self._task = task
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self._endpoint)
        self._sub = sub
        try:
            while not self._stopping:
                item = await self._next_live()
                if item is not None:
                    await self._on_live(*item)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            if task is not None:
                task.uncancel()  # the cancellation was our own stop(): finish normally
        finally:
            self._close_dealer()
            sub.close(linger=0)
            self._sub = None
            self._task = None

    async def stop(self) -> None:
        """Stop ``run()`` (wherever it is waiting) and wait until its sockets are closed. Idempotent."""
        self._stopping = True
        task = self._task
        if task is None or task.done() or task is asyncio.current_task():
            return
        task.cancel()
        await asyncio.wait([task])

    # --- live stream ----------------------------------------------------------------------------------------

    async def _next_live(self) -> tuple[int, bytes] | None:
        """The next live (seq, payload), batches buffered during a replay first; None: a frame to ignore."""
        if self._pending:
            seq, payload = self._pending.popleft()
            self._pending_seqs.discard(seq)
            return seq, payload
        assert self._sub is not None
        return self._parse_live(await self._sub.recv_multipart())

    def _parse_live(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3:
            self._decode_errors += 1
            logger.warning("KV event message with %d frames (expected 3) ignored", len(frames))
            return None
        topic, seq_raw, payload = frames
        if topic != self._topic:
            return None  # SUB filters by prefix; another topic that merely starts with ours
        try:
            seq = _seq_from_bytes(seq_raw)
            if seq < 0:
                raise EventDecodeError(f"negative sequence number {seq}")
        except EventDecodeError as exc:
            self._decode_errors += 1
            logger.warning("KV event message ignored: %s", exc)
            return None
        return seq, payload

    async def _on_live(self, seq: int, payload: bytes) -> None:
        last_live = self._last_live
        if last_live is not None and seq == last_live and payload == self._last_live_payload:
            logger.debug("duplicate KV event batch seq %d dropped", seq)
            return
        self._last_live, self._last_live_payload = seq, payload
        if last_live is not None and seq <= last_live:
            self._resets += 1
            logger.warning("KV event seq went back from %d to %d: engine restarted", last_live, seq)
            self._last_applied = None
            reset = CacheReset(f"engine restart: event seq went from {last_live} to {seq}")
            await self._catch_up(seq, payload, reset)
            return
        if self._last_applied is None:
            await self._catch_up(seq, payload, None)
        elif seq <= self._last_applied:
            pass  # already applied through a replay that ran ahead of the live stream
        elif seq == self._last_applied + 1:
            self._apply(seq, payload, None, replayed=False)
        else:
            self._gaps += 1
            logger.info("KV event gap: expected seq %d, got %d; replaying", self._last_applied + 1, seq)
            await self._catch_up(seq, payload, None)

    async def _catch_up(self, seq: int, payload: bytes, reset: CacheReset | None) -> None:
        """Fill what is missing before live batch ``seq`` through replay, then apply it.

        With nothing applied yet (start, or after a restart) missing history is merely attempted (from seq 0);
        otherwise any hole left after the replay becomes a ``CacheReset``.
        """
        start = 0 if self._last_applied is None else self._last_applied + 1
        replayed = await self._replay(start) if seq > start else []
        batches = {s: p for s, p in replayed if s >= start}
        batches[seq] = payload  # the live copy; a replayed one of the same seq is the same bytes
        for s in sorted(batches):
            if self._last_applied is not None and s <= self._last_applied:
                continue
            if self._last_applied is not None and s > self._last_applied + 1:
                self._unrecovered += 1
                lost = f"{self._last_applied + 1}..{s - 1}"
                logger.warning("KV events seq %s lost beyond replay: resetting the cache view", lost)
                if reset is None:
                    reset = CacheReset(f"unrecoverable gap: event seq {lost} lost")
            self._apply(s, batches[s], reset, replayed=s != seq)
            reset = None

    def _apply(self, seq: int, payload: bytes, reset: CacheReset | None, *, replayed: bool) -> None:
        """Mark ``seq`` applied, deliver its events (after ``reset``); an undecodable batch still counts."""
        self._last_applied = seq
        self._batches += 1
        if replayed:
            self._replayed += 1
        if reset is not None:
            self.tiers.reset()
        try:
            events = decode_batch(payload, self._skipped, self.tiers)
        except EventDecodeError as exc:
            self._decode_errors += 1
            logger.warning("KV event batch seq %d could not be decoded: %s; resetting the cache view", seq, exc)
            events = []
            if reset is None:  # what it stored or removed is unknown: never a silently stale view
                reset = CacheReset(f"KV event batch seq {seq} undecodable")
                self.tiers.reset()
        self._events += len(events)
        out: list[CacheEvent] = [reset, *events] if reset is not None else events
        if not out:
            return
        try:
            self._on_events(out)
        except Exception:
            self._callback_errors += 1
            logger.exception("KV event callback failed on batch seq %d", seq)

    # --- replay ---------------------------------------------------------------------------------------------

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """Batches with seq >= ``start`` from the publisher's replay buffer, ascending; [] when unavailable.

        Keeps reading the SUB socket meanwhile (into ``_pending``, bounded) so the live stream is not held up.
        Returns what arrived before a failure; the DEALER is then recreated so that late replies to an
        abandoned request can never be mistaken for those of the next one.
        """
        if self._replay_endpoint is None:
            return []
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self._replay_endpoint)
        dealer = self._dealer
        out: list[tuple[int, bytes]] = []
        ok = False
        try:
            async with asyncio.timeout(self._replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(_SEQ_BYTES, "big")])
            while True:
                frames = await self._next_replay_frames(dealer)
                if frames is None:
                    logger.warning("KV event replay from seq %d timed out after %d batches", start, len(out))
                    break
                if len(frames) != 4 or frames[0] != b"":
                    logger.warning("malformed KV event replay reply (%d frames) ends the replay", len(frames))
                    break
                seq = _seq_from_bytes(frames[2])
                if seq == END_OF_REPLAY_SEQ:
                    ok = True
                    break
                if seq < start or (out and seq <= out[-1][0]):
                    logger.warning("KV event replay sent seq %d out of order; ignored", seq)
                    continue
                out.append((seq, frames[3]))
        except TimeoutError:
            logger.warning("KV event replay request to %s could not be sent", self._replay_endpoint)
        except EventDecodeError as exc:
            logger.warning("malformed KV event replay reply ends the replay: %s", exc)
        if not ok:
            self._close_dealer()
        return out

    async def _next_replay_frames(self, dealer: zmq.asyncio.Socket) -> list[bytes] | None:
        """The next replay reply (None: none within ``replay_timeout_s``); buffers live batches meanwhile."""
        assert self._sub is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_timeout_s
        poller = zmq.asyncio.Poller()
        poller.register(dealer, zmq.POLLIN)
        reading_sub = False
        while True:
            want_sub = len(self._pending) < self._max_pending
            if want_sub != reading_sub:
                if want_sub:
                    poller.register(self._sub, zmq.POLLIN)
                else:
                    poller.unregister(self._sub)
                reading_sub = want_sub
            remaining_ms = int((deadline - loop.time()) * 1000)
            if remaining_ms <= 0:
                return None
            ready = dict(await poller.poll(remaining_ms))
            if dealer in ready:
                return list(await dealer.recv_multipart())
            if self._sub in ready:
                item = self._parse_live(await self._sub.recv_multipart())
                if item is not None and item[0] not in self._pending_seqs:
                    self._pending.append(item)
                    self._pending_seqs.add(item[0])
