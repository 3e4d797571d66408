"""``--log-format json`` from start to exit: every line written to the process's stdout and stderr -- by this process,
by vLLM's engine processes, by native code (a NUMA warning from the CPU backend), by tqdm's progress bars, by
``print`` (the ready line) -- reaches the real stdout and stderr as one JSON object per line.

Logging already formats its records as JSON (``logs.py``); what bypasses logging is caught at the file descriptors:
``install`` points fds 1 and 2 at pipes before anything else starts, so every child process inherits them, and a
small relay process (this module run as a program, stdlib only) reads the pipes and writes each line through: a line
that is a JSON object unchanged, any other line wrapped as ``{"asctime", "levelname", "name": "stdout"|"stderr",
"process", "message"}`` with the relay's parent as ``process`` (a pipe does not say which process wrote). A carriage
return ends a line too (tqdm redraws with one). A line is cut into pieces of at most ``max_line_bytes``
(``config.DEFAULT_JSON_STDIO_MAX_LINE_BYTES``), each its own object, so that a writer without newlines cannot grow the
relay's memory.

The relay is a process, not a thread, so that what a crashing node writes last (a traceback, a fatal signal's dump)
still comes out; it ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group; the node's own shutdown
lines must still come out) and exits when every writer has closed its end.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

__all__ = ["install", "wrap_line"]

_READ_BYTES = 65536
_LEVELS = {"stdout": "INFO", "stderr": "WARNING"}


def _asctime(now: float) -> str:
    """logging's default asctime (``2026-12-02 01:28:03,123``), as the JSON formatter writes it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"


def wrap_line(line: bytes, stream: str, process: int, now: float | None = None) -> bytes | None:
    """One output line as a JSON line: a JSON object as it is, other text wrapped; None for a blank line."""
    text = line.decode("utf-8", errors="replace").rstrip()
    if not text.strip():
        return None
    if text.startswith("{"):
        try:
            if isinstance(json.loads(text), dict):
                return text.encode() + b"\n"
        except ValueError:
            pass
    record = {
        "asctime": _asctime(time.time() if now is None else now),
        "levelname": _LEVELS[stream],
        "name": stream,
        "process": process,
        "message": text,
    }
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def relay(sources: dict[int, tuple[str, int]], process: int, max_line_bytes: int) -> None:
    """Copy each source fd (stream name, destination fd) to its destination as JSON lines until every source ends."""
    selector = selectors.DefaultSelector()
    pending = {fd: b"" for fd in sources}
    for fd in sources:
        selector.register(fd, selectors.EVENT_READ)

    def emit(fd: int, line: bytes) -> None:
        stream, destination = sources[fd]
        out = wrap_line(line, stream, process)
        if out is not None:
            _write_all(destination, out)

    while pending:
        for key, _ in selector.select():
            fd = key.fd
            chunk = os.read(fd, _READ_BYTES)
            if not chunk:  # every writer closed its end
                if pending[fd]:
                    emit(fd, pending[fd])
                selector.unregister(fd)
                os.close(fd)
                del pending[fd]
                continue
            lines = (pending[fd] + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            rest = lines.pop()  # the line still being written
            cut = len(rest) - len(rest) % max_line_bytes if len(rest) > max_line_bytes else 0
            lines += [rest[i:i + max_line_bytes] for i in range(0, cut, max_line_bytes)]
            pending[fd] = rest[cut:]
            for line in lines:
                for start in range(0, max(len(line), 1), max_line_bytes):
                    emit(fd, line[start:start + max_line_bytes])


def install(max_line_bytes: int) -> None:
    """Route fds 1 and 2 of this process (and every child it starts from now on) through a JSON relay process."""
    sys.stdout.flush()
    sys.stderr.flush()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    subprocess.Popen(
        # isolated (-I): the file alone, by path, with nothing of the environment or the package to import
        [sys.executable, "-I", os.path.abspath(__file__), str(out_read), str(err_read), str(os.getpid()),
         str(max_line_bytes)],
        pass_fds=(out_read, err_read),
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )
    os.close(out_read)
    os.close(err_read)
    os.dup2(out_write, 1)
    os.dup2(err_write, 2)
    os.close(out_write)
    os.close(err_write)


def _main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out_read, err_read, process, max_line_bytes = (int(a) for a in argv)
    relay({out_read: ("stdout", 1), err_read: ("stderr", 2)}, process, max_line_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
