"""``DiskTier``: the local disk tier below the host tier, a secondary tier of vLLM's tiering offloading manager.

vLLM 0.32 runs secondary tiers below its host tier (``TieringOffloadingSpec``, ``v1/kv_offload/tiering/``): a chunk
evicted from the host tier's LRU was cascaded to them when it was stored, and a host-tier miss that a secondary tier
holds is promoted (disk -> host -> engine) -- its lookups, promotions, fencing and KV events are vLLM's, as they
ship, in the scheduler process. Its own file-system tier (``tiering/fs/``) is pure Python and would run on the CPU
build, but it is unbounded (no eviction: a disk fills until writes fail), has no checksum (only a short read is
caught), and keys its files by vLLM's ``FileMapper``, which leaves out the weights, kernel layout, vLLM version and
hash seed. This tier implements the same interface with what p2pnode needs (``disk_store.py``): bounded with LRU
eviction (a ``BlockRemoved`` for each entry it drops), a CRC-32 per entry verified on load, files keyed by the whole
layout, and reuse after a restart.

Faults end in a recompute, a counted failure and one log line (rate-limited per kind), never a wrong token or a crash:
a store that fails (a full or unwritable disk) leaves no entry; a load that fails (a corrupt entry, an entry of
another layout, a vanished file) reports its chunks failed to vLLM, which drops them from the host tier's promotion
and recomputes; the corrupt entry is deleted. The counts go out as the tier's connector stats (``FAILURES``, by
``reason``), beside vLLM's own tier counters.

Entries found at start carry no token metadata (vLLM's events tracker learns a chunk's tokens when it is stored), so
the node's index learns of them only when they are loaded or stored again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from p2pnode.kv.tier.disk_store import (
    ENTRY_HEADER_BYTES,
    LAYOUT_FILE,
    CorruptEntry,
    DiskIndex,
    EntryFormat,
    layout_id,
    read_entry,
    write_entry,
)
from p2pnode.kv.tier.stats import DISK_FAILURES as FAILURES
from p2pnode.log_limit import LogLimiter

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger("p2pnode.kv.tier")

__all__ = ["FAILURES", "DiskTier"]

#: The tier's failures (``FAILURES``) by ``reason``: ``store`` (a write failed: full or unwritable disk), ``corrupt``
#: (an entry failed its check on load), ``unreadable`` (an entry could not be read), ``layout`` (entries of another
#: layout found at start, left unread).


@dataclass
class _Job:
    keys: list[OffloadKey]
    future: Future[Any]
    is_load: bool
    evicted: list[bytes] = field(default_factory=list)


class DiskTier(SecondaryTierManager):
    """A bounded, checksummed disk tier (module docstring). Runs in vLLM's scheduler process; its file I/O runs on
    ``n_threads`` threads of its own."""

    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            FAILURES: OffloadingCounterMetadata(
                documentation="Failures of the disk KV tier (each recomputed), by reason.", labelnames=("reason",)
            )
        }

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        max_bytes: int,
        kv_layout: str,
        n_threads: int = 2,
        enable_kv_events: bool = True,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        entry_bytes = ENTRY_HEADER_BYTES + self.block_size_bytes
        if max_bytes < entry_bytes:  # refused as the engine starts, not at its first request (the index opens then)
            raise ValueError(
                f"--disk-kv-bytes {max_bytes} holds no chunk of this engine's KV: each takes {entry_bytes} bytes "
                f"on disk ({self.block_size_bytes} of KV and a {ENTRY_HEADER_BYTES}-byte header)"
            )
        self.locality = Locality(locality) if locality else Locality.LOCAL
        self._root = Path(root_dir)
        self._max_bytes = int(max_bytes)
        self._kv_layout = kv_layout
        self._flat = primary_kv_view.cast("B")
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None
        )
        self._pool = ThreadPoolExecutor(max_workers=max(1, n_threads), thread_name_prefix="p2pnode_kv_disk")
        self._jobs: dict[int, _Job] = {}
        self._stats = OffloadingConnectorStats()
        self._log = LogLimiter(log)
        self._index: DiskIndex | None = None  # opened at first use: the block-hash seed is known by then

    # --- the store, opened once vLLM has chosen its hash seed -----------------------------------------------------

    def layout_fields(self) -> dict[str, Any]:
        """Everything a chunk's bytes and key depend on (``disk_store`` module docstring)."""
        import vllm
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed

        config = self._offloading_spec.config
        return {
            "kv_layout": self._kv_layout,
            "vllm": vllm.__version__,
            "dtype": str(config.model.dtype),
            # the seed itself may be a secret (a random one for a non-cryptographic hash): only its digest is written
            "hash_seed": hashlib.sha256(get_none_hash_seed().encode()).hexdigest()[:16],
            "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": config.cache.blocks_per_chunk,
            "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
            "world_size": config.parallel.world_size,
            "tp_size": config.parallel.tp_size,
            "pp_size": config.parallel.pp_size,
            "chunk_bytes": self.block_size_bytes,
        }

    @property
    def index(self) -> DiskIndex:
        if self._index is None:
            self._index = self._open()
        return self._index

    def _open(self) -> DiskIndex:
        import json

        fields = self.layout_fields()
        lid = layout_id(fields)
        fmt = EntryFormat(self._root / lid, lid, self.block_size_bytes)
        index = DiskIndex(fmt, self._max_bytes)
        try:
            fmt.folder.mkdir(parents=True, exist_ok=True)
            (fmt.folder / LAYOUT_FILE).write_text(json.dumps(fields, indent=2, sort_keys=True))
        except OSError as e:
            self._fail("store", "disk KV tier: cannot write its folder %s (%s); every store will fail", fmt.folder, e)
        evicted, removed = index.scan()
        for key in evicted:
            fmt.path(key).unlink(missing_ok=True)
        others = [p for p in self._root.iterdir() if p.is_dir() and p.name != lid] if self._root.is_dir() else []
        if others:
            self._fail(
                "layout",
                "disk KV tier: %s holds entries of %d other KV layout(s) (%s): not read; this engine's are in %s",
                self._root, len(others), ", ".join(p.name for p in others[:3]), lid,
            )  # fmt: skip
        log.info(
            "disk KV tier: %s, %.1f MiB of %.1f MiB in use (%d chunks of %d bytes found, %d stray files removed)",
            fmt.folder, index.used_bytes / 2**20, self._max_bytes / 2**20, len(index), fmt.entry_bytes, removed,
        )  # fmt: skip
        return index

    # --- vLLM's SecondaryTierManager ------------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if bytes(key) in self.index else LookupResult.MISS

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        index = self.index
        for key in keys:
            index.touch(bytes(key))

    def submit_store(self, job_metadata: TransferJob) -> None:
        index = self.index
        todo: list[tuple[bytes, int]] = []
        evicted: list[bytes] = []
        for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            dropped = index.begin_write(bytes(key))
            if dropped is None:
                continue  # held already, being written, or no room (every entry is being read)
            evicted.extend(dropped)
            todo.append((bytes(key), int(chunk)))
        if evicted:
            self._emit(evicted, removed=True)
        future = self._pool.submit(self._write, index.fmt, todo, evicted)
        self._jobs[job_metadata.job_id] = _Job([k for k, _ in todo], future, is_load=False)  # type: ignore[misc]

    def submit_load(self, job_metadata: TransferJob) -> None:
        index = self.index
        keys = [bytes(k) for k in job_metadata.keys]
        for key in keys:
            index.begin_read(key)
        todo = [(key, int(chunk)) for key, chunk in zip(keys, job_metadata.chunk_ids, strict=True)]
        future = self._pool.submit(self._read, index.fmt, todo)
        self._jobs[job_metadata.job_id] = _Job(keys, future, is_load=True)  # type: ignore[arg-type]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = [job_id for job_id, job in self._jobs.items() if job.future.done()]
        return [self._finish(job_id, self._jobs.pop(job_id)) for job_id in done]

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def drain_jobs(self) -> None:
        wait([job.future for job in self._jobs.values()])

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._flat.release()  # vLLM closes the host tier's mapping next: no view of it may remain

    # --- p2pnode's -------------------------------------------------------------------------------------------

    def _write(self, fmt: EntryFormat, todo: list[tuple[bytes, int]], evicted: list[bytes]) -> tuple[int, str, str]:
        """I/O thread: delete what eviction dropped, then write each entry; (entries written, failure reason,
        detail)."""
        for key in evicted:
            with contextlib.suppress(OSError):  # a file left behind is found (and bounded) at the next start
                fmt.path(key).unlink(missing_ok=True)
        size = fmt.payload_bytes
        for n, (key, chunk) in enumerate(todo):
            try:
                write_entry(fmt, key, self._flat[chunk * size : (chunk + 1) * size])
            except Exception as e:  # a full or unwritable disk, above all
                return n, "store", f"{type(e).__name__}: {e}"
        return len(todo), "", ""

    def _read(self, fmt: EntryFormat, todo: list[tuple[bytes, int]]) -> tuple[int, str, str]:
        """I/O thread: read each entry into its host chunk; (entries loaded, failure reason, detail). A load stops at
        its first failure: the prefix after it cannot be used anyway."""
        size = fmt.payload_bytes
        for n, (key, chunk) in enumerate(todo):
            try:
                read_entry(fmt, key, self._flat[chunk * size : (chunk + 1) * size])
            except CorruptEntry as e:
                with contextlib.suppress(OSError):
                    fmt.path(key).unlink(missing_ok=True)
                return n, "corrupt", str(e)
            except Exception as e:
                with contextlib.suppress(OSError):
                    fmt.path(key).unlink(missing_ok=True)
                return n, "unreadable", f"{type(e).__name__}: {e}"
        return len(todo), "", ""

    def _finish(self, job_id: int, job: _Job) -> JobResult:
        index = self.index
        nbytes = index.fmt.payload_bytes
        try:
            done, reason, detail = job.future.result()
        except Exception as e:  # not expected: the I/O functions catch their own
            done, reason, detail = 0, "unreadable" if job.is_load else "store", f"{type(e).__name__}: {e}"
        if not job.is_load:
            for n, key in enumerate(job.keys):
                index.end_write(key, n < done)
            if done:
                self._emit(job.keys[:done], removed=False)
            if reason:
                self._fail(reason, "disk KV tier: a store failed (%s); %d chunk(s) not kept", detail,
                           len(job.keys) - done)  # fmt: skip
            return JobResult(job_id, not reason, transfer_bytes=done * nbytes)
        loaded = done
        for key in job.keys:
            index.end_read(key)
        if not reason:
            return JobResult(job_id, True, transfer_bytes=loaded * nbytes)
        bad = job.keys[loaded]
        if index.drop(bad):  # never offered again (vLLM would retry a hit that cannot load, over and over)
            self._emit([bad], removed=True)
        self._fail(reason, "disk KV tier: a load failed (%s entry %s: %s); its prefix is recomputed", reason,
                   bad.hex()[:16], detail)  # fmt: skip
        return JobResult(
            job_id, False, successful_keys=tuple(job.keys[:loaded]) or None, transfer_bytes=loaded * nbytes
        )  # type: ignore[arg-type]

    def _emit(self, keys: list[bytes], removed: bool) -> None:
        if self._events is not None and keys:
            self._events.append(
                OffloadingEvent(
                    keys=[OffloadKey(k) for k in keys],
                    medium=self.medium,
                    removed=removed,
                    locality=self.locality,
                    removal_expected=not removed,
                )
            )

    def _fail(self, reason: str, msg: str, *args: object) -> None:
        self._stats.increase_counter(FAILURES, 1, (reason,))
        self._log.log(logging.WARNING, reason, msg, *args)
