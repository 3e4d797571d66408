"""Segmented traces: the reader (units, numeric strings, refusals by line and field), their replay with segments, the
``p2pnode sim --trace`` flags, and the RAGPulse converter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads import (
    Limit,
    SegmentedTraceWorkload,
    TraceFormatError,
    detect_trace_format,
    load_segmented_trace,
)
from tests.scripts import load_script

EXAMPLE = Path(__file__).resolve().parent / "fixtures" / "segmented_trace.jsonl"
HEADER_S = {"format": "segmented", "timestamp_unit": "s"}


def _piece(kind: str, ident: int | str, tokens: int, segment: bool = False) -> dict:
    return {"kind": kind, "id": ident, "tokens": tokens, "segment": segment}


def _request(t: float | str, *pieces: dict, output: int = 8) -> dict:
    return {"timestamp": t, "prompt": list(pieces), "output_tokens": output}


GOOD = _request(0, _piece("system", 0, 100), _piece("doc", 1, 300, True), _piece("question", 0, 20))


def _write(tmp_path: Path, objs: list[dict | str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
    return p


def test_timestamps_in_seconds_or_ms_as_numbers_or_strings(tmp_path: Path) -> None:
    seconds = _write(tmp_path, [HEADER_S, {**GOOD, "timestamp": "2.5"}, {**GOOD, "timestamp": 1}])
    assert [r.timestamp_ms for r in load_segmented_trace(seconds)] == [1000.0, 2500.0]  # sorted
    no_header = _write(tmp_path, [{**GOOD, "timestamp": " 82 "}, {**GOOD, "timestamp": 90.5}])
    assert [r.timestamp_ms for r in load_segmented_trace(no_header, "ms")] == [82.0, 90.5]
    assert [r.timestamp_ms for r in load_segmented_trace(no_header, "s")] == [82_000.0, 90_500.0]


def test_the_unit_must_be_stated_once(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"trace\.jsonl:1: timestamp unit unknown.*--trace-time-unit"):
        load_segmented_trace(_write(tmp_path, [GOOD]))
    with pytest.raises(TraceFormatError, match=r":1: the header says timestamps are in 's', --trace-time-unit says"):
        load_segmented_trace(_write(tmp_path, [HEADER_S, GOOD]), "ms")
    assert load_segmented_trace(_write(tmp_path, [HEADER_S, GOOD]), "s")[0].timestamp_ms == 0.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{oops", "not valid JSON"),
        (json.dumps({**GOOD, "timestamp": "soon"}), "'timestamp' must be a non-negative number or numeric string"),
        (json.dumps({**GOOD, "timestamp": -1}), "'timestamp' must be a non-negative"),
        (json.dumps({**GOOD, "timestamp": True}), "'timestamp' must be"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "output_tokens"}), "missing field 'output_tokens'"),
        (json.dumps({**GOOD, "output_tokens": -3}), "'output_tokens' must be an integer >= 0"),
        (json.dumps({**GOOD, "prompt": []}), "'prompt' must be a non-empty list"),
        (json.dumps(_request(0, _piece("doc", 1, 300, True), {"kind": "q", "tokens": 5})),
         r"prompt\[1\]: missing field 'id'"),
        (json.dumps(_request(0, _piece("", 1, 3))), r"prompt\[0\]\.kind: must be a non-empty string"),
        (json.dumps(_request(0, _piece("doc", 1.5, 3))), r"prompt\[0\]\.id: must be a non-empty string or an integer"),
        (json.dumps(_request(0, _piece("q", 1, 5), _piece("doc", 2, 0, True))), r"prompt\[1\]: 'tokens' must be"),
        (json.dumps(_request(0, {**_piece("doc", 1, 300), "segment": "yes"})), r"prompt\[0\]\.segment: must be true"),
        (json.dumps(_request(0, _piece("doc", 1, 300, True), _piece("doc", "1", 300, True))),
         r"prompt\[1\]: segment \('doc', '1'\) is named again \(first at prompt\[0\]\)"),
        (json.dumps(_request(0, _piece("doc", 1, 299, True))),
         r"prompt\[0\]\.tokens: \('doc', '1'\) has 299 tokens here and 300 at line 2"),
        (json.dumps({**GOOD, "session_id": [1]}), "'session_id' must be a string, an integer or null"),
        # a billion tokens passed, and were made into tokens mid-run (a MemoryError traceback)
        (json.dumps(_request(0, _piece("doc", 9, 10**9, True))), "more than 1048576 tokens"),
    ],
)
def test_malformed_lines_name_line_and_field(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [HEADER_S, GOOD, "", bad, GOOD])
    with pytest.raises(TraceFormatError, match=rf"trace\.jsonl:4: .*{message}"):
        load_segmented_trace(path)


def test_a_bad_header_and_an_empty_trace_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r":1: header 'format' must be 'segmented'"):
        load_segmented_trace(_write(tmp_path, [{"format": "mooncake"}, GOOD]), "s")
    with pytest.raises(TraceFormatError, match=r":1: header 'timestamp_unit' must be one of s, ms"):
        load_segmented_trace(_write(tmp_path, [{"format": "segmented", "timestamp_unit": "min"}, GOOD]))
    with pytest.raises(TraceFormatError, match="no records"):
        load_segmented_trace(_write(tmp_path, [HEADER_S]))
    with pytest.raises(TraceFormatError, match=r":1: header 'timestamp_unit' must be one of"):  # a TypeError before
        load_segmented_trace(_write(tmp_path, [{"format": "segmented", "timestamp_unit": ["s"]}, GOOD]))


def test_bytes_that_are_not_utf8_and_a_span_of_years_are_refused_naming_the_file(tmp_path: Path) -> None:
    """Invalid UTF-8 gave only the codec's message (no file, no line); one epoch timestamp among relative ones
    (1.7e12 ms) made a 3-request run simulate 55 years of idle mesh."""
    bad = tmp_path / "trace.jsonl"
    bad.write_bytes(json.dumps(HEADER_S).encode() + b"\n" + json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match=r"trace\.jsonl:3: not UTF-8"):
        load_segmented_trace(bad)
    with pytest.raises(TraceFormatError, match="days"):
        load_segmented_trace(_write(tmp_path, [{"format": "segmented", "timestamp_unit": "ms"}, GOOD,
                                               {**GOOD, "timestamp": 1.733e12}]))


def test_the_format_is_detected_from_the_first_line(tmp_path: Path) -> None:
    mooncake = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1]}
    assert detect_trace_format(_write(tmp_path, ["", json.dumps(mooncake)])) == "mooncake"
    assert detect_trace_format(_write(tmp_path, [HEADER_S, GOOD])) == "segmented"
    assert detect_trace_format(_write(tmp_path, [GOOD])) == "segmented"
    assert detect_trace_format(EXAMPLE) == "segmented"


def test_a_piece_has_the_same_tokens_everywhere_and_segments_keep_their_keys_in_any_position(tmp_path: Path) -> None:
    doc_a, doc_b = _piece("doc", "a", 130, True), _piece("doc", "b", 70, True)
    path = _write(tmp_path, [
        HEADER_S,
        _request(0, _piece("system", 0, 40), doc_a, doc_b, _piece("q", 1, 9)),
        _request(1, _piece("system", "0", 40), doc_b, doc_a, _piece("q", 2, 9)),
        _request(2, _piece("system", 0, 40), _piece("q", 3, 9), output=0),
    ])
    wl = SegmentedTraceWorkload(path, block_size=16)
    assert wl.has_segments and wl.block_size == 16
    r1, r2, r3 = wl.requests(None, 0, BlockSpace(16), Limit(max_requests=10))
    assert [r.arrival for r in (r1, r2, r3)] == [0.0, 1.0, 2.0] and r1.prompt_tokens == 40 + 130 + 70 + 9
    assert r1.segments is not None and r2.segments is not None
    assert r1.segments.spans == ((40, 170), (170, 240)) and r2.segments.spans == ((40, 110), (110, 240))
    assert r1.segments.keys == tuple(reversed(r2.segments.keys))
    t1, t2 = r1.segments.tokens, r2.segments.tokens
    assert t1[:40] == t2[:40]  # id 0 and "0": one system prompt
    assert t1[40:170] == t2[110:240] and t1[170:240] == t2[40:110]  # each document's tokens, wherever it stands
    assert t1[240:249] != t2[240:249] and len(t1) == 249 + 8  # questions of their own; the output carried
    assert r1.chain[:2] == r2.chain[:2] and r1.chain[2] != r2.chain[2]  # the shared prefix: 40 tokens, 2 full blocks
    assert r3.segments is None and (r1.cls, r3.cls) == ("segments", "plain")
    assert len(r3.chain) == 3 and r3.chain[:2] == r1.chain[:2]  # 49 tokens, no output: 3 full blocks


def _sim(tmp_path: Path, trace: Path, *flags: str) -> tuple[int, dict | None]:
    from p2pnode.cli import main

    out = tmp_path / "out"
    rc = main(["sim", "--trace", str(trace), "--nodes", "2", "--policies", "p2p", "--jobs", "1", "--quiet",
               "--warmup", "0", "--out", str(out), *flags])
    return rc, json.loads((out / "results.json").read_text()) if rc == 0 else None


def test_approximate_replay_of_the_example_reuses_more_than_prefix_caching(tmp_path: Path) -> None:
    """The example trace draws 3 of 8 passages in varying order behind one system prompt: prefix caching reuses the
    system prompt and the odd repeated leading passage; approximate reuse loads the passages wherever they stand."""
    rc, results = _sim(tmp_path, EXAMPLE, "--segments", "none,approximate")
    assert rc == 0 and results is not None
    runs = {r["segments"]: r for r in results["runs"]}
    assert runs["none"]["completed"] == runs["approximate"]["completed"] == 36
    assert runs["approximate"]["kv_hit"] > runs["none"]["kv_hit"] + 0.3
    assert results["config"]["block_size"] == {"trace:segmented_trace.jsonl": 64}


def test_reuse_asked_of_a_trace_without_segments_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _write(tmp_path, [HEADER_S, _request(0, _piece("system", 0, 100), _piece("q", 1, 10))])
    assert _sim(tmp_path, plain, "--segments", "none,exact")[0] == 2
    err = capsys.readouterr().err
    assert "--segments exact: trace:trace.jsonl names no segments" in err and "--segments none" in err
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1]}) + "\n")
    assert _sim(tmp_path, mooncake, "--segments", "approximate")[0] == 2
    assert "--segments approximate: trace:mooncake.jsonl names no segments" in capsys.readouterr().err
    assert _sim(tmp_path, mooncake, "--trace-time-unit", "s")[0] == 2
    assert "a Mooncake trace's timestamps are ms" in capsys.readouterr().err
    assert _sim(tmp_path, plain)[0] == 0  # --segments none: replayed


def test_the_cli_names_a_malformed_line_and_takes_the_format_and_unit_as_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _write(tmp_path, [HEADER_S, GOOD, json.dumps(_request(0, _piece("doc", 1, 300, True), {"kind": "q"}))])
    assert _sim(tmp_path, bad)[0] == 2
    assert "bad trace:" in (err := capsys.readouterr().err) and r"trace.jsonl:3: prompt[1]: missing field 'id'" in err
    headless = _write(tmp_path, [GOOD, {**GOOD, "timestamp": "1500"}])
    assert _sim(tmp_path, headless)[0] == 2
    assert "--trace-time-unit" in capsys.readouterr().err
    rc, results = _sim(tmp_path, headless, "--trace-format", "segmented", "--trace-time-unit", "ms",
                       "--segments", "exact")
    assert rc == 0 and results is not None and results["runs"][0]["completed"] == 2
    assert _sim(tmp_path, headless, "--trace-format", "mooncake")[0] == 2  # read as Mooncake: refused
    assert "missing field 'input_length'" in capsys.readouterr().err


# --- the RAGPulse converter ------------------------------------------------------------------------------------------

def _ragpulse(root: Path) -> Path:
    """A RAGPulse-layout directory of three requests: passages shared in varying order, a repeated passage, a piece
    of 0 tokens, a web search result."""
    src = root / "ragpulse"
    src.mkdir()
    trace = [
        {"timestamp": "82", "input_length": 900, "output_length": 19, "session_id": "s1",
         "hash_ids": {"sys_prompt": [100, 101], "passages_ids": [1, 2], "history": [300], "web_search": [],
                      "user_input": [400]}},
        {"timestamp": "93", "input_length": 1135, "output_length": 20, "session_id": "s1",
         "hash_ids": {"sys_prompt": [100, 101], "passages_ids": [2, 1, 2], "history": [300], "web_search": [500],
                      "user_input": [401]}},
        {"timestamp": "95", "input_length": 160, "output_length": 20, "session_id": "s2",
         "hash_ids": {"sys_prompt": [100, 102], "passages_ids": [], "history": [], "web_search": [],
                      "user_input": [402]}},
    ]
    files = {
        "0_trace.jsonl": trace,
        "1_sys_prompt.jsonl": [{"sys_prompt_id": 100, "token_length": 120}, {"sys_prompt_id": 101, "token_length": 80},
                               {"sys_prompt_id": 102, "token_length": 0}],
        "2_passages.jsonl": [{"passage_id": 1, "token_length": 300}, {"passage_id": 2, "token_length": 200}],
        "3_history.jsonl": [{"history_id": 300, "token_length": 150}],
        "4_user_input.jsonl": [{"user_input_id": i, "token_length": n} for i, n in ((400, 30), (401, 25), (402, 40))],
        "5_web_search.jsonl": [{"web_search_id": 500, "token_length": 60}],
    }
    for name, lines in files.items():
        (src / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return src


def test_the_converter_writes_ragpulse_as_a_segmented_trace(tmp_path: Path) -> None:
    convert = load_script("convert_ragpulse")
    src = _ragpulse(tmp_path)
    out = tmp_path / "ragpulse.jsonl"
    summary = convert.convert(src, out)
    records = load_segmented_trace(out)  # its header says seconds
    assert [r.timestamp_ms for r in records] == [82_000.0, 93_000.0, 95_000.0]
    assert [r.session_id for r in records] == ["s1", "s1", "s2"] and records[0].output_tokens == 19
    second = [(p.kind, p.ident, p.tokens, p.segment) for p in records[1].pieces]
    assert second == [
        ("sys_prompt", "100", 120, False), ("sys_prompt", "101", 80, False),
        ("passage", "2", 200, True), ("passage", "1", 300, True), ("passage", "2", 200, False),  # named once
        ("history", "300", 150, False), ("web_search", "500", 60, True), ("user_input", "401", 25, False),
    ]
    assert [p.ident for p in records[2].pieces] == ["100", "402"]  # the 0-token chunk left out
    assert summary.requests == 3 and summary.with_passages == 2 and len(summary.sessions) == 2
    assert summary.tokens_by_kind == {"sys_prompt": 520, "passage": 1200, "history": 300, "web_search": 60,
                                      "user_input": 95}
    assert (summary.empty_pieces, summary.repeated_segments, summary.length_mismatches) == (1, 1, 1)
    assert "3 requests" in summary.text() and "66.7% of requests with passages" in summary.text()

    convert.convert(src, out, history_segments=True, max_requests=2)
    records = load_segmented_trace(out)
    assert len(records) == 2 and all(p.segment for p in records[0].pieces if p.kind == "history")
    wl = SegmentedTraceWorkload(out)
    reqs = list(wl.requests(None, 0, BlockSpace(wl.block_size), Limit(max_requests=10)))
    assert [r.arrival for r in reqs] == [0.0, 11.0] and reqs[0].segments is not None


def test_the_converter_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    convert = load_script("convert_ragpulse")
    src = _ragpulse(tmp_path)
    (src / "2_passages.jsonl").write_text(json.dumps({"passage_id": 1, "token_length": 300}) + "\n")
    assert convert.main([str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "0_trace.jsonl:1: 'hash_ids.passages_ids' names 2, which 2_passages.jsonl does not list" in \
        capsys.readouterr().err
    (src / "5_web_search.jsonl").unlink()
    with pytest.raises(convert.RagPulseError, match=r"5_web_search\.jsonl: missing"):
        convert.convert(src, tmp_path / "o.jsonl")
