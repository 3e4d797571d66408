"""A p2pnode node: wires the engine, the local prefix index, the gossip agent, the router and the gRPC server, and
owns their lifecycle.

One gRPC server carries everything: the client API (Node), the peer API (Peer/Gossip, Forwarder/Forward), the
standard health service and reflection. With mTLS configured it requires client certificates for all of them.
Beside it, in the same event loop, the OpenAI-compatible HTTP API (p2pnode/api/http/server.py: /v1/*, /metrics,
/health, /ready); both client APIs go through one ingress path (p2pnode/serving/ingress.py) and, with API keys
configured, require one.

Lifecycle: ``start()`` starts the engine (its KV events feed the index from the first request on), the server, then
gossip (joining through the seeds). ``drain()`` — on SIGTERM/SIGINT — refuses new calls with UNAVAILABLE (HTTP
503, /ready 503), lets in-flight calls of both APIs finish (up to ``drain_timeout_s``), tells the mesh it is
leaving, then stops the servers and the engine. A dead engine flips health to NOT_SERVING and withdraws the node
from peers' routing (gossip shows it as left; it still routes its own clients' requests to them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from p2pnode.api.auth import ApiKeyInterceptor, ApiKeys
from p2pnode.api.grpc.node_service import NodeService
from p2pnode.api.grpc.reflection import enable_reflection
from p2pnode.api.listen import BadAddress, bind_tcp, check_bindable
from p2pnode.api.metrics import MeshMetrics
from p2pnode.api.stats_log import StatsLogger
from p2pnode.cache.events import CacheEvent
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import SegmentSpans
from p2pnode.cache.tier_index import TierIndexes
from p2pnode.config import HEALTH_CHECK_INTERVAL_S, NodeConfig, derived_http_listen
from p2pnode.cost import get_profile
from p2pnode.engine.base import Engine
from p2pnode.engine.eviction_control import EvictionControl
from p2pnode.flow.rate_limit import TenantRateLimits
from p2pnode.gossip.agent import GossipAgent
from p2pnode.gossip.grpc_transport import PEER_SERVICE, GrpcTransport, add_peer_service, server_credentials
from p2pnode.gossip.membership import MemberState, Transition
from p2pnode.load import NodeLoad
from p2pnode.node_info import NodeInfo, engine_version, package_version
from p2pnode.peering import Peering, peer
from p2pnode.plan.gate import ShadowGate
from p2pnode.plan.plan import Plan
from p2pnode.plan.planner import PlanConfig
from p2pnode.plan.sync import PlanSync
from p2pnode.plan.work import ServedWork, decode_token_cost
from p2pnode.request import Request, SamplingOptions
from p2pnode.routing.router import Route, Router
from p2pnode.routing.segments import by_holder
from p2pnode.serving.engine_queue import URGENT_PRIORITY, EngineQueue
from p2pnode.serving.errors import ServeCode, ServeError
from p2pnode.serving.forward import (
    FORWARDER_SERVICE,
    ForwardClient,
    ForwarderService,
    PeerChannels,
    peer_server_keepalive_options,
)
from p2pnode.serving.ingress import Ingress, IngressContext, RequestCounters
from p2pnode.serving.local import LocalHooks, LocalServer
from p2pnode.serving.pulls import KvPulls
from p2pnode.serving.tenant_served import SERVED_KEY, TenantServed
from p2pnode.serving.tenant_usage import USAGE_KEY, TenantUsage
from p2pnode.serving.tenants import TenantLabels, Tenants
from p2pnode.v1 import node_pb2

log = logging.getLogger("p2pnode.node")

#: How often a draining node looks again at requests handed a slot but not yet started (seconds).
DRAIN_POLL_S = 0.01

SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


class Node:
    """One mesh member: engine + index + gossip + router + servers."""

    def __init__(self, config: NodeConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.index = PrefixIndex(block_size=config.engine.block_size)
        #: The engine's index (``index``) and one per KV tier below the engine (``cache/tier_index.py``).
        self.tiers = TierIndexes.for_engine(
            self.index, host_tier=config.tier.enabled, disk_tier=bool(config.tier.disk_path)
        )
        self.server: grpc.aio.Server | None = None
        self.service: NodeService | None = None
        self.agent: GossipAgent | None = None
        #: What the node publishes through gossip and the view of its peers it routes with (``peering.py``).
        self.peering: Peering | None = None
        #: KV pulls and exports (``serving/pulls.py``), when this node moves KV (``--kv-link-gbps``).
        self.kv_pulls: KvPulls | None = None
        self.plan_sync: PlanSync | None = None
        self.forwarder_service: ForwarderService | None = None
        self.channels: PeerChannels | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._watch_task: asyncio.Task[None] | None = None
        #: The engine as the node last saw it: "up", "stalled" (no step with work: until it steps again) or "dead"
        #: (for good); and the one-token request that gives a stalled engine a step to take.
        self._engine_state = "up"
        self._probe_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        #: Set by a second SIGTERM/SIGINT: a drain stops waiting for the calls in flight (``serve_forever``).
        self._drain_cut = asyncio.Event()
        # --- client APIs beyond gRPC ---
        self.ingress: Ingress | None = None
        #: The ingress's calls by outcome: counted there, exported by the metrics.
        self.counters = RequestCounters()
        self.metrics: MeshMetrics | None = None
        #: Who calls are for: the API keys (tenants' included), weights, rate limits (``serving/tenants.py``), the
        #: limits' buckets, and what this node and its peers admitted for them (``serving/tenant_usage.py``).
        self.tenants = Tenants(config.flow)
        #: The client APIs' keys, tenants' included (``api/auth.py``).
        self.api_keys = ApiKeys(config.api.api_keys, self.tenants.key_pairs)
        self.limits = TenantRateLimits(self.tenants.rate_limit)
        self.tenant_usage = TenantUsage(self.limits, lambda tenant: self.tenants.rate_limit(tenant).limited)
        #: The work this node and its peers served per tenant, for the queue's mesh-wide fair shares (with gossip).
        self.tenant_served: TenantServed | None = None
        self.http: Any = None  # HttpFront, imported lazily (vLLM's protocol models take seconds to import)
        self._stats_task: asyncio.Task[None] | None = None
        # --- bound before the engine starts ---
        self._http_socket: socket.socket | None = None
        self._http_listen = ""
        #: The served counts the load last reported and since when (wall clock): start-up, then each change.
        self._served_seen: tuple[tuple[int, int, int], float] = ((0, 0, 0), time.time())
        # --- the engine's KV eviction policy ---
        self.eviction = EvictionControl(config.eviction, engine, config.engine.block_size)

    def _on_cache_events(self, events: list[CacheEvent]) -> None:
        for event in events:
            self.tiers.apply(event)
        if self.peering is not None:
            self.peering.notify()

    @property
    def address(self) -> str:
        """The address peers and clients dial: ``--advertise``, else the listen host with the bound port."""
        if self.config.advertise:
            return self.config.advertise
        host = self.config.server.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def _message_options(self) -> list[tuple[str, int]]:
        server_cfg = self.config.server
        return [
            ("grpc.max_receive_message_length", server_cfg.max_receive_message_bytes),
            ("grpc.max_send_message_length", server_cfg.max_send_message_bytes),
        ]

    @property
    def node_info(self) -> NodeInfo:
        """Versions and served names, as peers see them (``node_info.py``)."""
        return NodeInfo(package_version("p2pnode"), engine_version(), self.served_model_names)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The model names clients may ask for: --served-model-name, else the model directory's name."""
        return self.config.api.served_model_names or (Path(self.config.engine.model).name,)

    def _api_key_rejected(self, method: str) -> None:
        """A Generate call refused for its key counts as a rejected request (GetStatus calls are not requests)."""
        if self.ingress is not None and method.endswith("/Generate"):
            error = ServeError(ServeCode.UNAUTHENTICATED, f"{method}: no valid API key")
            self.ingress.reject("grpc", "", error)

    async def start(self) -> None:
        """Start the engine, build the serving parts around it (each from the parts it needs, in dependency order),
        then the servers and gossip."""
        self._bind()  # before the engine: an address that cannot be bound fails now, not after its start
        await self.engine.start(self._on_cache_events)
        await self.eviction.start()
        self._warn_unadvertised()
        forwarder = self._join_mesh()
        self.metrics = MeshMetrics(self._status, self.counters)
        if self.engine.info.kv_layout and forwarder is not None:  # this node lends its KV and pulls its peers'
            self.kv_pulls = KvPulls(
                self.config.node_id, self.engine, self.index, forwarder, self.config.kv,
                observer=self.metrics.observe_pull, tiers=self.tiers,
            )
        self.router = self._build_router()
        self.plan_sync = self._build_plan_sync()
        queue = self._engine_queue()
        self.local = LocalServer(
            self.config.node_id, self.engine, self.index, self.config.server.max_in_flight, self._local_hooks(),
            queue=queue,
        )
        if self.agent is not None:
            self._share_tenant_served(self.agent, queue)
        self.ingress = Ingress(self.config, self.local, self.router, forwarder, self._ingress_context())
        self._serve_peers(forwarder)
        self.service = NodeService(self.ingress, self.address, peer_status=self._peer_status, keys=self.api_keys)
        self._register_services()
        await self.server.start()  # type: ignore[union-attr]
        await self._start_client_apis()
        await self._set_health(serving=True)
        self._publish_load()
        if self.agent is not None:
            await self.agent.start()
        self._watch_task = asyncio.create_task(self._watch(), name="engine-health")
        log.info("node %s serving %s on %s%s", self.config.node_id, self.engine.info.name, self.address,
                 f" (HTTP {self.http.address})" if self.http is not None else "")

    def _warn_unadvertised(self) -> None:
        listen = self.config.server.listen
        host = listen.rsplit(":", 1)[0]
        if self.config.gossip is not None and not self.config.advertise and host in ("0.0.0.0", "[::]", "::", ""):
            log.warning("listening on %s without --advertise: peers on other hosts cannot dial %s", listen,
                        self.address)

    def _join_mesh(self) -> ForwardClient | None:
        """The gossip agent, what the node publishes through it, and the client that forwards to peers (None for a
        standalone node)."""
        gossip_cfg = self.config.gossip
        if gossip_cfg is None:
            return None
        transport = GrpcTransport(gossip_cfg)
        seeds = list(self.config.seeds)
        self.agent = GossipAgent(gossip_cfg, self.config.node_id, self.address, transport, seeds=seeds)
        self.peering = peer(
            self.agent, self.index, self.engine.info.kv_layout, self.engine.adapters,
            segment_holdings=getattr(self.engine, "segment_holdings", None),  # an engine with a segment store
            segment_summary_bytes=self.config.segments.summary_bytes,
            info=self.node_info,
            tiers=self.tiers.below(),
        )
        add_peer_service(self.server, self.agent)
        self._share_tenant_usage(self.agent)
        credentials = None
        if gossip_cfg.tls is not None:
            cert, key, ca = gossip_cfg.tls.read()
            credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        self.channels = PeerChannels(self._message_options(), credentials, forwarding=self.config.forwarding,
                                     certified=gossip_cfg.certified_ids)
        return ForwardClient(
            self.config.node_id, self.agent.auth, self.channels, self.config.forwarding,
            generation_of=self.agent.generation_of,
        )

    def _share_tenant_usage(self, agent: GossipAgent) -> None:
        """Mesh-wide rate limits: publish what this node admitted for rate-limited tenants each round, and charge
        peers' to this node's buckets as their values arrive (``serving/tenant_usage.py``)."""
        self._share_each_round(agent, USAGE_KEY, self.tenant_usage.value, self.tenant_usage.apply)

    def _share_tenant_served(self, agent: GossipAgent, queue: EngineQueue) -> None:
        """Mesh-wide fair shares: publish the work this node's engine took per tenant each round, and charge what
        peers served beyond a fair share to this node's queue once per round (``serving/tenant_served.py``)."""
        served = self.tenant_served = TenantServed(queue.charge, queue.waiting_by_tenant, self.tenants.weight)
        queue.on_enter = served.record

        def each_round() -> bytes:
            served.charge_round()
            return served.publish_value()

        self._share_each_round(agent, SERVED_KEY, each_round, served.apply)

    def _share_each_round(
        self, agent: GossipAgent, key: str, value: Callable[[], bytes], apply: Callable[[str, bytes | None], None]
    ) -> None:
        """Publish ``value()`` under ``key`` before every gossip round (a no-op when unchanged), and hand each peer's
        value under ``key`` to ``apply`` as it arrives."""
        agent.before_round(lambda: agent.publish(key, value()))

        def peer_value(node_id: str, changed: str, peer: bytes | None) -> None:
            if node_id != self.config.node_id and changed == key:
                apply(node_id, peer)

        agent.watch(key, peer_value)

    def _build_router(self) -> Router:
        routing = self.config.routing
        gossip_cfg = self.config.gossip
        return Router.for_node(
            routing,
            self.config.node_id,
            self.address,
            self.index,
            self._local_load,
            self.peering.view if self.peering is not None else None,
            profile=get_profile(routing.cost_profile),
            kv_layout=self.engine.info.kv_layout if self.kv_pulls is not None else "",
            local_segments=getattr(self.engine, "holds_segment", None),
            bos_token_id=self.engine.info.bos_token_id,
            summary_stride=gossip_cfg.summary_stride if gossip_cfg is not None else 1,
            local_adapters=self.engine.adapters,
            on_routed=self._log_routed if self.agent is not None and routing.shadow_gate else None,
            local_tiers=self.tiers.depths if self.tiers.has_tiers else None,
        )

    def _build_plan_sync(self) -> PlanSync | None:
        """The rate plan's node side (with gossip only), gated by a shadow replay unless --no-shadow-gate."""
        routing = self.config.routing
        if self.agent is None:
            return None
        gate = None
        if routing.shadow_gate:
            from p2pnode.sim.replay import replay_log  # the simulator implements the gate's replay

            gate = ShadowGate(self.config.engine.block_size, replay_log, profile=routing.cost_profile)
        # The plan's work unit is the node's cost profile's (plan/work.py), like the gate's replay.
        plan_config = PlanConfig(
            period_s=routing.plan_period_s, decode_token_cost=decode_token_cost(get_profile(routing.cost_profile))
        )
        return PlanSync(self.agent, self._use_plan, plan_config, gate=gate)

    def _local_hooks(self) -> LocalHooks:
        segments_move = self.kv_pulls is not None and self.router.segment_pull_price is not None
        return LocalHooks(
            on_served=self.eviction.observe if self.eviction.selector is not None else None,
            pulls=self.kv_pulls,
            segment_pulls=self._segment_pull_plan if segments_move else None,
            segment_pull_done=self.router.record_pull if segments_move else None,
            segments_held_elsewhere=(
                self.router.segments_held_elsewhere if self.config.segments.store_threshold > 1 else None
            ),
        )

    def _engine_queue(self) -> EngineQueue:
        """Where requests wait for the engine (``serving/engine_queue.py``), observed by the metrics."""
        assert self.metrics is not None
        queue = EngineQueue(
            self.config.node_id, self.config.server.max_in_flight, self.config.flow, self.tenants.weight,
            TenantLabels(self.tenants.configured),
        )
        queue.on_wait = self.metrics.observe_queue_wait
        self.metrics.watch_queue(queue)
        return queue

    def _ingress_context(self) -> IngressContext:
        assert self.metrics is not None
        return IngressContext(
            served_model_names=self.served_model_names,
            mesh_adapters=self._mesh_adapters,
            peer_trusted=self.agent.trusted if self.agent is not None else None,
            observer=self.metrics.observe,
            on_served=self._count_served if self.plan_sync is not None else None,
            counters=self.counters,
            tenants=self.tenants,
            limits=self.limits,
            usage=self.tenant_usage if self.agent is not None else None,
        )

    def _serve_peers(self, forwarder: ForwardClient | None) -> None:
        """The Forwarder service for peers' requests, and gossip's liveness steering the calls forwarded to them."""
        if self.agent is None:
            return
        tls = self.agent.config.tls
        self.forwarder_service = ForwarderService(
            self.local, self.agent.auth, self.ingress.admission, self.config.server.max_receive_message_bytes,
            self.kv_pulls, check_sender=self.agent.check_sender, bind_tls=tls is not None and tls.bind_node_id,
            max_link_requests=self.config.forwarding.max_link_requests,
        )
        self.forwarder_service.register(self.server)
        if forwarder is not None:
            self._watch_peers(self.agent, forwarder, self.router)

    def _register_services(self) -> None:
        assert self.server is not None and self.service is not None
        self.service.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        if self.agent is not None:
            services += [PEER_SERVICE, FORWARDER_SERVICE]
        enable_reflection(services, self.server)

    def _status(self) -> node_pb2.NodeStatus:
        assert self.service is not None
        return self.service.status()

    # --- binding before the engine starts ---

    def _bind(self) -> None:
        """Create the gRPC server on its port and bind the HTTP socket; raise OSError naming the flag to change."""
        server_cfg = self.config.server
        gossip_cfg = self.config.gossip
        check_bindable(server_cfg.listen, "--listen")
        interceptor = ApiKeyInterceptor(self.api_keys, SERVICE_NAME, self._api_key_rejected)
        self.server = grpc.aio.server(
            options=[*self._message_options(), *self._keepalive_options(), ("grpc.so_reuseport", 0)],
            interceptors=[interceptor],
        )
        try:
            if gossip_cfg is not None and gossip_cfg.tls is not None:
                self.port = self.server.add_secure_port(server_cfg.listen, server_credentials(gossip_cfg.tls))
            else:
                self.port = self.server.add_insecure_port(server_cfg.listen)
        except RuntimeError:  # gRPC's "Failed to bind": the check above saw the address free a moment ago
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {server_cfg.listen}: change --listen")
        listen = self.config.api.http_listen
        if listen is None:
            listen = derived_http_listen(server_cfg.listen)
        if listen:
            try:
                self._http_socket = bind_tcp(listen)
            except BadAddress as e:
                raise OSError(f"--http-listen {e}") from None
            except OSError as e:
                raise OSError(
                    f"cannot listen on {listen} for the HTTP API ({e.strerror or e}): set --http-listen (or 'off')"
                ) from None
            self._http_listen = listen

    @staticmethod
    def _watch_peers(agent: GossipAgent, forwarder: ForwardClient, router: Router) -> None:
        """Gossip's view of peers steers forwarding: calls to a peer turning suspect or dead are abandoned (and
        retried elsewhere while nothing streamed); the ingress tries peers not fully trusted last
        (``IngressContext.peer_trusted``); what the router learned of a peer dead or gone (its sends in flight, its
        guessed cache, its link figure) goes with it -- a restarted peer starts afresh."""

        def on_liveness(t: Transition) -> None:
            if t.new in (MemberState.SUSPECT, MemberState.DEAD, None):
                abandoned = forwarder.peer_down(t.node_id, dead=t.new is not MemberState.SUSPECT)
                if abandoned:
                    log.warning("peer %s is %s: %d forwarded call(s) to it abandoned", t.node_id,
                                t.new or "forgotten", abandoned)
            if t.new in (MemberState.DEAD, MemberState.LEFT, None):
                router.forget_peer(t.node_id)

        agent.watch_liveness(on_liveness)

    def _keepalive_options(self) -> list[tuple[str, int]]:
        """Let peers' keepalive pings through (gRPC servers refuse pings more often than every 5 minutes)."""
        return peer_server_keepalive_options(self.config.forwarding)

    async def _start_client_apis(self) -> None:
        """Metrics, the stats line, and the OpenAI-compatible HTTP API (unless --http-listen is empty)."""
        assert self.ingress is not None and self.service is not None
        api = self.config.api
        if api.stats_interval_s > 0:
            stats = StatsLogger(self.service.status, self.ingress.counters, self.engine, api.stats_interval_s)
            self._stats_task = asyncio.create_task(stats.run(), name="stats-log")
        if self._http_socket is None:
            return
        from p2pnode.api.http.server import HttpFront

        self.http = HttpFront(
            self.ingress, self.metrics, api, self.served_model_names, self.readiness, str(self.config.engine.model),
            keys=self.api_keys,
        )
        sock, self._http_socket = self._http_socket, None
        self.service.http_address = await self.http.start(self._http_listen, sock)

    def readiness(self) -> tuple[bool, str]:
        """Ready for traffic: engine up, not draining, and (with seeds) joined: another member seen alive."""
        if self._draining:
            return False, "draining"
        status = self.engine.status()
        if not status.healthy:
            return False, "engine stalled" if status.stalled_s else "engine down"
        if self.agent is not None and self.config.seeds and not any(
            m.state == "alive" and not m.is_self for m in self.agent.members()
        ):
            return False, "joining the mesh"
        return True, "ok"

    def _segment_pull_plan(self, segments: SegmentSpans) -> list[tuple[str, str, list[int]]]:
        """The request's segments to pull from peers (``Router.segment_pulls``), by holder: (holder, its address,
        indices into the request's segments)."""
        asks = by_holder(self.router.segment_pulls(segments))
        return [(holder, self.router.address_of(holder), list(indices)) for holder, indices in asks.items()]

    def _use_plan(self, plan: Plan) -> None:
        self.router.plan = plan

    def _log_routed(self, route: Route) -> None:
        """Log a routed request for the shadow gate's replay (its arrival, prompt and max_tokens)."""
        assert self.plan_sync is not None
        self.plan_sync.routed(route.block_hashes, route.prompt_tokens, route.max_tokens)

    def _count_served(self, route: Route, final: node_pb2.GenerateFinal) -> None:
        """Count a served request for the rate plan, with the work its engine reported, once its final message is
        on its way (deriving its routing key is not part of the decision unless the policy reads keys)."""
        work = ServedWork(final.prompt_tokens, final.cached_tokens, final.completion_tokens)
        asyncio.get_running_loop().call_soon(self._observe, route, work)

    def _observe(self, route: Route, work: ServedWork) -> None:
        assert self.plan_sync is not None
        self.plan_sync.served_request(route.routing_key, work)

    def _peer_status(self, status: node_pb2.NodeStatus) -> None:
        """Fill what NodeService does not know: versions, served names, the engine's prefix-cache hit rate and the
        KV holding cached prefixes, the eviction policy, then the mesh part from the gossip agent."""
        info = self.node_info
        status.version, status.engine_version = info.version, info.engine_version
        status.served_model_names.extend(info.served_model_names)
        load = self._node_load()
        status.load.prefix_cache_hit_rate, status.load.kv_cached = load.prefix_cache_hit_rate, load.kv_cached
        self._tier_status(status.tier)
        policy, active, selector = self.eviction.snapshot()
        ev = status.eviction
        ev.policy, ev.active = policy, active
        if selector is not None:
            ev.shadow_hit_rates.update(selector.hit_rates)
            ev.observed_requests, ev.sampled_requests = selector.observed, selector.sampled
            ev.switches, ev.sample_rate = selector.switches, selector.sample_rate
            ev.shadow_blocks = selector.shadow_blocks
        if self.peering is None:
            return
        status.index.summary_version = self.peering.summary.published_version
        for m in self.peering.view.members():
            member = status.members.add(
                node_id=m.node_id,
                address=m.address,
                state=m.state.value,
                generation=m.generation,
                heartbeat=m.heartbeat,
                info_age_s=m.info_age_s if m.info_age_s != float("inf") else -1.0,
                summary_hashes=m.summary_hashes,
                summary_segments=m.summary_segments,
                is_self=m.is_self,
                adapters=sorted(self.engine.adapters().served if m.is_self else m.adapters.served),
            )
            if m.phi is not None:
                member.phi = m.phi
            if m.load is not None:
                member.running, member.waiting, member.kv_usage = m.load.running, m.load.waiting, m.load.kv_usage
                member.in_flight = m.load.in_flight
                member.prefix_cache_hit_rate, member.kv_cached = m.load.prefix_cache_hit_rate, m.load.kv_cached
            if m.info is not None:
                member.version, member.engine_version = m.info.version, m.info.engine_version
                member.served_model_names.extend(m.info.served_model_names)
        stats = self.agent.stats.as_dict()
        for key, value in sorted(stats.items()):
            if isinstance(value, int | float):
                status.gossip_counters[key] = int(value)
            elif isinstance(value, dict):
                for sub, n in value.items():
                    status.gossip_counters[f"{key}.{sub}"] = int(n)
        if self.forwarder_service is not None:
            status.routing.forwards_received = self.forwarder_service.received
        if self.channels is not None:
            status.routing.peer_links = self.channels.links_open
            status.routing.peer_links_opened = self.channels.links_opened
        if self.plan_sync is not None:
            self._plan_status(status.plan)

    def _tier_status(self, out: node_pb2.TierStatus) -> None:
        """The host KV tier under the engine (left empty when it has none), and the disk tier below it: the engine's
        account of what they hold and moved, the requests served from them and the exports they fed, and what this
        node's index of them places."""
        read = getattr(self.engine, "tier_status", None)  # an engine with a host tier
        tier = read() if read is not None else None
        if tier is None:
            return
        io, c = tier.io, self.local.counters
        out.host_bytes, out.host_blocks, out.host_used_bytes = tier.config.host_bytes, tier.blocks, tier.used_bytes
        out.host_indexed_blocks = len(self.tiers.host) if self.tiers.host is not None else 0
        out.stored_blocks, out.evicted_blocks = tier.stored_blocks, tier.evicted_blocks
        out.store_failures = io.store_failures
        out.loads, out.loaded_tokens = c.host_tier_requests, c.host_tier_tokens
        out.load_bytes, out.load_seconds = io.load_bytes, io.load_seconds
        out.store_bytes, out.store_seconds = io.store_bytes, io.store_seconds
        if self.kv_pulls is not None:
            pulls = self.kv_pulls.counters
            out.exports, out.export_blocks = pulls.tier_exports, pulls.tier_export_blocks
        out.store_threshold, out.store_outputs = tier.config.store_threshold, tier.config.store_outputs
        out.eviction = tier.config.eviction
        if tier.config.disk_path:
            out.disk_bytes = tier.config.disk_bytes
            out.disk_blocks = len(self.tiers.disk) if self.tiers.disk is not None else 0
            out.disk_load_bytes, out.disk_store_bytes = io.disk_load_bytes, io.disk_store_bytes
            out.disk_failures = io.disk_failures

    def _plan_status(self, out: node_pb2.PlanStatus) -> None:
        """The plan in force as this node holds it: its warm set, its gate verdict, and this ingress's split."""
        assert self.plan_sync is not None
        sync, plan = self.plan_sync, self.plan_sync.plan
        out.planner = sync.planner_id() if sync.alive_ids() else ""
        out.plans_built = sync.stats.plans_built
        out.plans_adopted = sync.stats.plans_adopted
        out.tracked_keys = len(sync.sketch)
        if sync.stats.last_churn is not None:
            out.cache_churn = sync.stats.last_churn.cache_churn
            out.count_churn = sync.stats.last_churn.count_churn
        if plan is None:
            out.gate = "pending" if sync.gate is not None else "off"
            return
        out.epoch = plan.epoch
        out.built_by = plan.planner_id
        out.warm_keys = len(plan.assignments)
        out.destinations = sum(len(d) for d in plan.assignments.values())
        out.expected_imbalance = plan.imbalance()
        out.affinity = plan.affinity
        verdict = plan.verdict
        if verdict is None:  # built by a planner without a gate (affinity on) or before any evidence (off)
            out.gate = "off" if plan.affinity else "pending"
        else:
            out.gate = verdict.reason
            out.gate_requests = verdict.requests
            out.gate_plan_kv_hit = verdict.plan_kv_hit
            out.gate_flat_kv_hit = verdict.flat_kv_hit
            out.gate_plan_p99_ttft_s = verdict.plan_p99_ttft_s
            out.gate_flat_p99_ttft_s = verdict.flat_p99_ttft_s
            out.gate_age_s = max(0.0, time.time() - verdict.at)
        observed = self.router.split.observed(plan)
        for key in sorted(plan.assignments, key=lambda k: (-plan.key_load[k], k)):
            dests = plan.assignments[key]
            sent = observed.get(key, {})
            hold = plan.holds.get(key)
            out.warm.add(
                key=key, kb=len(dests), destinations=dests, expected_load=plan.key_load[key],
                sent=[sent.get(d, 0) for d in dests], held_kb=hold.kb if hold is not None else 0,
            )
        out.prefill_token_cost, out.decode_token_cost = plan.prefill_token_cost, plan.decode_token_cost
        for node_id, expected in sorted(plan.expected_loads().items()):
            served = sync.served.served_since(node_id, plan.created_at, plan.prefill_token_cost, plan.decode_token_cost)
            out.loads.add(node_id=node_id, expected=expected, served=served or 0.0)
        out.plans_scored = sync.stats.plans_scored
        if sync.stats.plans_scored:
            out.mean_imbalance_error = sync.stats.imbalance_error_sum / sync.stats.plans_scored
        score = sync.stats.last_score
        if score is not None:
            last = out.last_score
            last.epoch, last.built_by, last.seconds = score.epoch, score.planner_id, score.end - score.start
            last.expected_imbalance, last.served_imbalance = score.expected_imbalance, score.served_imbalance
            last.period_imbalance = score.period_imbalance
            last.expected_load, last.served_load = score.expected_total, score.served_total
            for node_id in sorted(score.expected):
                last.destinations.add(
                    node_id=node_id, expected=score.expected[node_id], served=score.served.get(node_id, 0.0)
                )

    def _node_load(self) -> NodeLoad:
        """The engine's load with what only the node knows: the requests waiting in its queue (as waiting: routers see
        a node whose engine is full as loaded as one whose engine queues), its calls in flight, their prefill backlog,
        the share of its KV holding cached prefixes, and the work it has served (stamped with the time they last
        changed, so that an idle node's load does not change)."""
        capacity = self.engine.kv_capacity_blocks()
        c = self.local.counters
        served = (c.served, c.uncached_tokens, c.completion_tokens)
        if served != self._served_seen[0]:
            self._served_seen = (served, time.time())
        load = self.engine.status().load
        return replace(
            load,
            waiting=load.waiting + len(self.local.queue),
            prefill_backlog_tokens=self.local.prefill_backlog_tokens,
            urgent_waiting=self.local.urgent_waiting + self.local.queue.waiting_ahead_of(URGENT_PRIORITY),
            urgent_backlog_tokens=self.local.urgent_backlog_tokens,
            in_flight=len(self.local.in_flight),
            kv_cached=min(1.0, len(self.index) / capacity) if capacity else 0.0,
            served_requests=served[0],
            served_uncached_tokens=served[1],
            served_completion_tokens=served[2],
            served_at=self._served_seen[1],
        )

    def _mesh_adapters(self) -> frozenset[str]:
        """The LoRA adapters this node and its alive peers serve: what a request's ``model`` may name."""
        served = set(self.engine.adapters().served)
        if self.peering is not None:
            for peer_view in self.peering.view.peers():
                if peer_view.usable:
                    served |= peer_view.adapters.served
        return frozenset(served)

    def _local_load(self) -> NodeLoad | None:
        """This node's load for its own router; None while the engine cannot serve."""
        return self._node_load() if self.engine.status().healthy else None

    def _publish_load(self) -> None:
        if self.peering is not None and self._engine_state != "stalled":
            self.peering.load.set(self._node_load())

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch(self) -> None:
        """Engine health -> health service and routing; live load -> gossip."""
        while True:
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
            await self.check_engine()
            self._publish_load()
            if self.plan_sync is not None:
                try:
                    self.plan_sync.tick()
                except Exception:  # planning must never take the node down
                    log.exception("rate plan tick failed")

    async def check_engine(self) -> None:
        """Act on a change of the engine's health (every ``HEALTH_CHECK_INTERVAL_S``). Dead is for good: the node
        withdraws from peers' routing. Stalled (work and no step: ``engine/stall.py``) lasts until it steps again:
        its requests fail retryably, its load leaves gossip (peers stop routing here), and a probe gives a core that
        resumes a step to take. Both report NOT_SERVING meanwhile."""
        status = self.engine.status()
        state = "up" if status.healthy else "stalled" if status.stalled_s else "dead"
        if state != self._engine_state:
            was, self._engine_state = self._engine_state, state
            await self._set_health(serving=state == "up" and not self._draining)
            if state == "dead":
                log.error("engine is dead: reporting NOT_SERVING")
                if self.agent is not None:
                    self.agent.withdraw()  # peers stop routing here instead of failing a hop per request
            elif state == "stalled":
                failed = await self.local.fail_stalled(status.stalled_s)
                log.error(
                    "engine stalled: it had %d request(s) and took no step for %.0f s; failed %d (retryable), "
                    "reporting NOT_SERVING and out of peers' routing until it steps again", status.unfinished,
                    status.stalled_s, failed,
                )
                if self.peering is not None:
                    self.peering.load.withhold()
            else:
                log.warning("engine is serving again (it was %s)", was)
                self._publish_load()
        if state == "stalled" and (self._probe_task is None or self._probe_task.done()):
            # a probe, again when one could not enter (one that ran to its end was a step: the stall is over)
            self._probe_task = asyncio.create_task(self._probe_engine(), name="engine-probe")

    async def _probe_engine(self) -> None:
        """One token of a one-token prompt on a stalled engine: the step a core that resumes takes, which ends the
        stall (whether it comes is the engine's; an engine that dies instead fails it)."""
        request = Request(
            request_id=f"p2pnode-stall-probe-{time.monotonic_ns()}",
            tokens=(self.engine.info.bos_token_id or 0,),
            sampling=SamplingOptions(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0),
        )
        try:
            async with contextlib.aclosing(self.engine.generate(request)) as chunks:
                async for _ in chunks:
                    pass
        except Exception as e:  # the engine's own state says what it is; the probe only gives it work
            log.debug("engine probe failed: %s", e)

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
        if self.agent is not None:
            self.agent.withdraw()  # peers stop routing here now, not when it stops: a refused hop per peer saved
        timeout = self.config.server.drain_timeout_s
        in_flight = len(self.local.in_flight) + len(self.service.relays)
        log.info("draining: %d call(s) in flight, waiting up to %.0fs", in_flight, timeout)
        idle = asyncio.ensure_future(self._idle())
        cut = asyncio.ensure_future(self._drain_cut.wait())
        try:
            await asyncio.wait((idle, cut), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            cut.cancel()
        if self._drain_cut.is_set():
            log.warning("second signal: stopping now, %d call(s) still in flight",
                        len(self.local.in_flight) + len(self.service.relays))
        await self.stop()

    async def _idle(self) -> None:
        assert self.service is not None
        queue = self.local.queue
        while self.local.in_flight.active or self.service.relays.active or len(queue) or queue.inside:
            await self.local.in_flight.idle.wait()
            await self.service.relays.idle.wait()
            if len(queue) or queue.inside:  # a waiting request (a peer's too) is served: it was admitted
                await asyncio.sleep(DRAIN_POLL_S)

    async def stop(self, leave: bool = True) -> None:
        """Stop gossip (announcing 'left' unless ``leave`` is False), the servers and the engine."""
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self.agent is not None:
            await self.agent.stop(leave=leave)
        if self.http is not None:
            await self.http.stop()
        if self._http_socket is not None:  # bound, but the node stopped before serving HTTP
            self._http_socket.close()
            self._http_socket = None
        if self.forwarder_service is not None:
            self.forwarder_service.close_links()  # peers' links stay open between requests: end them, not wait
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.channels is not None:
            await self.channels.close()
        if self.plan_sync is not None and self.plan_sync.gate is not None:
            self.plan_sync.gate.close()
        await self.engine.shutdown()
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Start, then run until SIGTERM/SIGINT, then drain. A signal while the node starts stops it without ever
        serving (an engine may take minutes to load); a second signal while it drains stops it at once."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()

        def on_signal() -> None:
            if stop_requested.is_set():  # the second signal
                self._drain_cut.set()
            stop_requested.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        starting = asyncio.ensure_future(self.start())
        signalled = asyncio.ensure_future(stop_requested.wait())
        try:
            await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                log.info("signal received while starting: stopping")
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # what it raises as it is cancelled
                    await starting
                await self.stop(leave=False)
                return
            starting.result()  # its failure, if it failed
        except BaseException:
            starting.cancel()
            await self.stop(leave=False)  # what did start (the engine, a server) goes down with the node
            raise
        finally:
            signalled.cancel()
        http = f" http {self.http.address}" if self.http is not None else ""
        print(f"p2pnode {self.config.node_id} ready on {self.address}{http}", flush=True)
        await stop_requested.wait()
        log.info("signal received: draining (a second signal stops now)")
        await self.drain()
        log.info("node %s stopped", self.config.node_id)
