"""The plan's unit of work: what one request costs the destination that serves it, in prefill-token units.

A request's work is ``uncached prompt tokens x prefill_token_cost + completion tokens x decode_token_cost``, with
the token counts the serving engine reports when the request ends (``ServedWork``): the prefix-cache hit the engine
found, not the router's estimate when it routed, and the completion length it produced, not ``max_tokens``. Counting
at routing time made a key whose prefix the router did not yet see cached look like a full prefill on every request,
and weighed every request by its upper bound of decode: on a live mesh the plan weighed a key with half the traffic
at ~17x a small key's load while it carried ~50x their requests (docs/plan.md, "Work").

The weights come from the engine's cost profile (``p2pnode/cost/profiles.py``), the one a node names with
``--cost-profile`` and the simulator runs: a decode token costs the GPU time of one sequence's share of a busy
decode step (``DECODE_BATCH`` sequences of ``DECODE_CONTEXT`` tokens), divided by the time of one prefilled token.
That is ~5.3 for Llama-3.1-8B on an H100 and ~0.25 for the tiny CPU model, whose steps are mostly fixed overhead
shared by the batch: no one ratio fits every engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pnode.config import DEFAULT_DECODE_TOKEN_COST
from p2pnode.cost import CostProfile

__all__ = ["DECODE_BATCH", "DECODE_CONTEXT", "ServedWork", "decode_token_cost"]

#: The busy decode step a decode token's cost is a share of: 64 sequences of 2,048 tokens of context.
DECODE_BATCH, DECODE_CONTEXT = 64, 2048


def decode_token_cost(profile: CostProfile) -> float:
    """GPU time of one decode token in prefill-token units, from the profile (the planner's load unit); a profile
    whose prefill costs nothing (a fixed-step test engine) gives ``DEFAULT_DECODE_TOKEN_COST``."""
    if not profile.prefill_s_per_token > 0:
        return DEFAULT_DECODE_TOKEN_COST
    step = profile.step_time(0, 0.0, DECODE_BATCH, DECODE_BATCH * DECODE_CONTEXT)
    return step / DECODE_BATCH / profile.prefill_s_per_token


@dataclass(frozen=True, slots=True)
class ServedWork:
    """One finished request as its engine reported it: what the plan counts (``RateSketch.observe``)."""

    prompt_tokens: int
    cached_tokens: int  # the engine's prefix-cache hit
    completion_tokens: int  # tokens it generated

    @property
    def uncached_tokens(self) -> int:
        """The prefill it cost: prompt tokens the engine did not find cached (never negative)."""
        return max(self.prompt_tokens - self.cached_tokens, 0)

    def work(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        return self.uncached_tokens * prefill_token_cost + max(self.completion_tokens, 0) * decode_token_cost
