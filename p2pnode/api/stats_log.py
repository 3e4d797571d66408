"""A stats line every ``stats_interval_s`` (10 s by default), like vLLM's "Avg prompt throughput..." line.

Each tick logs the mesh's line — calls per second by API and outcome, where they were served, the routing
estimate against the engines' own cached tokens, in-flight sequences, members, plan, index, KV-event gaps —
then asks the engine for its own line (vLLM's, on the same clock as ``vllm serve``). A quiet node logs at DEBUG
(as vLLM does when idle), so an idle mesh does not fill its logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from p2pnode.engine.base import Engine
from p2pnode.serving.ingress import RequestCounters
from p2pnode.v1 import node_pb2

log = logging.getLogger("p2pnode.stats")


def stats_line(
    before: node_pb2.NodeStatus,
    after: node_pb2.NodeStatus,
    calls_before: dict[tuple[str, str], int],
    calls_after: dict[tuple[str, str], int],
    elapsed_s: float,
) -> tuple[str, bool]:
    """The line for one interval, and whether anything happened in it."""
    def delta(key: tuple[str, str]) -> int:
        return calls_after.get(key, 0) - calls_before.get(key, 0)

    by_api = {api: sum(delta((a, o)) for a, o in calls_after if a == api) for api in ("http", "grpc")}
    by_outcome = {o: sum(delta((a, oc)) for a, oc in calls_after if oc == o)
                  for o in ("success", "rejected", "failed", "cancelled")}
    calls = sum(by_api.values())
    rb, ra = before.routing, after.routing
    served = ra.served - rb.served
    engine_cached = ra.engine_cached_tokens - rb.engine_cached_tokens
    estimated = ra.estimated_cached_tokens - rb.estimated_cached_tokens
    error = ra.estimate_abs_error_tokens - rb.estimate_abs_error_tokens
    alive = sum(1 for m in after.members if m.state == "alive")
    rate = calls / elapsed_s if elapsed_s > 0 else 0.0
    parts = [
        f"ingress {rate:.1f} calls/s (http {by_api['http']}, grpc {by_api['grpc']}: "
        + ", ".join(f"{k} {v}" for k, v in by_outcome.items()) + ")",
        f"served here {ra.served_locally - rb.served_locally}, forwarded {ra.forwarded - rb.forwarded}, "
        f"retried {ra.retries - rb.retries}, served for peers {ra.forwards_received - rb.forwards_received}",
        f"in flight {ra.relays_in_flight}",
        (f"routing estimate {estimated} vs engine-cached {engine_cached} tokens "
         f"(mean |error| {error / served:.1f} tokens over {served})" if served else "routing estimate -"),
        f"members alive {alive}/{len(after.members)}" if after.members else "standalone",
        f"plan epoch {after.plan.epoch} ({after.plan.warm_keys} warm keys)",
        f"index {after.index.blocks} blocks",
        f"KV-event gaps {after.kv_events.gaps} ({after.kv_events.unrecovered_gaps} unrecovered)",
    ]
    busy = calls > 0 or ra.relays_in_flight > 0 or ra.forwards_received != rb.forwards_received
    return "; ".join(parts), busy


class StatsLogger:
    """Logs ``stats_line`` every interval, then the engine's own stats."""

    def __init__(
        self, status: Callable[[], node_pb2.NodeStatus], counters: RequestCounters, engine: Engine, interval_s: float
    ) -> None:
        self.status = status
        self.counters = counters
        self.engine = engine
        self.interval_s = interval_s

    async def run(self) -> None:
        before, calls_before, at = self.status(), dict(self.counters.by_api), time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                after, calls_after, now = self.status(), dict(self.counters.by_api), time.monotonic()
                line, busy = stats_line(before, after, calls_before, calls_after, now - at)
                log.log(logging.INFO if busy else logging.DEBUG, "mesh stats: %s", line)
                before, calls_before, at = after, calls_after, now
                await self.engine.log_stats()
            except Exception:  # stats must never take the node down
                log.exception("stats logging failed")
