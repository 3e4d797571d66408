"""Workloads by name (``--workload``), and trace replay (``--trace``: Mooncake's format, ``trace.py``, or segmented
traces whose prompts name reusable segments, ``segmented_trace.py``).

Names: ``cacheroute-aggregate``, ``whales``, ``wakman-mixes`` (a family: 21 mixes, each reported on its own, or
one mix by its full name such as ``wakman-mixes/s20-c40-a40``), ``mmlu``, ``low-reuse``, ``platform-chat``,
``platform-chat-long``, ``tool-agent``, ``revisit``, ``rag`` (documents reused behind varying contexts: the workload
of reuse beyond prefixes, ``rag.py``), ``ragpulse-shaped`` (a RAG service's traffic with RAGPulse's published shape:
passages behind a shared system prompt, ``ragpulse.py``; ``ragpulse-shaped-history`` names its history chunks as
segments too). Each module's docstring defines its workload;
``docs/simulator.md`` collects them (``low-reuse``: see ``lowreuse.py``; the production shapes: ``production.py``).

``arrival``/``cv`` override a workload's own arrival process (None: its own: Poisson for the first five, bursty
Gamma with CV 2 for the production shapes).
"""

from __future__ import annotations

from p2pnode.config import DEFAULT_ARRIVAL_CV
from p2pnode.sim.workloads import production
from p2pnode.sim.workloads.aggregate import CacheRouteAggregate
from p2pnode.sim.workloads.arrivals import ARRIVAL_PROCESSES
from p2pnode.sim.workloads.base import Limit, Workload
from p2pnode.sim.workloads.lowreuse import LowReuse
from p2pnode.sim.workloads.mmlu import Mmlu
from p2pnode.sim.workloads.production import PlatformChat, ToolAgent
from p2pnode.sim.workloads.rag import NAME as RAG
from p2pnode.sim.workloads.rag import Rag
from p2pnode.sim.workloads.ragpulse import HISTORY_NAME as RAGPULSE_HISTORY
from p2pnode.sim.workloads.ragpulse import NAME as RAGPULSE
from p2pnode.sim.workloads.ragpulse import RagPulseShaped
from p2pnode.sim.workloads.revisit import NAME as REVISIT
from p2pnode.sim.workloads.revisit import Revisit
from p2pnode.sim.workloads.segmented_trace import (
    DEFAULT_SEGMENTED_BLOCK_SIZE,
    SegmentedTraceWorkload,
    detect_trace_format,
    load_segmented_trace,
)
from p2pnode.sim.workloads.trace import DEFAULT_TRACE_BLOCK_SIZE, TraceFormatError, TraceWorkload, load_trace
from p2pnode.sim.workloads.wakman import FAMILY as WAKMAN_FAMILY
from p2pnode.sim.workloads.wakman import WakmanMix, all_mixes
from p2pnode.sim.workloads.whales import Whales

__all__ = [
    "ARRIVAL_PROCESSES",
    "DEFAULT_SEGMENTED_BLOCK_SIZE",
    "DEFAULT_TRACE_BLOCK_SIZE",
    "WORKLOAD_NAMES",
    "CacheRouteAggregate",
    "Limit",
    "LowReuse",
    "Mmlu",
    "PlatformChat",
    "Rag",
    "RagPulseShaped",
    "Revisit",
    "SegmentedTraceWorkload",
    "ToolAgent",
    "TraceFormatError",
    "TraceWorkload",
    "WakmanMix",
    "Whales",
    "Workload",
    "detect_trace_format",
    "get_workloads",
    "load_segmented_trace",
    "load_trace",
]

WORKLOAD_NAMES = (
    "cacheroute-aggregate", "whales", WAKMAN_FAMILY, "mmlu", "low-reuse", "platform-chat", "platform-chat-long",
    "tool-agent", REVISIT, RAG, RAGPULSE, RAGPULSE_HISTORY,
)  # fmt: skip


def get_workloads(name: str, *, arrival: str | None = None, cv: float | None = None) -> list[Workload]:
    """The workload(s) called ``name`` (a family expands to its members); ValueError listing valid names."""
    if arrival is not None and arrival not in ARRIVAL_PROCESSES:
        raise ValueError(f"unknown arrival process {arrival!r}; valid: {', '.join(ARRIVAL_PROCESSES)}")
    if name in ("platform-chat", "platform-chat-long", "tool-agent"):
        session_cv = 1.0 if arrival == "poisson" else (cv if cv is not None else production.SESSION_CV)
        if name == "tool-agent":
            return [ToolAgent(session_cv)]
        tokens = production.PLATFORM_TOKENS if name == "platform-chat" else production.PLATFORM_LONG_TOKENS
        return [PlatformChat(tokens, session_cv)]
    own_arrivals = name == REVISIT or name.split("/")[0] == WAKMAN_FAMILY
    if own_arrivals and (arrival not in (None, "poisson") or cv is not None):
        raise ValueError(f"{name} brings its own arrivals (Poisson): --arrival gamma and --arrival-cv do not apply")
    arrival = arrival or "poisson"
    cv = DEFAULT_ARRIVAL_CV if cv is None else cv
    if name == "cacheroute-aggregate":
        return [CacheRouteAggregate(arrival, cv)]
    if name == "whales":
        return [Whales(arrival, cv)]
    if name == "mmlu":
        return [Mmlu(arrival, cv)]
    if name == "low-reuse":
        return [LowReuse(arrival, cv)]
    if name == REVISIT:
        return [Revisit()]
    if name == RAG:
        return [Rag(arrival, cv if arrival == "gamma" else 1.0)]
    if name in (RAGPULSE, RAGPULSE_HISTORY):
        return [RagPulseShaped(arrival, cv if arrival == "gamma" else 1.0, history_segments=name == RAGPULSE_HISTORY)]
    if name == WAKMAN_FAMILY:
        return list(all_mixes())
    if name.startswith(WAKMAN_FAMILY + "/"):
        for mix in all_mixes():
            if mix.name == name:
                return [mix]
        valid = ", ".join(m.name for m in all_mixes())
        raise ValueError(f"unknown mix {name!r}; valid: {valid}")
    raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOAD_NAMES)} (or --trace FILE)")
