"""Greedy tokens compared across engines, processes and hosts: only as far as the reference's first near-tie.

The tiny model has random weights: its next-token logits are close together, and now and then its top two are
within a few bf16 roundings of each other -- or equal. Which of the two wins then depends on the order in which the
host's kernels add things up (AVX2, AVX-512, AMX; oneDNN's and vLLM's own), and on how the prompt was split between
cache and computation; every token after it follows from that choice. So a greedy answer is compared only up to its
first step that was not *decided*: where the chosen token did not lead every other by at least ``DECIDED_MARGIN``.
The margin is measured on the reference (the recording, or the run compared against), from its top log-probabilities
(a log-softmax keeps logit differences).

``DECIDED_MARGIN``: vLLM's logits are bf16, 8 significant bits; the tiny model's top logits lie between 0.77 and
1.29 (measured), where one bf16 step is 2^-8 below 1 and 2^-7 above. The same requests (the recorded cases and 60
random prompts, 1,024 greedy steps) served with this host's kernels (AVX512-BF16) and with those an AVX2-only host and
an AVX-512 host without bf16 get (forced in every process by a sitecustomize that makes torch.cpu's capability
probes, _is_avx512_supported and _is_avx512_bf16_supported, which decide vLLM's kernels, answer as such a host's
would, with ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE_VNNI and ATEN_CPU_CAPABILITY=avx2 or avx512; the AVX2 run gave
every answer recorded on a real AVX2-only host) moved the difference of two logits by at most 2^-6
(``OBSERVED_SPREAD``), and every flip they made was at a margin of 2^-7 or less. A step is decided at twice that
spread: four bf16 steps of a logit above 1 (2^-5; 0.03, off the lattice bf16 logits' differences lie on, so that
the float error of a log-softmax cannot put a margin of exactly 2^-5 on either side). About a quarter of the tiny
model's steps fall short of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pnode.engine.base import GenerationChunk, PositionLogprobs
    from p2pnode.v1 import node_pb2

#: The largest change in the difference of two logits of one step between two hosts' kernels (the probes above).
OBSERVED_SPREAD = 2**-6
#: A step whose chosen token leads every other by at least this much (logprob units) is the same on every host.
DECIDED_MARGIN = 0.03
#: A comparison with fewer decided steps than this checks too little to mean anything: choose another prompt. A
#: test whose reference is computed where it runs has prompts that decide their first steps here by at least
#: DECIDED_MARGIN + OBSERVED_SPREAD, so that every host decides them too.
MIN_DECIDED_STEPS = 3


def margin(top: Mapping[int, float], chosen: int, bias: Mapping[int, float] | None = None) -> float:
    """How far ``chosen`` led the best other token at one step: ``top`` the step's top log-probabilities (token id ->
    logprob, raw: before ``bias``, vLLM's logit_bias, which the choice saw), the chosen token's among them (vLLM adds
    the sampled one). A token outside ``top`` scored at most its lowest entry, plus its bias."""
    bias = bias or {}
    floor = min(top.values())
    mine = top[chosen] + bias.get(chosen, 0.0)
    others = [lp + bias.get(t, 0.0) for t, lp in top.items() if t != chosen]
    unseen_bias = max([b for t, b in bias.items() if t != chosen and t not in top], default=0.0)
    return mine - max([*others, floor + max(unseen_bias, 0.0)])


def decided_steps(margins: Sequence[float]) -> int:
    """How many leading steps were decided (every step after the first undecided one depends on how it went)."""
    for step, m in enumerate(margins):
        if m < DECIDED_MARGIN:
            return step
    return len(margins)


def assert_same_greedy(
    reference: Sequence[int], margins: Sequence[float], tokens: Sequence[int], min_steps: int = MIN_DECIDED_STEPS
) -> None:
    """``tokens`` are ``reference``'s greedy tokens as far as those were decided (``margins``: the reference's, one per
    token); at least ``min_steps`` of them must be (else the prompt tells nothing: choose another)."""
    assert len(margins) == len(reference), (len(margins), len(reference))
    decided = decided_steps(margins)
    assert decided >= min(min_steps, len(reference)), (
        f"only {decided} of {len(reference)} greedy steps decided (margins {[round(m, 4) for m in margins]}): "
        "choose another prompt"
    )
    assert list(tokens[:decided]) == list(reference[:decided]), (
        f"greedy tokens differ within the {decided} decided steps: {list(tokens)} != {list(reference)}"
    )


def position_margin(position: node_pb2.PositionLogprobs | PositionLogprobs) -> float:
    """One step of an answer with its top log-probabilities (at least 2; a gRPC answer's or an engine's): its
    sampled token's lead over the best other."""
    top = {t.token_id: t.logprob for t in position.top}
    top.setdefault(position.sampled.token_id, position.sampled.logprob)
    return margin(top, position.sampled.token_id)


async def tap_margins(
    messages: AsyncIterable[node_pb2.GenerateResponse], into: list[float]
) -> AsyncIterator[node_pb2.GenerateResponse]:
    """``messages`` as they come, each step's margin appended to ``into`` (for ``client.collect_call``)."""
    async for message in messages:
        into.extend(position_margin(p) for p in message.logprobs)
        yield message


def chunk_margins(chunks: Sequence[GenerationChunk]) -> list[float]:
    """An engine's answer's margins, one per token (``SamplingOptions.logprobs`` at least 2)."""
    return [position_margin(p) for c in chunks for p in c.logprobs]
