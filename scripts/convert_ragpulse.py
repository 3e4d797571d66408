#!/usr/bin/env python3
"""Convert a RAGPulse trace directory into a segmented trace for ``p2pnode sim --trace`` (docs/simulator.md,
"Segmented traces").

    python scripts/convert_ragpulse.py RAGPULSE_DATA_DIR --out ragpulse.jsonl [--history-segments] [--requests N]

RAGPulse publishes a directory: ``0_trace.jsonl``, one request a line -- ``timestamp`` (seconds from the trace's
start, a string), ``input_length``, ``output_length``, ``hash_ids`` (the ids of the prompt's pieces by kind:
``sys_prompt``, ``passages_ids``, ``history``, ``web_search``, ``user_input``) and ``session_id`` -- beside one file
per kind (``1_sys_prompt.jsonl``, ``2_passages.jsonl``, ``3_history.jsonl``, ``4_user_input.jsonl``,
``5_web_search.jsonl``), each line ``{"<kind>_id": id, "token_length": n}``.

Each request becomes one line whose prompt is its pieces in RAGPulse's own order -- system prompt chunks, passages,
history, web search results, user input -- each piece its id's tokens from its kind's file. Passages and web search
results are segments (reused wherever they stand in exact and approximate mode); the system prompt, history and user
input are plain text, unless ``--history-segments`` names history chunks as segments too. A segment repeated within a
request is plain text after its first occurrence (a request names a segment once); pieces of 0 tokens are left out.
``output_tokens`` is ``output_length``; the timestamps stay seconds (the header says so). A short summary is printed:
requests, tokens by kind, the share of requests with passages, and how often the pieces' sum differs from
``input_length`` (RAGPulse counts template text the pieces do not carry).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pnode.sim.workloads.segmented_trace import FORMAT

TRACE_FILE = "0_trace.jsonl"
#: (the request's ``hash_ids`` key, the piece's kind, its file), in prompt order.
PIECES = (
    ("sys_prompt", "sys_prompt", "1_sys_prompt.jsonl"),
    ("passages_ids", "passage", "2_passages.jsonl"),
    ("history", "history", "3_history.jsonl"),
    ("web_search", "web_search", "5_web_search.jsonl"),
    ("user_input", "user_input", "4_user_input.jsonl"),
)
SEGMENT_KINDS = frozenset({"passage", "web_search"})


class RagPulseError(ValueError):
    """A file of the directory that is not RAGPulse's layout; the message names the file and line."""


@dataclass
class Summary:
    requests: int = 0
    tokens_by_kind: Counter[str] = field(default_factory=Counter)
    with_passages: int = 0
    sessions: set[str] = field(default_factory=set)
    #: Requests whose pieces' sum differs from their ``input_length``.
    length_mismatches: int = 0
    empty_pieces: int = 0
    repeated_segments: int = 0

    def text(self) -> str:
        total = sum(self.tokens_by_kind.values())
        share = self.with_passages / self.requests if self.requests else 0.0
        lines = [
            f"{self.requests} requests, {len(self.sessions)} sessions, {total} prompt tokens; "
            f"{share:.1%} of requests with passages",
            "tokens by kind: " + ", ".join(
                f"{kind} {n} ({n / total:.1%})" for kind, n in self.tokens_by_kind.most_common()) if total else "",
        ]
        if self.length_mismatches:
            lines.append(f"pieces' sum differs from input_length on {self.length_mismatches} requests")
        if self.empty_pieces or self.repeated_segments:
            lines.append(f"pieces of 0 tokens left out: {self.empty_pieces}; segments repeated within a request, "
                         f"written as plain text: {self.repeated_segments}")
        return "\n".join(line for line in lines if line)


def _lines(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise RagPulseError(f"{path}: missing (expected RAGPulse's layout: {TRACE_FILE} and one file per kind)")
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RagPulseError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise RagPulseError(f"{path}:{lineno}: expected a JSON object")
            out.append((lineno, obj))
    return out


def load_lengths(path: Path) -> dict[int | str, int]:
    """A kind's file: id -> token length (the id is the line's one field besides ``token_length``)."""
    lengths: dict[int | str, int] = {}
    for lineno, obj in _lines(path):
        n = obj.get("token_length")
        ids = [v for k, v in obj.items() if k != "token_length"]
        if type(n) is not int or n < 0 or len(ids) != 1 or type(ids[0]) not in (int, str):
            raise RagPulseError(f'{path}:{lineno}: expected {{"<kind>_id": id, "token_length": n >= 0}}, got {obj}')
        lengths[ids[0]] = n
    return lengths


def _seconds(v: object, where: str) -> int | float:
    try:
        t = float(v) if isinstance(v, (str, int, float)) and not isinstance(v, bool) else -1.0
    except ValueError:
        t = -1.0
    if not t >= 0:
        raise RagPulseError(f"{where}: 'timestamp' must be a non-negative number of seconds, got {v!r}")
    return int(t) if t.is_integer() else t


def convert(src: Path, out: Path, history_segments: bool = False, max_requests: int | None = None) -> Summary:
    """Write ``src``'s requests to ``out`` as a segmented trace; the summary of what was written."""
    lengths = {kind: load_lengths(src / name) for _, kind, name in PIECES}
    segment_kinds = SEGMENT_KINDS | ({"history"} if history_segments else set())
    summary = Summary()
    trace = src / TRACE_FILE
    with out.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"format": FORMAT, "version": 1, "timestamp_unit": "s", "source": "RAGPulse"}) + "\n")
        for lineno, obj in _lines(trace):
            if max_requests is not None and summary.requests >= max_requests:
                break
            where = f"{trace}:{lineno}"
            hash_ids = obj.get("hash_ids")
            if not isinstance(hash_ids, dict):
                raise RagPulseError(f"{where}: 'hash_ids' must be an object of id lists by kind")
            prompt: list[dict] = []
            named: set[tuple[str, int | str]] = set()
            for key, kind, name in PIECES:
                ids = hash_ids.get(key) or []
                if not isinstance(ids, list):
                    raise RagPulseError(f"{where}: 'hash_ids.{key}' must be a list")
                for ident in ids:
                    n = lengths[kind].get(ident)
                    if n is None:
                        raise RagPulseError(f"{where}: 'hash_ids.{key}' names {ident!r}, which {name} does not list")
                    if n == 0:
                        summary.empty_pieces += 1
                        continue
                    segment = kind in segment_kinds and (kind, ident) not in named
                    if kind in segment_kinds and not segment:
                        summary.repeated_segments += 1
                    named.add((kind, ident))
                    prompt.append({"kind": kind, "id": ident, "tokens": n, "segment": segment})
                    summary.tokens_by_kind[kind] += n
            if not prompt:
                raise RagPulseError(f"{where}: a request with no tokens in its pieces")
            output = obj.get("output_length")
            if type(output) is not int or output < 0:
                raise RagPulseError(f"{where}: 'output_length' must be an integer >= 0, got {output!r}")
            stamp = _seconds(obj.get("timestamp"), where)
            record: dict = {"timestamp": stamp, "prompt": prompt, "output_tokens": output}
            session = obj.get("session_id")
            if session is not None:
                record["session_id"] = session
                summary.sessions.add(str(session))
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            summary.requests += 1
            summary.with_passages += any(p["kind"] == "passage" for p in prompt)
            if obj.get("input_length") != sum(p["tokens"] for p in prompt):
                summary.length_mismatches += 1
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="RAGPulse's data directory (0_trace.jsonl and the files of each kind)")
    ap.add_argument("--out", type=Path, default=Path("ragpulse.jsonl"))
    ap.add_argument("--history-segments", action="store_true", help="name history chunks as segments too")
    ap.add_argument("--requests", type=int, default=None, help="convert only the first N requests")
    args = ap.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        ap.error(f"--requests must be >= 1, got {args.requests}")
    try:
        summary = convert(args.src, args.out, args.history_segments, args.requests)
    except RagPulseError as e:
        print(f"convert_ragpulse: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {summary.text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
