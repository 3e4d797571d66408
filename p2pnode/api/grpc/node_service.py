"""The client-facing gRPC servicer: ``Generate`` (a thin adapter over the node's one ingress path,
p2pnode/serving/ingress.py) and ``GetStatus``.

``Generate`` writes with ``context.write()`` rather than being an async generator: a cancellation (client gone,
deadline passed) then always lands in this coroutine — at a write or while waiting for output inside the ingress
stream — so the stream is closed and the engine request aborted right away, wherever it runs, instead of whenever
an abandoned generator happens to be garbage-collected. The ingress's ``ServeError`` becomes the call's status.

Both methods take the request as raw bytes and parse it here (``register``), so that bytes that are not a request
are answered INVALID_ARGUMENT, counted as rejected and logged a few lines a minute, instead of failing inside
gRPC's deserializer with UNKNOWN and a traceback per call. Any other unexpected error is INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from p2pnode.api.auth import ApiKeys
from p2pnode.log_limit import LogLimiter
from p2pnode.serving.errors import ServeError
from p2pnode.serving.forward import CallGone, status_of, write_or_gone
from p2pnode.serving.ingress import Ingress, RequestCounters
from p2pnode.serving.local import ActivityTracker
from p2pnode.serving.retry_after import trailing_metadata
from p2pnode.serving.tenants import Caller
from p2pnode.v1 import node_pb2, node_pb2_grpc

log = logging.getLogger("p2pnode.api")

SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


class NodeService(node_pb2_grpc.NodeServicer):
    """Generate through the ingress, and the node's status."""

    def __init__(
        self,
        ingress: Ingress,
        address: str,
        peer_status: Callable[[node_pb2.NodeStatus], None] | None = None,
        keys: ApiKeys | None = None,
    ) -> None:
        """``peer_status``: fills the mesh part of the status (members, gossip counters), when gossip runs; ``keys``:
        the API keys, whose match names a call's tenant (None: no key names one)."""
        self.ingress = ingress
        self.keys = keys if keys is not None else ApiKeys()
        self.config = ingress.config
        self.local = ingress.local
        self.engine = ingress.engine
        self.index = ingress.local.index
        self.router = ingress.router
        self.address = address
        self.started_at = time.monotonic()
        #: The HTTP API's address, reported in the status ("" when off); set by the node.
        self.http_address = ""
        self.peer_status = peer_status
        self._log = LogLimiter(log)

    # --- raw-bytes registration -----------------------------------------------------------------------------

    def register(self, server: grpc.aio.Server) -> None:
        """Serve ``p2pnode.v1.Node`` on ``server``, parsing requests here (see the module docstring)."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate_bytes, response_serializer=node_pb2.GenerateResponse.SerializeToString
            ),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                self._get_status_bytes, response_serializer=node_pb2.NodeStatus.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def _parse(self, message_type: type, data: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError, TypeError, RecursionError):
            name = message_type.DESCRIPTOR.full_name
            if message_type is node_pb2.GenerateRequest:
                self.counters.count("grpc", "rejected")
                self.counters.rejected_by[("grpc", "INVALID_ARGUMENT")] += 1
            self._log.warning(
                f"undecodable:{name}", "refused %d bytes from %s: not a %s", len(data), context.peer(), name
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a {name} (undecodable protobuf)")

    async def _generate_bytes(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        request = await self._parse(node_pb2.GenerateRequest, data, context)
        try:
            await self.Generate(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # a bug before the ingress took the call (it turns its own into INTERNAL)
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")

    async def _get_status_bytes(self, data: bytes, context: grpc.aio.ServicerContext) -> node_pb2.NodeStatus:
        await self._parse(node_pb2.GetStatusRequest, data, context)
        try:
            return self.status()
        except Exception as e:  # a bug: INTERNAL, never UNKNOWN
            log.exception("GetStatus failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")

    @property
    def draining(self) -> bool:
        return self.ingress.draining

    @property
    def relays(self) -> ActivityTracker:
        return self.ingress.relays

    @property
    def counters(self) -> RequestCounters:
        return self.ingress.counters

    # --- Generate -----------------------------------------------------------------------------------------

    async def Generate(self, request: node_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            caller = self._caller(context)
            call = await self.ingress.admit([request], "grpc", deadline=deadline, caller=caller)
        except ServeError as e:
            await _abort(context, e)
        try:
            async with contextlib.aclosing(self.ingress.run(call)) as messages:
                async for message in messages:
                    await write_or_gone(context, message)
        except ServeError as e:
            await _abort(context, e)
        except CallGone:
            pass  # the call is over (the ingress counted it cancelled): nothing is left to send

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """Who the call is for (its key's tenant, else the tenant header's) and its requests' default priority
        (``serving/tenants.py``)."""
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        try:
            return self.ingress.tenants.caller(self.keys.tenant_of(metadata.get("authorization")), metadata.get)
        except ServeError as e:
            self.ingress.reject("grpc", "", e)
            raise

    # --- GetStatus ----------------------------------------------------------------------------------------

    def status(self) -> node_pb2.NodeStatus:
        engine = self.engine.status()
        status = node_pb2.NodeStatus(
            node_id=self.config.node_id,
            address=self.address,
            model=self.engine.info.name,
            block_size=self.engine.info.block_size,
            max_model_len=self.engine.info.max_model_len,
            draining=self.draining,
            load=node_pb2.EngineLoad(
                running=engine.load.running,
                waiting=engine.load.waiting,
                kv_usage=engine.load.kv_usage,
                in_flight=len(self.local.in_flight),
                queued=len(self.local.queue),
                engine_unfinished=engine.unfinished,
                healthy=engine.healthy,
                stalled_s=engine.stalled_s,
            ),
            index=self._index_status(),
            requests_total=self.counters.total,
            requests_failed=self.counters.failed,
            requests_rejected=self.counters.rejected,
            requests_cancelled=self.counters.cancelled,
            requests_succeeded=self.counters.succeeded,
            http_address=self.http_address,
            uptime_s=time.monotonic() - self.started_at,
            routing=self._routing_status(),
        )
        if self.peer_status is not None:
            self.peer_status(status)
        kv = self._kv_status()
        if kv is not None:
            status.kv.CopyFrom(kv)
        adapters = self.engine.adapters()
        status.adapters.extend(sorted(adapters.served))
        status.resident_adapters.extend(sorted(adapters.resident))
        status.adapter_requests.update(self.local.adapter_requests)
        status.segments.CopyFrom(self._segment_status())
        kv_events = self._kv_event_status()
        if kv_events is not None:
            status.kv_events.CopyFrom(kv_events)
        return status

    def _index_status(self) -> node_pb2.IndexStatus:
        stats = self.index.stats()
        return node_pb2.IndexStatus(
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
        )

    def _kv_status(self) -> node_pb2.KvStatus | None:
        """KV moved between nodes (None when this node pulls none: the status keeps its empty default)."""
        pulls = self.local.pulls
        if pulls is None:
            return None
        c = pulls.counters
        links = self.router.links
        return node_pb2.KvStatus(
            layout=self.engine.info.kv_layout,
            block_server=self.engine.info.kv_address,
            link_gbps=links.default * 8 / 1e9 if links is not None else 0.0,
            pulls=dict(c.pulls),
            pulled_tokens=c.pulled_tokens,
            pulled_bytes=c.pulled_bytes,
            exports=dict(c.exports),
        )

    def _segment_status(self) -> node_pb2.SegmentStatus:
        held = self.engine.segment_holdings()
        sc = self.local.segment_counters
        return node_pb2.SegmentStatus(
            store_bytes=self.engine.segment_store_bytes(),
            held_segments=len(held),
            held_tokens=sum(held.values()),
            requests=dict(sc.requests),
            reused_tokens=dict(sc.reused_tokens),
            loaded_segments=sc.loaded_segments,
            phases=sc.phases,
        )

    def _kv_event_status(self) -> node_pb2.KvEventStatus | None:
        """The engine's KV-event stream (None when the engine has none: the status keeps its empty default)."""
        kv = self.engine.kv_event_stats()
        if kv is None:
            return None
        return node_pb2.KvEventStatus(
            batches=kv.batches,
            events=kv.events,
            decode_errors=kv.decode_errors,
            gaps=kv.gaps,
            replayed_batches=kv.replayed_batches,
            unrecovered_gaps=kv.unrecovered_gaps,
            resets=kv.resets,
            last_seq=kv.last_seq,
        )

    def _routing_status(self) -> node_pb2.RoutingStatus:
        c = self.router.counters
        return node_pb2.RoutingStatus(
            policy=self.router.policy_name,
            decisions=c.decisions,
            served_locally=c.local,
            forwarded=c.forwarded,
            retries=c.retries,
            migrations=c.migrations,
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


async def _abort(context: grpc.aio.ServicerContext, error: ServeError) -> None:
    """End the call with the error's status; a throttled one (RESOURCE_EXHAUSTED: its message says "rate limit"
    or "overloaded") carries its ``retry-after`` (whole seconds) in the trailing metadata."""
    await context.abort(status_of(error.code), error.message, trailing_metadata(error.retry_after_s))
