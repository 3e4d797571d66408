"""The connector's per-request vocabulary: what a node puts in a request's ``kv_transfer_params`` and what the
connector answers in the finished request's (``RequestOutput.kv_transfer_params``).

Everything lives under one private key (``KEY``) so that no vLLM-reserved name (``do_remote_prefill``...) is touched;
values are plain msgpack-able types because they cross into vLLM's engine-core process.

Two requests use it:
- a **pull**: a request served here whose prefix's KV is pulled from a holder -- ``PullSource`` in, ``PullResult``
  out (what arrived, and how long it took);
- an **export**: a one-token request the holder runs over the prefix so that its blocks are leased to the puller --
  ``ExportAsk`` in, ``ExportLease`` out (or the reason it could not lease them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["KEY", "ExportAsk", "ExportLease", "PullResult", "PullSource", "read"]

#: The one key of ``kv_transfer_params`` p2pnode uses.
KEY = "p2pnode"


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


_KINDS: dict[str, type] = {"pull": PullSource, "pulled": PullResult, "export": ExportAsk, "lease": ExportLease}


def wrap(value: PullSource | PullResult | ExportAsk | ExportLease) -> dict[str, Any]:
    """``value`` as ``kv_transfer_params`` (or a finished request's answer)."""
    kind = next(k for k, cls in _KINDS.items() if isinstance(value, cls))
    body = asdict(value)
    return {KEY: {kind: {k: list(v) if isinstance(v, tuple) else v for k, v in body.items()}}}


def read(params: dict[str, Any] | None, kind: str) -> Any:
    """The ``kind`` entry ("pull", "pulled", "export", "lease") of ``params``, rebuilt; None when absent or malformed
    (a malformed value is never trusted: the request is served as if it had none)."""
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
