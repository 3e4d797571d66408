"""The disk tier's files: one checksummed file per KV chunk, under a folder named by the whole KV layout, bounded.

A chunk's bytes mean something only to an engine of the same layout: the same weights, KV dtype, block size, vLLM
version, attention kernel (``kv/layout.py``), block-hash seed (vLLM's ``NONE_HASH`` seed: the same tokens hash to
another key under another seed), chunk size and parallel rank. vLLM's own file key (``v1/kv_offload/file_mapper.py``)
names the model by its path and leaves out the weights, the kernel layout, the vLLM version and the hash seed, so a
node that restarts on another model at the same path, or on a host of another ISA, would load noise. Here every one of
them goes into the folder's name (``layout_id``: a digest of ``layout.json``, written beside the entries), and again
into each entry's header, which is checked on every load together with the payload's checksum. A restarted node of the
same layout finds its entries again; one of another layout finds none of them (another folder), and reads nothing.

The store is bounded: entries are dropped least recently used first when a new one would pass ``max_bytes``. The index
(which entries exist, their order) lives in memory, owned by one thread (vLLM's scheduler); the file reads and writes
are plain functions that run on I/O threads and touch no index. At start the folder is scanned: entries of the right
size come back in their modification order (oldest first evicted); anything else in it is removed.

Entry file: a 128-byte header (magic, layout id, key, payload length, CRC-32 of the payload), then the payload (one
chunk as the host tier holds it). Written to a temporary name and renamed, so a crash mid-write leaves no entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENTRY_HEADER_BYTES",
    "CorruptEntry",
    "DiskIndex",
    "EntryFormat",
    "layout_id",
    "read_entry",
    "write_entry",
]

MAGIC = b"P2PKVD1\n"
#: magic, layout id (16 raw bytes), key length, key (padded), payload length, CRC-32 of the payload.
_HEADER = struct.Struct("<8s16sH64sQI")
ENTRY_HEADER_BYTES = 128
MAX_KEY_BYTES = 64
SUFFIX = ".kv"
LAYOUT_FILE = "layout.json"


class CorruptEntry(Exception):
    """An entry whose header, length or checksum does not match: never loaded."""


def layout_id(fields: dict[str, Any]) -> str:
    """The folder name of a layout: a digest of its fields (32 hex digits)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class EntryFormat:
    """Where one layout's entries live and how big each is."""

    folder: Path
    layout: str  # layout_id
    payload_bytes: int

    @property
    def entry_bytes(self) -> int:
        return ENTRY_HEADER_BYTES + self.payload_bytes

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    def key_of(self, path: Path) -> bytes | None:
        """The key a file name stands for (None: not an entry's name)."""
        if path.suffix != SUFFIX:
            return None
        try:
            key = bytes.fromhex(path.stem)
        except ValueError:
            return None
        return key if 0 < len(key) <= MAX_KEY_BYTES and path.parent.name == path.stem[:2] else None


def _header(fmt: EntryFormat, key: bytes, crc: int) -> bytes:
    packed = _HEADER.pack(MAGIC, bytes.fromhex(fmt.layout)[:16], len(key), key, fmt.payload_bytes, crc)
    return packed.ljust(ENTRY_HEADER_BYTES, b"\0")


def write_entry(fmt: EntryFormat, key: bytes, payload: memoryview) -> None:
    """Write one entry (temporary file, then rename); raises OSError (a full or unwritable disk) as it comes."""
    if len(payload) != fmt.payload_bytes:
        raise ValueError(f"a payload of {len(payload)} bytes, not {fmt.payload_bytes}")
    path = fmt.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_header(fmt, key, zlib.crc32(payload)))
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_entry(fmt: EntryFormat, key: bytes, into: memoryview) -> None:
    """Read one entry into ``into`` (``payload_bytes`` long) and verify it: CorruptEntry when its header is not this
    layout's and key's, its length is wrong or its checksum fails (``into`` then holds garbage: never use it)."""
    with open(fmt.path(key), "rb") as f:
        header = f.read(ENTRY_HEADER_BYTES)
        if len(header) != ENTRY_HEADER_BYTES:
            raise CorruptEntry("a short header")
        magic, layout, key_len, padded_key, length, crc = _HEADER.unpack_from(header)
        if magic != MAGIC:
            raise CorruptEntry("not an entry (bad magic)")
        if layout != bytes.fromhex(fmt.layout)[:16]:
            raise CorruptEntry("an entry of another KV layout")
        if padded_key[:key_len] != key or length != fmt.payload_bytes:
            raise CorruptEntry("the header names another key or length")
        read = f.readinto(into)
        if read != fmt.payload_bytes or f.read(1):
            raise CorruptEntry(f"a payload of {read}+ bytes, not {fmt.payload_bytes}")
    if zlib.crc32(into) != crc:
        raise CorruptEntry("checksum mismatch")


class DiskIndex:
    """Which entries exist, least recently used first, and the bytes they take (one thread owns it)."""

    def __init__(self, fmt: EntryFormat, max_bytes: int) -> None:
        if max_bytes < fmt.entry_bytes:
            raise ValueError(f"a disk tier of {max_bytes} bytes holds no entry of {fmt.entry_bytes}")
        self.fmt = fmt
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, None] = OrderedDict()  # ready to read, LRU first
        self._writing: set[bytes] = set()
        self._reading: dict[bytes, int] = {}  # key -> loads in flight (never evicted under them)

    @property
    def capacity(self) -> int:
        return self.max_bytes // self.fmt.entry_bytes

    @property
    def used_bytes(self) -> int:
        return (len(self._entries) + len(self._writing)) * self.fmt.entry_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def scan(self) -> tuple[list[bytes], int]:
        """Find the entries already in the folder (a restart's), oldest first; remove what is not an entry of the right
        size (temporary files of a crash among them) and what passes the bound. Returns the keys evicted (none are
        indexed) and the count of files removed as not entries."""
        found: list[tuple[float, bytes]] = []
        removed = 0
        if self.fmt.folder.is_dir():
            for path in self.fmt.folder.glob("*/*"):
                key = self.fmt.key_of(path)
                try:
                    st = path.stat()
                    if key is None or st.st_size != self.fmt.entry_bytes:
                        path.unlink()
                        removed += 1
                        continue
                except OSError:
                    continue
                found.append((st.st_mtime, key))
        found.sort()
        for _, key in found:
            self._entries[key] = None
        evicted = self._evict_for(0)
        return evicted, removed

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def begin_write(self, key: bytes) -> list[bytes] | None:
        """Reserve room for a new entry: the keys evicted to make it (their files are the caller's to delete), or None
        when it is there already, being written, or no room can be made (every entry is being read)."""
        if key in self._entries or key in self._writing:
            return None
        evicted = self._evict_for(self.fmt.entry_bytes)
        if self.used_bytes + self.fmt.entry_bytes > self.max_bytes:
            return None
        self._writing.add(key)
        return evicted

    def end_write(self, key: bytes, ok: bool) -> None:
        self._writing.discard(key)
        if ok:
            self._entries[key] = None

    def begin_read(self, key: bytes) -> None:
        self._reading[key] = self._reading.get(key, 0) + 1
        self.touch(key)

    def end_read(self, key: bytes) -> None:
        left = self._reading.get(key, 0) - 1
        if left > 0:
            self._reading[key] = left
        else:
            self._reading.pop(key, None)

    def drop(self, key: bytes) -> bool:
        """Forget an entry (a corrupt one); True if it was indexed."""
        if key not in self._entries:
            return False
        del self._entries[key]
        return True

    def _evict_for(self, new_bytes: int) -> list[bytes]:
        evicted: list[bytes] = []
        over = self.used_bytes + new_bytes - self.max_bytes
        if over <= 0:
            return evicted
        for key in list(self._entries):
            if over <= 0:
                break
            if key in self._reading:
                continue
            del self._entries[key]
            evicted.append(key)
            over -= self.fmt.entry_bytes
        return evicted
