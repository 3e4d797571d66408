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

import random
from collections.abc import Iterator

from p2pnode.config import DEFAULT_SIM_BLOCK_SIZE
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import (
    Limit,
    cumulative,
    geometric,
    hashed_lognormal,
    lognormal_int,
    pick,
    zipf_weights,
)
from p2pnode.sim.workloads.sessions import ChatTurns, Sessions

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
CHAT = ChatTurns(CHAT_USER_MEDIAN, CHAT_OUTPUT_MEDIAN, CHAT_THINK_MEAN_S, CHAT_THINK_MIN_S)

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
        sessions = Sessions(seed, space, lambda e: _prefix_len(seed, e), CHAT)
        start = {"single": self._single, "chat": self._chat, "agent": self._agent}
        session_rate = qps * sum(self.shares[c] / MEAN_LEN[c] for c in self._classes)
        starts = arrival_times(random.Random(seed ^ 0xA5A5), session_rate, "poisson")

        def session(t: float, entity: int) -> SimRequest:
            cls = self._classes[pick(sessions.rng.random(), self._session_weights)]
            return start[cls](sessions, entity, t)

        yield from sessions.run(starts, limit, session)

    def _single(self, s: Sessions, entity: int, t: float) -> SimRequest:
        """A template and a unique body: one request."""
        e = _TEMPLATE_BASE + pick(s.rng.random(), self._tmpl)
        stream = s.stream(entity, e)
        return s.request(
            stream, t, f"s{s.seed}t{e}",
            lognormal_int(s.draw, BODY_MEDIAN, 0.8, 16, 8000),
            lognormal_int(s.draw, SINGLE_OUTPUT_MEDIAN, 0.7, 4, 2000), "single",
        )  # fmt: skip

    def _chat(self, s: Sessions, entity: int, t: float) -> SimRequest:
        """A thread's first turn; its later turns come a think time apart (``Sessions.later``)."""
        e = _SYSTEM_BASE + pick(s.rng.random(), self._sys)
        stream = s.stream(entity, e)
        key = f"s{s.seed}c{e}"
        turns = 1 + geometric(s.rng, CHAT_EXTRA_TURNS_MEAN)
        r = s.chat_turn(stream, t, key)
        s.later(t, stream, key, turns - 1)
        return r

    def _agent(self, s: Sessions, entity: int, t: float) -> SimRequest:
        """A session's first step, every later one chained to it as its ``follow`` (closed loop)."""
        e = _AGENT_BASE + pick(s.rng.random(), self._agents)
        stream = s.stream(entity, e)
        key = f"s{s.seed}a{e}"
        steps = 2 + geometric(s.rng, AGENT_EXTRA_STEPS_MEAN)
        first = prev = s.request(
            stream, t, key,
            lognormal_int(s.draw, AGENT_TASK_MEDIAN, 0.6, 16, 4000),
            lognormal_int(s.draw, AGENT_OUTPUT_MEDIAN, 0.5, 8, 1000), "agent",
        )  # fmt: skip
        for _ in range(steps - 1):
            nxt = s.request(
                stream, -1.0, key,
                lognormal_int(s.draw, AGENT_TOOL_MEDIAN, 1.0, 8, 8000),
                lognormal_int(s.draw, AGENT_OUTPUT_MEDIAN, 0.5, 8, 1000), "agent",
            )  # fmt: skip
            prev.follow = nxt
            prev.follow_gap_s = s.rng.expovariate(1.0 / AGENT_GAP_MEAN_S)
            prev = nxt
        return first


def _prefix_len(seed: int, e: int) -> int:
    """The length of shared prefix ``e``: a template, a system prompt or an agent prompt, by its entity range."""
    if e >= _AGENT_BASE:
        return hashed_lognormal(seed, e, AGENT_PROMPT_MEDIAN, 0.4, 512, 12_000)
    if e >= _SYSTEM_BASE:
        return hashed_lognormal(seed, e, SYSTEM_MEDIAN, 0.6, 64, 6000)
    return hashed_lognormal(seed, e, TEMPLATE_MEDIAN, 0.6, 32, 4000)


def all_mixes() -> list[WakmanMix]:
    """Every mix on the grid: single + chat + agent = 100% in steps of 100 / GRID_STEPS (21 mixes)."""
    out = []
    for s in range(GRID_STEPS + 1):
        for c in range(GRID_STEPS + 1 - s):
            out.append(WakmanMix(s / GRID_STEPS, c / GRID_STEPS, (GRID_STEPS - s - c) / GRID_STEPS))
    return out
