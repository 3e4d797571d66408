"""An engine process dies with the node that started it, however the node dies, and a node started
again under the same id reports an engine of its previous life that still runs. (The real vLLM engine core under
kill -9 of its node is tests/integration/test_engine_lifeline.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from p2pnode.engine.lifeline import EngineRecord, process_start_time
from tests.polling import until_sync

#: A "node" that starts an "engine" the way vLLM does (multiprocessing, spawn), guarded or not, and prints its pid;
#: the engine says "ready" once it is guarded (or would have been).
NODE = textwrap.dedent(
    """
    import multiprocessing, sys, time

    def engine(guarded):
        if guarded:
            from p2pnode.engine.lifeline import guard_this_process
            guard_this_process()
        print("ready", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        child = multiprocessing.get_context("spawn").Process(target=engine, args=(sys.argv[1] == "guarded",))
        child.start()
        print(f"pid {child.pid}", flush=True)
        time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    state = None
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_node(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    node = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    assert node.stdout is not None
    lines = {node.stdout.readline().strip() for _ in range(2)}  # the node's line and its engine's, in either order
    assert "ready" in lines, lines
    [pid] = [int(line.removeprefix("pid ")) for line in lines if line.startswith("pid ")]
    return node, pid


def test_a_guarded_engine_dies_with_its_node_on_kill_9(tmp_path: Path) -> None:
    """Before: the engine outlived ``kill -9`` of its node. An unguarded one still does, which the test checks so
    that it cannot pass for the wrong reason."""
    guarded_node, guarded = start_node(tmp_path, "guarded")
    plain_node, plain = start_node(tmp_path, "unguarded")
    try:
        for node in (guarded_node, plain_node):  # both engines ready: the guard is in place
            os.kill(node.pid, signal.SIGKILL)
            node.wait()
        until_sync(lambda: not alive(guarded), "the guarded engine to die with its node")
        assert alive(plain)
    finally:
        for pid in (guarded, plain):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_stale_engine_of_this_node_id_is_reported(tmp_path: Path) -> None:
    """A record left by a node that is gone, naming a process that still runs, is reported (with its pid)."""
    record = EngineRecord("n1", tmp_path)
    assert record.stale() == []  # nothing recorded yet
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record.write([leftover.pid])
        assert record.stale() == []  # the node that wrote it (this process) still runs
        data = record.path.read_text().replace(f'"node_pid": {os.getpid()}', '"node_pid": 999999999')
        record.path.write_text(data)
        stale = record.stale()
        assert [s.pid for s in stale] == [leftover.pid]
        assert f"kill -9 {leftover.pid}" in stale[0].describe("n1")
        leftover.kill()
        leftover.wait()
        assert record.stale() == []  # gone: nothing to report
        assert process_start_time(leftover.pid) is None
    finally:
        leftover.kill()
    record.clear()
    assert not record.path.exists()
    assert EngineRecord("a/../b c", tmp_path).path.parent == tmp_path  # a node id never escapes the directory


def test_an_exited_engine_not_yet_reaped_is_not_reported(tmp_path: Path) -> None:
    """A zombie (exited, its parent has not collected it yet) holds no memory: no warning that it "is still running"
    (it was reported, and reaped seconds later)."""
    record = EngineRecord("n1", tmp_path)
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record.write([leftover.pid])
        record.path.write_text(record.path.read_text().replace(f'"node_pid": {os.getpid()}', '"node_pid": 999999999'))
        assert [s.pid for s in record.stale()] == [leftover.pid]
        os.kill(leftover.pid, signal.SIGKILL)  # not waited for: a zombie until leftover.wait()
        stat = Path(f"/proc/{leftover.pid}/stat")
        until_sync(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the killed process to be a zombie")
        assert stat.exists()  # still listed, as a zombie
        assert record.stale() == []
    finally:
        leftover.kill()
        leftover.wait()
