"""How much host memory a KV tier may take: a tier larger than the machine's available memory is refused at start.

vLLM allocates the whole tier when its engine starts (one host tensor per KV tensor, zero-filled: every page touched),
so a tier the machine cannot hold ends in the out-of-memory killer minutes later, or in swap. Refusing it before the
engine starts, naming the flag, is the only useful answer.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory_bytes", "check_host_tier"]

_MEMINFO = Path("/proc/meminfo")


def available_memory_bytes() -> int | None:
    """Memory the machine can give a new allocation without swapping (Linux's ``MemAvailable``; elsewhere its free
    pages); None when it cannot be told."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_tier(host_bytes: int, available: int | None = None) -> str | None:
    """Why a host tier of ``host_bytes`` cannot be held here (None: it can, or it is off)."""
    if host_bytes <= 0:
        return None
    available = available_memory_bytes() if available is None else available
    if available is not None and host_bytes > available:
        return (
            f"--host-kv-bytes {host_bytes} ({host_bytes / 2**30:.1f} GiB) is more than this machine's available "
            f"memory ({available / 2**30:.1f} GiB): the engine allocates its whole tier at start"
        )
    return None
