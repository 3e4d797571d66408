"""Start ``p2pnode serve`` as a child process and wait until it is ready: used by the demo, the integration
tests and the benchmarks, so all of them exercise the real CLI and process lifecycle.

Invariants: a node runs in a process group of its own (a signal to the driver's terminal does not reach it) and
nothing of that group outlives the driver: ``terminate`` kills what the node left behind once it exited, and the
groups of nodes still running are killed when the driver exits or gets SIGTERM (a killed driver -- SIGKILL --
cannot). The node's output is always drained, whatever bytes it writes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path

from p2pnode.config import DEFAULT_NODE_START_TIMEOUT_S, DEFAULT_NODE_STOP_TIMEOUT_S

#: "p2pnode <id> ready on <gRPC address>[ http <HTTP address>]" (the HTTP part is absent when HTTP is off).
_READY = re.compile(r"p2pnode (\S+) ready on (\S+)(?: http (\S+))?")
#: Lines of a child's output kept for error messages.
_TAIL_LINES = 200
#: How long ``terminate`` lets a node's children finish exiting after the node did (its engine core's own exit).
_GROUP_EXIT_GRACE_S = 30.0
#: The nodes started and not yet stopped, whose groups the driver's exit kills.
_RUNNING: weakref.WeakSet[NodeProcess] = weakref.WeakSet()
_atexit_installed = False
_handler_installed = False
#: The process that started the nodes: a forked child inherits the handler and the set, and must not act on them (a
#: pool's workers get SIGTERM from ``Pool.terminate``).
_owner_pid = os.getpid()


def _kill_running_groups() -> None:
    """SIGKILL every running node's group; no waiting (safe in a signal handler: ``Popen.wait`` takes a lock). Only
    nodes not yet reaped: a reaped node's pid may name another process group by now. Only in the process that
    started them."""
    if os.getpid() != _owner_pid:
        return
    for node in list(_RUNNING):
        if node.proc is not None and node.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.proc.pid, signal.SIGKILL)


def _on_sigterm(signum: int, frame: object) -> None:
    _kill_running_groups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_cleanup() -> None:
    """Kill the running nodes' groups at the driver's exit, and on its SIGTERM when nothing else handles it (a
    ``timeout`` or CI ending the driver skips its ``finally`` blocks). The handler can only be set from the main
    thread: called from both ``NodeProcess()`` and ``start`` (drivers build nodes there and start them in threads)."""
    global _atexit_installed, _handler_installed, _owner_pid
    if not _atexit_installed or os.getpid() != _owner_pid:  # (again in a forked child that starts nodes itself)
        _atexit_installed, _handler_installed, _owner_pid = True, False, os.getpid()
        atexit.register(_kill_running_groups)
    if (
        not _handler_installed
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        _handler_installed = True
        signal.signal(signal.SIGTERM, _on_sigterm)


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it: its pid, and so its process group's id, stays its own
    until ``wait`` (a reaped pid may name another session's group at once)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _others_in_group(pgid: int) -> bool:
    """Whether a process of group ``pgid`` besides its leader is alive (read from /proc: a signal 0 to the group
    counts the leader's zombie too)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            return True
    return False


def _message(line: str) -> str:
    """A line's text: the ``message`` of a JSON line (``--log-format json``), else the line itself."""
    if line.startswith("{"):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                return str(record.get("message", ""))
    return line


class NodeProcess:
    """A running ``p2pnode serve``; ``address`` (gRPC) and ``http_address`` are known once ``start()`` returns."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.address: str | None = None
        self.http_address: str | None = None
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        #: After ``terminate``: whether any process of the node's group outlived the node by ``_GROUP_EXIT_GRACE_S``
        #: (then killed): a node that failed to stop its engine.
        self.left_behind = False
        _install_cleanup()

    def start(self, timeout_s: float = DEFAULT_NODE_START_TIMEOUT_S) -> NodeProcess:
        _install_cleanup()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2pnode", "serve", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a byte that is not UTF-8 (native code's output) must not end the reader
            env=self.env,
            start_new_session=True,
        )
        _RUNNING.add(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"node failed to start (exit {self.proc.returncode}):\n{self.output()}")
        return self

    def _read(self) -> None:
        """Drain the node's output to the end: a pipe left full blocks the node on its next write."""
        assert self.proc is not None and self.proc.stdout is not None
        log = None
        if self.log_path:
            with contextlib.suppress(OSError):
                log = self.log_path.open("a")
        for line in self.proc.stdout:
            self.tail.append(line)
            if log:
                try:
                    log.write(line)
                    log.flush()
                except OSError:  # a full disk: the log stops, the draining does not
                    with contextlib.suppress(OSError):
                        log.close()
                    log = None
            m = _READY.search(_message(line))
            if m and not self._ready.is_set():
                self.address = m.group(2)
                self.http_address = m.group(3)
                self._ready.set()
        if log:
            with contextlib.suppress(OSError):
                log.close()

    def output(self) -> str:
        return "".join(self.tail)

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL (``http://HOST:PORT/v1``)."""
        assert self.http_address is not None, "the node runs without its HTTP API"
        return f"http://{self.http_address}/v1"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self, timeout_s: float = DEFAULT_NODE_STOP_TIMEOUT_S, grace_s: float = _GROUP_EXIT_GRACE_S) -> int:
        """SIGTERM (drain), wait for exit; returns the exit code (kills after the timeout). What the node left of its
        group (it crashed before, or failed to stop its engine) is killed after ``grace_s``, and ``left_behind``
        says so."""
        assert self.proc is not None
        proc, pid = self.proc, self.proc.pid
        if proc.returncode is None:  # (one reaped before -- killed, polled -- has a pid that may be another's now)
            if not _exited(pid):
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while not _exited(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _exited(pid):
                self.kill()
            else:  # exited, not yet reaped: the group's id is still its own while what it left is looked for
                deadline = time.monotonic() + grace_s
                while _others_in_group(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _others_in_group(pid):
                    self.left_behind = True
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                proc.wait()
        _RUNNING.discard(self)
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        """Kill the node and everything it started (vLLM's engine core runs in a child process)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _RUNNING.discard(self)


def tiny_model_dir() -> Path:
    """The tiny model built by scripts/make_tiny_model.py (``make bootstrap``)."""
    return Path(os.environ.get("P2PNODE_TINY_MODEL", Path(__file__).resolve().parent.parent / "models" / "tiny"))


if threading.current_thread() is threading.main_thread():
    _install_cleanup()  # at import: a driver that builds and starts its nodes in threads (chaos, the mesh benches) too
