"""``wakman-mixes``: WAKMan-style mixes of single-turn, multi-turn chat and agentic requests (21 mixes).

Three request classes (lengths are ours; WAKMan's point is the mix, and which eviction policy wins depends on it):
- **single**: one of 100 prompt templates (Zipf 1.0, median 400 tokens) + a unique body (median 800) -> 200
  tokens. Reuse is the template only.
- **chat**: one of 1,000 system prompts (Zipf 0.9, median 800); a thread of 1 + Geometric(mean 3) turns (mean 4),
  user messages median 150, answers median 250, the next turn 20 s (exponential, >= 2 s) after the previous one
  arrived (open loop). Reuse: the system prompt and the thread's own history, tens of seconds later.
- **agent**: one of 200 agent prompts with tool schemas (Zipf 1.0, median 3000); a session of 2 + Geometric(mean
  10) steps; step 1 adds a task (median 400), each later step adds the previous tool call's result (median 400,
  wide) to the whole context; each step answers ~120 tokens (a tool call) and the next step is released
  1.5 s (exponential) after the previous one *finishes* (closed loop: "agentic steps return within seconds").
  Reuse: the whole, growing context, seconds later -- recency is everything, so LRU should do well here.

A mix gives the share of *requests* of each class. Mixes: every (single, chat, agent) share on a 20% grid (21
mixes, pure ones included). Sessions start as a Poisson process at ``qps * sum(share_c / mean_len_c)``, so the
request rate is ``qps`` in steady state, the class of a session drawn in proportion to ``share_c / mean_len_c``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator

from p2pnode.config import DEFAULT_SIM_BLOCK_SIZE
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import (
    Limit,
    PrefixTable,
    Stream,
    cumulative,
    geometric,
    hashed_lognormal,
    lognormal_int,
    pick,
    zipf_weights,
)

__all__ = ["FAMILY", "WakmanMix", "all_mixes"]

FAMILY = "wakman-mixes"
GRID_STEPS = 5  # 20% grid -> 21 mixes

N_TEMPLATES, TEMPLATE_ZIPF, TEMPLATE_MEDIAN = 100, 1.0, 400
BODY_MEDIAN, SINGLE_OUTPUT_MEDIAN = 800, 200
N_SYSTEMS, SYSTEM_ZIPF, SYSTEM_MEDIAN = 1000, 0.9, 800
CHAT_EXTRA_TURNS_MEAN, CHAT_USER_MEDIAN, CHAT_OUTPUT_MEDIAN = 3.0, 150, 250
CHAT_THINK_MEAN_S, CHAT_THINK_MIN_S = 20.0, 2.0
N_AGENTS, AGENT_ZIPF, AGENT_PROMPT_MEDIAN = 200, 1.0, 3000
AGENT_EXTRA_STEPS_MEAN, AGENT_TASK_MEDIAN, AGENT_TOOL_MEDIAN, AGENT_OUTPUT_MEDIAN = 10.0, 400, 400, 120
AGENT_GAP_MEAN_S = 1.5

#: Mean requests per session of each class.
MEAN_LEN = {"single": 1.0, "chat": 1.0 + CHAT_EXTRA_TURNS_MEAN, "agent": 2.0 + AGENT_EXTRA_STEPS_MEAN}
#: Entity offsets so the three classes' shared prefixes never share content ids.
_TEMPLATE_BASE, _SYSTEM_BASE, _AGENT_BASE = 0, 1 << 20, 2 << 20


class WakmanMix:
    #: Preferred simulation block size (``--block-size`` overrides it): agent contexts grow to ~10k tokens.
    block_size = DEFAULT_SIM_BLOCK_SIZE
    """One mix: shares of single-turn, chat and agent requests (they sum to 1)."""

    description = "WAKMan-style mix of single-turn, multi-turn chat and agentic (closed-loop) requests"

    def __init__(self, single: float, chat: float, agent: float) -> None:
        total = single + chat + agent
        if total <= 0 or min(single, chat, agent) < 0:
            raise ValueError("mix shares must be >= 0 and not all 0")
        self.shares = {"single": single / total, "chat": chat / total, "agent": agent / total}
        pct = {c: round(100 * v) for c, v in self.shares.items()}
        self.name = f"{FAMILY}/s{pct['single']}-c{pct['chat']}-a{pct['agent']}"
        self._classes = [c for c in ("single", "chat", "agent") if self.shares[c] > 0]
        self._session_weights = cumulative([self.shares[c] / MEAN_LEN[c] for c in self._classes])
        self._tmpl = cumulative(zipf_weights(N_TEMPLATES, TEMPLATE_ZIPF))
        self._sys = cumulative(zipf_weights(N_SYSTEMS, SYSTEM_ZIPF))
        self._agents = cumulative(zipf_weights(N_AGENTS, AGENT_ZIPF))

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{self.name} needs a request rate")
        rng = random.Random(seed)
        draw = rng.lognormvariate

        def prefix_len(e: int) -> int:
            if e >= _AGENT_BASE:
                return hashed_lognormal(seed, e, AGENT_PROMPT_MEDIAN, 0.4, 512, 12_000)
            if e >= _SYSTEM_BASE:
                return hashed_lognormal(seed, e, SYSTEM_MEDIAN, 0.6, 64, 6000)
            return hashed_lognormal(seed, e, TEMPLATE_MEDIAN, 0.6, 32, 4000)

        prefixes = PrefixTable(space, prefix_len)
        session_rate = qps * sum(self.shares[c] / MEAN_LEN[c] for c in self._classes)
        starts = arrival_times(random.Random(seed ^ 0xA5A5), session_rate, "poisson")
        next_start = next(starts)
        pending: list[tuple[float, int, Stream, str, int]] = []  # open-loop chat turns: (time, seq, stream, key, left)
        created = 0
        rid = 0
        entity = 0
        while True:
            if pending and pending[0][0] <= next_start:
                t, _, stream, key, left = heapq.heappop(pending)
                if limit.reached(t, created):
                    return
                r = stream.request(
                    rid, t, key,
                    lognormal_int(draw, CHAT_USER_MEDIAN, 0.8, 4, 4000),
                    lognormal_int(draw, CHAT_OUTPUT_MEDIAN, 0.7, 4, 2000), "chat",
                )
                rid += 1
                created += 1
                if left > 1:
                    heapq.heappush(pending, (t + self._think(rng), rid, stream, key, left - 1))
                yield r
                continue
            t = next_start
            next_start = next(starts)
            if limit.reached(t, created):
                return
            cls = self._classes[pick(rng.random(), self._session_weights)]
            entity += 1
            if cls == "single":
                e = _TEMPLATE_BASE + pick(rng.random(), self._tmpl)
                r = Stream(space, entity, prefixes.get(e)).request(
                    rid, t, f"s{seed}t{e}",
                    lognormal_int(draw, BODY_MEDIAN, 0.8, 16, 8000),
                    lognormal_int(draw, SINGLE_OUTPUT_MEDIAN, 0.7, 4, 2000), "single",
                )
                rid += 1
                created += 1
            elif cls == "chat":
                e = _SYSTEM_BASE + pick(rng.random(), self._sys)
                stream = Stream(space, entity, prefixes.get(e))
                key = f"s{seed}c{e}"
                turns = 1 + geometric(rng, CHAT_EXTRA_TURNS_MEAN)
                r = stream.request(
                    rid, t, key,
                    lognormal_int(draw, CHAT_USER_MEDIAN, 0.8, 4, 4000),
                    lognormal_int(draw, CHAT_OUTPUT_MEDIAN, 0.7, 4, 2000), "chat",
                )
                rid += 1
                created += 1
                if turns > 1:
                    heapq.heappush(pending, (t + self._think(rng), rid, stream, key, turns - 1))
            else:
                e = _AGENT_BASE + pick(rng.random(), self._agents)
                stream = Stream(space, entity, prefixes.get(e))
                key = f"s{seed}a{e}"
                steps = 2 + geometric(rng, AGENT_EXTRA_STEPS_MEAN)
                r = prev = stream.request(
                    rid, t, key,
                    lognormal_int(draw, AGENT_TASK_MEDIAN, 0.6, 16, 4000),
                    lognormal_int(draw, AGENT_OUTPUT_MEDIAN, 0.5, 8, 1000), "agent",
                )
                rid += 1
                created += 1
                for _ in range(steps - 1):
                    nxt = stream.request(
                        rid, -1.0, key,
                        lognormal_int(draw, AGENT_TOOL_MEDIAN, 1.0, 8, 8000),
                        lognormal_int(draw, AGENT_OUTPUT_MEDIAN, 0.5, 8, 1000), "agent",
                    )
                    rid += 1
                    created += 1
                    prev.follow = nxt
                    prev.follow_gap_s = rng.expovariate(1.0 / AGENT_GAP_MEAN_S)
                    prev = nxt
            yield r

    @staticmethod
    def _think(rng: random.Random) -> float:
        return max(CHAT_THINK_MIN_S, rng.expovariate(1.0 / CHAT_THINK_MEAN_S))


def all_mixes() -> list[WakmanMix]:
    """Every mix on the grid: single + chat + agent = 100% in steps of 100 / GRID_STEPS (21 mixes)."""
    out = []
    for s in range(GRID_STEPS + 1):
        for c in range(GRID_STEPS + 1 - s):
            out.append(WakmanMix(s / GRID_STEPS, c / GRID_STEPS, (GRID_STEPS - s - c) / GRID_STEPS))
    return out
