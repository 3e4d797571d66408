"""Stream migration: a sequence whose serving node fails after it streamed tokens continues on another node.

The continuation is an ordinary request: the prompt followed by the token ids already sent, for the tokens still
owed (``max_tokens`` and ``min_tokens`` less those sent), under a new id. A greedy model computes from that prefix
exactly what the failed node would have computed next, so the client sees each token once and in order, as if
nothing had happened (Dynamo's request migration, ``--migration-limit``).

What migrates is what such a continuation reproduces (``not_resumable`` says why a request does not): greedy or
unseeded sampling, with stop strings (checked across the seam: below), logit bias, stop token ids, repetition penalty
(computed over prompt and output alike) and logprobs. What does not, and ends with the partial output as before:
- seeded sampling: the engine's per-request random state cannot be replayed on another node;
- presence and frequency penalties and structured outputs: they depend on the output so far (counted over output
  tokens, a grammar's state), which the continuation would take for prompt;
- stop strings before ``min_tokens`` were sent (the engine checks none until then);
- segments: the serving node lays an exact-mode prompt out as it chooses and approximate reuse depends on its
  store, so the continuation's prefix would not be the one the first node computed with.

Text: the serving node turns token ids into text with the prompt as context, and may hold back the end of a
character split across tokens. ``TextSeam`` makes the client's text across the seam what one node would have sent:
it decodes the streamed tokens and the continuation's first tokens together and sends what the failed node still
owed, never twice. Stop strings: the failed node held back the text that might begin one, and the continuation's
node sees its own output only, so ``StopSeam`` checks the joined text across the seam as the engine would. It needs
the engine's decode to be what its stream sent and the seam to fall between characters (inside one, the
continuation's engine checks its stop strings on garbled text): a stop-string request whose seam is not so does not
migrate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2pnode.request import Request

__all__ = ["MIGRATION_SUFFIX", "SeamCut", "StopSeam", "TextSeam", "continuation", "not_resumable"]

#: The continuation's request id: the sequence's own id and the migration's number (``<id>.m1``): a failed node that
#: is only frozen may still hold the old id, and the serving engine keys requests by it.
MIGRATION_SUFFIX = ".m"

#: Prompt tokens decoded before the seam's tokens, so a tokenizer that drops a leading space decodes them in context.
SEAM_CONTEXT_TOKENS = 8

Decode = Callable[[list[int]], str]


def not_resumable(request: Request, sent: int) -> str:
    """Why a continuation of ``request`` after ``sent`` tokens would not produce what its first node would have ("" if
    it would)."""
    s = request.sampling
    if s.seed is not None and s.temperature > 0:
        return "seeded sampling cannot be replayed on another node"
    if s.presence_penalty or s.frequency_penalty:
        return "presence and frequency penalties count the output so far"
    if s.structured_outputs:
        return "a structured output's grammar state cannot be moved"
    if s.stop and s.min_tokens > sent:
        return "stop strings are not checked before min_tokens, which the seam cannot tell"
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
    return request.with_tokens(
        (*request.tokens, *streamed),
        request_id=f"{request.request_id}{MIGRATION_SUFFIX}{migration}",
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

    def text(self, token_ids: Sequence[int], node_text: str, stop_token: bool = False) -> str:
        """The text to send with a continuation message carrying ``token_ids`` and ``node_text``; ``stop_token``:
        its last token is a stop token whose text the client must not see (vLLM leaves it out unless
        ``include_stop_str_in_output``)."""
        if not self._mending:
            return node_text
        start = len(self._tokens)
        self._tokens.extend(token_ids[:-1] if stop_token and token_ids else token_ids)
        # the longest run of this message's tokens whose decode ends on a whole character, as a stream of one token a
        # message would send it: a message of several tokens may end inside a character while holding whole ones
        for end in range(len(self._tokens), start - 1, -1):
            full = self._decode(self._context + self._tokens[:end])
            if not full.startswith(self._base):
                self._mending = False
                return node_text
            expected = full[len(self._base):]
            if not expected.startswith(self._sent):  # the engine's stream is not its decode: nothing to mend
                self._mending = False
                return node_text
            if not expected.endswith("\ufffd"):
                break
        else:  # a character still split across tokens: wait for its end (a stream never sends one unfinished)
            return ""
        if len(expected) == len(self._sent) and end < len(self._tokens):
            return ""  # nothing past the seam is whole yet
        new = expected[len(self._sent):]
        self._sent = expected
        self._mending = False  # the seam is behind: the continuation's node sends the right deltas from here on
        return new


@dataclass(frozen=True, slots=True)
class SeamCut:
    """What a continuation message becomes at the seam: its ``text``, the number of its tokens to keep (None: all)
    and the stop string that ended the sequence there ("": none)."""

    text: str
    keep: int | None = None
    stop: str = ""


class StopSeam:
    """Stop strings across a migration's seam, where neither node can see them.

    The failed node held back the end of its text that could begin a stop string, and the continuation's node checks
    its own output only. So for the continuation's first tokens -- until its text is longer than any stop string --
    the ingress decodes each token in context and checks the joined text as the engine would (the stop string that
    completes earliest; the text cut before it, or after it with ``include_stop_str_in_output``; the tokens after
    the one completing it dropped). Past that window it passes on the node's text, less what it already sent.
    Built only where the engine's decode is what its stream sent and the seam falls between characters (``build``):
    otherwise no check is possible.
    """

    __slots__ = ("_base", "_context", "_decode", "_held", "_include", "_node_text", "_node_window", "_post_sent",
                 "_reach", "_seam_at", "_sent", "_stops", "_text", "_tokens", "_window")

    def __init__(
        self, decode: Decode, context: list[int], base: str, streamed: Sequence[int], before: str, sent_text: str,
        stops: tuple[str, ...], include: bool,
    ) -> None:
        self._decode, self._context, self._base = decode, context, base
        self._tokens = list(streamed)
        self._stops, self._include = stops, include
        self._reach = max(len(s) for s in stops)
        #: What the engine holds back of its text: what may begin a stop string (vLLM's stop_buffer_length).
        self._held = 0 if include else self._reach - 1
        self._seam_at = len(before)  # the text before the seam, as one stream would have sent it
        self._text = before  # the text so far, checked for stop strings (by the engines before the seam)
        self._sent = sent_text  # ... and what the client has of it
        self._window = True
        self._node_text = 0  # characters of the continuation node's text received
        self._node_window = ""  # ... and that text, while the ingress sends its own
        self._post_sent = 0  # ... and of the text past the seam the ingress sent itself

    @classmethod
    def build(
        cls, decode: Decode, prompt: Sequence[int], streamed: Sequence[int], sent_text: str, stops: tuple[str, ...],
        include: bool,
    ) -> StopSeam | None:
        """The seam's checker, or None when the seam falls inside a character or the engine's decode of the
        streamed tokens is not the text it sent."""
        context = list(prompt[-SEAM_CONTEXT_TOKENS:])
        base, full = decode(context), decode(context + list(streamed))
        if not full.startswith(base):
            return None
        before = full[len(base):]
        # A seam inside a character: the continuation's engine decodes its first bytes without the character's
        # start and checks its stop strings on that garbled text; nothing here can make it see the right text.
        if before.endswith("\ufffd") or not before.startswith(sent_text):
            return None
        return cls(decode, context, base, streamed, before, sent_text, stops, include)

    def take(self, token_ids: Sequence[int], node_text: str, *, last: bool = False, by_token: bool = False) -> SeamCut:
        """A continuation message's tokens and text as the client gets them. ``last``: the sequence's final message
        (nothing is held back); ``by_token``: it ends on a stop token, whose text the engine leaves out unless
        ``include_stop_str_in_output``."""
        if not self._window:
            return SeamCut(self._past_window(node_text))
        self._node_text += len(node_text)
        self._node_window += node_text
        for i, token in enumerate(token_ids):
            if not (by_token and not self._include and i == len(token_ids) - 1):
                self._tokens.append(token)
            expected = self._expected()
            if expected is None or expected.endswith("\ufffd") or len(expected) <= len(self._text):
                continue
            end, stop = self._first_stop(expected)
            if stop:
                text = expected[len(self._sent):end]
                self._sent = expected[:end]
                return SeamCut(text, i + 1, stop)
            self._text = expected
        # like the engine, hold back what may begin a stop string until the stream ends
        shown = len(self._text) if last else max(len(self._sent), len(self._text) - self._held)
        text = self._text[len(self._sent):shown]
        self._sent = self._text[:shown]
        if len(self._text) - self._seam_at >= self._reach:  # no stop string can span the seam any more
            self._window = False
            ours = self._sent[self._seam_at:]
            if len(self._node_window) > len(ours) and self._node_window.startswith(ours):  # the node sent more
                text += self._node_window[len(ours):]
                self._sent += self._node_window[len(ours):]
            self._post_sent = len(self._sent) - self._seam_at
        return SeamCut(text)

    def _expected(self) -> str | None:
        full = self._decode(self._context + self._tokens)
        return full[len(self._base):] if full.startswith(self._base) else None

    def _first_stop(self, text: str) -> tuple[int, str]:
        """Where the text ends at the stop string completed earliest in the new part of ``text`` (vLLM's
        ``check_stop_strings``), and that stop string ("" when none)."""
        best_end, best_cut, best = len(text) + 1, 0, ""
        for stop in self._stops:
            start = text.find(stop, max(0, len(self._text) - len(stop) + 1))
            if start != -1 and start + len(stop) < best_end:
                best_end, best = start + len(stop), stop
                best_cut = best_end if self._include else start
        return best_cut, best

    def _past_window(self, node_text: str) -> str:
        """The node's text, less the part of it the ingress sent itself during the window."""
        skip = max(0, self._post_sent - self._node_text)
        self._node_text += len(node_text)
        return node_text[skip:]
