"""``--log-format json`` gives only JSON lines from start to exit: what bypasses logging -- ``print`` (the ready line),
native writes, progress bars redrawn with a carriage return, child processes, an error on the way out -- is wrapped
(before: plain text lines among the JSON ones)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from p2pnode.launcher import NodeProcess

ROOT = Path(__file__).resolve().parents[2]


def json_lines(text: str) -> list[dict]:
    """Every non-empty line of ``text`` as a JSON object (fails naming the first line that is not one)."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        assert isinstance(record, dict), line
        records.append(record)
    return records


def test_everything_written_to_stdout_and_stderr_comes_out_as_json_lines() -> None:
    script = textwrap.dedent("""
        import os, subprocess
        from p2pnode import json_stdio
        json_stdio.install(32)
        print("plain text from print", flush=True)
        print('{"already": "json"}', flush=True)
        os.write(2, b"a native warning\\rprogress 50%\\rprogress 100%\\n")
        os.write(2, b"y" * 70 + b"\\n")
        subprocess.run(["sh", "-c", "echo from a child; echo child error >&2"], check=True)
        os.write(1, b"last words without a newline")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out, err = json_lines(result.stdout), json_lines(result.stderr)
    assert [r.get("message") for r in out] == [
        "plain text from print", None, "from a child", "last words without a newline"
    ]
    assert out[1] == {"already": "json"}  # a JSON line passes unchanged
    assert [r["message"] for r in err] == [
        "a native warning", "progress 50%", "progress 100%", "y" * 32, "y" * 32, "y" * 6, "child error"
    ]
    assert {(r["name"], r["levelname"]) for r in err} == {("stderr", "WARNING")}
    assert all(r["name"] == "stdout" and r["asctime"] and r["process"] for r in out if "message" in r)


def test_serve_with_json_logs_writes_only_json_lines_from_start_to_exit() -> None:
    node = NodeProcess([
        "--engine", "sim", "--model", "sim", "--node-id", "j", "--listen", "127.0.0.1:0", "--http-listen",
        "127.0.0.1:0", "--log-format", "json", "--stats-interval", "0",
    ]).start(timeout_s=120)
    assert node.address and node.http_address  # the ready line, read from its JSON message
    assert node.terminate() == 0
    records = json_lines(node.output())
    assert any(r.get("message", "").startswith("p2pnode j ready on") for r in records)
