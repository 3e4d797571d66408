"""The launcher (``p2pnode/launcher.py``) against a stand-in ``p2pnode serve``: a package of that name first on the
child's path (the working directory), which misbehaves the ways a real node can -- a child it leaves running, bytes
that are not UTF-8 -- so that what the launcher promises is checked on real processes in a second, not a vLLM node's
minute."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from p2pnode.launcher import NodeProcess

STAND_IN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its "engine core"
    out = sys.stdout.buffer
    out.write(b"native code says \\xff\\xfe\\n")  # not UTF-8
    for i in range(3000):  # ~300 KB: more than a pipe holds, so a reader that died would block this process
        out.write(b"line %d " % i + b"y" * 90 + b"\\n")
    out.write(b"child %d\\n" % child.pid)
    out.write(b"p2pnode stand-in ready on 127.0.0.1:1\\n")
    out.flush()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # exits at SIGTERM, its child left running
    while True:
        time.sleep(1)
    """
)


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "p2pnode"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(STAND_IN)
    monkeypatch.chdir(tmp_path)  # ``python -m p2pnode`` finds the working directory's package first
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_a_node_that_leaves_its_child_running_and_writes_non_utf8_is_drained_and_cleaned_up(stand_in: Path) -> None:
    """Before: a byte that was not UTF-8 killed the reader thread (the node then blocked on its next write once the
    pipe filled, its ready line never read), and ``terminate`` of a node that exited left its children running (a
    vLLM engine core and its memory)."""
    node = NodeProcess(["--ignored"], log_path=stand_in / "node.log").start(timeout_s=60)
    assert node.address == "127.0.0.1:1"
    child = int(next(line for line in node.output().splitlines() if line.startswith("child")).split()[1])
    assert _alive(child)
    assert "\ufffd" in (stand_in / "node.log").read_text()  # the bad bytes replaced, the log kept going
    assert node.terminate(grace_s=0.5) == 0
    assert node.left_behind
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_driver_ended_by_sigterm_takes_its_nodes_with_it(stand_in: Path) -> None:
    """Before: nodes run in sessions of their own, so a driver ended by SIGTERM (``timeout``, CI) skipped its
    ``finally`` and left the whole mesh running."""
    driver = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        sys.modules.pop("p2pnode", None)
        from p2pnode.launcher import NodeProcess
        node = NodeProcess(["--ignored"]).start(timeout_s=60)
        child = next(line for line in node.output().splitlines() if line.startswith("child")).split()[1]
        print(node.pid, child, flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True, cwd=stand_in)
    assert process.stdout is not None
    pids = [int(p) for p in process.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_a_forked_child_never_kills_its_parents_nodes(stand_in: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork inherits the SIGTERM handler and the running set: a pool's worker ended by ``Pool.terminate`` killed
    every node of its parent."""
    from p2pnode import launcher

    node = NodeProcess(["--ignored"]).start(timeout_s=60)
    try:
        monkeypatch.setattr(launcher, "_owner_pid", os.getpid() + 1)  # as a forked child sees it
        launcher._kill_running_groups()
        assert node.proc is not None and node.proc.poll() is None
    finally:
        monkeypatch.undo()
        node.terminate(grace_s=0.5)


def test_terminating_a_node_reaped_before_signals_no_group(stand_in: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node reaped before (killed, polled) has a pid another session may hold by now: terminate's search for what
    it left killed that group."""
    node = NodeProcess(["--ignored"]).start(timeout_s=60)
    node.kill()
    signalled: list[int] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append(pgid))
    assert node.terminate(grace_s=0.5) == -signal.SIGKILL
    assert signalled == [] and not node.left_behind
