"""Trace replay: any JSONL file in the Mooncake format.

One JSON object per line: ``timestamp`` (ms, non-negative number), ``input_length`` and ``output_length`` (tokens,
integers, input >= 1, output >= 0), ``hash_ids`` (list of non-negative integers: block ``i`` of the prompt, each
id naming the whole prefix up to it, blocks of ``block_size`` tokens, default 512 as in Mooncake's traces), and
optionally ``tenant`` (a string of at most ``MAX_TENANT_CHARS``: who sent it) and ``priority`` (an integer, vLLM's:
lower first, 0 the default), which a run with flow control queues and reports by (``sim/admission.py``).
Mooncake lists ``ceil(input_length / block_size)`` ids (the last block may be partial); a list of exactly the full
blocks (``floor``) is accepted too. Blank lines are skipped. Anything else is refused with ``TraceFormatError``
naming the file and line, before the simulation starts.

Replay: ids become content ids (``blocks.py``), so equal id prefixes are equal hash chains. Only full blocks are
cached or matched. The trace has no output content, so outputs are not cached for later requests (the trace's
later ids cover what did get reused). With a rate, timestamps are scaled so the mean rate is ``qps``; without,
the trace's own timing is kept. Requests are replayed in timestamp order (stable for equal stamps). No routing
key: routers derive it from the leading blocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from p2pnode.cache.block_hash import ROOT_SEED
from p2pnode.config import MOONCAKE_BLOCK_SIZE
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.base import Limit

__all__ = ["DEFAULT_TRACE_BLOCK_SIZE", "TraceFormatError", "TraceRecord", "TraceWorkload", "load_trace"]

#: The traces' block (``config.MOONCAKE_BLOCK_SIZE``).
DEFAULT_TRACE_BLOCK_SIZE = MOONCAKE_BLOCK_SIZE
_MAX_ID = (1 << 64) - 1
#: Longest tenant name a trace may give.
MAX_TENANT_CHARS = 64
#: Most prompt tokens a trace's request may have (8x the longest context of the profiles): a larger count is a
#: malformed line, which would otherwise be made into tokens mid-run (a MemoryError traceback).
MAX_TRACE_PROMPT_TOKENS = 1 << 20
#: Longest time a trace may span (ms): a week. Idle simulated time is not free (gossip rounds run through it), and
#: one epoch timestamp among relative ones made a 3-request run last hours.
MAX_TRACE_SPAN_MS = 7 * 24 * 3600 * 1000.0


class TraceFormatError(ValueError):
    """A trace line that is not a valid Mooncake record; the message names the file and line."""


def trace_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a trace file; TraceFormatError naming the line that is not UTF-8."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def check_span(path: Path, first_ms: float, last_ms: float) -> None:
    """TraceFormatError when the records span more than ``MAX_TRACE_SPAN_MS``."""
    if last_ms - first_ms > MAX_TRACE_SPAN_MS:
        days = (last_ms - first_ms) / 86_400_000
        raise TraceFormatError(
            f"{path}: the timestamps span {days:,.0f} days (at most {MAX_TRACE_SPAN_MS / 86_400_000:.0f}): epoch "
            "times among relative ones, or a unit that is not the trace's?"
        )


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str = ""
    priority: int = 0


def _int_field(obj: dict, name: str, where: str, minimum: int) -> int:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    v = obj[name]
    if type(v) is not int:
        raise TraceFormatError(f"{where}: {name!r} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceFormatError(f"{where}: {name!r} must be >= {minimum}, got {v}")
    return v


def parse_line(line: str, where: str, block_size: int) -> TraceRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise TraceFormatError(f"{where}: missing field 'timestamp'")
    ts = obj["timestamp"]
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(f"{where}: 'timestamp' must be a non-negative number of ms, got {ts!r}")
    inp = _int_field(obj, "input_length", where, 1)
    if inp > MAX_TRACE_PROMPT_TOKENS:
        raise TraceFormatError(f"{where}: 'input_length' {inp} is above {MAX_TRACE_PROMPT_TOKENS}")
    out = _int_field(obj, "output_length", where, 0)
    if "hash_ids" not in obj:
        raise TraceFormatError(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h <= _MAX_ID for h in ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of non-negative 64-bit integers")
    full, ceil = inp // block_size, -(-inp // block_size)
    if len(ids) not in (full, ceil):
        raise TraceFormatError(
            f"{where}: {len(ids)} hash_ids for input_length {inp} at block size {block_size} (expected {ceil}, "
            f"or {full} full blocks); is --block-size the trace's?"
        )
    tenant = obj.get("tenant", "")
    if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
        raise TraceFormatError(f"{where}: 'tenant' must be a string of at most {MAX_TENANT_CHARS} characters")
    priority = obj.get("priority", 0)
    if type(priority) is not int or not -(1 << 31) <= priority < 1 << 31:
        raise TraceFormatError(f"{where}: 'priority' must be a 32-bit integer, got {priority!r}")
    return TraceRecord(float(ts), inp, out, tuple(ids), tenant, priority)


def load_trace(path: str | Path, block_size: int = DEFAULT_TRACE_BLOCK_SIZE) -> list[TraceRecord]:
    """Every record of the file, sorted by timestamp; TraceFormatError on the first malformed line."""
    path = Path(path)
    records = []
    for lineno, line in trace_lines(path):
        if not line.strip():
            continue
        records.append(parse_line(line, f"{path}:{lineno}", block_size))
    if not records:
        raise TraceFormatError(f"{path}: no records")
    records.sort(key=lambda r: r.timestamp_ms)
    check_span(path, records[0].timestamp_ms, records[-1].timestamp_ms)
    return records


class TraceWorkload:
    """Replays a Mooncake-format trace (loaded and validated once; replayed per rate and seed)."""

    description = "trace replay (Mooncake JSONL)"

    def __init__(self, path: str | Path, block_size: int = DEFAULT_TRACE_BLOCK_SIZE) -> None:
        self._init(load_trace(path, block_size), block_size, f"trace:{Path(path).name}")

    @classmethod
    def from_records(
        cls, records: list[TraceRecord], block_size: int = DEFAULT_TRACE_BLOCK_SIZE, name: str = "replay"
    ) -> TraceWorkload:
        """A replay of records already in memory (e.g. a shadow replay of a node's request log: its block hashes
        name prefixes as Mooncake's ids do, so they serve as ``hash_ids``)."""
        if not records:
            raise ValueError("no records to replay")
        self = cls.__new__(cls)
        self._init(sorted(records, key=lambda r: r.timestamp_ms), block_size, name)
        return self

    def _init(self, records: list[TraceRecord], block_size: int, name: str) -> None:
        self.block_size = block_size  # the trace's hash_ids granularity is the simulation's block size
        self.records = records
        self.name = name
        t0, t1 = records[0].timestamp_ms, records[-1].timestamp_ms
        #: Some record names a tenant or a priority: the run needs flow control to honour them.
        self.has_flow = any(r.tenant or r.priority for r in records)
        self.native_qps = len(records) / max(1e-3, (t1 - t0) / 1000.0)

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if space.block_size != self.block_size:
            raise ValueError(f"trace loaded at block size {self.block_size}, simulated at {space.block_size}")
        scale = 1.0 if qps is None else self.native_qps / qps
        t0 = self.records[0].timestamp_ms
        memo: dict[int, tuple[int, int]] = {}  # hash_id -> (parent hash, hash): ids name prefixes, so reuse is safe
        bs = self.block_size
        for rid, rec in enumerate(self.records):
            t = (rec.timestamp_ms - t0) / 1000.0 * scale
            if limit.reached(t, rid):
                return
            n_full = rec.input_length // bs
            chain: list[int] = []
            cids: list[int] = []
            parent = ROOT_SEED
            for hid in rec.hash_ids[:n_full]:
                hit = memo.get(hid)
                if hit is not None and hit[0] == parent:
                    h = hit[1]
                    chain.append(h)
                    cids.append(hid)
                else:
                    space.extend(chain, cids, [hid])
                    h = chain[-1]
                    memo[hid] = (parent, h)
                parent = h
            # Output blocks carry no content in a trace: the request caches its prompt blocks only.
            r = SimRequest(rid, t, "", rec.input_length, rec.output_length, chain, cids, bs, "trace")
            r.n_blocks = r.n_prompt_blocks
            r.tenant = rec.tenant
            r.priority = rec.priority
            yield r
