"""Serving a request on this node's own engine, as a stream of client-API messages.

Both the client-facing Generate (when routing picks this node) and the peer-facing Forward use it, so a request
is served the same way wherever it entered the mesh.

Invariants:
- the engine request is aborted whenever the stream is closed before its final message (client gone, deadline,
  ingress gave up) — the consumer closes it with ``contextlib.aclosing``;
- a failure raises ``TargetFailed``; ``retryable`` says whether another node may still serve the request, which
  is only true while nothing has been streamed yet (the consumer tracks that);
- ``in_flight`` holds exactly the requests whose engine stream is open; ``prefill_backlog_tokens`` is the uncached
  prompt tokens (by the index, at admission) of those that have not produced a token yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import Layout, SegmentReuse, SegmentSpans
from p2pnode.engine.base import (
    Engine,
    EngineDeadError,
    EngineRejected,
    FinishReason,
    GenerationChunk,
    PositionLogprobs,
    SamplingOptions,
    SegmentOutcome,
)
from p2pnode.kv.params import PullResult, PullSource
from p2pnode.serving.errors import ServeCode, TargetFailed
from p2pnode.serving.segments import SegmentLayouts, use_message
from p2pnode.v1 import forward_pb2, node_pb2

if TYPE_CHECKING:
    from p2pnode.serving.pulls import KvPulls

log = logging.getLogger("p2pnode.serving")

__all__ = ["ActivityTracker", "LocalServer", "chunk_message"]

FINISH_TO_PROTO = {
    FinishReason.STOP: node_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: node_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: node_pb2.FINISH_REASON_ABORT,
}


def _logprobs_proto(positions: tuple[PositionLogprobs | None, ...]) -> list[node_pb2.PositionLogprobs]:
    """Positions on the wire (None, the first prompt position, is an empty message)."""

    def one(t) -> node_pb2.TokenLogprob:
        return node_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token, rank=t.rank)

    return [
        node_pb2.PositionLogprobs() if p is None else node_pb2.PositionLogprobs(
            sampled=one(p.sampled), top=[one(t) for t in p.top]
        )
        for p in positions
    ]


def chunk_message(chunk: GenerationChunk, final: node_pb2.GenerateFinal | None = None) -> node_pb2.GenerateResponse:
    """An engine chunk as a client-API message (the logprobs travel with their tokens, the prompt's with the first
    chunk)."""
    message = node_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text, final=final)
    if chunk.logprobs:
        message.logprobs.extend(_logprobs_proto(chunk.logprobs))
    if chunk.prompt_logprobs:
        message.prompt_logprobs.extend(_logprobs_proto(chunk.prompt_logprobs))
    return message


def pull_message(holder: str, result: PullResult, seconds: float) -> node_pb2.KvPull:
    """The final message's account of a pull."""
    return node_pb2.KvPull(
        holder=holder, outcome=result.outcome, tokens=result.tokens, bytes=result.bytes, seconds=seconds
    )


@dataclass
class ActivityTracker:
    """Keys of calls in progress, with an event set whenever none is (drain waits on it)."""

    active: dict[str, float] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def __len__(self) -> int:
        return len(self.active)

    def __contains__(self, key: str) -> bool:
        return key in self.active

    def begin(self, key: str) -> None:
        self.active[key] = time.monotonic()
        self.idle.clear()

    def end(self, key: str) -> None:
        self.active.pop(key, None)
        if not self.active:
            self.idle.set()


@dataclass
class LocalCounters:
    served: int = 0
    failed: int = 0
    cancelled: int = 0
    #: The work of the requests served (the engine's account): prompt tokens it did not find cached, tokens it
    #: generated. The node gossips them with its load; the rate plan scores its expected loads against them.
    uncached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class SegmentCounters:
    """Requests served here with segments and what they reused (status and metrics)."""

    requests: dict[str, int] = field(default_factory=dict)  # by mode
    reused_tokens: dict[str, int] = field(default_factory=dict)  # engine-reported cached tokens, by mode
    loaded_segments: int = 0
    phases: int = 0

    def record(self, segments: SegmentSpans, cached_tokens: int, outcome: SegmentOutcome | None) -> None:
        mode = segments.mode.value
        self.requests[mode] = self.requests.get(mode, 0) + 1
        self.reused_tokens[mode] = self.reused_tokens.get(mode, 0) + cached_tokens
        if outcome is not None:
            self.loaded_segments += outcome.segments
            self.phases += outcome.phases


class LocalServer:
    """The node's engine, admitted through an in-flight limit and a draining switch."""

    def __init__(
        self,
        node_id: str,
        engine: Engine,
        index: PrefixIndex,
        max_in_flight: int,
        on_served: Callable[[Sequence[int], Sequence[int]], None] | None = None,
        pulls: KvPulls | None = None,
    ) -> None:
        """``on_served(prompt, output)``: called with the token ids of each request that finished here (the
        eviction selector's feed under ``--eviction-policy adaptive``); ``pulls``: how a request's prefix is pulled
        from its holder when routing says so (None: never)."""
        self.node_id = node_id
        self.pulls = pulls
        self.on_served = on_served
        self.engine = engine
        self.index = index
        self.max_in_flight = max_in_flight
        self.in_flight = ActivityTracker()
        self.prefill_backlog_tokens = 0
        self.draining = False
        self.counters = LocalCounters()
        self.segment_counters = SegmentCounters()
        self.adapter_requests: dict[str, int] = {}  # requests served here by LoRA adapter
        self._layouts: SegmentLayouts | None = None  # exact-mode segments (made once the engine knows its BOS)
        #: As the serving node of an approximate request: which of its segments to pull from whom (holder, its
        #: address, indices into the request's segments; ``Router.segment_pulls``), and told how each pull went
        #: (holder, bytes, seconds, ok: the holder's link figure). None: this node pulls no segments.
        self.segment_pulls: Callable[[SegmentSpans], list[tuple[str, str, list[int]]]] | None = None
        self.segment_pull_done: Callable[[str, int, float, bool], None] | None = None

    def layouts(self) -> SegmentLayouts:
        if self._layouts is None:
            self._layouts = SegmentLayouts(self.index, self.engine.info.bos_token_id)
        return self._layouts

    async def _pull_segments(self, segments: SegmentSpans, tokens: list[int]) -> list[tuple[str, PullResult, float]]:
        """Pull into the engine's store the request's segments routing says a peer should lend (each holder's at
        once, holders side by side); what each pull did. Never raises: what did not arrive is computed."""
        pulls, plan = self.pulls, self.segment_pulls
        if pulls is None or plan is None:
            return []
        try:
            chosen = plan(segments)
        except Exception:  # a bug in planning must cost the pull, never the request
            log.exception("segment pull planning failed; the request computes its segments")
            return []

        async def one(holder: str, address: str, indices: list[int]) -> tuple[str, PullResult, float]:
            refs = [(segments.keys[i], tokens[segments.spans[i][0] : segments.spans[i][1]]) for i in indices]
            try:
                result, seconds = await pulls.pull_segments(holder, address, refs)
            except Exception as e:
                log.exception("segment pull from %s failed; its segments are computed", holder)
                result, seconds = PullResult(f"failed: {type(e).__name__}: {e}"), 0.0
            pulls.record(result, seconds)
            if self.segment_pull_done is not None and not result.outcome.startswith("refused"):
                self.segment_pull_done(holder, result.bytes, result.seconds, result.ok)
            return holder, result, seconds

        return list(await asyncio.gather(*(one(*p) for p in chosen if p[1])))

    def check_admission(self, engine_request_id: str) -> None:
        """Raise TargetFailed when this node cannot take the request now."""
        if self.draining:
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, "node is draining", retryable=True)
        if not self.engine.status().healthy:
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, "engine is down", retryable=True)
        if len(self.in_flight) >= self.max_in_flight:
            raise TargetFailed(
                self.node_id,
                ServeCode.RESOURCE_EXHAUSTED,
                f"{self.max_in_flight} requests in flight (max_in_flight)",
                retryable=True,
            )
        if engine_request_id in self.in_flight:
            raise TargetFailed(
                self.node_id,
                ServeCode.ALREADY_EXISTS,
                f"request_id {engine_request_id!r} is already running here",
                retryable=False,
            )

    async def stream(
        self,
        engine_request_id: str,
        tokens: list[int],
        options: SamplingOptions,
        arrived: float,
        request_id: str,
        pull: forward_pb2.KvPullHint | None = None,
        segments: SegmentSpans | None = None,
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
    ) -> AsyncIterator[node_pb2.GenerateResponse]:
        """Serve on the engine: chunks, then one message with ``final`` (served_by and engine accounting). ``pull``:
        the prefix to pull from its holder first (``pulls.py``); whatever does not arrive is computed. ``segments``:
        exact mode serves the prompt laid out for reuse (``serving/segments.py``), approximate mode lets the engine
        load them (a request with segments pulls nothing)."""
        self.check_admission(engine_request_id)
        layout: Layout | None = None
        engine_segments: SegmentSpans | None = None
        if not namespace.is_default:
            pull = None  # a holder exports default-namespace prefixes only (docs/lora.md)
        if segments is not None:
            pull = None
            if segments.mode is SegmentReuse.EXACT:
                layout = self.layouts().layout(tokens, segments, namespace)
                tokens = layout.token_ids
            else:
                engine_segments = segments
        index_match = self.index.match(tokens, namespace)
        self.in_flight.begin(engine_request_id)
        backlog = len(tokens) - index_match  # until its first token: queued prefill work others wait behind
        self.prefill_backlog_tokens += backlog
        finished = False
        first_token_at: float | None = None
        completion_tokens = 0
        output: list[int] | None = [] if self.on_served is not None else None
        source: PullSource | None = None
        pulled: PullResult | None = None
        export_s = 0.0
        segment_pulls: list[tuple[str, PullResult, float]] = []
        if pull is not None and self.pulls is not None:
            started = time.monotonic()
            got = await self.pulls.source(pull, tokens)
            export_s = time.monotonic() - started
            source, pulled = (got, None) if isinstance(got, PullSource) else (None, got)
        try:
            if engine_segments is not None:  # inside: a client gone meanwhile ends the request as any other
                segment_pulls = await self._pull_segments(engine_segments, tokens)
            generation = self.engine.generate(
                engine_request_id, tokens, options, pull=source, segments=engine_segments, namespace=namespace
            )
            async with contextlib.aclosing(generation) as chunks:
                async for chunk in chunks:
                    completion_tokens += len(chunk.token_ids)
                    if output is not None:
                        output.extend(chunk.token_ids)
                    if first_token_at is None and (chunk.token_ids or chunk.text):
                        first_token_at = time.monotonic()
                        self.prefill_backlog_tokens -= backlog
                        backlog = 0
                    if chunk.finish_reason is None:
                        if chunk.token_ids or chunk.text or chunk.prompt_logprobs:
                            yield chunk_message(chunk)
                        continue
                    now = time.monotonic()
                    final = node_pb2.GenerateFinal(
                        request_id=request_id,
                        finish_reason=FINISH_TO_PROTO[chunk.finish_reason],
                        prompt_tokens=len(tokens),
                        completion_tokens=completion_tokens,
                        cached_tokens=chunk.cached_tokens,
                        served_by=self.node_id,
                        index_match_tokens=index_match,
                        stop_reason=chunk.stop_reason,
                        timings=node_pb2.Timings(
                            queue_s=chunk.queue_s or 0.0,
                            ttft_s=(first_token_at or now) - arrived,
                            total_s=now - arrived,
                        ),
                    )
                    if pull is not None and self.pulls is not None:
                        if source is not None:
                            pulled = chunk.pull or PullResult("failed: the engine reported no pull")
                            # vLLM counted every token it asked the pull for as cached at admission; the ones
                            # that did not arrive were computed: the final message counts what was not
                            final.cached_tokens = max(0, chunk.cached_tokens - max(0, pulled.asked - pulled.tokens))
                        assert pulled is not None
                        seconds = export_s + pulled.seconds  # asking the holder, then the transfer
                        self.pulls.record(pulled, seconds)
                        final.pull.CopyFrom(pull_message(pull.holder, pulled, seconds))
                    final.segment_pulls.extend(pull_message(h, r, s) for h, r, s in segment_pulls)
                    if segments is not None:
                        final.segments.CopyFrom(use_message(segments, layout, chunk.segments))
                        self.segment_counters.record(segments, final.cached_tokens, chunk.segments)
                    finished = True
                    self.counters.served += 1
                    if namespace.adapter:
                        self.adapter_requests[namespace.adapter] = self.adapter_requests.get(namespace.adapter, 0) + 1
                    self.counters.uncached_tokens += max(0, final.prompt_tokens - final.cached_tokens)
                    self.counters.completion_tokens += completion_tokens
                    if self.on_served is not None and output is not None:
                        self.on_served(tokens, output)
                    yield chunk_message(chunk, final)
                    return
            self.counters.failed += 1
            raise TargetFailed(
                self.node_id, ServeCode.INTERNAL, "engine ended the stream without finishing", retryable=True
            )
        except EngineDeadError as e:
            self.counters.failed += 1
            log.error("request %s failed: %s", engine_request_id, e)
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, f"engine unavailable: {e}",
                               retryable=True) from e
        except EngineRejected as e:
            # The engine's own limits: every node serves the same model, so another node would refuse it too.
            self.counters.failed += 1
            field = e.field if e.field.startswith(("prompt", "messages")) else f"sampling.{e.field}"
            raise TargetFailed(self.node_id, ServeCode.INVALID_ARGUMENT, f"{field}: {e.message}",
                               retryable=False) from e
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self.counters.cancelled += 1
            raise
        finally:
            self.prefill_backlog_tokens -= backlog
            self.in_flight.end(engine_request_id)
            if not finished:
                # Closing the engine stream already aborts in vLLM; this covers engines that need telling.
                with contextlib.suppress(Exception):
                    await self.engine.abort(engine_request_id)
