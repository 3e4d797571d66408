"""The engine dies with its node, whatever kills the node; a restarted node says when an engine survived anyway.

Why: vLLM runs its engine core in a child process (``VLLM::EngineCore``) that notices its front end is gone only
when the front end shuts it down. ``kill -9`` of the node, the OOM killer or a crash left it running -- holding its
KV cache (hundreds of MB on CPU, the GPU's memory on a GPU host) -- until killed by hand, and a restarted node then
competed with it. vLLM 0.32 has no parent-death handling for the engine core (its TP workers do watch the core
through a pipe, so they follow it).

How: the node starts vLLM's engine core through ``guarded_run_engine_core`` (``install()`` points vLLM's process
target at it; spawned or forked, the child runs it before vLLM's own ``run_engine_core``), which in the engine
process

1. asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux): immediate and needs
   nothing from the dying parent;
2. checks that the parent is still the node that started it (a node killed before step 1 ran has already handed
   its child to another parent) and exits otherwise;
3. keeps a daemon thread checking the parent every ``ENGINE_PARENT_CHECK_S`` (systems without prctl).

PR_SET_PDEATHSIG fires when the *thread* that started the child exits: the node starts its engine from a thread of
the event loop's default executor (``asyncio.to_thread``), which lives as long as the loop; whoever launches an
engine from a thread of its own must keep that thread alive as long as the engine (a pool's worker does).

A record per node id (``EngineRecord``: pid and start time of the engine processes, under the temp dir) lets a node
started again under the same id find an engine of its previous life that is still running (the guard failed, or
an older p2pnode ran it) and say so, with the command that stops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import multiprocessing
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pnode.config import ENGINE_PARENT_CHECK_S, ENGINE_PID_DIR_NAME

log = logging.getLogger("p2pnode.engine")

#: prctl option: the signal a process receives when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1

#: vLLM's own target, remembered by ``install`` (a forked child inherits the patched class, so it needs this).
_original_target: Callable[..., Any] | None = None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where prctl is unavailable."""
    if not hasattr(os, "getppid") or not Path("/proc").is_dir():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent_pid: int, interval_s: float = ENGINE_PARENT_CHECK_S) -> threading.Thread:
    """A daemon thread that kills this process as soon as its parent is no longer ``parent_pid``."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="p2pnode-parent-watch", daemon=True)
    thread.start()
    return thread


def guard_this_process() -> None:
    """Make the current (engine) process die with its parent (see the module docstring, steps 1-3)."""
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent_pid:  # the node died before the kernel was asked
        os.kill(os.getpid(), signal.SIGKILL)
    watch_parent(parent_pid)


def guarded_run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``EngineCoreProc.run_engine_core``, in a process that dies with the node that started it.

    It is also where p2pnode's eviction policies enter the engine core (``eviction_hook.install``): the
    one entry point of p2pnode code in that process, before vLLM builds its block pool.
    """
    guard_this_process()
    from p2pnode.engine import eviction_hook

    eviction_hook.install()
    target = _original_target
    if target is None:  # a spawned child: vLLM's class is unpatched in this process
        from vllm.v1.engine.core import EngineCoreProc

        target = EngineCoreProc.run_engine_core
    return target(*args, **kwargs)


def install() -> None:
    """Point vLLM's engine-core process target at ``guarded_run_engine_core`` (idempotent; before AsyncLLM)."""
    global _original_target
    from vllm.v1.engine.core import EngineCoreProc

    current = EngineCoreProc.__dict__["run_engine_core"]
    function = current.__func__ if isinstance(current, staticmethod) else current
    if function is guarded_run_engine_core:
        return
    _original_target = function
    EngineCoreProc.run_engine_core = staticmethod(guarded_run_engine_core)


# --- the record of a node's engine processes -----------------------------------------------------------------------


#: /proc/<pid>/stat states of a process that has exited: a zombie (its parent has not reaped it yet) and dead.
_EXITED_STATES = frozenset({"Z", "X", "x"})


def process_start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22), or None when it is gone --
    exited too: a zombie still has a stat entry until it is reaped, and an engine that has exited holds nothing."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces and parentheses
    if fields[0] in _EXITED_STATES:
        return None
    return int(fields[19])


@dataclass(frozen=True)
class StaleEngine:
    """An engine process recorded by an earlier life of this node id that is still running."""

    pid: int
    node_pid: int

    def describe(self, node_id: str) -> str:
        return (
            f"an engine started by an earlier run of node {node_id} (node pid {self.node_pid}, gone) is still "
            f"running as pid {self.pid}: it holds the memory (on a GPU host, the GPU memory) a new engine needs. "
            f"Stop it with: kill -9 {self.pid}"
        )


class EngineRecord:
    """``<temp>/p2pnode-engines-<uid>/<node id>.engine``: which processes run this node id's engine."""

    def __init__(self, node_id: str, directory: Path | None = None) -> None:
        base = directory or Path(tempfile.gettempdir()) / f"{ENGINE_PID_DIR_NAME}-{os.getuid()}"
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", node_id)[:200] or "_"
        self.node_id = node_id
        self.path = base / f"{safe}.engine"

    def stale(self) -> list[StaleEngine]:
        """Recorded engine processes still running, from a node process that is gone (none when unreadable)."""
        try:
            record = json.loads(self.path.read_text())
            node_pid = int(record["node_pid"])
            engines = {int(pid): int(start) for pid, start in record["engines"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        if process_start_time(node_pid) == record.get("node_start"):
            return []  # that node still runs: its engine is not stale (and not ours to report)
        return [StaleEngine(pid, node_pid) for pid, start in engines.items() if process_start_time(pid) == start]

    def write(self, engine_pids: list[int]) -> None:
        """Record this node's engine processes (best effort: a node serves without its record)."""
        engines = {str(pid): start for pid in engine_pids if (start := process_start_time(pid)) is not None}
        record = {"node_pid": os.getpid(), "node_start": process_start_time(os.getpid()), "engines": engines}
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(self.path)
        except OSError as e:
            log.debug("cannot record the engine's processes in %s: %s", self.path, e)

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
