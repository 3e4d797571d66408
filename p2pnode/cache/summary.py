"""The compact cache summary a node publishes: a stride-sampled subset of its cached block hashes, one key each.

p2pnode block hashes are chained (``cache/block_hash.py``): the hash at depth d names the whole d-block prefix.
So a peer holding a request's chain h_1..h_n can estimate a node's longest cached prefix as the deepest depth d
whose hash the node published (and the sampled depth before it: ``routing/tier_summaries.py``) -- no tree, no depths
on the wire. A node publishes the hashes of its cached blocks whose depth (1-based) is a multiple of the *stride* s,
each as its 32-bit summary key (``summary_log.summary_key``, the low half):

- **bounded error**: a cached prefix of m blocks is estimated as s * floor(m / s), under the truth by less than s
  blocks (never over it, unless the engine evicted a block in the middle of a chain while keeping deeper ones,
  which vLLM's tail-first eviction makes rare; or the summary is stale; or, by one stride, a 32-bit key collides:
  ``summary_log.py``, "Why 32 bits");
- **bounded size**: at most ``max_hashes`` keys. When the sampled set would exceed it, the stride doubles (powers of
  two, so the new set is a subset of the old one) until it fits; it halves back only once the finer set fits in
  3/4 of the cap (hysteresis). Every cached prefix stays represented, with a coarser error, instead of some
  prefixes vanishing;
- **cheap deltas**: the set travels as an append log of key batches with withdrawal bitmaps
  (``summary_log.py``): ~4 B per published key and a few bytes per round for the withdrawn ones, exact at every
  age. The key ``"summary"`` holds ``[stride, block_size]`` so peers read the keys correctly.

One summary per medium a node caches in: the engine's own KV (the keys above), and each tier below it (a host tier:
``summary/host`` and its own log, ``SUMMARY_FAMILIES``), each with its own hash budget, so a tier several times the
engine's size does not coarsen the engine's summary: peers read every tier's depth of a prompt separately and a
router prices each (``routing/cluster_view.py``).

``SummaryPublisher.poll`` is called once per gossip round (never from the engine's event path; ``attach`` hooks it
into an agent's rounds): when the index version moved it rescans the index (``iter_blocks``; the index's public API
gives no depth for a changed hash, so a scan is the only way to keep depth sampling exact -- ~1 ms per 16k blocks)
and returns what to add and remove.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgpack

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.summary_log import GPU_KEYS, SummaryKeys, SummaryWriter, summary_key
from p2pnode.cache.tiers import Medium
from p2pnode.gossip.clock import Clock

__all__ = [
    "SUMMARY_FAMILIES",
    "SUMMARY_META_KEY",
    "Publisher",
    "SummaryChange",
    "SummaryFamily",
    "SummaryMeta",
    "SummaryPublisher",
    "decode_meta",
    "encode_meta",
    "hash_key",
    "key_hash",
]

#: The key holding ``[stride, block_size]``: how to read this node's summary keys.
SUMMARY_META_KEY = "summary"


@dataclass(frozen=True, slots=True)
class SummaryFamily:
    """The gossip keys of one medium's summary: its meta key and its log's keys."""

    medium: Medium
    meta_key: str
    log: SummaryKeys


#: Every medium's summary keys (the engine's own first: its keys are the original ones).
SUMMARY_FAMILIES = {
    Medium.GPU: SummaryFamily(Medium.GPU, SUMMARY_META_KEY, GPU_KEYS),
    Medium.HOST: SummaryFamily(Medium.HOST, "summary/host", SummaryKeys("cb/", "cd/")),
    Medium.DISK: SummaryFamily(Medium.DISK, "summary/disk", SummaryKeys("db/", "dd/")),
}
_KEY_LEN = 2 + 11  # a two-character prefix, then 8 bytes in unpadded base64
#: Seconds a publish waits after the first ``notify`` of a quiet index: the rest of the engine's burst of events
#: (a prompt's blocks arrive as several events) joins the same batch.
SUMMARY_SETTLE_S = 0.02
#: The stride halves back only when the finer sampled set fits in this fraction of the cap.
STRIDE_DOWN_FILL = 0.75


_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")
# The 11th character of 8 bytes in base64 carries 4 bits and 2 zero bits: only these 16 characters are canonical.
_CANONICAL_LAST = frozenset("AEIMQUYcgkosw048")


def hash_key(h: int, prefix: str) -> str:
    """The state key publishing the 64-bit key ``h`` in a family of one key per value: ``prefix`` (two characters)
    + base64url of its 8 bytes (``cache/segment_summary.py``'s segment keys)."""
    encoded = binascii.b2a_base64(h.to_bytes(8, "big"), newline=False)[:11]
    return prefix + encoded.translate(_TO_URLSAFE).decode()


def key_hash(key: str, prefix: str) -> int | None:
    """The 64-bit key a ``hash_key`` key publishes, or None when ``key`` is not a well-formed one.

    Only the canonical spelling (``hash_key``'s) is accepted, so that one hash has exactly one key. On every peer's
    hot path for such changes: ~0.5 us. ``prefix``: as for ``hash_key`` (two characters).
    """
    if len(key) != _KEY_LEN or not key.startswith(prefix) or key[-1] not in _CANONICAL_LAST:
        return None
    body = key[len(prefix) :]
    if "+" in body or "/" in body:
        return None
    try:
        raw = binascii.a2b_base64(body.encode().translate(_FROM_URLSAFE) + b"=", strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 8 else None


@dataclass(frozen=True, slots=True)
class SummaryMeta:
    """How to read a node's summary keys: the depth stride they were sampled with and the index's block size; and
    whether its cached KV can be moved to another node (``kv_layout``: equal non-empty layouts are interchangeable,
    ``routing/policies/types.PeerSnapshot.kv_layout``; "" when the node takes part in no KV transfer)."""

    stride: int
    block_size: int
    kv_layout: str = ""


#: Longest encoded meta accepted (the layout fingerprint is short).
MAX_META_BYTES = 256
#: The largest stride and block size a peer's meta may name (a real stride is a few thousand blocks at most; a block
#: a few thousand tokens): a stride of 2**63 passed and made every routing decision of every node raise in C.
MAX_META_FIELD = 1 << 20


def encode_meta(meta: SummaryMeta) -> bytes:
    fields: list[object] = [meta.stride, meta.block_size]
    if meta.kv_layout:
        fields.append(meta.kv_layout)
    return msgpack.packb(fields)


def decode_meta(value: bytes) -> SummaryMeta | None:
    if len(value) > MAX_META_BYTES:
        return None
    try:
        fields = msgpack.unpackb(value)
        stride, block_size, *rest = fields
    except Exception:
        return None
    if type(stride) is not int or type(block_size) is not int or len(rest) > 1:
        return None
    if not (0 < stride <= MAX_META_FIELD and 0 < block_size <= MAX_META_FIELD):
        return None
    layout = rest[0] if rest else ""
    if not isinstance(layout, str):
        return None
    return SummaryMeta(stride, block_size, layout)


@dataclass(frozen=True, slots=True)
class SummaryChange:
    """What one poll changed: hashes to publish, hashes to withdraw, and the (possibly new) meta."""

    added: list[int]
    removed: list[int]
    meta: SummaryMeta


class Publisher(Protocol):
    """Where a summary is published: a gossip agent (``GossipAgent``)."""

    def before_round(self, publisher: Callable[[], None]) -> None: ...

    clock: Clock
    running: bool

    def push_own(self) -> None: ...

    def publish(self, key: str, value: bytes) -> None: ...

    def unpublish(self, key: str) -> None: ...


class SummaryPublisher:
    """Keeps the published hash set in step with a PrefixIndex (see the module docstring)."""

    def __init__(
        self,
        index: PrefixIndex,
        base_stride: int,
        max_hashes: int,
        kv_layout: str = "",
        medium: Medium = Medium.GPU,
    ) -> None:
        """``index``: the exact index of what the node caches in ``medium`` (the engine's own KV by default)."""
        if base_stride < 1 or max_hashes < 1:
            raise ValueError("base_stride and max_hashes must be >= 1")
        self.family = SUMMARY_FAMILIES[medium]
        self.index = index
        self.base_stride = base_stride
        self.max_hashes = max_hashes
        self.kv_layout = kv_layout
        self.level = 0  # stride = base_stride * 2**level
        #: The published summary keys (``summary_log.summary_key`` of the sampled blocks' hashes).
        self.published: set[int] = set()
        self.log = SummaryWriter(self.family.log)
        self._version: int | None = None
        self._agent: Publisher | None = None
        self._min_gap_s: float | None = None
        self._pending = False
        self._published_at = float("-inf")

    @property
    def stride(self) -> int:
        return self.base_stride << self.level

    @property
    def meta(self) -> SummaryMeta:
        return SummaryMeta(self.stride, self.index.block_size, self.kv_layout)

    @property
    def published_version(self) -> int:
        """The index version the published set was computed from (0 before the first poll): the summary is current
        when it equals ``index.version``."""
        return self._version or 0

    def poll(self) -> SummaryChange | None:
        """Rescan the index if it changed since the last poll; None when it did not."""
        version = self.index.version
        if version == self._version:
            return None
        self._version = version
        base = self.base_stride
        # (hash, depth // base) of every block at a multiple of the base stride
        sampled = [(h, d // base) for h, d in self.index.iter_blocks() if d % base == 0]
        # hist[t]: sampled blocks whose depth // base has exactly t trailing zero bits; the set at level k is the
        # blocks with >= k trailing zeros.
        hist: list[int] = []
        for _, q in sampled:
            t = (q & -q).bit_length() - 1
            if t >= len(hist):
                hist.extend([0] * (t + 1 - len(hist)))
            hist[t] += 1
        counts = [sum(hist[k:]) for k in range(len(hist) + 1)]  # counts[k]: published at level k

        def fits(k: int, cap: float) -> bool:
            return k >= len(counts) or counts[k] <= cap

        level = 0
        while not fits(level, self.max_hashes):
            level += 1
        if level < self.level:  # going finer: only with room to spare
            finer = level
            while not fits(finer, self.max_hashes * STRIDE_DOWN_FILL):
                finer += 1
            level = min(finer, self.level)
        self.level = level
        mask = (1 << level) - 1
        target = {summary_key(h) for h, q in sampled if not q & mask}
        added = [h for h in target if h not in self.published]
        removed = [h for h in self.published if h not in target]
        self.published = target
        return SummaryChange(added, removed, self.meta)

    def attach(self, agent: Publisher, min_gap_s: float | None = None) -> None:
        """Publish this summary through ``agent``: polled at the start of each of its rounds and, with ``min_gap_s``,
        soon after each ``notify`` (``SUMMARY_SETTLE_S`` later, and at least ``min_gap_s`` after the previous
        publish); each publish writes the meta, then the log's entries (``summary_log.SummaryWriter``), and pushes
        them ahead of the round when they add prefixes (``GossipAgent.push_own``)."""
        self._agent = agent
        self._min_gap_s = min_gap_s
        agent.before_round(self._publish)

    def notify(self) -> None:
        """The index changed: publish soon, not at the next round (a no-op unless ``attach`` got ``min_gap_s``)."""
        agent, gap = self._agent, self._min_gap_s
        if agent is None or gap is None or self._pending:
            return
        self._pending = True
        now = agent.clock.now()
        agent.clock.call_later(max(SUMMARY_SETTLE_S, self._published_at + gap - now), self._publish_pending)

    def _publish_pending(self) -> None:
        self._pending = False
        if self._agent is not None and self._agent.running:
            self._publish()

    def _publish(self) -> None:
        agent = self._agent
        assert agent is not None
        self._published_at = agent.clock.now()
        change = self.poll()
        if change is None:
            return
        agent.publish(self.family.meta_key, encode_meta(change.meta))
        for key, value in self.log.update(change.added, change.removed):
            if value is None:
                agent.unpublish(key)
            else:
                agent.publish(key, value)
        if change.added:  # new prefixes: routing elsewhere should know them before the next exchanges
            agent.push_own()
