"""The engine's processes are reniced below the node: every thread of every descendant, nothing else."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from p2pnode.engine.priority import MAX_NICE, descendant_pids, lower_priority

#: A child that starts a grandchild with a second thread, prints the grandchild's pid, then waits.
TREE = """
import subprocess, sys
g = subprocess.Popen([sys.executable, "-c",
    "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
    "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
g.stdout.readline()
print(g.pid, flush=True)
g.wait()
"""


def fake_stat(proc: Path, pid: int, ppid: int, comm: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")


def test_descendants_are_found_through_every_generation_and_odd_names(tmp_path: Path) -> None:
    fake_stat(tmp_path, 10, 1, "p2pnode")
    fake_stat(tmp_path, 11, 10, "VLLM::EngineCore")
    fake_stat(tmp_path, 12, 11, "odd) name (x")  # comm may hold parentheses and spaces
    fake_stat(tmp_path, 13, 1, "someone else")
    (tmp_path / "self").mkdir()
    assert descendant_pids(10, tmp_path) == [11, 12]
    assert descendant_pids(13, tmp_path) == []


def test_every_thread_of_a_real_process_tree_is_reniced_and_the_caller_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        grandchild = int(child.stdout.readline())  # type: ignore[union-attr]
        pids = descendant_pids(os.getpid())
        assert child.pid in pids and grandchild in pids
        before = os.getpriority(os.PRIO_PROCESS, 0)
        threads = [int(t) for t in os.listdir(f"/proc/{grandchild}/task")]
        assert len(threads) == 2
        assert lower_priority([child.pid, grandchild], 3) >= 3
        for tid in threads:
            assert os.getpriority(os.PRIO_PROCESS, tid) == min(MAX_NICE, before + 3)
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
    finally:
        if grandchild:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()
