"""The disk KV tier's pure parts (``kv/tier/disk_store.py``, ``disk_space.py``) and its secondary tier
(``kv/tier/disk.py``) against a host tier in plain memory: entries are keyed by the whole layout, checksummed,
bounded, found again after a restart; every fault is a miss, counted, never bytes of the wrong chunk."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from p2pnode.kv.tier.disk_space import check_disk_tier, check_shared_region
from p2pnode.kv.tier.disk_store import (
    ENTRY_HEADER_BYTES,
    CorruptEntry,
    DiskIndex,
    EntryFormat,
    layout_id,
    read_entry,
    write_entry,
)

PAYLOAD = 4096


def fmt_at(root: Path, layout: dict | None = None) -> EntryFormat:
    lid = layout_id(layout or {"kv_layout": "a"})
    return EntryFormat(root / lid, lid, PAYLOAD)


def payload(seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes())


def test_the_layout_id_changes_with_every_field() -> None:
    base = {"kv_layout": "w/bfloat16/b32/2x2x64/vllm-0.32.0/cpu-vec", "hash_seed": "s", "blocks_per_chunk": 1}
    ids = {layout_id(base)} | {layout_id({**base, k: f"{v}x"}) for k, v in base.items()}
    assert len(ids) == 1 + len(base)
    assert layout_id(dict(reversed(base.items()))) == layout_id(base)  # order does not matter


def test_an_entry_comes_back_bit_for_bit(tmp_path: Path) -> None:
    fmt = fmt_at(tmp_path)
    write_entry(fmt, b"k1", payload(1))
    assert fmt.path(b"k1").stat().st_size == ENTRY_HEADER_BYTES + PAYLOAD
    out = bytearray(PAYLOAD)
    read_entry(fmt, b"k1", memoryview(out))
    assert bytes(out) == bytes(payload(1))
    assert not list(fmt.folder.rglob("*.tmp"))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b.__setitem__(ENTRY_HEADER_BYTES + 100, b[ENTRY_HEADER_BYTES + 100] ^ 1), "checksum"),
        (lambda b: b.__delitem__(slice(len(b) - 1, None)), "payload"),
        (lambda b: b.__setitem__(0, 0), "magic"),
        (lambda b: b.extend(b"x"), "payload"),
    ],
)
def test_a_damaged_entry_is_never_loaded(tmp_path: Path, damage: object, reason: str) -> None:
    fmt = fmt_at(tmp_path)
    write_entry(fmt, b"k1", payload(1))
    data = bytearray(fmt.path(b"k1").read_bytes())
    damage(data)  # type: ignore[operator]
    fmt.path(b"k1").write_bytes(bytes(data))
    with pytest.raises(CorruptEntry, match=reason):
        read_entry(fmt, b"k1", memoryview(bytearray(PAYLOAD)))


def test_an_entry_of_another_layout_or_key_is_never_loaded(tmp_path: Path) -> None:
    mine, other = fmt_at(tmp_path), fmt_at(tmp_path, {"kv_layout": "b"})
    write_entry(other, b"k1", payload(1))
    mine.path(b"k1").parent.mkdir(parents=True)
    mine.path(b"k1").write_bytes(other.path(b"k1").read_bytes())  # moved into this layout's folder
    with pytest.raises(CorruptEntry, match="another KV layout"):
        read_entry(mine, b"k1", memoryview(bytearray(PAYLOAD)))
    write_entry(mine, b"k2", payload(2))
    mine.path(b"k1").write_bytes(mine.path(b"k2").read_bytes())  # another key's entry under this key's name
    with pytest.raises(CorruptEntry, match="another key"):
        read_entry(mine, b"k1", memoryview(bytearray(PAYLOAD)))


def test_the_index_is_bounded_least_recently_used_first_and_spares_entries_being_read(tmp_path: Path) -> None:
    fmt = fmt_at(tmp_path)
    index = DiskIndex(fmt, 3 * fmt.entry_bytes)

    def write(key: bytes, ok: bool = True) -> list[bytes] | None:
        evicted = index.begin_write(key)
        if evicted is not None:
            index.end_write(key, ok)
        return evicted

    assert [write(k) for k in (b"a", b"b", b"c")] == [[], [], []]
    assert write(b"a") is None  # held already
    index.touch(b"a")  # b is now the least recently used
    assert write(b"d") == [b"b"]
    index.begin_read(b"c")  # a read is a use, and its entry is never dropped while it lasts
    assert write(b"e") == [b"a"]
    assert write(b"f") == [b"d"]  # c is the least recently used now, but being read
    index.end_read(b"c")
    assert write(b"g", ok=False) == [b"c"]  # a failed write leaves no entry and frees its room
    assert {k for k in b"abcdefg" if bytes([k]) in index} == set(b"ef")
    assert index.used_bytes == 2 * fmt.entry_bytes <= index.max_bytes
    index.begin_read(b"e")
    index.begin_read(b"f")
    assert index.begin_write(b"h") == []
    assert index.begin_write(b"i") is None  # no room can be made: every entry is being read or written
    with pytest.raises(ValueError):
        DiskIndex(fmt, fmt.entry_bytes - 1)


def test_a_restart_finds_its_entries_oldest_first_and_removes_what_is_not_one(tmp_path: Path) -> None:
    fmt = fmt_at(tmp_path)
    for n, key in enumerate((b"old", b"mid", b"new")):
        write_entry(fmt, key, payload(n))
        t = time.time() - 100 + n
        os.utime(fmt.path(key), (t, t))
    (fmt.folder / "6b" / ".6b31.123.tmp").parent.mkdir(exist_ok=True)
    (fmt.folder / "6b" / ".6b31.123.tmp").write_bytes(b"half an entry")  # a crash mid-write
    short = fmt.path(b"short")
    short.parent.mkdir(parents=True, exist_ok=True)
    short.write_bytes(b"too short")
    index = DiskIndex(fmt, 2 * fmt.entry_bytes)  # a smaller bound than the last run's
    evicted, removed = index.scan()
    assert evicted == [b"old"] and removed == 2
    assert b"mid" in index and b"new" in index and len(index) == 2
    assert not short.exists() and not (fmt.folder / "6b" / ".6b31.123.tmp").exists()
    assert index.begin_write(b"x") == [b"mid"]


def test_a_disk_tier_that_cannot_run_is_refused_naming_the_flag(tmp_path: Path) -> None:
    assert check_disk_tier("", 1 << 40) is None
    assert check_disk_tier(str(tmp_path / "tier"), 1 << 20, free=2 << 20) is None
    assert (tmp_path / "tier").is_dir()
    refused = check_disk_tier(str(tmp_path / "tier"), 4 << 20, free=2 << 20)
    assert refused is not None and refused.startswith("--disk-kv-bytes")
    (tmp_path / "tier" / "old-entries").write_bytes(b"\0" * (3 << 20))  # a restart's own files count as room
    assert check_disk_tier(str(tmp_path / "tier"), 4 << 20, free=2 << 20) is None
    assert check_shared_region(0, free=0) is None and check_shared_region(1 << 20, free=2 << 20) is None
    refused = check_shared_region(4 << 20, free=2 << 20)  # the host tier lives in /dev/shm with a disk tier below
    assert refused is not None and refused.startswith("--host-kv-bytes")
    (tmp_path / "file").write_text("not a folder")
    refused = check_disk_tier(str(tmp_path / "file" / "tier"), 1 << 20)
    assert refused is not None and refused.startswith("--disk-kv-path")


# --- the secondary tier in vLLM's tiering manager, over a host tier in plain memory ---------------------------------


CHUNKS = 8


def make_tier(root: Path, max_chunks: int = 4, layout: str = "fp"):
    from p2pnode.kv.tier.disk import DiskTier

    config = SimpleNamespace(
        model=SimpleNamespace(dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=32, blocks_per_chunk=1),
        groups=[SimpleNamespace(tokens_per_block=32, layer_names=("l0", "l1"))],
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1),
    )
    spec = SimpleNamespace(config=config, kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
    host = np.zeros((CHUNKS, PAYLOAD), dtype=np.uint8)
    tier = DiskTier(spec, memoryview(host), "DiskTier", str(root), (ENTRY_HEADER_BYTES + PAYLOAD) * max_chunks, layout)
    return tier, host


def job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool):
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return TransferJob(job_id, keys, np.asarray(chunks), promotion, SimpleNamespace(req_id="r"))


def finished(tier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def events(tier) -> list[tuple[bool, list[bytes]]]:
    return [(e.removed, list(e.keys)) for e in tier.take_events()]


def failures(tier) -> dict[tuple[str, ...], int]:
    from p2pnode.kv.tier.disk import FAILURES

    stats = tier.get_stats()
    return dict(stats.data["data"].get(FAILURES, {})) if stats is not None else {}


def test_chunks_stored_to_disk_load_back_into_other_host_chunks_and_survive_a_restart(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import LookupResult, Medium

    tier, host = make_tier(tmp_path)
    host[0], host[1] = 7, 9
    keys = [b"\x01" * 36, b"\x02" * 36]
    assert tier.lookup(keys[0], None) is LookupResult.MISS
    tier.submit_store(job(1, keys, [0, 1], False))
    assert [(r.job_id, r.success) for r in finished(tier)] == [(1, True)]
    assert events(tier) == [(False, keys)] and tier.medium is Medium.STORAGE
    assert tier.lookup(keys[0], None) is LookupResult.HIT
    tier.submit_load(job(2, keys, [5, 6], True))
    assert [(r.job_id, r.success) for r in finished(tier)] == [(2, True)]
    assert (host[5] == 7).all() and (host[6] == 9).all()
    tier.shutdown()
    again, host2 = make_tier(tmp_path)  # a restart of the same layout
    assert again.lookup(keys[1], None) is LookupResult.HIT
    again.submit_load(job(3, [keys[1]], [2], True))
    assert finished(again)[0].success and (host2[2] == 9).all()
    other, _ = make_tier(tmp_path, layout="another-model")  # another layout: finds none of them, says so
    assert other.lookup(keys[1], None) is LookupResult.MISS
    assert failures(other) == {("layout",): 1}


def test_a_corrupt_entry_is_a_counted_miss_and_its_prefix_before_it_is_kept(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    tier, _ = make_tier(tmp_path)
    keys = [bytes([n]) * 36 for n in range(3)]
    tier.submit_store(job(1, keys, [0, 1, 2], False))
    finished(tier)
    events(tier)
    path = tier.index.fmt.path(keys[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    tier.submit_load(job(2, keys, [4, 5, 6], True))
    (result,) = finished(tier)
    assert not result.success and list(result.successful_keys) == [keys[0]]
    assert tier.lookup(keys[1], None) is LookupResult.MISS and not path.exists()
    assert events(tier) == [(True, [keys[1]])]
    assert failures(tier) == {("corrupt",): 1}
    assert tier.lookup(keys[2], None) is LookupResult.HIT  # not read: still good


def test_the_tier_is_bounded_and_says_what_it_dropped(tmp_path: Path) -> None:
    tier, _ = make_tier(tmp_path, max_chunks=2)
    keys = [bytes([n]) * 36 for n in range(3)]
    for n, key in enumerate(keys):
        tier.submit_store(job(n, [key], [n], False))
        finished(tier)
    assert events(tier) == [(False, [keys[0]]), (False, [keys[1]]), (True, [keys[0]]), (False, [keys[2]])]
    assert sorted(p.name for p in tier.index.fmt.folder.rglob("*.kv")) == sorted(
        tier.index.fmt.path(k).name for k in keys[1:]
    )


def test_a_store_that_fails_is_counted_and_leaves_no_entry(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    tier, _ = make_tier(tmp_path)
    key = b"\x01" * 36
    tier.index.fmt.path(key).parent.write_text("in the way")  # its folder cannot be made, as on a full disk
    tier.submit_store(job(1, [key], [0], False))
    (result,) = finished(tier)
    assert not result.success and failures(tier) == {("store",): 1}
    assert tier.lookup(key, None) is LookupResult.MISS and events(tier) == []
    assert tier.index.used_bytes == 0


def test_a_finished_requests_tier_load_is_read_by_medium() -> None:
    from p2pnode.kv.params import TIER_KEY, tier_loaded

    params = {TIER_KEY: {"host": 64, "disk": 192}}
    assert (tier_loaded(params), tier_loaded(params, "disk")) == (64, 192)
    assert tier_loaded({TIER_KEY: {"host": 64}}, "disk") == 0  # a host tier alone
    assert tier_loaded({TIER_KEY: {"disk": True}}, "disk") == tier_loaded(None, "disk") == 0


def test_a_disk_tier_smaller_than_one_chunk_is_refused_as_the_engine_starts(tmp_path: Path) -> None:
    """Before: accepted, and the engine died at its first request (the index opens at first use, inside vLLM's
    scheduler, which calls it without a try), and so did every restart."""
    with pytest.raises(ValueError, match=r"--disk-kv-bytes \d+ holds no chunk of this engine's KV"):
        make_tier(tmp_path / "tier", max_chunks=0)
    tier, _ = make_tier(tmp_path / "tier", max_chunks=1)  # one chunk: runs
    tier.shutdown()
