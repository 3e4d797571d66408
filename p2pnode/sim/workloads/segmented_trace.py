"""Segmented trace replay: a JSONL trace whose prompts are ordered, named pieces, some of them reusable segments.

Mooncake's format (``trace.py``) says only which block prefixes requests share, so reuse beyond prefixes cannot be
replayed from it. A segmented trace names each prompt's pieces instead (docs/simulator.md, "Segmented traces"):

- an optional **header** as the first line, ``{"format": "segmented", "timestamp_unit": "s"}`` (``"s"`` or
  ``"ms"``; ``"version": 1`` and any other keys are accepted and ignored). Without it the format must be named
  (``--trace-format segmented``) and the unit given (``--trace-time-unit``); given both ways, they must agree;
- then one **request** per line: ``timestamp`` (a non-negative number, or a string holding one, in the stated
  unit), ``prompt`` (a non-empty list of pieces, in prompt order), ``output_tokens`` (integer >= 0) and, optionally,
  ``session_id`` (string, integer or null; carried, not routed on: routers derive their key from the leading
  blocks, as for Mooncake traces);
- a **piece** is ``{"kind": str, "id": str | int, "tokens": int >= 1, "segment": bool}`` (``segment`` optional,
  default false). ``id`` 3 and ``"3"`` are the same piece. Pieces of one (kind, id) are the same text everywhere:
  the same token count on every line (anything else is refused), and the same tokens, token j a hash of
  (kind, id, j) (``rag.hashed_token_ids``, the tokens the rag workload writes for a real model). A piece marked
  ``segment`` is a named segment -- its KV may be reused wherever it stands, in ``exact`` and ``approximate``
  mode (``--segments``) -- and a request names a segment once.

Replay is the rag workload's (``rag.py``): every request's real tokens are hashed into blocks by the node's own
``block_hashes``, and a request with segments carries them as a ``SegmentedPrompt`` (spans, keys:
``segment_key`` of each segment's tokens), which the run reuses as ``--segments`` says; a request without any is a
plain prompt (prefix caching in every mode). The output is the request's own text (a token no other request has,
then filler): cached as the engine caches any output, never reused by a later request. Classes: ``segments`` and
``plain``. Timing as for Mooncake traces: timestamp order (stable), the trace's own rate, or scaled to a ladder's.
Simulated at 64-token blocks unless told (rag's: there are no block ids to keep).

Anything malformed is refused with ``TraceFormatError`` naming the file, the line and the field, before the run.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from p2pnode.cache.block_hash import block_hashes
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.simulated.segments import SegmentedPrompt, segment_key
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.base import Limit
from p2pnode.sim.workloads.rag import BLOCK_SIZE, FILLER, hashed_token_ids
from p2pnode.sim.workloads.trace import MAX_TRACE_PROMPT_TOKENS, TraceFormatError, check_span, trace_lines

__all__ = [
    "DEFAULT_SEGMENTED_BLOCK_SIZE",
    "FORMAT",
    "TIME_UNITS",
    "TRACE_FORMATS",
    "SegmentedPiece",
    "SegmentedRecord",
    "SegmentedRequests",
    "SegmentedTraceWorkload",
    "detect_trace_format",
    "load_segmented_trace",
]

#: The header's ``format`` (and ``--trace-format``'s name for it).
FORMAT = "segmented"
#: ``--trace-format``'s choices: ``auto`` reads the first line (``detect_trace_format``).
TRACE_FORMATS = ("auto", "mooncake", FORMAT)
#: Milliseconds per unit of ``timestamp``.
TIME_UNITS = {"s": 1000.0, "ms": 1.0}
DEFAULT_SEGMENTED_BLOCK_SIZE = BLOCK_SIZE
#: Token ids span all of uint32: the simulator has no vocabulary to fit.
_VOCAB = 1 << 32
#: Tokens of pieces kept between requests (a piece's tokens cost a hash each to derive; ~40 bytes a token).
_MEMO_TOKENS = 4_000_000


@dataclass(frozen=True, slots=True)
class SegmentedPiece:
    kind: str
    ident: str
    tokens: int
    segment: bool


@dataclass(frozen=True, slots=True)
class SegmentedRecord:
    timestamp_ms: float
    pieces: tuple[SegmentedPiece, ...]
    output_tokens: int
    session_id: str | None = None

    @property
    def input_length(self) -> int:
        return sum(p.tokens for p in self.pieces)

    @property
    def has_segments(self) -> bool:
        return any(p.segment for p in self.pieces)


def _first_object(path: Path) -> tuple[int, object] | None:
    """(line number, parsed JSON) of the first non-blank line; None if there is none or it is not JSON."""
    for lineno, line in trace_lines(path):
        if line.strip():
            try:
                return lineno, json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def detect_trace_format(path: str | Path) -> str:
    """``segmented`` when the first line is a segmented header or request (a ``format`` or a ``prompt`` field),
    else ``mooncake`` (whose loader then says what is wrong with a file that is neither)."""
    try:
        first = _first_object(Path(path))
    except TraceFormatError:
        first = None  # the loader names the line
    if first is not None and isinstance(first[1], dict) and ("format" in first[1] or "prompt" in first[1]):
        return FORMAT
    return "mooncake"


def _header_unit(obj: dict, where: str) -> str | None:
    if obj["format"] != FORMAT:
        raise TraceFormatError(f"{where}: header 'format' must be {FORMAT!r}, got {obj['format']!r}")
    unit = obj.get("timestamp_unit")
    if unit is not None and (not isinstance(unit, str) or unit not in TIME_UNITS):
        raise TraceFormatError(f"{where}: header 'timestamp_unit' must be one of {', '.join(TIME_UNITS)}, got {unit!r}")
    return unit


def _timestamp(v: object, where: str) -> float:
    if isinstance(v, str):
        try:
            t = float(v.strip())
        except ValueError:
            t = math.nan
    elif type(v) in (int, float):
        t = float(v)  # type: ignore[arg-type]
    else:
        t = math.nan
    if not math.isfinite(t) or t < 0:
        raise TraceFormatError(f"{where}: 'timestamp' must be a non-negative number or numeric string, got {v!r}")
    return t


def _int(obj: dict, name: str, where: str, minimum: int) -> int:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    v = obj[name]
    if type(v) is not int or v < minimum:
        raise TraceFormatError(f"{where}: {name!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _piece(obj: object, where: str) -> SegmentedPiece:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected an object {{kind, id, tokens, segment}}, got {obj!r}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise TraceFormatError(f"{where}.kind: must be a non-empty string, got {kind!r}")
    if "id" not in obj:
        raise TraceFormatError(f"{where}: missing field 'id'")
    ident = obj["id"]
    if type(ident) is int:
        ident = str(ident)
    if not isinstance(ident, str) or not ident:
        raise TraceFormatError(f"{where}.id: must be a non-empty string or an integer, got {obj['id']!r}")
    tokens = _int(obj, "tokens", where, 1)
    segment = obj.get("segment", False)
    if type(segment) is not bool:
        raise TraceFormatError(f"{where}.segment: must be true or false, got {segment!r}")
    return SegmentedPiece(kind, ident, tokens, segment)


def _record(obj: object, where: str, ms_per_unit: float) -> SegmentedRecord:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise TraceFormatError(f"{where}: missing field 'timestamp'")
    t = _timestamp(obj["timestamp"], where)
    if "prompt" not in obj:
        raise TraceFormatError(f"{where}: missing field 'prompt'")
    prompt = obj["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise TraceFormatError(f"{where}: 'prompt' must be a non-empty list of pieces")
    pieces = tuple(_piece(p, f"{where}: prompt[{i}]") for i, p in enumerate(prompt))
    if sum(p.tokens for p in pieces) > MAX_TRACE_PROMPT_TOKENS:
        raise TraceFormatError(f"{where}: the prompt's pieces hold more than {MAX_TRACE_PROMPT_TOKENS} tokens")
    named: dict[tuple[str, str], int] = {}
    for i, p in enumerate(pieces):
        if p.segment:
            j = named.setdefault((p.kind, p.ident), i)
            if j != i:
                raise TraceFormatError(
                    f"{where}: prompt[{i}]: segment ({p.kind!r}, {p.ident!r}) is named again (first at prompt[{j}]); "
                    f"a request names a segment once"
                )
    output = _int(obj, "output_tokens", where, 0)
    session = obj.get("session_id")
    if type(session) is int:
        session = str(session)
    if session is not None and not isinstance(session, str):
        raise TraceFormatError(f"{where}: 'session_id' must be a string, an integer or null, got {session!r}")
    return SegmentedRecord(t * ms_per_unit, pieces, output, session)


def load_segmented_trace(path: str | Path, time_unit: str | None = None) -> list[SegmentedRecord]:
    """Every request of the file, sorted by timestamp; ``time_unit`` (``s`` or ``ms``) is the header's unit or
    stands in for it. TraceFormatError on the first malformed line, or when the unit is unknown or contradicted."""
    path = Path(path)
    if time_unit is not None and time_unit not in TIME_UNITS:
        raise ValueError(f"time unit must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")
    records: list[SegmentedRecord] = []
    lengths: dict[tuple[str, str], tuple[int, int]] = {}  # (kind, id) -> (tokens, first line)
    ms_per_unit: float | None = None
    for lineno, line in trace_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if ms_per_unit is None:  # the first line: a header, or a request with the unit told
            unit = _header_unit(obj, where) if isinstance(obj, dict) and "format" in obj else None
            if unit is not None and time_unit is not None and unit != time_unit:
                raise TraceFormatError(
                    f"{where}: the header says timestamps are in {unit!r}, --trace-time-unit says {time_unit!r}"
                )
            unit = unit or time_unit
            if unit is None:
                raise TraceFormatError(
                    f"{where}: timestamp unit unknown: state it in a header line "
                    f'{{"format": "{FORMAT}", "timestamp_unit": "s"}} or give --trace-time-unit s|ms'
                )
            ms_per_unit = TIME_UNITS[unit]
            if isinstance(obj, dict) and "format" in obj:
                continue
        rec = _record(obj, where, ms_per_unit)
        for i, p in enumerate(rec.pieces):
            n, first = lengths.setdefault((p.kind, p.ident), (p.tokens, lineno))
            if n != p.tokens:
                raise TraceFormatError(
                    f"{where}: prompt[{i}].tokens: ({p.kind!r}, {p.ident!r}) has {p.tokens} tokens here and {n} "
                    f"at line {first}; a piece is the same text everywhere"
                )
        records.append(rec)
    if not records:
        raise TraceFormatError(f"{path}: no records")
    records.sort(key=lambda r: r.timestamp_ms)
    check_span(path, records[0].timestamp_ms, records[-1].timestamp_ms)
    return records


class SegmentedRequests:
    """Records of named pieces as simulated requests: each piece's tokens and each segment's key, memoised within a
    bound (what a trace's replay and a generator of such records share)."""

    def __init__(self) -> None:
        self._tokens: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self._memo_tokens = 0
        self._keys: dict[tuple[str, str], int] = {}

    def __getstate__(self) -> dict:
        """What a worker process is sent: the records, not the memos (rebuilt there as it replays)."""
        state = dict(self.__dict__)
        state.update(_tokens=OrderedDict(), _memo_tokens=0, _keys={})
        return state

    def piece_tokens(self, piece: SegmentedPiece) -> list[int]:
        """The piece's tokens (module docstring), memoised within a bound."""
        name = (piece.kind, piece.ident)
        ids = self._tokens.get(name)
        if ids is not None:
            self._tokens.move_to_end(name)
            return ids
        ids = hashed_token_ids(f"{piece.kind}:{piece.ident}", piece.tokens, _VOCAB)
        self._tokens[name] = ids
        self._memo_tokens += len(ids)
        while self._memo_tokens > _MEMO_TOKENS and len(self._tokens) > 1:
            self._memo_tokens -= len(self._tokens.popitem(last=False)[1])
        return ids

    def request(self, rid: int, arrival: float, rec: SegmentedRecord, block_size: int) -> SimRequest:
        """One record as a simulated request, with its segments when it names any."""
        tokens: list[int] = []
        spans: list[tuple[int, int]] = []
        keys: list[int] = []
        for piece in rec.pieces:
            ids = self.piece_tokens(piece)
            if piece.segment:
                spans.append((len(tokens), len(tokens) + len(ids)))
                name = (piece.kind, piece.ident)
                key = self._keys.get(name)
                if key is None:
                    key = self._keys[name] = segment_key("", ids)
                keys.append(key)
            tokens += ids
        n_prompt = len(tokens)
        if rec.output_tokens:  # the request's own text: a token no other request has, then filler
            tokens.append(FILLER + xxhash.xxh3_64_intdigest(f"output:{rid}".encode()) % (_VOCAB - FILLER))
            tokens += [FILLER] * (rec.output_tokens - 1)
        r = SimRequest(rid, arrival, "", n_prompt, rec.output_tokens, block_hashes(tokens, block_size), [],
                       block_size, "segments" if spans else "plain")  # fmt: skip
        if spans:
            r.segments = SegmentedPrompt(tokens, tuple(spans), tuple(keys))
        return r


class SegmentedTraceWorkload(SegmentedRequests):
    """Replays a segmented trace (loaded and validated once; replayed per rate and seed)."""

    description = "trace replay (segmented JSONL)"

    def __init__(
        self, path: str | Path, block_size: int = DEFAULT_SEGMENTED_BLOCK_SIZE, time_unit: str | None = None
    ) -> None:
        super().__init__()
        self.records = load_segmented_trace(path, time_unit)
        self.block_size = block_size
        self.name = f"trace:{Path(path).name}"
        self.has_segments = any(r.has_segments for r in self.records)
        t0, t1 = self.records[0].timestamp_ms, self.records[-1].timestamp_ms
        self.native_qps = len(self.records) / max(1e-3, (t1 - t0) / 1000.0)

    def records_for(self, qps: float | None, seed: int, limit: Limit) -> Iterator[tuple[float, SegmentedRecord]]:
        """(arrival in seconds, record) of the requests a run replays: the trace's own, its rate scaled to ``qps``."""
        scale = 1.0 if qps is None else self.native_qps / qps
        t0 = self.records[0].timestamp_ms
        for n, rec in enumerate(self.records):
            t = (rec.timestamp_ms - t0) / 1000.0 * scale
            if limit.reached(t, n):
                return
            yield t, rec

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        for rid, (t, rec) in enumerate(self.records_for(qps, seed, limit)):
            yield self.request(rid, t, rec, space.block_size)
