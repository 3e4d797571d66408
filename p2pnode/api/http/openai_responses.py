"""The ingress's message stream -> OpenAI responses, built with vLLM's own pydantic response models.

One ``ResponseBuilder`` per call: fed each ``GenerateResponse`` (token deltas, logprobs, one ``final`` per
sequence), it emits server-sent events for ``stream: true`` or, at the end, the whole response. Choice ``k`` is
sequence ``k`` (prompt ``k // n``, sample ``k % n``), as in vLLM. ``usage`` counts each prompt once (its first
sample's engine-reported ``cached_tokens`` in ``prompt_tokens_details``) and every sample's completion.

Each finished choice also carries ``p2pnode``: the node that served it, the routing policy and estimate, the
engine's cached tokens, the attempts and the KV pull of its prefix, if any — extra fields OpenAI clients ignore and
keep (``choice.model_extra``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo
from vllm.logprobs import Logprob

from p2pnode.client import pull_dict
from p2pnode.v1 import node_pb2

#: OpenAI's finish_reason for each of ours.
FINISH_REASONS = {
    node_pb2.FINISH_REASON_STOP: "stop",
    node_pb2.FINISH_REASON_LENGTH: "length",
    node_pb2.FINISH_REASON_ABORT: "abort",
}
#: A log-probability JSON can carry (vLLM clamps -inf the same way).
_MIN_LOGPROB = -9999.0
DONE_EVENT = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _lp(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def mesh_info(final: node_pb2.GenerateFinal) -> dict[str, Any]:
    """What the mesh did for one choice (the ``p2pnode`` extra field): as gRPC's GenerateFinal says it, ``pull`` the
    KV pull of the prefix the serving node attempted (holder, outcome, tokens, bytes, seconds; null when none)."""
    return {
        "served_by": final.served_by,
        "ingress": final.ingress,
        "policy": final.policy,
        "cached_tokens": final.cached_tokens,
        "estimated_match_tokens": final.estimated_match_tokens,
        "attempts": final.attempts,
        "migrations": final.migrations,
        "pull": pull_dict(final.pull) if final.HasField("pull") else None,
    }


def top_dict(position: node_pb2.PositionLogprobs, k: int) -> dict[str, float]:
    """A completion position's ``top_logprobs`` as vLLM builds it: the sampled (or prompt) token, then the likeliest
    alternatives, ``k + 1`` entries at most (by decoded token; -1: all)."""
    entries = [position.sampled, *(t for t in position.top if t.token_id != position.sampled.token_id)]
    if k >= 0:
        entries = entries[: k + 1]
    return {t.token: _lp(t.logprob) for t in entries}


def prompt_logprobs_json(positions: list[node_pb2.PositionLogprobs]) -> list[dict[int, Logprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first position, then {token id: Logprob(logprob, rank,
    decoded_token)} (the prompt's own token first, then the alternatives), vLLM's own type for the response models'
    field (plain dicts serialized the same but made pydantic warn on every such response)."""
    out: list[dict[int, Logprob] | None] = []
    for position in positions:
        if not position.HasField("sampled"):
            out.append(None)
            continue
        entries: dict[int, Logprob] = {}
        for t in (position.sampled, *position.top):
            entries.setdefault(t.token_id, Logprob(logprob=_lp(t.logprob), rank=t.rank or None, decoded_token=t.token))
        out.append(entries)
    return out


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    text_offset: int = 0
    final: node_pb2.GenerateFinal | None = None
    # completions' logprobs, accumulated for the non-streamed response
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # chat's logprobs
    content: list[ChatCompletionLogProbsContent] = field(default_factory=list)
    # the prompt's log-probabilities (its first message), and whether the echo was sent (streams)
    prompt_positions: list[node_pb2.PositionLogprobs] = field(default_factory=list)
    echoed: bool = False
    # return_token_ids: the tokens generated, and whether a chunk carried the prompt's (streamed completions)
    token_ids: list[int] = field(default_factory=list)
    prompt_ids_sent: bool = False


class ResponseBuilder:
    """Builds one call's OpenAI response (chat or completion, streamed or whole)."""

    def __init__(
        self,
        *,
        chat: bool,
        call_id: str,
        model: str,
        prompt_tokens: list[int],
        n: int,
        logprobs: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
        echo: list[str] | None = None,
        prompt_logprobs: bool = False,
        logprobs_k: int = 0,
        token_text: Callable[[int], str] | None = None,
        return_token_ids: bool = False,
    ) -> None:
        """``echo``: each choice's text to put before its output (completions: the prompt; chat: the last message
        when it is the assistant's), None: no echo; ``prompt_logprobs``: report the prompt's; ``logprobs_k``:
        completions' alternatives per position; ``token_text``: a token's text with special tokens kept (the first
        prompt position of an echo with logprobs); ``return_token_ids``: vLLM's field of that name (the prompt's and
        each choice's token ids, shaped as vLLM shapes them: ``_token_ids``)."""
        self.return_token_ids = return_token_ids
        self.echo = echo
        self.want_prompt_logprobs = prompt_logprobs
        self.logprobs_k = logprobs_k
        self.token_text = token_text or str
        self.chat = chat
        self.id = f"chatcmpl-{call_id}" if chat else f"cmpl-{call_id}"
        self.created = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens  # per choice
        self.n = max(n, 1)
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.choices = [_Choice() for _ in prompt_tokens]

    # --- pieces ------------------------------------------------------------------------------------------------

    def _completion_logprobs(
        self, choice: _Choice, message: node_pb2.GenerateResponse, prompt: list[int] | None = None
    ) -> CompletionLogProbs:
        """The message's positions (after the prompt's, for an echo: ``prompt`` its token ids)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if prompt is not None:
            for i, token_id in enumerate(prompt):
                position = choice.prompt_positions[i] if i < len(choice.prompt_positions) else None
                if position is None or not position.HasField("sampled"):
                    tokens.append(self.token_text(token_id))
                    token_logprobs.append(None)
                    top_logprobs.append(None)
                else:
                    tokens.append(position.sampled.token)
                    token_logprobs.append(_lp(position.sampled.logprob))
                    top_logprobs.append(top_dict(position, self.logprobs_k))
                offsets.append(choice.text_offset)
                choice.text_offset += len(tokens[-1])
        for position in message.logprobs:
            token = position.sampled.token
            tokens.append(token)
            token_logprobs.append(_lp(position.sampled.logprob))
            top_logprobs.append(top_dict(position, self.logprobs_k))
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        # Passed to the constructor (not appended afterwards): streamed chunks are dumped with exclude_unset.
        return CompletionLogProbs(
            text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top_logprobs
        )

    def _chat_logprobs(self, message: node_pb2.GenerateResponse) -> ChatCompletionLogProbs:
        content = [
            ChatCompletionLogProbsContent(
                token=p.sampled.token,
                logprob=_lp(p.sampled.logprob),
                bytes=list(p.sampled.token.encode()),
                top_logprobs=[
                    ChatCompletionLogProb(token=t.token, logprob=_lp(t.logprob), bytes=list(t.token.encode()))
                    for t in p.top
                ],
            )
            for p in message.logprobs
        ]
        return ChatCompletionLogProbs(content=content)

    def _token_ids(self, k: int, token_ids: list[int]) -> dict[str, Any]:
        """A streamed choice's ``return_token_ids`` fields as vLLM's chunks carry them: each chunk its new tokens,
        a completion's first chunk its prompt's too (chat's go in its first chunk, the role's: ``start``)."""
        if not self.return_token_ids:
            return {}
        out: dict[str, Any] = {"token_ids": token_ids}
        choice = self.choices[k]
        if not self.chat and not choice.prompt_ids_sent:
            choice.prompt_ids_sent = True
            out["prompt_token_ids"] = self.prompt_tokens[k]
        return out

    def _usage(self, indices: range | list[int], *, so_far: bool = False) -> UsageInfo:
        """Prompt tokens once per prompt, completion tokens of every choice in ``indices``. ``so_far``: a chunk's
        running usage (``continuous_usage_stats``), which vLLM's chat chunks send with ``completion_tokens_details``
        null (its reasoning-token count, set to None without a reasoning parser) and its completion chunks
        without."""
        prompt = cached = 0
        for k in indices:
            if k % self.n == 0 or so_far:
                prompt += len(self.prompt_tokens[k])
                final = self.choices[k].final
                cached += final.cached_tokens if final is not None else 0
        completion = sum(self.choices[k].completion_tokens for k in indices)
        details: dict[str, Any] = {"completion_tokens_details": None} if so_far and self.chat else {}
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached),
            **details,
        )

    # --- feeding -----------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Events before any output: chat streams open each choice with the assistant role (as vLLM does)."""
        if not self.chat:
            return []
        events = []
        for k in range(len(self.choices)):
            chunk = ChatCompletionStreamResponse(
                id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                choices=[ChatCompletionResponseStreamChoice(
                    index=k, delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None
                )],
                # null unless asked for, as vLLM's first chunk has them
                prompt_token_ids=self.prompt_tokens[k] if self.return_token_ids else None, prompt_text=None,
            )
            if self.continuous_usage:  # vLLM's first chunk carries the prompt's usage already
                chunk.usage = self._usage([k], so_far=True)
            events.append(sse(chunk.model_dump_json(exclude_unset=True)))
        if self.echo is not None:
            for k, prefix in enumerate(self.echo):
                if prefix:
                    chunk = ChatCompletionStreamResponse(
                        id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                        choices=[ChatCompletionResponseStreamChoice(index=k, delta={"content": prefix})],
                    )
                    events.append(sse(chunk.model_dump_json(exclude_unset=True)))
        return events

    def add(self, message: node_pb2.GenerateResponse) -> str | None:
        """Account for one message; for streams, the event to send (None: nothing to send)."""
        k = message.index
        choice = self.choices[k]
        if message.prompt_logprobs and not choice.prompt_positions:
            choice.prompt_positions = list(message.prompt_logprobs)
        text = message.text
        echo_prompt: list[int] | None = None
        if self.echo is not None and not choice.echoed and (message.token_ids or message.HasField("final")):
            choice.echoed = True
            if not self.chat:  # chat echoes in its own chunk (start), as vLLM does
                text = self.echo[k] + text
                echo_prompt = self.prompt_tokens[k]
        choice.text.append(text)
        choice.completion_tokens += len(message.token_ids)
        if self.return_token_ids:
            choice.token_ids += message.token_ids
        final = message.final if message.HasField("final") else None
        if final is not None:
            choice.final = final
        logprobs: Any = None
        if self.logprobs and (message.logprobs or echo_prompt is not None):
            if self.chat:
                logprobs = self._chat_logprobs(message)
                choice.content.extend(logprobs.content or [])
            else:
                logprobs = self._completion_logprobs(choice, message, echo_prompt)
                choice.tokens += logprobs.tokens
                choice.token_logprobs += logprobs.token_logprobs
                choice.top_logprobs += logprobs.top_logprobs
                choice.offsets += logprobs.text_offset
        if final is None and not text and not message.token_ids:
            return None
        # The fields vLLM's chunks carry as null when they have no value (set, so that exclude_unset keeps them)
        extra: dict[str, Any] = (
            {"logprobs": None, "finish_reason": None, "token_ids": None} if self.chat else
            {"logprobs": None, "finish_reason": None, "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
        )
        if final is not None:
            extra |= {"finish_reason": FINISH_REASONS.get(final.finish_reason, "stop"),
                      "stop_reason": final.stop_reason or None, "p2pnode": mesh_info(final)}
        extra |= self._token_ids(k, list(message.token_ids))
        if logprobs is not None:
            extra["logprobs"] = logprobs
        if self.chat:
            choice_chunk: Any = ChatCompletionResponseStreamChoice(
                index=k, delta={"content": text}, **extra
            )
            chunk: Any = ChatCompletionStreamResponse(
                id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                choices=[choice_chunk],
            )
        else:
            choice_chunk = CompletionResponseStreamChoice(index=k, text=text, **extra)
            chunk = CompletionStreamResponse(
                id=self.id, object="text_completion", created=self.created, model=self.model, choices=[choice_chunk]
            )
        if self.continuous_usage:
            chunk.usage = self._usage([k], so_far=True)
        return sse(chunk.model_dump_json(exclude_unset=True))

    def end(self) -> list[str]:
        """Events after the last final: the usage chunk when asked for, then [DONE]."""
        events = []
        if self.include_usage:
            cls: Any = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            chunk = cls(id=self.id, object=kind, created=self.created, model=self.model, choices=[], usage=self.usage())
            events.append(sse(chunk.model_dump_json(exclude_unset=True)))
        events.append(DONE_EVENT)
        return events

    def usage(self) -> UsageInfo:
        return self._usage(range(len(self.choices)))

    # --- whole responses ---------------------------------------------------------------------------------------

    def response(self) -> ChatCompletionResponse | CompletionResponse:
        """The non-streamed response, once every choice has its final message."""
        choices: list[Any] = []
        for k, c in enumerate(self.choices):
            assert c.final is not None
            common = {
                "index": k,
                "finish_reason": FINISH_REASONS.get(c.final.finish_reason, "stop"),
                "stop_reason": c.final.stop_reason or None,
                "p2pnode": mesh_info(c.final),
            }
            if self.return_token_ids:  # each choice its tokens; a completion's its prompt's, chat's once (below)
                common["token_ids"] = list(c.token_ids)
                if not self.chat:
                    common["prompt_token_ids"] = self.prompt_tokens[k]
            text = "".join(c.text)
            if self.chat:
                if self.echo is not None:
                    text = self.echo[k] + text
                logprobs = ChatCompletionLogProbs(content=c.content) if self.logprobs else None
                choices.append(ChatCompletionResponseChoice(
                    message=ChatMessage(role="assistant", content=text), logprobs=logprobs, **common
                ))
            else:
                logprobs = None
                if self.logprobs:
                    logprobs = CompletionLogProbs(
                        text_offset=c.offsets, token_logprobs=c.token_logprobs, tokens=c.tokens,
                        top_logprobs=c.top_logprobs,
                    )
                if self.want_prompt_logprobs:
                    common["prompt_logprobs"] = prompt_logprobs_json(c.prompt_positions)
                choices.append(CompletionResponseChoice(text=text, logprobs=logprobs, **common))
        cls = ChatCompletionResponse if self.chat else CompletionResponse
        response = cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage())
        if self.chat and self.want_prompt_logprobs:
            response.prompt_logprobs = prompt_logprobs_json(self.choices[0].prompt_positions)
        if self.chat and self.return_token_ids:
            response.prompt_token_ids = self.prompt_tokens[0]
        return response

    def error_event(self, body: dict[str, Any]) -> list[str]:
        """A failure after the stream began: an error event (the openai client raises it), then [DONE]."""
        return [sse(json.dumps(body)), DONE_EVENT]
