"""The client-facing gRPC servicer: ``Generate`` (route, then serve here or relay from a peer) and ``GetStatus``.

Invariants a client can rely on:
- every call ends with exactly one of: a message carrying ``final``, or a gRPC error status whose message names
  the cause (and the field, for INVALID_ARGUMENT);
- output is never duplicated: another node is tried only while nothing has been streamed; after that a failure
  is UNAVAILABLE and says how much partial output was sent;
- a cancelled call (client gone, deadline passed) aborts the engine request wherever it runs;
- while the node drains, new calls get UNAVAILABLE and running calls finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from p2pnode.api import validation
from p2pnode.api.forwarding import ForwardClient
from p2pnode.api.local_serving import ActivityTracker, CallGone, LocalServer, TargetFailed, write_or_gone
from p2pnode.config import NodeConfig
from p2pnode.engine.base import SamplingOptions
from p2pnode.routing.policies.types import NoAliveCandidate
from p2pnode.routing.router import Route, Router
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc

log = logging.getLogger("p2pnode.api")

#: Text prompts longer than this are tokenized on a worker thread so the event loop keeps serving.
_TOKENIZE_OFF_LOOP_CHARS = 8192


@dataclass(frozen=True, slots=True)
class Admitted:
    """A validated, tokenized request the ingress is routing."""

    request_id: str
    routing_key: str
    tokens: list[int]
    options: SamplingOptions
    arrived: float


@dataclass
class RequestCounters:
    total: int = 0
    failed: int = 0
    rejected: int = 0
    cancelled: int = 0


class NodeService(node_pb2_grpc.NodeServicer):
    """Routes each Generate call, serves it here or relays it from a peer, and reports the node's status."""

    def __init__(
        self,
        config: NodeConfig,
        local: LocalServer,
        router: Router,
        forwarder: ForwardClient | None,
        address: str,
    ) -> None:
        self.config = config
        self.local = local
        self.engine = local.engine
        self.index = local.index
        self.router = router
        self.forwarder = forwarder
        self.address = address
        self.counters = RequestCounters()
        self.relays = ActivityTracker()
        self.started_at = time.monotonic()
        self._ids = itertools.count(1)
        self._id_prefix = f"{config.node_id}-{os.getpid()}-"
        #: Fills the mesh part of the status (members, gossip counters); set by the node when gossip runs.
        self.peer_status: Callable[[node_pb2.NodeStatus], None] | None = None

    @property
    def draining(self) -> bool:
        return self.local.draining

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

    async def Generate(self, request: node_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Written with context.write() rather than as an async generator: a cancellation then always lands in
        # this coroutine (at a write or while waiting for output), so the request is aborted right away instead
        # of whenever an abandoned generator happens to be garbage-collected.
        arrived = time.monotonic()
        self.counters.total += 1
        server = self.config.server
        info = self.engine.info
        if self.draining:
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
        if len(self.relays) >= server.max_in_flight:
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node {self.config.node_id} has {server.max_in_flight} calls in flight (max_in_flight)",
            )
        request_id = request.request_id or f"{self._id_prefix}{next(self._ids)}"
        if request_id in self.relays:
            await self._reject(
                context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running here"
            )
        try:
            route = self.router.route(tokens, request.routing_key, options.max_tokens, request_id)
        except NoAliveCandidate as e:
            self.counters.failed += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no node can serve: {e} (this node's engine is down)")
        self.relays.begin(request_id)
        try:
            admitted = Admitted(request_id, request.routing_key, tokens, options, arrived)
            await self._relay(context, route, admitted)
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            raise
        except CallGone:
            self.counters.cancelled += 1  # the call is over: nothing is left to send
        finally:
            self.relays.end(request_id)

    def _source(
        self, target: str, route: Route, req: Admitted, timeout: float | None
    ) -> AsyncIterator[node_pb2.GenerateResponse]:
        if target == self.config.node_id or self.forwarder is None:
            return self.local.stream(req.request_id, req.tokens, req.options, req.arrived, req.request_id)
        forward = forward_pb2.ForwardRequest(
            request_id=req.request_id,
            prompt_token_ids=req.tokens,
            sampling=validation.to_proto(req.options),
            origin=self.config.node_id,
            hop=1,
            routing_key=req.routing_key,
        )
        return self.forwarder.stream(target, route.addresses[target], forward, timeout)

    async def _relay(self, context: grpc.aio.ServicerContext, route: Route, req: Admitted) -> None:
        """Stream from the ranked candidates in turn until one finishes; retry only before any output."""
        decision = route.decision
        candidates = decision.ranked[: self.config.routing.max_attempts]
        failures: list[TargetFailed] = []
        streamed_tokens = 0
        streamed_messages = 0
        for attempt, target in enumerate(candidates, start=1):
            if attempt > 1:
                self.router.counters.retries += 1
            ticket = self.router.begin(route, target)
            try:
                source = self._source(target, route, req, context.time_remaining())
                async with contextlib.aclosing(source) as messages:
                    async for message in messages:
                        if message.HasField("final"):
                            final = message.final
                            final.ingress = self.config.node_id
                            final.policy = decision.policy
                            final.estimated_match_tokens = route.estimated_tokens(final.served_by or target)
                            final.attempts = attempt
                            final.timings.total_s = time.monotonic() - req.arrived
                            self.router.record_outcome(route, final.served_by or target, final.cached_tokens)
                        await write_or_gone(context, message)
                        streamed_messages += 1
                        streamed_tokens += len(message.token_ids)
                        if message.HasField("final"):
                            return
                raise TargetFailed(target, grpc.StatusCode.INTERNAL, "stream ended without a final message",
                                   retryable=True)
            except TargetFailed as e:
                log.warning("request %s: %s failed (%s): %s", req.request_id, target, e.code.name, e.message)
                if streamed_messages:
                    self.counters.failed += 1
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"node {target} failed after streaming {streamed_tokens} tokens ({e.code.name}: "
                        f"{e.message}); the partial output ({streamed_tokens} tokens) is all this call returns — "
                        "retrying elsewhere would duplicate it",
                    )
                if not e.retryable:
                    self.counters.failed += 1
                    await context.abort(e.code, e.message)
                failures.append(e)
            finally:
                self.router.end(target, ticket)
        self.counters.failed += 1
        summary = "; ".join(f"{f.node_id}: {f.code.name} {f.message}" for f in failures)
        if failures and all(f.code == grpc.StatusCode.RESOURCE_EXHAUSTED for f in failures):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"mesh overloaded: every candidate is full ({summary})"
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no node could serve the request ({summary})")

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
            draining=self.draining,
            load=node_pb2.EngineLoad(
                running=load.running,
                waiting=load.waiting,
                kv_usage=load.kv_usage,
                in_flight=len(self.local.in_flight),
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
            routing=self._routing_status(),
        )
        if self.peer_status is not None:
            self.peer_status(status)
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

    def _routing_status(self) -> node_pb2.RoutingStatus:
        c = self.router.counters
        return node_pb2.RoutingStatus(
            policy=self.router.policy_name,
            decisions=c.decisions,
            served_locally=c.local,
            forwarded=c.forwarded,
            retries=c.retries,
            served=c.served,
            estimated_cached_tokens=c.estimated_tokens,
            engine_cached_tokens=c.actual_cached_tokens,
            estimate_abs_error_tokens=c.estimate_abs_error_tokens,
            relays_in_flight=len(self.relays),
        )

    async def GetStatus(
        self, request: node_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeStatus:
        return self.status()
