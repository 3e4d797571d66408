"""The connector's per-request vocabulary: what a node puts in a request's ``kv_transfer_params`` and what the
connector answers in the finished request's (``RequestOutput.kv_transfer_params``).

Everything lives under one private key (``KEY``) so that no vLLM-reserved name (``do_remote_prefill``...) is touched;
values are plain msgpack-able types because they cross into vLLM's engine-core process.

Three requests use it:
- a **pull**: a request served here whose prefix's KV is pulled from a holder -- ``PullSource`` in, ``PullResult``
  out (what arrived, and how long it took);
- an **export**: a one-token request the holder runs over the prefix so that its blocks are leased to the puller --
  ``ExportAsk`` in, ``ExportLease`` out (or the reason it could not lease them);
- a request with **approximate segments** (``segments.py``): ``SegmentAsk`` in (where its segments lie, and whether
  to keep its tail for the next phase), ``SegmentResult`` out (what was loaded, what the store took and dropped);
- a **segment export**: a one-token request on the holder that lends stored segments to a puller --
  ``SegmentExportAsk`` in, ``SegmentLease`` out (the entries lent);
- a **segment fetch**: a one-token request on the puller that waits while its worker pulls leased segments into its
  own store -- ``SegmentFetch`` in, ``SegmentFetched`` out (what arrived and what the store took).

Every finished request that loaded blocks from the host tier says how many tokens under a key of its own
(``TIER_KEY``): the tier is another connector in the same engine (``kv/tier/``), and vLLM refuses two connectors'
answers under one key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = [
    "KEY",
    "TIER_KEY",
    "TIER_LOADED_ATTR",
    "ExportAsk",
    "ExportLease",
    "PullResult",
    "PullSource",
    "SegmentAsk",
    "SegmentExportAsk",
    "SegmentFetch",
    "SegmentFetched",
    "SegmentLease",
    "SegmentResult",
    "read",
    "tier_loaded",
]

#: The one key of ``kv_transfer_params`` p2pnode uses.
KEY = "p2pnode"
#: The key of a finished request's answer under which the host tier's connector says what it loaded.
TIER_KEY = "p2pnode_tier"
#: The attribute of vLLM's ``Request`` (engine-core process) where the tier's connector notes what it loaded, for
#: ``PeerPullConnector`` deciding whether an export's blocks were cached (absent: nothing loaded).
TIER_LOADED_ATTR = "_p2pnode_tier_loaded"


@dataclass(frozen=True, slots=True)
class PullSource:
    """Pull the prompt's first ``blocks`` blocks from a holder's engine: its block server at ``kv_address`` serves the
    leased ``block_ids`` (in prefix order) to whoever presents ``lease``."""

    holder: str
    kv_address: str
    lease: str
    block_ids: tuple[int, ...]
    blocks: int


@dataclass(frozen=True, slots=True)
class PullResult:
    """What a pull delivered: ``tokens`` of the prompt arrived (``bytes`` of KV in ``seconds``) of the ``asked`` ones
    the engine counted as cached when it admitted the request; ``outcome`` is "ok" or why it failed -- the engine then
    computed what did not arrive (and still counts it as cached: ``asked - tokens`` too many)."""

    outcome: str
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    asked: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(frozen=True, slots=True)
class ExportAsk:
    """Lease the request's first ``blocks`` blocks (cached ones only) under ``lease`` for ``ttl_s`` seconds."""

    lease: str
    blocks: int
    ttl_s: float


@dataclass(frozen=True, slots=True)
class ExportLease:
    """The leased blocks (in prefix order), or ``error`` ("" when leased) and how many blocks were cached."""

    lease: str
    block_ids: tuple[int, ...] = ()
    error: str = ""
    cached_blocks: int = 0


@dataclass(frozen=True, slots=True)
class SegmentAsk:
    """Reuse stored segments for this prompt (approximate mode): ``spans`` holds each segment's ``start, end`` token
    positions, flattened and in prompt order, and ``keys`` their store keys (``segments.segment_key``); a segment's
    first ``recompute`` tokens are always computed, never loaded. ``tail``: keep the KV of the prompt's last partial
    block once the request ends, for the next phase of the same prompt (``segments.py``). ``elsewhere``: the keys a
    peer's store holds, as the serving node's gossip says (each counts as one offer more for the store's admission).
    """

    spans: tuple[int, ...]
    keys: tuple[int, ...]
    recompute: int = 0
    tail: bool = False
    elsewhere: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SegmentResult:
    """What a request with segments got: ``loaded`` tokens came from the store (``segments`` of its segments, the
    rest from a tail), the store took ``stored`` keys from it and dropped ``evicted`` ones (now ``held_tokens`` in
    all); ``error`` says why nothing was loaded when the store is off."""

    loaded: int = 0
    segments: int = 0
    stored: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    held_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class SegmentExportAsk:
    """Lend the stored segments ``keys`` (``lengths`` tokens each, ``tokens`` all of them concatenated: an entry is
    lent only when it holds exactly these) under ``lease`` for ``ttl_s`` seconds."""

    lease: str
    keys: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens: tuple[int, ...]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class SegmentLease:
    """The segments lent (``keys``, each's ``starts`` -- where its keys were rotated -- and ``lengths``), in the order
    the worker streams them; ``error`` says why none was."""

    lease: str
    keys: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class SegmentFetch:
    """Pull the segments of a ``lease`` from the block server at ``kv_address`` into this engine's store: ``keys``,
    ``starts`` and ``lengths`` as the holder's ``SegmentLease`` says, ``tokens`` their tokens concatenated."""

    holder: str
    kv_address: str
    lease: str
    keys: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SegmentFetched:
    """What a segment fetch got: ``outcome`` "ok" or why not all arrived; the store took ``stored`` keys (whole
    segments that arrived: ``tokens`` tokens, ``bytes`` of K/V in ``seconds``) and dropped ``evicted`` ones."""

    outcome: str
    stored: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


_KINDS: dict[str, type] = {
    "pull": PullSource,
    "pulled": PullResult,
    "export": ExportAsk,
    "lease": ExportLease,
    "segments": SegmentAsk,
    "segmented": SegmentResult,
    "segment_export": SegmentExportAsk,
    "segment_lease": SegmentLease,
    "segment_fetch": SegmentFetch,
    "segment_fetched": SegmentFetched,
}

Value = (
    PullSource
    | PullResult
    | ExportAsk
    | ExportLease
    | SegmentAsk
    | SegmentResult
    | SegmentExportAsk
    | SegmentLease
    | SegmentFetch
    | SegmentFetched
)


def wrap(*values: Value) -> dict[str, Any]:
    """``values`` as ``kv_transfer_params`` (or a finished request's answer), one entry per kind."""
    entries: dict[str, Any] = {}
    for value in values:
        kind = next(k for k, cls in _KINDS.items() if isinstance(value, cls))
        entries[kind] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(value).items()}
    return {KEY: entries}


def read(params: dict[str, Any] | None, kind: str) -> Any:
    """The ``kind`` entry (a key of ``_KINDS``: "pull", "pulled", "export", "segments", ...) of ``params``, rebuilt;
    None when absent or malformed (a malformed value is never trusted: the request is served as if it had none)."""
    if not isinstance(params, dict):
        return None
    body = params.get(KEY)
    if not isinstance(body, dict) or not isinstance(body.get(kind), dict):
        return None
    cls = _KINDS[kind]
    raw = body[kind]
    try:
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        for name, value in values.items():
            if isinstance(value, list):
                values[name] = tuple(int(x) for x in value)
        return cls(**values)
    except (TypeError, ValueError):
        return None


def tier_loaded(params: dict[str, Any] | None, medium: str = "host") -> int:
    """Tokens a finished request loaded from the host tier (``TIER_KEY``; 0 when none or malformed); ``medium``
    "disk": those the disk tier below it supplied (through the host tier, counted apart)."""
    body = params.get(TIER_KEY) if isinstance(params, dict) else None
    tokens = body.get(medium) if isinstance(body, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0
