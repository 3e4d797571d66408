"""Workloads by name (``--workload``), and trace replay (``--trace``).

Names: ``cacheroute-aggregate``, ``whales``, ``wakman-mixes`` (a family: 21 mixes, each reported on its own, or
one mix by its full name such as ``wakman-mixes/s20-c40-a40``), ``mmlu``, ``low-reuse``. Each module's docstring
defines its workload; ``docs/simulator.md`` collects them (``low-reuse``: see ``lowreuse.py``).
"""

from __future__ import annotations

from p2pnode.sim.workloads.aggregate import CacheRouteAggregate
from p2pnode.sim.workloads.arrivals import ARRIVAL_PROCESSES
from p2pnode.sim.workloads.base import Limit, Workload
from p2pnode.sim.workloads.lowreuse import LowReuse
from p2pnode.sim.workloads.mmlu import Mmlu
from p2pnode.sim.workloads.trace import DEFAULT_TRACE_BLOCK_SIZE, TraceFormatError, TraceWorkload, load_trace
from p2pnode.sim.workloads.wakman import FAMILY as WAKMAN_FAMILY
from p2pnode.sim.workloads.wakman import WakmanMix, all_mixes
from p2pnode.sim.workloads.whales import Whales

__all__ = [
    "ARRIVAL_PROCESSES",
    "DEFAULT_TRACE_BLOCK_SIZE",
    "WORKLOAD_NAMES",
    "CacheRouteAggregate",
    "Limit",
    "LowReuse",
    "Mmlu",
    "TraceFormatError",
    "TraceWorkload",
    "WakmanMix",
    "Whales",
    "Workload",
    "get_workloads",
    "load_trace",
]

WORKLOAD_NAMES = ("cacheroute-aggregate", "whales", WAKMAN_FAMILY, "mmlu", "low-reuse")


def get_workloads(name: str, *, arrival: str = "poisson", cv: float = 1.9) -> list[Workload]:
    """The workload(s) called ``name`` (a family expands to its members); ValueError listing valid names."""
    if arrival not in ARRIVAL_PROCESSES:
        raise ValueError(f"unknown arrival process {arrival!r}; valid: {', '.join(ARRIVAL_PROCESSES)}")
    if name == "cacheroute-aggregate":
        return [CacheRouteAggregate(arrival, cv)]
    if name == "whales":
        return [Whales(arrival, cv)]
    if name == "mmlu":
        return [Mmlu(arrival, cv)]
    if name == "low-reuse":
        return [LowReuse(arrival, cv)]
    if name == WAKMAN_FAMILY:
        return list(all_mixes())
    if name.startswith(WAKMAN_FAMILY + "/"):
        for mix in all_mixes():
            if mix.name == name:
                return [mix]
        valid = ", ".join(m.name for m in all_mixes())
        raise ValueError(f"unknown mix {name!r}; valid: {valid}")
    raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOAD_NAMES)} (or --trace FILE)")
