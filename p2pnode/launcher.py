"""Start ``p2pnode serve`` as a child process and wait until it is ready: used by the demo, the integration
tests and the benchmarks, so all of them exercise the real CLI and process lifecycle."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from p2pnode.config import DEFAULT_NODE_START_TIMEOUT_S, DEFAULT_NODE_STOP_TIMEOUT_S

#: "p2pnode <id> ready on <gRPC address>[ http <HTTP address>]" (the HTTP part is absent when HTTP is off).
_READY = re.compile(r"p2pnode (\S+) ready on (\S+)(?: http (\S+))?")
#: Lines of a child's output kept for error messages.
_TAIL_LINES = 200


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

    def start(self, timeout_s: float = DEFAULT_NODE_START_TIMEOUT_S) -> NodeProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2pnode", "serve", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"node failed to start (exit {self.proc.returncode}):\n{self.output()}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        log = self.log_path.open("a") if self.log_path else None
        for line in self.proc.stdout:
            self.tail.append(line)
            if log:
                log.write(line)
                log.flush()
            m = _READY.search(_message(line))
            if m and not self._ready.is_set():
                self.address = m.group(2)
                self.http_address = m.group(3)
                self._ready.set()
        if log:
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

    def terminate(self, timeout_s: float = DEFAULT_NODE_STOP_TIMEOUT_S) -> int:
        """SIGTERM (drain), wait for exit; returns the exit code (kills after the timeout)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        """Kill the node and everything it started (vLLM's engine core runs in a child process)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def tiny_model_dir() -> Path:
    """The tiny model built by scripts/make_tiny_model.py (``make bootstrap``)."""
    return Path(os.environ.get("P2PNODE_TINY_MODEL", Path(__file__).resolve().parent.parent / "models" / "tiny"))
