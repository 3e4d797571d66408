"""The client-facing gRPC servicer: ``Generate`` and ``GetStatus``.

Invariants a client can rely on:
- every call ends with exactly one of: a message carrying ``final``, or a gRPC error status whose message names
  the cause (and the field, for INVALID_ARGUMENT);
- a cancelled call (client gone, deadline passed) aborts its engine request; nothing keeps running for it;
- while the node drains, new calls get UNAVAILABLE and running calls finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import grpc

from p2pnode.api import validation
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.config import NodeConfig
from p2pnode.engine.base import Engine, EngineDeadError, FinishReason, SamplingOptions
from p2pnode.v1 import node_pb2, node_pb2_grpc

log = logging.getLogger("p2pnode.api")

#: Text prompts longer than this are tokenized on a worker thread so the event loop keeps serving.
_TOKENIZE_OFF_LOOP_CHARS = 8192

_FINISH_TO_PROTO = {
    FinishReason.STOP: node_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: node_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: node_pb2.FINISH_REASON_ABORT,
}


@dataclass
class RequestCounters:
    total: int = 0
    failed: int = 0
    rejected: int = 0
    cancelled: int = 0


@dataclass
class LocalServing:
    """What the node is doing right now: requests in flight (by id) and whether it is draining."""

    in_flight: dict[str, float] = field(default_factory=dict)
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self, request_id: str) -> None:
        self.in_flight[request_id] = time.monotonic()
        self.idle.clear()

    def end(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        if not self.in_flight:
            self.idle.set()


class NodeService(node_pb2_grpc.NodeServicer):
    """Serves Generate on the local engine and reports the node's status."""

    def __init__(self, config: NodeConfig, engine: Engine, index: PrefixIndex, address: str) -> None:
        self.config = config
        self.engine = engine
        self.index = index
        self.address = address
        self.counters = RequestCounters()
        self.serving = LocalServing()
        self.started_at = time.monotonic()
        self._ids = itertools.count(1)
        self._id_prefix = f"{config.node_id}-{os.getpid()}-"

    # --- Generate -----------------------------------------------------------------------------------------

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.counters.rejected += 1
        await context.abort(code, message)

    async def _prompt_tokens(self, spec: validation.PromptSpec) -> list[int]:
        if spec.token_ids is not None:
            return spec.token_ids
        assert spec.text is not None
        if len(spec.text) > _TOKENIZE_OFF_LOOP_CHARS:
            return await asyncio.to_thread(self.engine.encode, spec.text)
        return self.engine.encode(spec.text)

    async def Generate(
        self, request: node_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Written with context.write() rather than as an async generator: a cancellation then always lands in
        # this coroutine (at a write or at the engine), so the engine request is aborted right away instead of
        # whenever the abandoned generator happens to be garbage-collected.
        arrived = time.monotonic()
        self.counters.total += 1
        server = self.config.server
        info = self.engine.info
        if self.serving.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "node is draining; send to another node")
        try:
            validation.check_identity(request)
            spec = validation.check_prompt(request, server.max_prompt_chars, info.vocab_size)
            tokens = await self._prompt_tokens(spec)
            field_name = "prompt.text" if spec.text is not None else "prompt.token_ids"
            validation.check_prompt_length(len(tokens), info, field_name)
            options = validation.check_sampling(request.sampling, server.sampling, info, len(tokens))
        except validation.InvalidRequest as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if len(self.serving.in_flight) >= server.max_in_flight:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node {self.config.node_id} has {server.max_in_flight} requests in flight (max_in_flight)",
            )
        request_id = request.request_id or f"{self._id_prefix}{next(self._ids)}"
        if request_id in self.serving.in_flight:
            await self._reject(
                context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running here"
            )
        await self._serve_locally(request_id, tokens, options, arrived, context)

    async def _serve_locally(
        self,
        request_id: str,
        tokens: list[int],
        options: SamplingOptions,
        arrived: float,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Run one request on the local engine, streaming chunks and one final message to ``context``."""
        index_match = self.index.match(tokens)
        self.serving.begin(request_id)
        finished = False
        first_token_at: float | None = None
        completion_tokens = 0
        try:
            async with contextlib.aclosing(self.engine.generate(request_id, tokens, options)) as stream:
                async for chunk in stream:
                    completion_tokens += len(chunk.token_ids)
                    if first_token_at is None and (chunk.token_ids or chunk.text):
                        first_token_at = time.monotonic()
                    if chunk.finish_reason is None:
                        if chunk.token_ids or chunk.text:
                            await context.write(node_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text))
                        continue
                    now = time.monotonic()
                    final = node_pb2.GenerateFinal(
                        request_id=request_id,
                        finish_reason=_FINISH_TO_PROTO[chunk.finish_reason],
                        prompt_tokens=len(tokens),
                        completion_tokens=completion_tokens,
                        cached_tokens=chunk.cached_tokens,
                        served_by=self.config.node_id,
                        index_match_tokens=index_match,
                        stop_reason=chunk.stop_reason,
                        timings=node_pb2.Timings(
                            queue_s=chunk.queue_s or 0.0,
                            ttft_s=(first_token_at or now) - arrived,
                            total_s=now - arrived,
                        ),
                    )
                    last = node_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text, final=final)
                    await context.write(last)
                    finished = True
                    break
            if not finished:
                self.counters.failed += 1
                await context.abort(grpc.StatusCode.INTERNAL, "engine ended the stream without finishing")
        except EngineDeadError as e:
            self.counters.failed += 1
            log.error("request %s failed: %s", request_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable on {self.config.node_id}: {e}")
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            raise
        finally:
            self.serving.end(request_id)
            if not finished:
                # Closing the stream already aborts in vLLM; this covers engines that need telling.
                with contextlib.suppress(Exception):
                    await self.engine.abort(request_id)

    # --- GetStatus ----------------------------------------------------------------------------------------

    def status(self) -> node_pb2.NodeStatus:
        load = self.engine.load()
        stats = self.index.stats()
        status = node_pb2.NodeStatus(
            node_id=self.config.node_id,
            address=self.address,
            model=self.engine.info.name,
            block_size=self.engine.info.block_size,
            max_model_len=self.engine.info.max_model_len,
            draining=self.serving.draining,
            load=node_pb2.EngineLoad(
                running=load.running,
                waiting=load.waiting,
                kv_usage=load.kv_usage,
                in_flight=len(self.serving.in_flight),
                engine_unfinished=load.unfinished,
                healthy=load.healthy,
            ),
            index=node_pb2.IndexStatus(
                blocks=stats.blocks,
                approx_bytes=stats.approx_bytes,
                max_blocks=self.index.max_blocks,
                stored_blocks_total=stats.stored_blocks_total,
                removed_blocks_total=stats.removed_blocks_total,
                orphaned_blocks=stats.orphaned_blocks,
                unknown_removals=stats.unknown_removals,
                overflow_evictions=stats.overflow_evictions,
                resets=stats.resets,
                version=stats.version,
            ),
            requests_total=self.counters.total,
            requests_failed=self.counters.failed,
            requests_rejected=self.counters.rejected,
            requests_cancelled=self.counters.cancelled,
            uptime_s=time.monotonic() - self.started_at,
        )
        kv = self.engine.kv_event_stats()
        if kv is not None:
            status.kv_events.CopyFrom(
                node_pb2.KvEventStatus(
                    batches=kv.batches,
                    events=kv.events,
                    decode_errors=kv.decode_errors,
                    gaps=kv.gaps,
                    replayed_batches=kv.replayed_batches,
                    unrecovered_gaps=kv.unrecovered_gaps,
                    resets=kv.resets,
                    last_seq=kv.last_seq,
                )
            )
        return status

    async def GetStatus(
        self, request: node_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeStatus:
        return self.status()
