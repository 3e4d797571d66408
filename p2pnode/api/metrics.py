"""``GET /metrics``: the engine's own ``vllm:*`` families, unchanged, plus the mesh's ``p2pnode:*`` ones.

vLLM's ``PrometheusStatLogger`` registers ``vllm:*`` in prometheus_client's default registry of the process that
runs ``AsyncLLM`` — the node process — and ``AsyncLLM`` keeps it beside custom stat loggers (StatLoggerManager
adds it unless a custom one is a PrometheusStatLogger), so the scrape is that registry's exposition followed by
this node's own registry. A simulated engine has no ``vllm:*``; every ``p2pnode:*`` family is there from the
start on any engine.

The mesh families are read at scrape time from the counters the node already keeps (the ingress's calls, and
GetStatus: routing, gossip, members, plan, prefix index, KV events) by a custom collector, so nothing is
counted twice. Two histograms are observed as sequences finish (buckets are vLLM's, so dashboards compare like
with like), one as requests enter the engine (their wait in the node's queue). Labels are bounded: api (grpc,
http), outcome (4 values), path (local, forwarded, retried), member state (4 values), eviction policy (5 names),
tenant (at most MAX_TENANT_LABELS, the rest "other": ``serving/tenants.TenantLabels``) — never request ids or keys.
One family takes node ids: the plan's per-destination loads (``destination``), at most the plan's destinations,
which the member cap bounds; its series follow the mesh's membership.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pnode.serving.engine_queue import REFUSAL_REASONS, EngineQueue
from p2pnode.serving.ingress import OUTCOMES, RequestCounters
from p2pnode.serving.pulls import PULL_OUTCOMES
from p2pnode.v1 import node_pb2

APIS = ("grpc", "http")
#: The label values of p2pnode:segment_* families.
SEGMENT_MODES = ("exact", "approximate")
MEMBER_STATES = ("alive", "suspect", "dead", "left")
#: vLLM's buckets (vllm/v1/metrics/buckets.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


#: Pull latency buckets (seconds): milliseconds on a fast link, seconds for a long prefix over TCP or a timeout.
KV_PULL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Queue wait buckets (seconds): none (the engine had room), then up to --max-queue-seconds' default and beyond.
QUEUE_WAIT_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0)


class _FlowCollector(Collector):
    """The engine queue's depth, and refusals by tenant and reason (``serving/engine_queue.py``)."""

    def __init__(self, queue: EngineQueue) -> None:
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        queue = self.queue
        yield GaugeMetricFamily(
            "p2pnode:queue_depth", "Requests waiting in the node's queue for its engine.", value=len(queue)
        )
        by_tenant = GaugeMetricFamily(
            "p2pnode:queue_waiting", "Requests waiting in the node's queue, by tenant.", labels=["tenant"]
        )
        waiting: dict[str, int] = {}
        for tenant, n in queue.waiting_by_tenant().items():
            label = queue.labels(tenant)
            waiting[label] = waiting.get(label, 0) + n
        for label, n in sorted(waiting.items()):
            by_tenant.add_metric([label], n)
        yield by_tenant
        yield CounterMetricFamily(
            "p2pnode:queued_requests", "Requests that waited in the node's queue for its engine.",
            value=queue.stats.queued,
        )
        refused = CounterMetricFamily(
            "p2pnode:flow_refused",
            "Requests refused or shed by flow control, by tenant and reason (" + ", ".join(REFUSAL_REASONS) + ").",
            labels=["tenant", "reason"],
        )
        for (tenant, reason), n in sorted(queue.stats.refused.items()):
            refused.add_metric([tenant, reason], n)
        yield refused


class _MeshCollector(Collector):
    """The p2pnode:* counters and gauges, read from the node at each scrape."""

    def __init__(self, status: Callable[[], node_pb2.NodeStatus], counters: RequestCounters) -> None:
        self.status = status
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        yield from self._requests(s)
        yield from _routing(s.routing)
        yield from _gossip(s)
        yield GaugeMetricFamily("p2pnode:plan_epoch", "Epoch of the rate plan in force (0: none).", value=s.plan.epoch)
        yield GaugeMetricFamily(
            "p2pnode:plan_warm_keys", "Keys in the rate plan's warm set.", value=s.plan.warm_keys
        )
        yield from _plan_loads(s.plan)
        yield from _prefix_index(s)
        yield from _eviction(s.eviction)
        yield from _kv_transfers(s.kv)
        yield from _kv_tier(s.tier)
        yield from _segments(s.segments)
        yield from _adapters(s)
        yield GaugeMetricFamily("p2pnode:draining", "1 while the node drains (SIGTERM).", value=int(s.draining))
        yield GaugeMetricFamily(
            "p2pnode:engine_healthy", "1 while the engine can serve.", value=int(s.load.healthy)
        )
        yield GaugeMetricFamily(
            "p2pnode:engine_stalled_seconds",
            "Seconds a stalled engine (work, no step past --engine-stall-timeout) has gone without a step; 0 while "
            "it steps.", value=s.load.stalled_s,
        )

    def _requests(self, s: node_pb2.NodeStatus) -> Iterator[Metric]:
        """Client calls to this node as the ingress: counted by outcome, refused, in flight."""
        requests = CounterMetricFamily(
            "p2pnode:requests", "Client calls to this node (as the ingress), by API and outcome.",
            labels=["api", "outcome"],
        )
        for api in APIS:
            for outcome in OUTCOMES:
                requests.add_metric([api, outcome], self.counters.by_api[(api, outcome)])
        yield requests
        rejected = CounterMetricFamily(
            "p2pnode:rejected_requests",
            "Client calls refused before they ran, by API and code (gRPC's name; HTTP's status follows from it). "
            "Their access lines are sampled: this counts every one.",
            labels=["api", "code"],
        )
        for (api, code), n in sorted(self.counters.rejected_by.items()):
            rejected.add_metric([api, code], n)
        yield rejected
        yield GaugeMetricFamily(
            "p2pnode:requests_in_flight", "Sequences this node is routing or relaying now.",
            value=s.routing.relays_in_flight,
        )


def _routing(r: node_pb2.RoutingStatus) -> Iterator[Metric]:
    """Where the router sent requests, and how well its cache estimates matched the engines' hits."""
    routed = CounterMetricFamily(
        "p2pnode:routed_requests",
        "Serving attempts by path: local (this engine), forwarded (a peer), retried (after a failed first choice).",
        labels=["path"],
    )
    routed.add_metric(["local"], r.served_locally)
    routed.add_metric(["forwarded"], r.forwarded)
    routed.add_metric(["retried"], r.retries)
    yield routed
    yield CounterMetricFamily(
        "p2pnode:stream_migrations",
        "Sequences this ingress continued on another node after their node failed mid-stream.",
        value=r.migrations,
    )
    yield CounterMetricFamily(
        "p2pnode:forwards_received", "Requests served here for other ingresses.", value=r.forwards_received
    )
    yield GaugeMetricFamily(
        "p2pnode:peer_links", "Links this node holds open to peers (one stream each, carrying its forwards).",
        value=r.peer_links,
    )
    yield CounterMetricFamily(
        "p2pnode:peer_links_opened", "Links to peers opened (again after an idle close or a failure).",
        value=r.peer_links_opened,
    )
    yield CounterMetricFamily(
        "p2pnode:routed_requests_served", "Requests this ingress routed that finished (any node).", value=r.served
    )
    yield CounterMetricFamily(
        "p2pnode:routing_estimated_cached_tokens",
        "Sum of the routing estimate of the serving node's cached prefix, in tokens.",
        value=r.estimated_cached_tokens,
    )
    yield CounterMetricFamily(
        "p2pnode:engine_cached_tokens",
        "Sum of the serving engines' reported prefix-cache hits for those requests, in tokens.",
        value=r.engine_cached_tokens,
    )
    yield CounterMetricFamily(
        "p2pnode:routing_estimate_error_tokens",
        "Sum of |routing estimate - engine-reported cached tokens|, in tokens.",
        value=r.estimate_abs_error_tokens,
    )


def _gossip(s: node_pb2.NodeStatus) -> Iterator[Metric]:
    """Gossip traffic, and the members as this node sees them."""
    gossip = s.gossip_counters
    yield CounterMetricFamily(
        "p2pnode:gossip_sent_bytes", "Gossip bytes sent.", value=gossip.get("bytes_sent", 0)
    )
    yield CounterMetricFamily(
        "p2pnode:gossip_received_bytes", "Gossip bytes received.", value=gossip.get("bytes_received", 0)
    )
    members = GaugeMetricFamily(
        "p2pnode:members", "Mesh members as this node sees them (itself included), by state.", labels=["state"]
    )
    for state in MEMBER_STATES:
        members.add_metric([state], sum(1 for m in s.members if m.state == state))
    yield members


def _prefix_index(s: node_pb2.NodeStatus) -> Iterator[Metric]:
    """The prefix index's size, and the KV-event stream that feeds it."""
    yield GaugeMetricFamily(
        "p2pnode:prefix_index_blocks", "KV blocks in this node's prefix index.", value=s.index.blocks
    )
    yield GaugeMetricFamily(
        "p2pnode:prefix_index_bytes", "Estimated memory of the prefix index, in bytes.", value=s.index.approx_bytes
    )
    yield CounterMetricFamily(
        "p2pnode:kv_event_gaps", "Gaps in the engine's KV-event sequence.", value=s.kv_events.gaps
    )
    yield CounterMetricFamily(
        "p2pnode:kv_event_unrecovered_gaps", "KV-event gaps replay could not fill.",
        value=s.kv_events.unrecovered_gaps,
    )


def _eviction(ev: node_pb2.EvictionStatus) -> Iterator[Metric]:
    """The KV eviction policy in force and, under adaptive, its candidates' shadow hit rates (none without one)."""
    if not ev.policy:
        return
    active = GaugeMetricFamily(
        "p2pnode:eviction_policy", "1 for the KV eviction policy the engine evicts with now.",
        labels=["configured", "active"],
    )
    active.add_metric([ev.policy, ev.active], 1)
    yield active
    hits = GaugeMetricFamily(
        "p2pnode:eviction_shadow_hit_rate",
        "Recent token-weighted KV hit rate of each candidate policy's shadow cache (adaptive only).",
        labels=["policy"],
    )
    for name, rate in sorted(ev.shadow_hit_rates.items()):
        hits.add_metric([name], rate)
    yield hits
    yield CounterMetricFamily(
        "p2pnode:eviction_switches", "Times adaptive changed the engine's eviction policy.", value=ev.switches
    )
    yield CounterMetricFamily(
        "p2pnode:eviction_observed_requests", "Finished requests offered to adaptive's selector.",
        value=ev.observed_requests,
    )


def _kv_transfers(kv: node_pb2.KvStatus) -> Iterator[Metric]:
    """KV this node pulled from peers before serving, and the leases it answered to theirs."""
    pulls = CounterMetricFamily(
        "p2pnode:kv_pulls", "KV pulls this node made before serving, by outcome (ok, failed, refused).",
        labels=["outcome"],
    )
    for outcome in PULL_OUTCOMES:
        pulls.add_metric([outcome], kv.pulls.get(outcome, 0))
    yield pulls
    yield CounterMetricFamily(
        "p2pnode:kv_pull_tokens", "Prompt tokens whose KV arrived by pulls (not computed here).",
        value=kv.pulled_tokens,
    )
    yield CounterMetricFamily("p2pnode:kv_pull_bytes", "KV bytes pulled from peers.", value=kv.pulled_bytes)
    exports = CounterMetricFamily(
        "p2pnode:kv_exports", "KV leases this node answered to peers, by outcome (ok, or why not).",
        labels=["outcome"],
    )
    for outcome, n in sorted(kv.exports.items()):
        exports.add_metric([outcome], n)
    yield exports


def _kv_tier(tier: node_pb2.TierStatus) -> Iterator[Metric]:
    """The KV tier in host memory under the engine (``medium`` host; every value 0 without one): its size and what
    it holds, what it stored, dropped, failed to store and loaded (the prefixes served from it, and vLLM's count of
    the bytes and seconds of its copies); with a disk tier below it, its size, blocks, bytes and failures (``medium``
    disk)."""

    def by_medium(
        kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float,
        disk: float | None = None,
    ) -> Metric:
        family = kind(f"p2pnode:kv_tier_{name}", doc, labels=["medium"])
        family.add_metric(["host"], value)
        if disk is not None:
            family.add_metric(["disk"], disk)
        return family

    gauge, counter = partial(by_medium, GaugeMetricFamily), partial(by_medium, CounterMetricFamily)

    on_disk = tier.disk_bytes > 0  # a disk tier below the host tier: its samples too (``medium`` disk)
    yield gauge(
        "capacity_bytes", "Size of the KV tier (--host-kv-bytes, --disk-kv-bytes; 0: none).", tier.host_bytes,
        tier.disk_bytes if on_disk else None,
    )
    yield gauge("used_bytes", "KV bytes the tier holds, by the engine's KV events.", tier.host_used_bytes)
    yield gauge(
        "blocks", "KV blocks the tier holds, by the engine's KV events (disk: those this node's index places).",
        tier.host_blocks, tier.disk_blocks if on_disk else None,
    )
    yield counter("stored_blocks", "Blocks the engine stored into the tier.", tier.stored_blocks)
    yield counter("evicted_blocks", "Blocks the tier dropped to make room.", tier.evicted_blocks)
    yield counter(
        "store_failures", "Stores the tier could not take (full of blocks in use); recomputed when needed.",
        tier.store_failures,
    )
    yield counter("loads", "Requests served here that loaded part of their prefix from the tier.", tier.loads)
    yield counter("loaded_tokens", "Prompt tokens loaded from the tier instead of computed.", tier.loaded_tokens)
    yield counter(
        "load_bytes", "KV bytes copied from the tier into the engine (disk: read back into the host tier).",
        tier.load_bytes, tier.disk_load_bytes if on_disk else None,
    )
    yield counter("load_seconds", "Seconds spent copying KV from the tier into the engine.", tier.load_seconds)
    yield counter(
        "store_bytes", "KV bytes copied from the engine into the tier (disk: written from the host tier).",
        tier.store_bytes, tier.disk_store_bytes if on_disk else None,
    )
    if on_disk:
        failures = CounterMetricFamily(
            "p2pnode:kv_tier_failures",
            "Entries the tier could not write or use (disk full or unwritable, corrupt, another layout's); each "
            "recomputed when needed.",
            labels=["medium"],
        )
        failures.add_metric(["disk"], tier.disk_failures)
        yield failures
    yield counter("store_seconds", "Seconds spent copying KV from the engine into the tier.", tier.store_seconds)
    yield counter(
        "exports", "Prefixes lent to peers after the engine loaded them (in part) from the tier.", tier.exports
    )


def _segments(seg: node_pb2.SegmentStatus) -> Iterator[Metric]:
    """Requests served here that named segments, by reuse mode, and the engine's segment store."""
    requests = CounterMetricFamily(
        "p2pnode:segment_requests", "Requests served here that named segments, by reuse mode.", labels=["mode"]
    )
    reused = CounterMetricFamily(
        "p2pnode:segment_reused_tokens",
        "Prompt tokens of requests with segments that the engine reported cached, by reuse mode.",
        labels=["mode"],
    )
    for mode in SEGMENT_MODES:
        requests.add_metric([mode], seg.requests.get(mode, 0))
        reused.add_metric([mode], seg.reused_tokens.get(mode, 0))
    yield requests
    yield reused
    yield CounterMetricFamily(
        "p2pnode:segment_loaded", "Segments loaded from the engine's segment store (approximate mode).",
        value=seg.loaded_segments,
    )
    yield CounterMetricFamily(
        "p2pnode:segment_phases", "One-token phases run to reach stored segments (approximate mode).",
        value=seg.phases,
    )
    yield GaugeMetricFamily(
        "p2pnode:segment_store_tokens", "Tokens the engine's segment store holds (as the node believes).",
        value=seg.held_tokens,
    )


def _adapters(s: node_pb2.NodeStatus) -> Iterator[Metric]:
    """The LoRA adapters this node serves, and the requests served with each."""
    adapters = GaugeMetricFamily(
        "p2pnode:lora_adapter", "1 for each LoRA adapter this node serves; resident: used most recently.",
        labels=["adapter", "resident"],
    )
    resident = set(s.resident_adapters)
    for name in s.adapters:
        adapters.add_metric([name, "true" if name in resident else "false"], 1)
    yield adapters
    lora_requests = CounterMetricFamily(
        "p2pnode:lora_requests", "Requests served here with a LoRA adapter, by adapter.", labels=["adapter"]
    )
    for name, n in sorted(s.adapter_requests.items()):
        lora_requests.add_metric([name], n)
    yield lora_requests


class MeshMetrics:
    """This node's registry (the p2pnode:* families) and the scrape of both registries."""

    def __init__(self, status: Callable[[], node_pb2.NodeStatus], counters: RequestCounters) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "p2pnode:time_to_first_token_seconds",
            "Arrival at the ingress to the sequence's first token leaving it, by API and path.",
            ["api", "path"], buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "p2pnode:e2e_request_latency_seconds",
            "Arrival at the ingress to the sequence's final message, by API and path.",
            ["api", "path"], buckets=E2E_BUCKETS, registry=self.registry,
        )
        self.kv_pull = Histogram(
            "p2pnode:kv_pull_seconds",
            "A KV pull from asking its holder to the last block written, by outcome.",
            ["outcome"], buckets=KV_PULL_BUCKETS, registry=self.registry,
        )
        self.queue_wait = Histogram(
            "p2pnode:queue_wait_seconds",
            "A request's wait in the node's queue before it entered the engine (0: the engine had room).",
            buckets=QUEUE_WAIT_BUCKETS, registry=self.registry,
        )
        for outcome in PULL_OUTCOMES:
            self.kv_pull.labels(outcome)
        for api in APIS:  # every series from the start, so rates and absent-series alerts work at once
            for path in ("local", "forwarded"):
                self.ttft.labels(api, path)
                self.e2e.labels(api, path)
        self.registry.register(_MeshCollector(status, counters))

    def observe(self, api: str, path: str, ttft_s: float, e2e_s: float) -> None:
        self.ttft.labels(api, path).observe(ttft_s)
        self.e2e.labels(api, path).observe(e2e_s)

    def observe_pull(self, outcome: str, seconds: float) -> None:
        self.kv_pull.labels(outcome).observe(seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def watch_queue(self, queue: EngineQueue) -> None:
        """Export the engine queue's depth and refusals."""
        self.registry.register(_FlowCollector(queue))

    def exposition(self) -> bytes:
        """The process registry (vllm:*, process_*, python_*) then this node's (p2pnode:*)."""
        return generate_latest(REGISTRY) + generate_latest(self.registry)


def _plan_loads(plan: node_pb2.PlanStatus) -> Iterator[Metric]:
    """The plan's expected loads against what the destinations served (docs/plan.md, "Expected and served")."""
    if not plan.epoch:
        return
    unit = "in the plan's work unit per second (uncached prompt and generated tokens weighed by its cost profile)"
    expected = GaugeMetricFamily(
        "p2pnode:plan_expected_load", f"Load the plan in force expects at each destination, {unit}.",
        labels=["destination"],
    )
    served = GaugeMetricFamily(
        "p2pnode:plan_served_load", f"Load each destination has served since the plan in force took force, {unit}.",
        labels=["destination"],
    )
    for d in plan.loads:
        expected.add_metric([d.node_id], d.expected)
        served.add_metric([d.node_id], d.served)
    yield expected
    yield served
    yield GaugeMetricFamily(
        "p2pnode:plan_expected_imbalance", "The plan in force's expected max/mean destination load.",
        value=plan.expected_imbalance,
    )
    yield CounterMetricFamily(
        "p2pnode:plans_scored", "Plans this node followed and scored against what was served while in force.",
        value=plan.plans_scored,
    )
    if plan.plans_scored:
        scored = GaugeMetricFamily(
            "p2pnode:plan_scored_imbalance",
            "The newest scored plan's max/mean destination load: expected by it (and over a period of its length, "
            "arrivals' chance included), and served while it was in force.",
            labels=["figure"],
        )
        scored.add_metric(["expected"], plan.last_score.expected_imbalance)
        scored.add_metric(["period"], plan.last_score.period_imbalance)
        scored.add_metric(["served"], plan.last_score.served_imbalance)
        yield scored
