"""Whether a disk tier can live where the flags put it: a path that cannot be written, or a bound above the disk's
free space, is refused at start, naming the flag.

A tier that finds out later fails every store (each counted and recomputed, so no answer is wrong) while the operator
believes it works; a bound larger than the disk fills the disk for everything else on it before the tier's eviction
starts. Entries the tier already wrote there (a restart's) count as room: the tier reuses or evicts them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["SHARED_REGION_DIR", "check_disk_tier", "check_shared_region", "tree_bytes"]

#: Where vLLM's tiering spec keeps the host tier when a tier lies below it (``cpu/shared_offload_region.py``).
SHARED_REGION_DIR = "/dev/shm"


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def check_disk_tier(path: str, disk_bytes: int, free: int | None = None) -> str | None:
    """Why a disk tier of ``disk_bytes`` at ``path`` cannot run (None: it can, or it is off). Creates ``path`` if
    missing. ``free``: the disk's free bytes (tests; None: asked of the file system)."""
    if not path:
        return None
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".p2pnode-probe-"):
            pass
    except OSError as e:
        return f"--disk-kv-path {path} is not a writable directory: {e.strerror or e}"
    if free is None:
        free = shutil.disk_usage(root).free
    room = free + tree_bytes(root)
    if disk_bytes > room:
        return (
            f"--disk-kv-bytes {disk_bytes} ({disk_bytes / 2**30:.1f} GiB) is more than the free space at {path} "
            f"({room / 2**30:.1f} GiB, counting the tier's own files there)"
        )
    return None


def check_shared_region(host_bytes: int, free: int | None = None) -> str | None:
    """Why the host tier cannot sit in shared memory (None: it can): with a disk tier below it, vLLM keeps it in a
    file of ``SHARED_REGION_DIR``, often far smaller than the machine's memory (a container's default is 64 MiB).
    ``free``: that file system's free bytes (tests; None: asked of it)."""
    if host_bytes <= 0:
        return None
    if free is None:
        try:
            free = shutil.disk_usage(SHARED_REGION_DIR).free
        except OSError:
            return None  # vLLM says why at start
    if host_bytes > free:
        return (
            f"--host-kv-bytes {host_bytes} ({host_bytes / 2**30:.1f} GiB) is more than {SHARED_REGION_DIR} can hold "
            f"({free / 2**30:.1f} GiB free): with --disk-kv-path the host tier lives there (raise its size, e.g. "
            "docker's --shm-size)"
        )
    return None
