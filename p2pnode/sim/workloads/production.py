"""Production traffic shapes, built from published statistics of real traces (never from one trace's contents):
``platform-chat`` (and ``platform-chat-long``), long multi-turn conversations behind one platform system prompt that
every request starts with, and ``tool-agent``, agent sessions behind a few long tool-definition prompts.

**platform-chat** -- the shape of Kimi's conversation trace (Mooncake, FAST'25):
- every request begins with the same platform prompt: one 512-token block in Mooncake's conversation trace ("every
  conversation request shares first block 0", a third-party analysis of the released trace); ``platform-chat-long``
  uses a 4,096-token one;
- sessions arrive as a bursty Gamma process (coefficient of variation 2): arrivals are "bursty beyond Poisson"
  (ServeGen, NSDI'26; BurstGPT, KDD'25), and Mooncake's hour has only ~1,180 distinct timestamps;
- turns per session: lognormal, median 2, 90th percentile 9 (so ~40% single-turn, mean ~4): BurstGPT's conversation
  logs (mean 4.18, median 2, p90 9, 35.5% single-turn);
- the first turn brings a long context (lognormal, median 2,000 tokens, sigma 1.2) and every later turn adds the
  previous answer plus a new message (lognormal, median 800 tokens, sigma 1.0); answers are lognormal with median
  250 and mean ~340 tokens. Mooncake's conversation trace averages 12,035 input and 343 output tokens per request,
  up to 128K (paper, Table 2), with a median input of ~6,900 (a third-party analysis of the released trace); the two
  context medians are set so that, with these turns and think times, requests average ~11,500 input tokens with a
  median of ~7,700. (ServeGen's conversations grow by a median +2,106 tokens a turn, on a mean input of 20,220.)
- the next turn comes a think time after the previous one (open loop): lognormal, median 124 s, 90th percentile
  2,331 s (BurstGPT), at most an hour (a trace's span: Mooncake's are one hour). Sessions start up to four hours
  before time 0, so the run begins in steady state (later turns arrive from the start) with caches cold, as after a
  restart.

**tool-agent** -- the shape of Kimi's tool&agent trace (Mooncake: average input 8,596 tokens, output 182, 59% cache
ratio; "pre-designed, often lengthy, system prompts that are fully repetitive"):
- four agent applications, each with its own system prompt and tool definitions (2,000-6,000 tokens), chosen with
  Mooncake's tool&agent first-block popularity (3 of 4 first blocks cover 46%, 39% and 15% of requests);
- a session runs 1 + Geometric(mean 3) steps; each step appends a tool result (lognormal, median 700 tokens, sigma
  1.0; coding agents append a median 1,045 per round (TraceLab), on far longer contexts: 700 gives Mooncake's mean
  input of ~8,600 tokens with these sessions) and answers with a short tool call (lognormal median 30, mean ~180
  tokens: the tool&agent trace's output median 30 and mean 182);
- the next step is released 1 s (median, lognormal sigma 1.0) after the previous one *finishes* (closed loop: TraceLab's
  idle gap after a tool result, median 1.0 s); sessions start as a bursty Gamma process (CV 2).

Both have no client routing keys (the router derives them) and are simulated at Mooncake's 512-token blocks.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator

from p2pnode.config import MOONCAKE_BLOCK_SIZE
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import Limit, PrefixTable, Stream, cumulative, lognormal_int, pick

__all__ = ["PlatformChat", "ToolAgent"]

#: Mooncake's block (the traces' hash_ids name 512-token blocks).
BLOCK_SIZE = MOONCAKE_BLOCK_SIZE
#: Session arrivals: Gamma renewal process with this coefficient of variation (bursty).
SESSION_CV = 2.0

PLATFORM_TOKENS, PLATFORM_LONG_TOKENS = 512, 4096
TURNS_MEDIAN, TURNS_P90, MAX_TURNS = 2.0, 9.0, 40
FIRST_CONTEXT_MEDIAN, FIRST_CONTEXT_SIGMA = 2000, 1.2
GROWTH_MEDIAN, GROWTH_SIGMA = 800, 1.0
ANSWER_MEDIAN, ANSWER_SIGMA = 250, 0.8
THINK_MEDIAN_S, THINK_P90_S = 124.0, 2331.0
#: Longest request (Mooncake's conversations reach 128K tokens).
MAX_CONTEXT = 131_072
#: Longest think time (Mooncake's traces span an hour).
MAX_THINK_S = 3600.0
#: How long before time 0 sessions start: a steady-state population from the first second (sessions of 40 turns
#: can span hours; ~97% of the steady-state rate is reached with 4 hours).
PRESTART_S = 4 * 3600.0

#: The agent applications: (prompt tokens, share of requests).
AGENT_APPS = ((4500, 0.46), (3000, 0.39), (6000, 0.15), (2000, 0.002))
AGENT_STEPS_MEAN = 3.0
TOOL_RESULT_MEDIAN, TOOL_RESULT_SIGMA = 700, 1.0
TOOL_CALL_MEDIAN, TOOL_CALL_SIGMA = 30, 1.9
AGENT_GAP_MEDIAN_S, AGENT_GAP_SIGMA = 1.0, 1.0

_Z90 = 1.2815515655446004  # the standard normal's 90th percentile


def _lognormal_sigma(median: float, p90: float) -> float:
    return math.log(p90 / median) / _Z90


class PlatformChat:
    """Long conversations behind one platform prompt (module docstring)."""

    block_size = BLOCK_SIZE
    description = "multi-turn conversations behind one platform prompt every request shares (Mooncake conversation)"

    def __init__(self, platform_tokens: int = PLATFORM_TOKENS, cv: float = SESSION_CV) -> None:
        self.platform_tokens = platform_tokens
        self.cv = cv
        self.name = "platform-chat" if platform_tokens == PLATFORM_TOKENS else "platform-chat-long"
        self._turn_sigma = _lognormal_sigma(TURNS_MEDIAN, TURNS_P90)
        self._think_sigma = _lognormal_sigma(THINK_MEDIAN_S, THINK_P90_S)
        # Mean turns of the clipped lognormal, for the session rate (estimated once, deterministically).
        rng = random.Random(0)
        self.mean_turns = sum(self._turns(rng) for _ in range(20_000)) / 20_000

    def _turns(self, rng: random.Random) -> int:
        return max(1, min(MAX_TURNS, round(rng.lognormvariate(math.log(TURNS_MEDIAN), self._turn_sigma))))

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{self.name} needs a request rate")
        rng = random.Random(seed)
        draw = rng.lognormvariate
        platform = PrefixTable(space, lambda _: self.platform_tokens).get(0)
        starts = arrival_times(random.Random(seed ^ 0xC4A7), qps / self.mean_turns, "gamma", self.cv)
        next_start = next(starts) - PRESTART_S
        # Turns due: (time, seq, stream, turns left); a turn before time 0 only grows its conversation.
        due: list[tuple[float, int, Stream, int]] = []
        seq = rid = created = 0
        while True:
            if due and due[0][0] <= next_start:
                t, _, stream, left = heapq.heappop(due)
                first = False
            else:
                t, next_start = next_start, next(starts) - PRESTART_S
                seq += 1
                stream = Stream(space, seq, platform)
                left = self._turns(rng)
                first = True
            if t >= 0 and limit.reached(t, created):
                return
            median = FIRST_CONTEXT_MEDIAN if first else GROWTH_MEDIAN
            sigma = FIRST_CONTEXT_SIGMA if first else GROWTH_SIGMA
            new = lognormal_int(draw, median, sigma, 1, MAX_CONTEXT)
            answer = lognormal_int(draw, ANSWER_MEDIAN, ANSWER_SIGMA, 1, 8192)
            if stream.length + new + answer > MAX_CONTEXT:
                continue  # the conversation outgrew the context: it ends
            r = stream.request(rid, t, "", new, answer, "chat")
            rid += 1
            if left > 1:
                seq += 1
                think = min(MAX_THINK_S, rng.lognormvariate(math.log(THINK_MEDIAN_S), self._think_sigma))
                heapq.heappush(due, (t + think, seq, stream, left - 1))
            if t >= 0:
                created += 1
                yield r


class ToolAgent:
    """Agent sessions behind a few long tool-definition prompts (module docstring)."""

    name = "tool-agent"
    block_size = BLOCK_SIZE
    description = "agent sessions behind 4 long tool-definition prompts, short closed-loop steps (Mooncake tool&agent)"

    def __init__(self, cv: float = SESSION_CV) -> None:
        self.cv = cv
        self._apps = cumulative([share for _, share in AGENT_APPS])

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{self.name} needs a request rate")
        rng = random.Random(seed)
        draw = rng.lognormvariate
        prompts = PrefixTable(space, lambda app: AGENT_APPS[app][0])
        mean_steps = 1.0 + AGENT_STEPS_MEAN
        starts = arrival_times(random.Random(seed ^ 0x7A9E), qps / mean_steps, "gamma", self.cv)
        p = 1.0 / (1.0 + AGENT_STEPS_MEAN)
        rid = created = 0
        for session, t in enumerate(starts, start=1):
            if limit.reached(t, created):
                return
            app = pick(rng.random(), self._apps)
            stream = Stream(space, session, prompts.get(app))
            steps = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))  # 1 + Geometric(mean AGENT_STEPS_MEAN)
            head = prev = None
            for _ in range(steps):
                new = lognormal_int(draw, TOOL_RESULT_MEDIAN, TOOL_RESULT_SIGMA, 1, 32_768)
                out = lognormal_int(draw, TOOL_CALL_MEDIAN, TOOL_CALL_SIGMA, 1, 4096)
                if stream.length + new + out > MAX_CONTEXT:
                    break
                r = stream.request(rid, t if prev is None else -1.0, "", new, out, "agent")
                rid += 1
                created += 1
                if prev is None:
                    head = r
                else:
                    prev.follow = r
                    prev.follow_gap_s = rng.lognormvariate(math.log(AGENT_GAP_MEDIAN_S), AGENT_GAP_SIGMA)
                prev = r
            if head is not None:
                yield head
