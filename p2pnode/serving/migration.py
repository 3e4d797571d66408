"""Stream migration: a sequence whose serving node fails after it streamed tokens continues on another node.

The continuation is an ordinary request: the prompt followed by the token ids already sent, for the tokens still
owed (``max_tokens`` and ``min_tokens`` less those sent), under a new id. A greedy model computes from that prefix
exactly what the failed node would have computed next, so the client sees each token once and in order, as if
nothing had happened (Dynamo's request migration, ``--migration-limit``).

What migrates is what such a continuation reproduces (``not_resumable`` says why a request does not): greedy or
unseeded sampling, with logit bias, stop token ids, repetition penalty (computed over prompt and output alike) and
logprobs. What does not, and ends with the partial output as before:
- seeded sampling: the engine's per-request random state cannot be replayed on another node;
- presence and frequency penalties and structured outputs: they depend on the output so far (counted over output
  tokens, a grammar's state), which the continuation would take for prompt;
- stop strings: the serving node holds back the text that may begin one, and a stop string across the seam would
  be seen by neither node;
- segments: the serving node lays an exact-mode prompt out as it chooses and approximate reuse depends on its
  store, so the continuation's prefix would not be the one the first node computed with.

Text: the serving node turns token ids into text with the prompt as context, and may hold back the end of a
character split across tokens. ``TextSeam`` makes the client's text across the seam what one node would have sent:
it decodes the streamed tokens and the continuation's first tokens together and sends what the failed node still
owed, never twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from p2pnode.request import Request

__all__ = ["MIGRATION_SUFFIX", "TextSeam", "continuation", "not_resumable"]

#: The continuation's request id: the sequence's own id and the migration's number (``<id>.m1``): a failed node that
#: is only frozen may still hold the old id, and the serving engine keys requests by it.
MIGRATION_SUFFIX = ".m"

#: Prompt tokens decoded before the seam's tokens, so a tokenizer that drops a leading space decodes them in context.
SEAM_CONTEXT_TOKENS = 8

Decode = Callable[[list[int]], str]


def not_resumable(request: Request) -> str:
    """Why a continuation of ``request`` would not produce what its first node would have ("" if it would)."""
    s = request.sampling
    if s.seed is not None and s.temperature > 0:
        return "seeded sampling cannot be replayed on another node"
    if s.presence_penalty or s.frequency_penalty:
        return "presence and frequency penalties count the output so far"
    if s.structured_outputs:
        return "a structured output's grammar state cannot be moved"
    if s.stop:
        return "stop strings may span the seam"
    if request.segments is not None:
        return "a segment layout is chosen by the serving node"
    return ""


def continuation(request: Request, streamed: Sequence[int], migration: int) -> Request:
    """The request that continues ``request`` after ``streamed`` output tokens, as its ``migration``-th migration
    (the caller has checked ``not_resumable`` and that tokens are still owed)."""
    sent = len(streamed)
    s = request.sampling
    sampling = dataclasses.replace(
        s, max_tokens=s.max_tokens - sent, min_tokens=max(s.min_tokens - sent, 0), prompt_logprobs=None
    )
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}{MIGRATION_SUFFIX}{migration}",
        tokens=(*request.tokens, *streamed),
        sampling=sampling,
        kv_source=None,
    )


class TextSeam:
    """The client's text across a migration: what the failed node held back, then the continuation's own.

    Built with the prompt, the token ids streamed and the text sent so far. For the continuation's first messages it
    decodes the tokens on both sides of the seam together (in the prompt's context, which the continuation's node
    had differently) and sends what the client has not seen yet: the failed node's held-back text and the first new
    characters, once no character is left split across tokens. From then on, or at once when the engine's decode
    is not what its stream sends (nothing to mend then), it passes the node's text through.
    """

    __slots__ = ("_base", "_context", "_decode", "_mending", "_sent", "_tokens")

    def __init__(self, decode: Decode, prompt: Sequence[int], streamed: Sequence[int], sent_text: str) -> None:
        self._decode = decode
        self._context = list(prompt[-SEAM_CONTEXT_TOKENS:])
        self._base = decode(self._context)
        self._tokens = list(streamed)
        self._sent = sent_text
        self._mending = True

    def text(self, token_ids: Sequence[int], node_text: str) -> str:
        """The text to send with a continuation message carrying ``token_ids`` and ``node_text``."""
        if not self._mending:
            return node_text
        self._tokens.extend(token_ids)
        full = self._decode(self._context + self._tokens)
        if not full.startswith(self._base):
            self._mending = False
            return node_text
        expected = full[len(self._base):]
        if not expected.startswith(self._sent):  # the engine's stream is not its decode: nothing to mend
            self._mending = False
            return node_text
        if expected.endswith("\ufffd"):  # a character still split across tokens: wait for its end (a stream never
            return ""                     # sends one unfinished, even at its end)
        new = expected[len(self._sent):]
        self._sent = expected
        self._mending = False  # the seam is behind: the continuation's node sends the right deltas from here on
        return new
