"""Serving a request on this node's own engine, as a stream of client-API messages.

Both the client-facing Generate (when routing picks this node) and the peer-facing Forward use it, so a request
is served the same way wherever it entered the mesh.

Invariants:
- the engine request is aborted whenever the stream is closed before its final message (client gone, deadline,
  ingress gave up) — the consumer closes it with ``contextlib.aclosing``;
- a failure raises ``TargetFailed``; ``retryable`` says whether another node may still serve the request, which
  is only true while nothing has been streamed yet (the consumer tracks that);
- ``in_flight`` holds exactly the requests whose engine stream is open; ``prefill_backlog_tokens`` is the uncached
  prompt tokens (by the index, at admission) of those that have not produced a token yet; ``urgent_waiting`` and
  ``urgent_backlog_tokens`` count the same for those of better than the default priority (``NodeLoad.urgent``);
- a request enters the engine through ``queue`` (``engine_queue.py``): at most ``max_in_flight`` are inside, the
  rest wait there in fair order, and one that waits nothing ever reaches the engine when it leaves the queue early.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import Layout, SegmentReuse, SegmentSpans
from p2pnode.config import FlowConfig
from p2pnode.engine.base import (
    AdapterNotServed,
    Engine,
    EngineDeadError,
    EngineRejected,
    EngineRequestFailed,
    FinishReason,
    GenerationChunk,
    PositionLogprobs,
    SegmentOutcome,
)
from p2pnode.kv.params import PullResult, PullSource
from p2pnode.request import Request
from p2pnode.serving.engine_queue import EngineQueue
from p2pnode.serving.errors import ServeCode, TargetFailed
from p2pnode.serving.segments import SegmentLayouts, use_message
from p2pnode.v1 import node_pb2

if TYPE_CHECKING:
    from p2pnode.serving.pulls import KvPulls

log = logging.getLogger("p2pnode.serving")

#: How long ``fail_stalled`` waits for the engine to take its aborts (seconds): a stalled core may never read them,
#: and the streams end without it.
ABORT_WAIT_S = 5.0

__all__ = ["ActivityTracker", "LocalHooks", "LocalServer", "chunk_message"]

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
    """Keys of calls in progress, with an event set whenever none is (drain waits on it). A key begun twice (two
    calls under one client-chosen id that both got past the check for a running one: on the HTTP front the check
    and the call's start are a loop turn apart) counts twice and ends twice: the first to end must not make a node
    that still serves the other look idle to its drain."""

    active: dict[str, float] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: Keys begun more than once, and how many times more.
    again: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.idle.set()

    def __len__(self) -> int:
        return len(self.active) + sum(self.again.values())

    def __contains__(self, key: str) -> bool:
        return key in self.active

    def begin(self, key: str) -> None:
        if key in self.active:
            self.again[key] = self.again.get(key, 0) + 1
        else:
            self.active[key] = time.monotonic()
        self.idle.clear()

    def end(self, key: str) -> None:
        more = self.again.get(key)
        if more:
            if more == 1:
                del self.again[key]
            else:
                self.again[key] = more - 1
            return
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
    #: Requests served here that loaded part of their prefix from the engine's host KV tier, and those tokens.
    host_tier_requests: int = 0
    host_tier_tokens: int = 0


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


#: A segment pull plan: (holder, its address, indices into the request's segments) for each holder to ask.
SegmentPullPlan = list[tuple[str, str, list[int]]]


@dataclass(frozen=True)
class LocalHooks:
    """What local serving is handed by the node (all optional: by default it pulls nothing and tells no one)."""

    #: Called with each request that finished here, as the engine served it, and its output's token ids: the
    #: eviction selector's feed under ``--eviction-policy adaptive``.
    on_served: Callable[[Request, Sequence[int]], None] | None = None
    #: How a request's prefix is pulled from its holder when routing says so (None: never).
    pulls: KvPulls | None = None
    #: As the serving node of an approximate request: which of its segments to pull from whom
    #: (``Router.segment_pulls``), and told how each pull went (holder, bytes, seconds, ok: the holder's link
    #: figure). None: this node pulls no segments.
    segment_pulls: Callable[[SegmentSpans], SegmentPullPlan] | None = None
    segment_pull_done: Callable[[str, int, float, bool], None] | None = None
    #: As the serving node of an approximate request: which of its segments a peer's store holds
    #: (``Router.segments_held_elsewhere``), told to the engine as evidence of reuse for its store's admission. None:
    #: every segment's evidence is this node's own (a store threshold of 1 needs none).
    segments_held_elsewhere: Callable[[SegmentSpans], frozenset[int]] | None = None


class LocalServer:
    """The node's engine, admitted through an in-flight limit (and the queue in front of it) and a draining switch."""

    def __init__(
        self,
        node_id: str,
        engine: Engine,
        index: PrefixIndex,
        max_in_flight: int,
        hooks: LocalHooks = LocalHooks(),
        queue: EngineQueue | None = None,
    ) -> None:
        """``queue``: where requests wait for one of the ``max_in_flight`` slots (default: none wait, a full engine
        refuses)."""
        self.node_id = node_id
        self.pulls = hooks.pulls
        self.on_served = hooks.on_served
        self.segment_pulls = hooks.segment_pulls
        self.segment_pull_done = hooks.segment_pull_done
        self.segments_held_elsewhere = hooks.segments_held_elsewhere
        self.engine = engine
        self.index = index
        self.in_flight = ActivityTracker()
        self.queue = queue if queue is not None else EngineQueue(node_id, max_in_flight, FlowConfig(max_queue_length=0))
        self.prefill_backlog_tokens = 0
        self.urgent_waiting = 0
        self.urgent_backlog_tokens = 0
        self.draining = False
        self.counters = LocalCounters()
        self.segment_counters = SegmentCounters()
        self.adapter_requests: dict[str, int] = {}  # requests served here by LoRA adapter
        self._jobs: set[_Job] = set()  # the requests whose engine stream is open
        self._layouts: SegmentLayouts | None = None  # exact-mode segments (made once the engine knows its BOS)

    def layouts(self) -> SegmentLayouts:
        if self._layouts is None:
            self._layouts = SegmentLayouts(self.index, self.engine.info.bos_token_id)
        return self._layouts

    async def pull_segments(self, segments: SegmentSpans, tokens: Sequence[int]) -> list[tuple[str, PullResult, float]]:
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
        """Raise TargetFailed when this node cannot take the request (a full engine is the queue's to decide)."""
        if self.draining:
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, "node is draining", retryable=True)
        self.check_startable(engine_request_id)

    def check_startable(self, engine_request_id: str) -> None:
        """Raise TargetFailed when the engine cannot start the request now (checked again after it waited: a request
        admitted before the node began draining still runs)."""
        status = self.engine.status()
        if not status.healthy:
            down = f"engine stalled: no step for {status.stalled_s:.0f} s" if status.stalled_s else "engine is down"
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, down, retryable=True)
        if engine_request_id in self.in_flight:
            raise TargetFailed(
                self.node_id,
                ServeCode.ALREADY_EXISTS,
                f"request_id {engine_request_id!r} is already running here",
                retryable=False,
            )

    async def fail_stalled(self, stalled_s: float) -> int:
        """The engine stalled (``engine/stall.py``): end every request on it UNAVAILABLE, retryable (an ingress moves
        it elsewhere, a stream already begun included), by aborting it there -- an aborted request's stream ends at
        once whatever the engine's core does (vLLM's front end ends it). How many were ended."""
        jobs = [job for job in self._jobs if not job.finished]
        for job in jobs:
            job.stalled_s = stalled_s
        aborts = (self.engine.abort(job.request.engine_request_id) for job in jobs)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*aborts, return_exceptions=True), ABORT_WAIT_S)
        return len(jobs)

    async def stream(self, request: Request) -> AsyncIterator[node_pb2.GenerateResponse]:
        """Serve ``request`` on the engine: chunks, then one message with ``final`` (served_by and engine accounting).
        Its ``kv_source``: the prefix to pull from its holder first (``pulls.py``); whatever does not arrive is
        computed. Its segments: exact mode serves the prompt laid out for reuse (``serving/segments.py``),
        approximate mode lets the engine load them (a request with segments pulls nothing)."""
        self.check_admission(request.engine_request_id)
        await self.queue.enter(request)  # raises when refused or shed; a cancellation meanwhile takes it out
        entered = time.monotonic()
        try:
            self.check_startable(request.engine_request_id)  # again: the engine may have died while it waited
            job = _Job(self, *self._as_served(request))
        except BaseException:
            self.queue.leave(None, request.tenant)
            raise
        self.in_flight.begin(request.engine_request_id)
        self._jobs.add(job)
        job.hold_backlog()
        try:
            source = await job.lease()
            segment_pulls = await job.pull_segments()  # inside: a client gone meanwhile ends it as any other
            # (one ``fail_stalled`` ended while it leased never enters: its abort came before it)
            generation = self.engine.generate(job.served, source) if not job.stalled_s else _nothing()
            async with contextlib.aclosing(generation) as chunks:
                async for chunk in chunks:
                    if job.stalled_s:  # aborted by ``fail_stalled``: what the abort ended it with is not output
                        break
                    job.saw(chunk)
                    if chunk.finish_reason is not None:
                        yield chunk_message(chunk, job.finish(chunk, segment_pulls))
                        return
                    if chunk.token_ids or chunk.text or chunk.prompt_logprobs:
                        yield chunk_message(chunk)
            self.counters.failed += 1
            if job.stalled_s:
                raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE,
                                   f"engine stalled: no step for {job.stalled_s:.0f} s", retryable=True)
            raise TargetFailed(
                self.node_id, ServeCode.INTERNAL, "engine ended the stream without finishing", retryable=True
            )
        except EngineDeadError as e:
            self.counters.failed += 1
            log.error("request %s failed: %s", request.engine_request_id, e)
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, f"engine unavailable: {e}",
                               retryable=True) from e
        except EngineRequestFailed as e:  # the engine failed this request (not itself): another node may serve it
            self.counters.failed += 1
            log.error("request %s failed: %s", request.engine_request_id, e)
            raise TargetFailed(self.node_id, ServeCode.INTERNAL, str(e), retryable=True) from e
        except AdapterNotServed as e:  # its adapter was unloaded here after admission: a peer may serve it
            self.counters.failed += 1
            raise TargetFailed(self.node_id, ServeCode.UNAVAILABLE, f"model: {e}", retryable=True) from e
        except EngineRejected as e:
            # The engine's own limits: every node serves the same model, so another node would refuse it too.
            self.counters.failed += 1
            raise TargetFailed(self.node_id, ServeCode.INVALID_ARGUMENT, f"{e.request_path}: {e.message}",
                               retryable=False) from e
        except (asyncio.CancelledError, GeneratorExit):
            if not job.finished:
                self.counters.cancelled += 1
            raise
        finally:
            self._jobs.discard(job)
            job.release_backlog()
            self.in_flight.end(request.engine_request_id)
            self.queue.leave(time.monotonic() - entered, request.tenant)
            if not job.finished:
                # Closing the engine stream already aborts in vLLM; this covers engines that need telling.
                with contextlib.suppress(Exception):
                    await self.engine.abort(request.engine_request_id)

    def _as_served(self, request: Request) -> tuple[Request, Request, Layout | None]:
        """The request as admitted, as the engine serves it, and its exact-mode layout: an exact-mode prompt laid out
        against this node's index (the engine then sees plain tokens); no pull for a request with segments or outside
        the default namespace (a holder exports default-namespace prefixes only: docs/lora.md)."""
        served, layout = request, None
        if request.kv_source is not None and (request.segments is not None or not request.namespace.is_default):
            served = request.with_kv_source(None)
        if request.segments is not None and request.segments.mode is SegmentReuse.EXACT:
            layout = self.layouts().layout(request.tokens, request.segments, request.namespace)
            served = served.with_tokens(layout.token_ids, segments=None)
        return request, served, layout

    def served(self, job: _Job, final: node_pb2.GenerateFinal, completion_tokens: int) -> None:
        """Account for a request that finished here."""
        self.counters.served += 1
        adapter = job.request.namespace.adapter
        if adapter:
            self.adapter_requests[adapter] = self.adapter_requests.get(adapter, 0) + 1
        self.counters.uncached_tokens += max(0, final.prompt_tokens - final.cached_tokens)
        self.counters.completion_tokens += completion_tokens
        if job.request.segments is not None:
            self.segment_counters.record(job.request.segments, final.cached_tokens, job.segment_outcome)
        if self.on_served is not None and job.output is not None:
            self.on_served(job.served, job.output)


async def _nothing() -> AsyncIterator[GenerationChunk]:
    """No chunk: the stream of a request that never entered the engine."""
    return
    yield  # makes this an async generator


class _Job:
    """One request on this node's engine: what it has produced so far, and what its pull did (``LocalServer.stream``).

    ``backlog``: its uncached prompt tokens by the index until its first token (queued prefill others wait behind),
    counted in the server's backlog (and its urgent backlog when ``urgent``) while ``waiting``.
    """

    def __init__(self, server: LocalServer, request: Request, served: Request, layout: Layout | None) -> None:
        self.server, self.request, self.served, self.layout = server, request, served, layout
        self.index_match = server.index.match(served.tokens, served.namespace)
        self.backlog = len(served.tokens) - self.index_match
        self.urgent = request.sampling.priority < 0
        self.waiting = False
        self.finished = False
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.output: list[int] | None = [] if server.on_served is not None else None
        self.pulled: PullResult | None = None
        self.source: PullSource | None = None
        self.export_s = 0.0
        self.segment_outcome: SegmentOutcome | None = None
        #: Set when its engine stalled (``LocalServer.fail_stalled``): the seconds it had gone without a step.
        self.stalled_s = 0.0

    def hold_backlog(self) -> None:
        """Count this request's prefill in the server's backlog until its first token."""
        server = self.server
        server.prefill_backlog_tokens += self.backlog
        if self.urgent:
            server.urgent_waiting += 1
            server.urgent_backlog_tokens += self.backlog
        self.waiting = True

    def release_backlog(self) -> None:
        """Its first token came (or it ended): no longer queued work there; once only."""
        if not self.waiting:
            return
        server = self.server
        server.prefill_backlog_tokens -= self.backlog
        if self.urgent:
            server.urgent_waiting -= 1
            server.urgent_backlog_tokens -= self.backlog
        self.waiting = False
        self.backlog = 0

    async def lease(self) -> PullSource | None:
        """Ask the holder for the prefix routing said to pull (the ask's time is the pull's too)."""
        hint, pulls = self.served.kv_source, self.server.pulls
        if hint is None or pulls is None:
            return None
        started = time.monotonic()
        got = await pulls.lease(hint, self.served.tokens)
        self.export_s = time.monotonic() - started
        if isinstance(got, PullSource):
            self.source = got
        else:
            self.pulled = got
        return self.source

    async def pull_segments(self) -> list[tuple[str, PullResult, float]]:
        segments = self.served.approximate_segments
        if segments is None:
            return []
        elsewhere = self.server.segments_held_elsewhere
        if elsewhere is not None:
            held = tuple(sorted(elsewhere(segments)))
            self.served = dataclasses.replace(self.served, segments=dataclasses.replace(segments, held_elsewhere=held))
        return await self.server.pull_segments(segments, self.served.tokens)

    def saw(self, chunk: GenerationChunk) -> None:
        self.completion_tokens += len(chunk.token_ids)
        if self.output is not None:
            self.output.extend(chunk.token_ids)
        if self.first_token_at is None and (chunk.token_ids or chunk.text):
            self.first_token_at = time.monotonic()
            self.release_backlog()

    def finish(
        self, chunk: GenerationChunk, segment_pulls: list[tuple[str, PullResult, float]]
    ) -> node_pb2.GenerateFinal:
        """The final message of the last chunk, with the request accounted for."""
        now = time.monotonic()
        arrived = self.request.arrived
        self.segment_outcome = chunk.segments
        final = node_pb2.GenerateFinal(
            request_id=self.request.request_id,
            finish_reason=FINISH_TO_PROTO[chunk.finish_reason],  # type: ignore[index]
            prompt_tokens=len(self.served.tokens),
            completion_tokens=self.completion_tokens,
            cached_tokens=chunk.cached_tokens,
            served_by=self.server.node_id,
            index_match_tokens=self.index_match,
            stop_reason=chunk.stop_reason,
            timings=node_pb2.Timings(
                queue_s=chunk.queue_s or 0.0, ttft_s=(self.first_token_at or now) - arrived, total_s=now - arrived
            ),
        )
        self._account_pull(chunk, final)
        final.tier_hits.CopyFrom(self._tier_hits(chunk, final))
        final.segment_pulls.extend(pull_message(h, r, s) for h, r, s in segment_pulls)
        if self.request.segments is not None:
            final.segments.CopyFrom(use_message(self.request.segments, self.layout, chunk.segments))
        self.finished = True
        self.server.served(self, final, self.completion_tokens)
        return final

    def _tier_hits(self, chunk: GenerationChunk, final: node_pb2.GenerateFinal) -> node_pb2.TierHits:
        """Where the cached tokens came from: a peer (the pull's tokens that arrived), the engine's host tier and the
        disk tier below it (what its connector loaded), and the engine's own cache (the rest, approximate segments it
        loaded included)."""
        pulled = self.pulled.tokens if self.source is not None and self.pulled is not None else 0
        host = min(chunk.host_tier_tokens, final.cached_tokens)
        disk = min(chunk.disk_tier_tokens, final.cached_tokens - host)
        if host:
            self.server.counters.host_tier_requests += 1
            self.server.counters.host_tier_tokens += host
        gpu = max(0, final.cached_tokens - host - disk - pulled)
        return node_pb2.TierHits(gpu=gpu, host=host, disk=disk, pulled=pulled)

    def _account_pull(self, chunk: GenerationChunk, final: node_pb2.GenerateFinal) -> None:
        """What the pull routing asked for did: counted, and in the final message."""
        hint, pulls = self.served.kv_source, self.server.pulls
        if hint is None or pulls is None:
            return
        if self.source is not None:
            self.pulled = chunk.pull or PullResult("failed: the engine reported no pull")
            # vLLM counted every token it asked the pull for as cached at admission; the ones that did not arrive
            # were computed: the final message counts what was not
            final.cached_tokens = max(0, chunk.cached_tokens - max(0, self.pulled.asked - self.pulled.tokens))
        assert self.pulled is not None
        seconds = self.export_s + self.pulled.seconds  # asking the holder, then the transfer
        if self.source is not None:
            pulls.transfer_ended(hint.holder, self.pulled, seconds)
        else:
            pulls.record(self.pulled, seconds)
        final.pull.CopyFrom(pull_message(hint.holder, self.pulled, seconds))
