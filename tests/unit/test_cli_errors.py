"""Mistakes on the command line are one line naming the flag, never a traceback, and an address that
cannot be bound fails before the engine starts (it used to fail after ~28 s of vLLM start-up, with a traceback)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pnode", *argv], capture_output=True, text=True, timeout=120)


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr without the lines vLLM's importer prints about Triton on CPU-only hosts."""
    return [line for line in result.stderr.splitlines() if line.strip() and "Triton" not in line]


SERVE = ("serve", "--model", "m", "--node-id", "n")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ((*SERVE, "--listen", "nonsense"), "--listen"),
        ((*SERVE, "--listen", "127.0.0.1:99999"), "--listen"),  # gRPC would silently bind port 99999 - 65536
        ((*SERVE, "--http-listen", "localhost"), "--http-listen"),
        ((*SERVE, "--log-level", "verbose"), "--log-level"),
        ((*SERVE, "--gossip-interval", "0"), "--gossip-interval"),
        ((*SERVE, "--drain-timeout", "-1"), "--drain-timeout"),
        ((*SERVE, "--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization"),
        ((*SERVE, "--first-token-timeout", "soon"), "--first-token-timeout"),
        ((*SERVE, "--engine", "sim", "--engine-arg", "max_num_seqs=3"), "--engine-arg"),
        ((*SERVE, "--host-kv-bytes", "lots"), "--host-kv-bytes"),
        ((*SERVE, "--host-kv-bytes", "1000TiB"), "--host-kv-bytes"),  # more than the machine's memory: refused
        ((*SERVE, "--engine", "sim", "--host-kv-bytes", "1MiB"), "--host-kv-bytes"),
        ((*SERVE, "--engine-arg", "kv_offloading_size=4"), "--host-kv-bytes"),  # vLLM's would replace p2pnode's
        ((*SERVE, "--tier-eviction", "fifo"), "--tier-eviction"),
        ((*SERVE, "--disk-kv-path", "/tmp/kv"), "--disk-kv-path"),  # no host tier to fill it from
        ((*SERVE, "--host-kv-bytes", "1MiB", "--disk-kv-path", "/proc/kv"), "--disk-kv-path"),  # not writable
        ((*SERVE, "--host-kv-bytes", "1MiB", "--disk-kv-path", "/dev/shm", "--disk-kv-bytes",
          "1000TiB"), "--disk-kv-bytes"),  # more than the disk's free space
        (("generate", "--token-ids", "a,b"), "--token-ids"),
        (("generate", "--target", "host-without-port", "hi"), "--target"),
        (("status", "--tls-cert", "/nonexistent.pem"), "--tls-cert"),
        (("sim", "--workload", "mmlu", "--requests", "10", "--speculative-ttl", "inf"), "--speculative-ttl"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv: tuple[str, ...], names: str) -> None:
    result = run(*argv)
    lines = error_lines(result)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, lines
    assert names in lines[0]


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_an_address_in_use_fails_at_once_naming_the_flag(which: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        flags = ["--listen", taken] if which == "grpc" else ["--listen", "127.0.0.1:0", "--http-listen", taken]
        started = time.monotonic()
        result = run("serve", "--engine", "sim", "--model", "sim", "--node-id", "x", *flags)
        took = time.monotonic() - started
    lines = error_lines(result)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(lines) == 1 and "in use" in lines[0]
    assert ("--listen" if which == "grpc" else "--http-listen") in lines[0]
    assert took < 60  # before any engine starts (vLLM takes ~30 s here)
