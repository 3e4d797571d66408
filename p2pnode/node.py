"""A p2pnode node: wires the engine, the local prefix index and the gRPC servers, and owns their lifecycle.

Lifecycle: ``start()`` starts the engine (its KV events feed the index from the first request on), then the
gRPC server (Node service, standard health service, reflection). ``drain()`` — on SIGTERM/SIGINT — refuses new
calls with UNAVAILABLE, lets in-flight calls finish (up to ``drain_timeout_s``), then stops the server and the
engine. A dead engine flips health to NOT_SERVING so load balancers and peers stop sending here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from p2pnode.api.local_serving import LocalServer
from p2pnode.api.node_service import NodeService
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.config import NodeConfig
from p2pnode.engine.base import Engine
from p2pnode.engine.events import CacheEvent
from p2pnode.routing.router import Router
from p2pnode.routing.speculative import SpeculativeIndex
from p2pnode.v1 import node_pb2, node_pb2_grpc

log = logging.getLogger("p2pnode.node")

#: How often the node checks its engine's health (seconds).
HEALTH_CHECK_INTERVAL_S = 1.0
SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


class Node:
    """One mesh member: engine + index + servers."""

    def __init__(self, config: NodeConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.index = PrefixIndex(block_size=config.engine.block_size)
        self.server: grpc.aio.Server | None = None
        self.service: NodeService | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    def _on_cache_events(self, events: list[CacheEvent]) -> None:
        for event in events:
            self.index.apply(event)

    @property
    def address(self) -> str:
        host = self.config.server.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        await self.engine.start(self._on_cache_events)
        server_cfg = self.config.server
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", server_cfg.max_receive_message_bytes),
                ("grpc.max_send_message_length", server_cfg.max_send_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        self.port = self.server.add_insecure_port(server_cfg.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {server_cfg.listen}")
        self.local = LocalServer(self.config.node_id, self.engine, self.index, server_cfg.max_in_flight)
        routing = self.config.routing
        self.router = Router(
            self.config.node_id,
            self.address,
            self.index,
            self.engine.load,
            directory=None,
            policy=routing.policy,
            routing_key_blocks=routing.routing_key_blocks,
            speculative=SpeculativeIndex(ttl_s=routing.speculative_ttl_s),
        )
        self.service = NodeService(self.config, self.local, self.router, None, self.address)
        node_pb2_grpc.add_NodeServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        await self.server.start()
        await self._set_health(serving=True)
        self._health_task = asyncio.create_task(self._watch_engine(), name="engine-health")
        log.info("node %s serving %s on %s", self.config.node_id, self.engine.info.name, self.address)

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch_engine(self) -> None:
        healthy = True
        while True:
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
            now = self.engine.load().healthy
            if now != healthy:
                healthy = now
                log.error("engine is %s", "healthy again" if now else "dead: reporting NOT_SERVING")
                await self._set_health(serving=now and not self._draining)

    @property
    def _draining(self) -> bool:
        return self.service is not None and self.service.draining

    async def drain(self) -> None:
        """Refuse new calls, let in-flight ones finish, then stop everything. Idempotent."""
        if self.service is None or self._draining:
            await self._stopped.wait()
            return
        self.local.draining = True
        await self._set_health(serving=False)
        timeout = self.config.server.drain_timeout_s
        in_flight = len(self.local.in_flight) + len(self.service.relays)
        log.info("draining: %d call(s) in flight, waiting up to %.0fs", in_flight, timeout)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle(), timeout)
        await self.stop()

    async def _idle(self) -> None:
        assert self.service is not None
        while self.local.in_flight.active or self.service.relays.active:
            await self.local.in_flight.idle.wait()
            await self.service.relays.idle.wait()

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        await self.engine.shutdown()
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Start, then run until SIGTERM/SIGINT, then drain."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        await self.start()
        print(f"p2pnode {self.config.node_id} ready on {self.address}", flush=True)
        await stop_requested.wait()
        log.info("signal received: draining")
        await self.drain()
        log.info("node %s stopped", self.config.node_id)
