"""The shadow gate's replay (``p2pnode.plan.gate.Replayer``): a node's recent request log through the simulator.

The log holds block hashes and lengths only; it is replayed as a Mooncake-style trace on as many simulated nodes as
the mesh has live destinations, once with the plan's policy (the registry's ``PLAN_POLICY``, ``cacheroute``: the
plan's affinity) and once cache-blind (``CACHE_BLIND_POLICY``, ``flat``). The planner only sees the requests it
accepted as an ingress, so the replay treats them as a sample of the mesh's traffic and speeds them up by the number
of destinations (the mesh's clients spread over its ingresses).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from p2pnode.cost import get_profile
from p2pnode.plan.gate import LoggedRequest, ReplayOutcome
from p2pnode.routing.policies import CACHE_BLIND_POLICY, PLAN_POLICY, get_spec
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig, decode_token_cost
from p2pnode.sim.plan import provider_for
from p2pnode.sim.workloads.base import Limit
from p2pnode.sim.workloads.trace import TraceRecord, TraceWorkload

__all__ = ["replay_log"]

#: Plans built within one replay (its plan period is the replayed span divided by this, at most the live period).
REPLAY_PLANS = 8
REPLAY_MAX_PLAN_PERIOD_S = 10.0


class _LogWorkload(TraceWorkload):
    """A trace whose records come from a request log (already validated: no file to load)."""

    def __init__(self, records: list[TraceRecord], block_size: int) -> None:
        self.path = Path("request-log")
        self.block_size = block_size
        self.records = records
        self.name = "shadow-replay"
        span = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
        self.native_qps = len(records) / max(1e-3, span)


def _records(entries: Sequence[LoggedRequest], block_size: int, speedup: float) -> list[TraceRecord]:
    t0 = entries[0].arrival_s
    out = []
    for e in entries:
        blocks = len(e.block_hashes)
        # Only the logged (possibly truncated) full blocks are replayed: the prompt length follows them.
        prompt = max(1, min(e.prompt_tokens, blocks * block_size + block_size - 1))
        out.append(TraceRecord((e.arrival_s - t0) * 1000.0 / speedup, prompt, e.output_tokens, e.block_hashes))
    return out


def replay_log(
    entries: Sequence[LoggedRequest], destinations: int, block_size: int, profile: str
) -> tuple[ReplayOutcome, ReplayOutcome]:
    """(with the plan, cache-blind) predictions for ``entries`` on ``destinations`` simulated nodes."""
    ordered = sorted(entries, key=lambda e: e.arrival_s)
    records = _records(ordered, block_size, speedup=max(1, destinations))
    workload = _LogWorkload(records, block_size)
    # Replan several times within the replayed span (the live period would not fire once in a short log).
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    period_s = max(0.05, min(REPLAY_MAX_PLAN_PERIOD_S, span_s / REPLAY_PLANS))
    outcomes = []
    for policy in (PLAN_POLICY, CACHE_BLIND_POLICY):
        cfg = SimConfig(nodes=max(1, destinations), block_size=block_size).with_routing(
            policy=policy, cost_profile=profile
        )
        provider = provider_for(get_spec(policy), decode_token_cost(get_profile(profile)), period_s=period_s)
        requests = workload.requests(None, 0, BlockSpace(block_size), Limit(max_requests=len(ordered)))
        summary = Cluster(cfg, plan_provider=provider).run(requests)
        outcomes.append(ReplayOutcome(summary["kv_hit"], summary["ttft_p99_s"]))
    return outcomes[0], outcomes[1]
