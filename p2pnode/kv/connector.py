"""``PeerPullConnector``: vLLM's KV connector that lets an engine pull a cached prefix's KV from a peer's engine, and
lend its own blocks to peers.

vLLM creates one instance in its engine-core process (the SCHEDULER role) and one in each worker process (WORKER);
they talk only through the per-step metadata (scheduler -> worker) and the step's connector output (worker ->
scheduler). The node talks to them a request at a time, through ``kv_transfer_params`` (``params.py``).

A pull (the puller's engine):
1. the request arrives with a ``PullSource`` (its holder's block server, a lease on the prefix's blocks there);
2. ``get_num_new_matched_tokens``: the leased blocks beyond the local prefix-cache hit are external tokens, loaded
   asynchronously (the request waits in ``WAITING_FOR_REMOTE_KVS``; the batch goes on);
3. ``update_state_after_alloc``: vLLM allocated the destination blocks; the pull job goes into the next metadata;
4. the worker's ``start_load_kv`` starts a fetch thread (``blocks.fetch``); once it ends, ``get_finished`` reports
   the request as received and ``get_block_ids_with_load_errors`` the blocks that did not arrive, in the same step;
   vLLM recomputes from the first missing block (``kv_load_failure_policy = recompute``) -- a failed pull costs time,
   never a wrong token -- and the blocks that arrived join the prefix cache, so the index and gossip see them
   (vLLM's own ``BlockStored``);
5. what arrived (blocks, bytes, seconds, why not all) goes back through the worker metadata and ends up in the
   finished request's ``kv_transfer_params`` (``PullResult``), for the node's final message and metrics.

An export (the holder's engine), vLLM's NixlPull pattern:
1. the holder's node runs the prefix (plus one token) as a one-token request with an ``ExportAsk``, at a priority
   ahead of its queue;
2. ``request_finished``: when the blocks asked for were a prefix-cache hit at admission, they stay allocated after
   the request (``delay_free``) and their ids go back as an ``ExportLease``; otherwise "evicted", and nothing is held;
3. the lease goes to the worker's block server in the next metadata; when the pull ends (or the lease expires
   unpulled) ``get_finished`` reports the export as sent and vLLM frees its blocks.

Segments (approximate reuse, ``segments.py``): a request with a ``SegmentAsk`` extends its cached prefix with the
stored segments (and a previous phase's tail) that follow it contiguously -- a synchronous load, written by the worker
before the step's forward; when it ends, the segments it computed (and its tail, when asked) are copied into the
worker's store (``segment_kv.py``) while vLLM holds its blocks (``delay_free``), and the finished request's
``SegmentResult`` says what was loaded, stored and evicted.

Segments between engines (``segment_transfer.py``), the prefix pull's pattern again:
- the holder's node runs a one-token request with a ``SegmentExportAsk``: its scheduler side lends the entries its
  store holds (``SegmentLease``) and tells the worker, whose block server takes references to their K/V for the lease
  (an entry dropped meanwhile still streams whole);
- the puller's node runs a one-token request with a ``SegmentFetch``: the scheduler side keeps it waiting (``None``
  from ``get_num_new_matched_tokens``: vLLM asks again next step) while a worker thread pulls the segments into a
  staging area; once the worker reports them, the scheduler admits the whole ones to its store (the worker adopts
  them, in the order of the store's other steps) and lets the request finish with a ``SegmentFetched``. Later
  requests load them exactly like segments computed here.

Nothing here may raise into vLLM (an exception in a connector hook kills its process): I/O runs on threads that
report, and malformed parameters are ignored.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from p2pnode.kv import params
from p2pnode.kv.plain import slots_of
from p2pnode.kv.segments import MIN_SEGMENT_TOKENS, Piece, SegmentStore, plan_loads, tail_key
from p2pnode.kv.settings import ConnectorSettings

log = logging.getLogger("p2pnode.kv")

__all__ = ["PeerPullConnector", "kv_bytes_per_token"]


@dataclass
class PullJob:
    """One pull for the worker: lease blocks ``first_block..`` into ``dst_block_ids``."""

    request_id: str
    kv_address: str
    lease: str
    first_block: int
    dst_block_ids: list[int]


@dataclass
class LeaseGrant:
    """A lease for the worker's block server: the finished export ``export_id`` holds ``block_ids``."""

    token: str
    export_id: str
    block_ids: list[int]
    ttl_s: float


@dataclass
class SegmentOp:
    """One segment-store step for the worker, in order: ``capture`` (copy ``slots`` into ``key``; ``request_id``'s
    blocks are held until it is done), ``drop`` (forget ``key``) or ``load`` (write ``pieces``: each a ``LoadPiece``'s
    fields, into ``request_id``'s blocks ``block_ids``)."""

    kind: str
    request_id: str = ""
    key: int = 0
    slots: list[int] = field(default_factory=list)
    pieces: list[tuple[int, int, int, int, list[int]]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    #: ``lend`` (a segment lease ``request_id`` of entries ``keys`` for ``ttl_s``), ``fetch`` (pull ``fetch`` into the
    #: staging area of ``request_id``), ``adopt`` (move staged ``key`` into the store), ``unstage`` (forget the rest).
    keys: list[int] = field(default_factory=list)
    ttl_s: float = 0.0
    fetch: params.SegmentFetch | None = None


@dataclass
class PullMetadata(KVConnectorMetadata):
    """One step's news for the worker."""

    pulls: list[PullJob] = field(default_factory=list)
    leases: list[LeaseGrant] = field(default_factory=list)
    segment_ops: list[SegmentOp] = field(default_factory=list)


@dataclass
class PullOutcomes(KVConnectorWorkerMetadata):
    """One step's news for the scheduler: how each finished pull went (request id -> result fields), and each
    finished segment fetch (request id -> outcome, the keys staged whole, bytes, seconds)."""

    results: dict[str, tuple[str, int, int, float]] = field(default_factory=dict)
    fetched: dict[str, tuple[str, tuple[int, ...], int, float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PullOutcomes):
            return PullOutcomes({**self.results, **other.results}, {**self.fetched, **other.fetched})
        return self


class PeerPullConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        #: What the node told this engine (``kv/settings.py``).
        self.settings = ConnectorSettings.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.block_size = int(vllm_config.cache_config.block_size)
        self.layout = self.settings.kv_layout
        self._lock = threading.Lock()
        # --- scheduler side -------------------------------------------------------------------------------
        self._asked: dict[str, tuple[int, int, params.PullSource]] = {}  # request -> (local tokens, external, source)
        self._tried: set[str] = set()  # requests whose pull started: never offered again (retries, preemption)
        self._exports: dict[str, tuple[params.ExportAsk, int]] = {}  # export request -> (ask, local tokens)
        self._results: dict[str, params.PullResult] = {}
        self._external: dict[str, int] = {}  # request -> external tokens its admission counted as cached
        self._jobs: list[PullJob] = []
        self._grants: list[LeaseGrant] = []
        # --- worker side ----------------------------------------------------------------------------------
        self._layers: list[Any] = []
        self._server: Any = None
        self._done: list[tuple[str, list[int], params.PullResult]] = []  # fetch threads' results
        self._load_errors: set[int] = set()
        self._reported: dict[str, tuple[str, int, int, float]] = {}
        self._unserved: set[str] = set()  # exports granted while no block server runs: released at once
        # --- segments (both sides) --------------------------------------------------------------------------
        self._store: SegmentStore | None = None
        self._store_error = ""
        store_bytes = self.settings.segment_store_bytes
        if store_bytes > 0:
            try:
                tokens = store_bytes // kv_bytes_per_token(vllm_config)
                self._store = SegmentStore(
                    tokens, self.settings.segment_policy, store_threshold=self.settings.segment_store_threshold
                )
            except Exception as e:  # an unknown policy, a model without the sizes: no store, said once
                self._store_error = f"segment store off: {e}"
                log.warning("kv connector: %s", self._store_error)
        else:
            self._store_error = "segment store off (no bytes given)"
        self._segment_plans: dict[str, list[Piece]] = {}  # request -> its load (scratch until allocation)
        self._segment_pins: dict[str, list[int]] = {}  # request -> the store keys its load pinned
        self._segment_loaded: dict[str, tuple[int, int]] = {}  # request -> (tokens, segments) it loaded
        self._segment_ops: list[SegmentOp] = []
        self._segment_kv: Any = None  # worker: segment_kv.SegmentKV once the KV tensors are known
        self._captured: set[str] = set()  # worker: requests whose captures are done (their blocks may be freed)
        # --- segments between engines ---------------------------------------------------------------------------
        self._lent: dict[str, params.SegmentLease] = {}  # scheduler: export request -> the entries it lent
        self._fetches: dict[str, params.SegmentFetch] = {}  # scheduler: fetch request -> what it pulls
        self._fetched: dict[str, params.SegmentFetched] = {}  # scheduler: fetch request -> what arrived
        self._staged: dict[str, dict[int, Any]] = {}  # worker: fetch request -> key -> K/V that arrived whole
        self._fetch_done: list[tuple[str, tuple[str, tuple[int, ...], int, float]]] = []  # worker: fetch threads
        self._fetch_reported: dict[str, tuple[str, tuple[int, ...], int, float]] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a request never waits for a consumer

    # === scheduler side (engine-core process) ================================================================

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        try:
            ask = params.read(request.kv_transfer_params, "export")
            if ask is not None:
                self._exports[rid] = (ask, num_computed_tokens)  # re-asked after a failed allocation: overwritten
                return 0, False
            ask_segments = params.read(request.kv_transfer_params, "segments")
            if ask_segments is not None:
                return self._match_segments(request, num_computed_tokens, ask_segments), False
            lend = params.read(request.kv_transfer_params, "segment_export")
            if lend is not None:
                if rid not in self._lent:  # asked again after a failed allocation: lent once
                    self._lent[rid] = self._lend_segments(lend)
                return 0, False
            fetch = params.read(request.kv_transfer_params, "segment_fetch")
            if fetch is not None:
                return self._wait_for_fetch(rid, fetch), False
            source = params.read(request.kv_transfer_params, "pull")
            if source is None or rid in self._tried:
                return 0, False
            bs = self.block_size
            leased = min(source.blocks, len(source.block_ids)) * bs
            wanted = min(leased, (request.num_tokens - 1) // bs * bs)  # the last prompt token is always computed
            external = wanted - num_computed_tokens
            if external <= 0:
                self._results[rid] = params.PullResult("ok")  # the local cache already holds it all
                return 0, False
            self._asked[rid] = (num_computed_tokens, external, source)
            return external, True
        except Exception:
            log.exception("kv connector: get_num_new_matched_tokens failed; the request computes its prompt")
            return 0, False

    def _match_segments(self, request: Any, computed: int, ask: params.SegmentAsk) -> int:
        """The stored segments' tokens that extend the cached prefix (``segments.plan_loads``), pinned until the
        request ends (asked again after a failed allocation or a preemption: the previous answer is replaced)."""
        rid = request.request_id
        if self._store is None:
            return 0
        spans = list(zip(ask.spans[0::2], ask.spans[1::2], strict=True))
        if len(spans) != len(ask.keys):
            return 0
        pieces = plan_loads(
            list(request.prompt_token_ids or ()),
            computed,
            spans,
            ask.keys,
            self._store,
            self.block_size,
            _namespace(request),
            ask.recompute,
        )
        self._store.unpin(self._segment_pins.pop(rid, []))
        self._segment_plans.pop(rid, None)
        if not pieces:
            return 0
        keys = [p.key for p in pieces]
        self._store.pin(keys)
        self._segment_pins[rid] = keys
        self._segment_plans[rid] = pieces
        return sum(p.count for p in pieces)

    def _lend_segments(self, ask: params.SegmentExportAsk) -> params.SegmentLease:
        """Lend the asked entries the store holds (with exactly the asked tokens) to the worker's block server."""
        store = self._store
        if store is None:
            return params.SegmentLease(ask.lease, error=self._store_error)
        keys: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        for key, n, pos in zip(ask.keys, ask.lengths, accumulate(ask.lengths, initial=0), strict=False):
            entry = store.get(key, ask.tokens[pos : pos + n])
            if entry is not None and n > 0:
                keys.append(key)
                starts.append(entry.start)
                lengths.append(n)
        if not keys:
            return params.SegmentLease(ask.lease, error=f"none of the {len(ask.keys)} segments is stored here")
        store.pin(keys)  # an access for the eviction policy; the lease holds the K/V itself, not the entry
        store.unpin(keys)
        self._segment_ops.append(SegmentOp("lend", ask.lease, keys=keys, ttl_s=ask.ttl_s))
        return params.SegmentLease(ask.lease, tuple(keys), tuple(starts), tuple(lengths))

    def _wait_for_fetch(self, rid: str, fetch: params.SegmentFetch) -> int | None:
        """0 once the fetch ended (the request then runs its one token); None while the worker pulls (vLLM asks
        again next step)."""
        if rid in self._fetched:
            return 0
        if self._store is None:
            self._fetched[rid] = params.SegmentFetched(f"refused: {self._store_error}")
            return 0
        if rid not in self._fetches:
            self._fetches[rid] = fetch
            self._segment_ops.append(SegmentOp("fetch", rid, fetch=fetch))
        return None

    def _fetch_ended(self, rid: str, outcome: str, keys: tuple[int, ...], moved: int, seconds: float) -> None:
        """The worker staged ``keys`` whole: admit them to the store (the worker adopts each admitted one), forget
        the rest."""
        fetch = self._fetches.get(rid)
        store = self._store
        if fetch is None or store is None or rid in self._fetched:  # aborted meanwhile
            self._segment_ops.append(SegmentOp("unstage", rid))
            return
        offsets = list(accumulate(fetch.lengths, initial=0))
        where = {key: i for i, key in enumerate(fetch.keys)}
        stored: list[int] = []
        evicted: list[int] = []
        tokens = 0
        for key in keys:
            i = where.get(key)
            if i is None or key in store:  # not asked, or computed here meanwhile: keep this engine's own
                continue
            ok, gone = store.admit(key, fetch.tokens[offsets[i] : offsets[i + 1]], fetch.starts[i])
            for old in gone:
                self._segment_ops.append(SegmentOp("drop", key=old))
            evicted.extend(gone)
            if ok:
                self._segment_ops.append(SegmentOp("adopt", rid, key))
                stored.append(key)
                tokens += fetch.lengths[i]
        self._segment_ops.append(SegmentOp("unstage", rid))
        self._fetched[rid] = params.SegmentFetched(outcome, tuple(stored), tuple(evicted), tokens, moved, seconds)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        pieces = self._segment_plans.pop(rid, None)
        if pieces is not None and num_external_tokens > 0:
            ids = list(blocks.get_block_ids()[0])
            bs = self.block_size
            loads = [(p.key, p.offset, p.count, p.delta, slots_of(ids, p.dst, p.count, bs)) for p in pieces]
            first = pieces[0].dst // bs
            last = (pieces[-1].dst + pieces[-1].count - 1) // bs
            self._segment_ops.append(SegmentOp("load", rid, pieces=loads, block_ids=ids[first : last + 1]))
            loaded = sum(p.count for p in pieces)
            self._segment_loaded[rid] = (loaded, sum(1 for p in pieces if not p.tail))
            return
        if num_external_tokens <= 0 or rid not in self._asked:
            return
        local, external, source = self._asked.pop(rid)
        bs = self.block_size
        ids = list(blocks.get_block_ids()[0])
        first, count = local // bs, external // bs
        dst = ids[first : first + count] if len(ids) >= first + count else ids[-count:]
        self._tried.add(rid)
        self._external[rid] = count * bs
        self._jobs.append(PullJob(rid, source.kv_address, source.lease, first, dst))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = PullMetadata(self._jobs, self._grants, self._segment_ops)
        self._jobs, self._grants, self._segment_ops = [], [], []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        outcomes = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(outcomes, PullOutcomes):
            for rid, (outcome, keys, moved, seconds) in outcomes.fetched.items():
                self._fetch_ended(rid, outcome, keys, moved, seconds)
            for rid, (outcome, tokens, moved, seconds) in outcomes.results.items():
                if rid not in self._tried:  # the request ended while its pull ran: nobody will read this
                    continue
                asked = self._external.pop(rid, tokens)
                self._results[rid] = params.PullResult(outcome, tokens, moved, seconds, asked)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        ask_segments = params.read(request.kv_transfer_params, "segments")
        if ask_segments is not None:
            return self._finish_segments(request, list(block_ids), ask_segments)
        lent = self._lent.pop(rid, None)
        if lent is not None:
            return False, params.wrap(lent)
        if rid in self._fetches:
            self._fetches.pop(rid)
            got = self._fetched.pop(rid, None) or params.SegmentFetched("failed: the request ended before its fetch")
            return False, params.wrap(got)
        if rid in self._fetched:  # refused before it started
            return False, params.wrap(self._fetched.pop(rid))
        export = self._exports.pop(rid, None)
        if export is not None:
            ask, local = export
            # cached: in the engine at admission, or loaded from the host tier since (``kv/tier/``)
            cached = (local + int(getattr(request, params.TIER_LOADED_ATTR, 0))) // self.block_size
            if cached < ask.blocks:
                return False, params.wrap(params.ExportLease(ask.lease, error="evicted", cached_blocks=cached))
            leased = [int(b) for b in block_ids[: ask.blocks]]
            self._grants.append(LeaseGrant(ask.lease, rid, leased, ask.ttl_s))
            return True, params.wrap(params.ExportLease(ask.lease, tuple(leased), cached_blocks=cached))
        self._asked.pop(rid, None)
        self._tried.discard(rid)
        self._external.pop(rid, None)
        result = self._results.pop(rid, None)
        return False, params.wrap(result) if result is not None else None

    def _finish_segments(
        self, request: Any, block_ids: list[int], ask: params.SegmentAsk
    ) -> tuple[bool, dict[str, Any] | None]:
        """Unpin the request's load; store the segments it computed (and its tail when asked) while vLLM holds its
        blocks; answer what it loaded and what the store took and dropped."""
        rid = request.request_id
        self._segment_plans.pop(rid, None)
        loaded, count = self._segment_loaded.pop(rid, (0, 0))
        store = self._store
        if store is None:
            return False, params.wrap(params.SegmentResult(error=self._store_error))
        store.unpin(self._segment_pins.pop(rid, []))
        prompt = list(request.prompt_token_ids or ())
        computed = min(int(request.num_computed_tokens), len(prompt))
        bs = self.block_size
        stored: list[int] = []
        evicted: list[int] = []
        captures = 0
        spans = list(zip(ask.spans[0::2], ask.spans[1::2], strict=False))
        elsewhere = set(ask.elsewhere)
        offered: set[int] = set()  # a document named twice in one prompt is one offer (the threshold counts requests)
        for (start, end), key in zip(spans, ask.keys, strict=False):
            if not 0 <= start < end <= computed or end - start < MIN_SEGMENT_TOKENS or key in store or key in offered:
                continue
            offered.add(key)
            if end > len(block_ids) * bs:
                continue
            ok, gone = store.offer(key, prompt[start:end], start, key in elsewhere)
            for old in gone:
                self._segment_ops.append(SegmentOp("drop", key=old))
            evicted.extend(gone)
            if ok:
                self._segment_ops.append(SegmentOp("capture", rid, key, slots_of(block_ids, start, end - start, bs)))
                stored.append(key)
                captures += 1
        if ask.tail and computed == len(prompt) and len(prompt) % bs:
            start = len(prompt) // bs * bs
            key = tail_key(_namespace(request), prompt)
            for old in store.add_tail(key, prompt[start:], start):
                self._segment_ops.append(SegmentOp("drop", key=old))
            slots = slots_of(block_ids, start, len(prompt) - start, bs)
            self._segment_ops.append(SegmentOp("capture", rid, key, slots))
            captures += 1
        result = params.SegmentResult(loaded, count, tuple(stored), tuple(evicted), store.held_tokens)
        return captures > 0, params.wrap(result)

    # === worker side (worker process) ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._layers = list(kv_caches.values())  # vLLM's layer order: the same on every node of one layout
        _allow_amx()
        if self._store is not None:
            self._segment_kv = _segment_kv(self._vllm_config, self._layers)
            if self._segment_kv is not None:
                self._segment_kv.rotate = self.settings.segment_rotation
        host = self.settings.kv_host
        if not host or not self.layout:
            return
        try:
            from p2pnode.kv.blocks import BlockServer

            port_file = self.settings.kv_port_file
            self._server = BlockServer(
                self._layers,
                self.layout,
                host,
                Path(port_file) if port_file else None,
                max_streams=self.settings.max_streams,
                block_delay_s=self.settings.block_delay_s,
            )
        except Exception:
            log.exception("kv connector: the block server did not start; this engine lends no blocks")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, PullMetadata):
            for op in connector_metadata.segment_ops:
                self._run_segment_op(op)
            for grant in connector_metadata.leases:
                if self._server is not None:
                    self._server.grant(grant.token, grant.export_id, grant.block_ids, grant.ttl_s)
                else:  # nobody can pull them: never hold a request's blocks for nothing
                    self._unserved.add(grant.export_id)

    def _run_segment_op(self, op: SegmentOp) -> None:
        """One store step (``SegmentOp``); a load that fails marks its blocks for recomputation, a capture that
        fails leaves the entry empty (its later loads fail the same way): never a wrong token."""
        from p2pnode.kv.segment_kv import LoadPiece

        kv = self._segment_kv
        try:
            if op.kind == "capture":
                if kv is not None:
                    kv.capture(op.key, op.slots)
                self._captured.add(op.request_id)
            elif op.kind == "drop":
                if kv is not None:
                    kv.drop(op.key)
            elif op.kind == "load":
                ok = kv is not None and kv.load([LoadPiece(*piece) for piece in op.pieces])
                if not ok:
                    self._load_errors.update(op.block_ids)
            elif op.kind == "lend":
                if kv is not None and self._server is not None:
                    empty: tuple[list[Any], list[Any]] = ([], [])  # an entry this worker lacks streams nothing
                    entries = [kv.entry(key) or empty for key in op.keys]
                    self._server.grant_segments(op.request_id, entries, op.ttl_s)
            elif op.kind == "fetch":
                assert op.fetch is not None
                threading.Thread(
                    target=self._fetch_segments, args=(op.request_id, op.fetch), name="kv-segments", daemon=True
                ).start()
            elif op.kind == "adopt":
                with self._lock:
                    entry = self._staged.get(op.request_id, {}).pop(op.key, None)
                if kv is not None and entry is not None:
                    kv.put(op.key, entry)
            elif op.kind == "unstage":
                with self._lock:
                    self._staged.pop(op.request_id, None)
        except Exception:
            log.exception("kv connector: segment %s failed", op.kind)
            if op.kind == "load":
                self._load_errors.update(op.block_ids)
            elif op.kind == "capture":
                self._captured.add(op.request_id)

    def _fetch_segments(self, rid: str, fetch: params.SegmentFetch) -> None:
        """A fetch thread: pull a segment lease into the staging area, then report (always, even failed)."""
        from p2pnode.kv.segment_transfer import fetch_segments

        staged: dict[int, Any] = {}
        moved, seconds, error = 0, 0.0, ""
        try:
            if self._segment_kv is None or not self._layers:
                error = "this engine keeps no segment store"
            else:
                layer = self._layers[0]
                shape = (int(layer.shape[1]), int(layer.shape[3]) // 2)  # [blocks, kv_heads, block_size, 2 x head]
                timeout = self.settings.fetch_timeout_s
                got = fetch_segments(
                    fetch.kv_address, fetch.lease, self.layout, fetch.lengths, len(self._layers), shape, layer.dtype,
                    timeout,
                )
                staged = {fetch.keys[i]: entry for i, entry in got.entries.items()}
                moved, seconds, error = got.bytes, got.seconds, got.error
        except Exception as e:  # never into vLLM: the segments are computed instead
            log.exception("kv connector: segment fetch failed")
            error = f"{type(e).__name__}: {e}"
        outcome = "ok" if not error and len(staged) == len(fetch.keys) else f"failed: {error or 'segments missing'}"
        with self._lock:
            self._staged[rid] = staged
            self._fetch_done.append((rid, (outcome, tuple(staged), moved, seconds)))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PullMetadata):
            return
        for job in meta.pulls:
            threading.Thread(target=self._fetch, args=(job,), name=f"kv-pull-{job.request_id}", daemon=True).start()

    def _fetch(self, job: PullJob) -> None:
        from p2pnode.kv.blocks import fetch

        timeout = self.settings.fetch_timeout_s
        got = fetch(self._layers, job.kv_address, job.lease, self.layout, job.first_block, job.dst_block_ids, timeout)
        outcome = "ok" if not got.error else f"failed: {got.error}"
        result = params.PullResult(outcome, got.blocks * self.block_size, got.bytes, got.seconds)
        with self._lock:
            self._done.append((job.request_id, job.dst_block_ids[got.blocks :], result))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done = self._done, []
            fetched, self._fetch_done = self._fetch_done, []
        for rid, report in fetched:
            self._fetch_reported[rid] = report
        received: set[str] = set()
        for rid, missing, result in done:
            received.add(rid)
            self._load_errors.update(missing)  # reported in this same step (vLLM's contract)
            self._reported[rid] = (result.outcome, result.tokens, result.bytes, result.seconds)
        sent = self._server.finished_exports() if self._server is not None else set()
        if self._unserved:
            sent |= self._unserved
            self._unserved = set()
        if self._captured:
            sent |= self._captured
            self._captured = set()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._reported and not self._fetch_reported:
            return None
        reported, self._reported = self._reported, {}
        fetched, self._fetch_reported = self._fetch_reported, {}
        return PullOutcomes(reported, fetched)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its blocks arrived

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # nothing is pushed: peers pull leased blocks

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state in this (worker) process. vLLM's CPU attention kernel uses AMX tiles without
    asking; oneDNN asks when a large enough matmul first runs on AMX. A fresh engine whose first forward is a prompt
    of a token or two (a segment export or fetch here) reached the kernel unasked and died of SIGILL (measured:
    vLLM 0.32 CPU, torch 2.13, an AMX host)."""
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
    except Exception as e:  # not an AMX host, or an older torch: nothing to ask
        log.debug("kv connector: AMX tile state not requested: %s", e)


def _namespace(request: Any) -> str:
    """What a request's KV depends on besides its tokens: its LoRA adapter and cache salt."""
    lora = getattr(request, "lora_request", None)
    return f"{getattr(lora, 'lora_name', '') or ''}|{getattr(request, 'cache_salt', None) or ''}"


def kv_bytes_per_token(vllm_config: Any) -> int:
    """Bytes of K and V per token over every layer (what one stored segment token costs)."""
    import torch

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    layers = model.get_num_layers(parallel)
    heads = model.get_num_kv_heads(parallel)
    dtype = model.dtype if isinstance(model.dtype, torch.dtype) else getattr(torch, str(model.dtype))
    return 2 * layers * heads * model.get_head_size() * dtype.itemsize


def _segment_kv(vllm_config: Any, layers: list[Any]) -> Any:
    """The worker's segment store, or None (logged) when this model or platform cannot move segments."""
    try:
        from vllm.platforms import current_platform

        from p2pnode.kv.plain import TokenCodec
        from p2pnode.kv.rope import Rerotation
        from p2pnode.kv.segment_kv import SegmentKV

        if not current_platform.is_cpu():
            raise ValueError("segment KV is implemented for vLLM's CPU attention layout only")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _, _, block_size, head2 = layers[0].shape
        head_size = head2 // 2
        isa = _get_attn_isa(layers[0].dtype, block_size, head_size, vllm_config.cache_config.cache_dtype)
        codec = TokenCodec.probe(isa, layers[0].dtype, block_size, head_size)
        return SegmentKV(layers, codec, Rerotation.for_model(vllm_config))
    except Exception as e:
        log.warning("kv connector: approximate segments off on this engine: %s", e)
        return None
