"""Sessions of several requests, as the mixes generate them (``wakman.py``, ``revisit.py``).

A mix starts sessions at the times of an arrival process; a session's first request is made when it starts, a chat's
later turns a think time after the previous turn *arrived* (open loop: they wait in ``Sessions.pending`` and are
interleaved with the sessions that start meanwhile, in time order), an agent's later steps chained to the first as
its ``follow`` (closed loop: the cluster releases them). Every length and time is drawn from one generator seeded by
the run's seed, in the order the requests are made, so a stream is a pure function of its seed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.base import Limit, PrefixTable, Stream, lognormal_int

__all__ = ["ChatTurns", "Sessions"]


@dataclass(frozen=True)
class ChatTurns:
    """A conversation's turns: the user message's and the answer's median lengths (lognormal), and the think time
    from one turn's arrival to the next's (exponential, with a floor)."""

    user_median: int
    output_median: int
    think_mean_s: float
    think_min_s: float


#: A chat turn waiting for its time: (arrival, sequence, its conversation's stream, key, turns left after it).
Pending = tuple[float, int, Stream, str, int]


class Sessions:
    """One run's sessions: the generator every draw comes from, the shared prefixes, the requests made so far (each
    one's id is the count before it) and the chat turns still to come."""

    def __init__(self, seed: int, space: BlockSpace, prefix_len: Callable[[int], int], chat: ChatTurns) -> None:
        self.seed = seed
        self.space = space
        self.rng = random.Random(seed)
        self.draw = self.rng.lognormvariate
        self.prefixes = PrefixTable(space, prefix_len)
        self.chat = chat
        self.created = 0
        self.pending: list[Pending] = []

    def run(
        self, starts: Iterator[float], limit: Limit, start: Callable[[float, int], SimRequest]
    ) -> Iterator[SimRequest]:
        """Sessions started at ``starts`` (``start(t, entity)`` makes each one's first request; entities count from
        1), interleaved with their pending chat turns in time order, until ``limit``."""
        next_start = next(starts)
        entity = 0
        while True:
            if self.pending and self.pending[0][0] <= next_start:  # a chat's next turn comes first
                t, _, stream, key, left = heapq.heappop(self.pending)
                if limit.reached(t, self.created):
                    return
                r = self.chat_turn(stream, t, key)
                self.later(t, stream, key, left - 1)
                yield r
                continue
            t = next_start
            next_start = next(starts)
            if limit.reached(t, self.created):
                return
            entity += 1
            yield start(t, entity)

    def stream(self, entity: int, prefix: int | None = None) -> Stream:
        """A new session's token stream, behind shared prefix ``prefix`` when it has one."""
        if prefix is None:
            return Stream(self.space, entity)
        return Stream(self.space, entity, self.prefixes.get(prefix))

    def request(self, stream: Stream, t: float, key: str, tokens: int, output: int, cls: str) -> SimRequest:
        r = stream.request(self.created, t, key, tokens, output, cls)
        self.created += 1
        return r

    def chat_turn(self, stream: Stream, t: float, key: str) -> SimRequest:
        """A conversation's turn: a user message, then its answer."""
        chat, draw = self.chat, self.draw
        return self.request(
            stream, t, key,
            lognormal_int(draw, chat.user_median, 0.8, 4, 4000),
            lognormal_int(draw, chat.output_median, 0.7, 4, 2000), "chat",
        )  # fmt: skip

    def later(self, t: float, stream: Stream, key: str, left: int) -> None:
        """The conversation's next turn, a think time after the one that arrived at ``t``, if ``left`` remain."""
        if left > 0:
            think = max(self.chat.think_min_s, self.rng.expovariate(1.0 / self.chat.think_mean_s))
            heapq.heappush(self.pending, (t + think, self.created, stream, key, left))
