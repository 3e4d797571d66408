"""Mooncake trace replay: malformed lines are refused with their line number; valid traces replay with reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.workloads import Limit, TraceFormatError, TraceWorkload, load_trace
from p2pnode.sim.workloads.trace import TraceRecord

GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({**GOOD, "timestamp": -5}), "'timestamp' must be a non-negative number"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "input_length"}), "missing field 'input_length'"),
        (json.dumps({**GOOD, "output_length": 1.5}), "'output_length' must be an integer"),
        (json.dumps({**GOOD, "input_length": 0}), "'input_length' must be >= 1"),
        (json.dumps({**GOOD, "hash_ids": [1, -2, 3]}), "'hash_ids' must be a list of non-negative"),
        (json.dumps({**GOOD, "hash_ids": "123"}), "'hash_ids' must be a list"),
        (json.dumps({**GOOD, "hash_ids": [1]}), "1 hash_ids for input_length 1100 at block size 512"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    with pytest.raises(TraceFormatError, match=rf"trace\.jsonl:3: .*{message}"):
        load_trace(path)


def test_empty_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no records"):
        load_trace(_write(tmp_path, ["", "  "]))


def test_replay_reuses_shared_ids_and_scales_time(tmp_path: Path) -> None:
    recs = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},  # 2 full blocks
        {"timestamp": 2000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},  # cap: 1 block
        {"timestamp": 1000, "input_length": 1600, "output_length": 10, "hash_ids": [1, 2, 4, 5]},  # 2 of 3 cached
    ]
    wl = TraceWorkload(_write(tmp_path, [json.dumps(r) for r in recs]))
    assert [r.timestamp_ms for r in wl.records] == [0, 1000, 2000]  # sorted
    c = Cluster(SimConfig(nodes=1, block_size=512))
    reqs = list(wl.requests(None, 0, c.space, Limit(max_requests=10)))
    assert [r.arrival for r in reqs] == [0.0, 1.0, 2.0]
    res = c.run(reqs)
    assert [r.cached_tokens for r in reqs] == [0, 1024, 512]
    assert res["kv_hit"] == pytest.approx(1536 / (1100 + 1600 + 1024))
    fast = list(wl.requests(wl.native_qps * 2, 0, c.space, Limit(max_requests=10)))
    assert [r.arrival for r in fast] == [0.0, 0.5, 1.0]


def test_replay_from_records_in_memory() -> None:
    recs = [TraceRecord(1000.0 * i, 1024, 4, (7, 8)) for i in range(3)]
    wl = TraceWorkload.from_records(recs, name="shadow")
    c = Cluster(SimConfig(nodes=2, block_size=512))
    res = c.run(wl.requests(None, 0, c.space, Limit(max_requests=10)))
    assert wl.name == "shadow" and res["completed"] == 3


def test_production_workloads_written_as_mooncake_traces_replay_with_the_same_reuse(tmp_path: Path) -> None:
    """scripts/make_traces.py writes the production shapes in Mooncake's format; replaying a file gives the
    workload's requests back, lengths and prefix sharing included."""
    import subprocess
    import sys

    from p2pnode.sim.workloads import get_workloads

    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, str(root / "scripts" / "make_traces.py"), "--out", str(tmp_path), "--duration", "120",
         "--workload", "platform-chat", "--workload", "tool-agent"],
        check=True, capture_output=True,
    )

    def ideal_hit(requests: list) -> float:
        seen: set[int] = set()
        hit = total = 0
        for r in requests:
            m = 0
            while m < r.n_prompt_blocks and r.chain[m] in seen:
                m += 1
            hit += min(m, (r.prompt_tokens - 1) // 512) * 512
            total += r.prompt_tokens
            seen.update(r.chain[: r.n_prompt_blocks])
        return hit / total

    for name in ("platform-chat", "tool-agent"):
        trace = TraceWorkload(tmp_path / f"{name}.jsonl")
        replay = list(trace.requests(None, 0, BlockSpace(512), Limit(max_requests=10**6)))
        original = []
        for r in get_workloads(name)[0].requests(8.0, 0, BlockSpace(512), Limit(duration_s=120)):
            while r is not None:
                original.append(r)
                r = r.follow
        assert len(replay) == len(original) > 100
        assert sorted(r.prompt_tokens for r in replay) == sorted(r.prompt_tokens for r in original)
        assert ideal_hit(replay) == pytest.approx(ideal_hit(sorted(original, key=lambda r: r.arrival)), abs=0.02)
        assert ideal_hit(replay) > 0.3  # the shared prompts and growing histories survive the round trip


def test_arrival_flags_are_refused_with_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace brings its own arrival times: --arrival/--arrival-cv would be ignored, so they are an error."""
    from p2pnode.cli import main

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1]}) + "\n")
    assert main(["sim", "--trace", str(path), "--arrival", "gamma", "--out", str(tmp_path / "o")]) == 2
    assert "--arrival" in capsys.readouterr().err


def test_a_mooncake_trace_out_of_bounds_is_refused_naming_its_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An input length of a billion tokens, bytes that are not UTF-8, and epoch timestamps among relative ones each
    get one line naming the file (and the line), never a traceback or a run of hours."""
    import json

    from p2pnode.sim.workloads import TraceFormatError
    from p2pnode.sim.workloads.trace import load_trace

    def line(ts: float, length: int = 512) -> str:
        return json.dumps({"timestamp": ts, "input_length": length, "output_length": 4,
                           "hash_ids": list(range(-(-length // 512)))})

    path = tmp_path / "t.jsonl"
    path.write_text(line(0) + "\n" + json.dumps({"timestamp": 1, "input_length": 10**9, "output_length": 1,
                                                  "hash_ids": []}) + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: 'input_length' 1000000000 is above"):
        load_trace(path)
    path.write_bytes(line(0).encode() + b"\n\xff\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not UTF-8"):
        load_trace(path)
    path.write_text(line(0) + "\n" + line(1.733e12) + "\n")
    with pytest.raises(TraceFormatError, match="days"):
        load_trace(path)
