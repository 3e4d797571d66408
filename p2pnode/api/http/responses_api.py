"""OpenAI's Responses API (``POST /v1/responses``) as ``vllm serve`` answers it for a model without a reasoning or
tool parser, built from vLLM's own pieces: its request model, its conversion of ``instructions`` + ``input`` to chat
messages (``construct_input_messages``), its sampling parameters (``ResponsesRequest.to_sampling_params``, with the
model's generation-config defaults), its response model (``ResponsesResponse.from_request``) and its streaming event
processor (``SimpleStreamingEventProcessor``: ``response.output_item.added``, ``...output_text.delta``, ...). The
rendered chat is served like any other call: admitted, routed across the mesh, retried, cancelled and counted.

``previous_response_id`` is refused with vLLM's own 404 ("Response with id ... not found"): ``vllm serve`` keeps no
responses unless started with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, and a mesh would need that store shared by
every node for the next call to find it wherever it lands; send the conversation in ``input`` instead.
``background`` is refused as vLLM refuses it without that store; ``store`` is ignored, as in vLLM.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from openai.types.responses import ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_output_text import Logprob, LogprobTopLogprob
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponseRawMessageAndToken,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from vllm.entrypoints.openai.responses.streaming_events import SimpleStreamingEventProcessor, _StateType
from vllm.entrypoints.openai.responses.utils import construct_input_messages
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput
from vllm.utils import random_uuid

from p2pnode.api.http import openai_requests
from p2pnode.api.http.errors import error_body as openai_error_body
from p2pnode.api.http.errors import translate
from p2pnode.engine.base import ModelInfo
from p2pnode.serving.errors import ServeError
from p2pnode.token_wire import fill_tokens
from p2pnode.v1 import node_pb2

__all__ = ["RENAMES", "Refused", "ResponsesBuilder", "ResponsesRequest", "chat_of", "check_supported",
           "generate_request"]

#: The request's parameters this front serves (others are refused unless left at their default).
SUPPORTED = frozenset({
    "input", "instructions", "max_output_tokens", "model", "logit_bias", "previous_response_id", "store", "stream",
    "temperature", "text", "top_logprobs", "include", "top_p", "top_k", "min_p", "truncation", "user",
    "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "request_id",
    "priority", "structured_outputs", "seed", "stop", "stop_token_ids", "ignore_eos", "chat_template_kwargs",
    "metadata", "service_tier", "reasoning", "tool_choice", "parallel_tool_calls", "include_reasoning", "background",
    "enable_response_messages",
})
#: Proto field -> the Responses parameter a refusal names.
RENAMES = {"sampling.max_tokens": "max_output_tokens", "sampling.logprobs": "top_logprobs",
           "sampling.structured_outputs": "text", "prompt.token_ids": "input", "prompt": "input"}


class Refused(Exception):
    """A request vLLM's Responses server refuses, as it says it (status, message, param, OpenAI ``type``)."""

    def __init__(self, status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


def error_body(e: Refused) -> dict[str, Any]:
    body = openai_error_body(e.status, e.message, e.param)
    body["error"]["type"] = e.kind
    return body


def nulls_as_defaults(request: ResponsesRequest) -> ResponsesRequest:
    """The request with every field the client sent as null but whose default is not null at its default: vLLM's
    request model takes ``"background": null`` (and others), its response model does not, and building the response
    raised (500)."""
    fields = type(request).model_fields
    update = {}
    for name in request.model_fields_set:
        info = fields.get(name)
        if info is None or getattr(request, name) is not None:
            continue
        default = info.get_default(call_default_factory=True)
        if default is not None:
            update[name] = default
    return request.model_copy(update=update) if update else request


def check_supported(request: ResponsesRequest, sent: list[str]) -> None:
    """Refuse what this front does not serve (naming it), and what vLLM refuses without a response store."""
    if request.previous_response_id is not None:
        raise Refused(404, f"Response with id '{request.previous_response_id}' not found.", "response_id")
    if request.background:
        raise Refused(400, "This vLLM engine does not support `store=True` and therefore does not support the "
                           "background mode. To enable these features, set the environment variable "
                           "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.", "background")
    neutral = {"tool_choice": ("auto", "none"), "store": (True, False), "include_reasoning": (True,),
               "truncation": ("disabled",), "service_tier": ("auto",), "parallel_tool_calls": (True,)}
    fields = type(request).model_fields
    for name in sorted(set(sent) - SUPPORTED):
        info = fields.get(name)
        if info is None:
            continue
        value = getattr(request, name)
        default = info.get_default(call_default_factory=True)
        if value == default or value in neutral.get(name, ()) or (value in (None, [], {}, "") and not default):
            continue
        raise Refused(400, f"{name}: is not supported by p2pnode", name, "BadRequestError")
    for item in request.include or ():
        if item != "message.output_text.logprobs":
            raise Refused(400, f"include: {item!r} is not supported by p2pnode", "include", "BadRequestError")


def chat_of(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat the request amounts to: vLLM's messages for its instructions and input, to be rendered with the
    model's chat template as vLLM renders them.

    Tokenized with the tokenizer's special tokens added (``add_special_tokens``), unlike a chat completion: vLLM's
    Responses server tokenizes the rendered text with ``ResponsesRequest.build_tok_params``, which leaves
    ``TokenizeParams.add_special_tokens`` at its default (True). A template that writes its own BOS (the tiny model's,
    Llama's) thus starts the prompt with two: ``vllm serve`` counts 26 input tokens for ``"hello"`` where the same
    chat completion counts 25, and the model answers after both. p2pnode renders the same prompt, so it answers the
    same."""
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    return ChatCompletionRequest(
        model=request.model, messages=messages, chat_template_kwargs=request.chat_template_kwargs,
        add_special_tokens=True,
    )


def generate_request(
    request: ResponsesRequest, request_id: str, prompt_tokens: list[int], info: ModelInfo
) -> tuple[node_pb2.GenerateRequest, Any]:
    """The call for the rendered prompt, and vLLM's SamplingParams for it (the response reports them): max tokens
    as vLLM computes them (``max_output_tokens`` within the rest of the context, else the model's default or the
    rest), every other value by vLLM's own ``to_sampling_params``."""
    room = info.max_model_len - len(prompt_tokens)
    if room <= 0:
        raise Refused(400, f"The engine prompt length {len(prompt_tokens)} exceeds the max_model_len "
                           f"{info.max_model_len}. Please reduce prompt.", "input")
    defaults = dict(info.sampling_defaults)
    fallback = request.max_output_tokens if request.max_output_tokens is not None else defaults.get("max_tokens")
    default_max_tokens = min(v for v in (room, fallback) if v is not None)
    try:
        params = request.to_sampling_params(int(default_max_tokens), defaults)
    except (ValueError, VLLMValidationError) as e:  # vLLM's own checks (VLLMValidationError, not a ValueError in
        # vLLM 0.32, names its parameter, by its name in vLLM's sampling: the request's own name here)
        param = getattr(e, "parameter", None)
        if param is not None:
            param = RENAMES.get(f"sampling.{param}", param)
        raise Refused(400, f"{param}: {e}" if param else str(e), param, "BadRequestError") from e
    try:
        sampling = openai_requests.sampling_from_vllm(params)
    except openai_requests.BadParameter as e:
        raise Refused(400, str(e), e.param, "BadRequestError") from e
    generate = node_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling, user=request.user or "", model=request.model or ""
    )
    fill_tokens(generate.token_ids, "ids", prompt_tokens)
    return generate, params


def _logprob(position: node_pb2.PositionLogprobs, top: int) -> Logprob:
    token = position.sampled.token
    return Logprob(
        token=token, logprob=max(position.sampled.logprob, -9999.0), bytes=list(token.encode("utf-8", "replace")),
        top_logprobs=[
            LogprobTopLogprob(token=t.token, logprob=max(t.logprob, -9999.0),
                              bytes=list(t.token.encode("utf-8", "replace")))
            for t in position.top[:top]
        ] if top else [],
    )


class ResponsesBuilder:
    """One call's Responses answer: fed the ingress's messages, it builds the whole response or its events."""

    def __init__(
        self, request: ResponsesRequest, params: Any, *, model: str, prompt_tokens: list[int], prompt_text: str = ""
    ) -> None:
        """``prompt_text``: the rendered chat before tokenization (``enable_response_messages`` reports it)."""
        self.request = request
        self.params = params
        self.model = model
        self.prompt_token_ids = prompt_tokens
        self.prompt_tokens = len(prompt_tokens)
        self.prompt_text = prompt_text
        self.created = int(time.time())
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.output_tokens = 0
        self.logprobs: list[Logprob] = []
        self.final: node_pb2.GenerateFinal | None = None
        self.want_logprobs = request.is_include_output_logprobs()

    def add(self, message: node_pb2.GenerateResponse) -> list[Logprob]:
        """Account for one message; the Responses logprobs of its tokens (empty unless asked for)."""
        self.text.append(message.text)
        self.output_tokens += len(message.token_ids)
        self.token_ids += message.token_ids
        logprobs = [_logprob(p, self.request.top_logprobs or 0) for p in message.logprobs] if self.want_logprobs else []
        self.logprobs += logprobs
        if message.HasField("final"):
            self.final = message.final
        return logprobs

    @property
    def status(self) -> str:
        length = self.final is not None and self.final.finish_reason == node_pb2.FINISH_REASON_LENGTH
        return "incomplete" if length else "completed"

    def _usage(self) -> ResponseUsage:
        cached = self.final.cached_tokens if self.final is not None else 0
        return ResponseUsage(
            input_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.prompt_tokens + self.output_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0,
                                                    input_tokens_per_turn=[], cached_tokens_per_turn=[]),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0, tool_output_tokens=0,
                                                      output_tokens_per_turn=[], tool_output_tokens_per_turn=[]),
        )

    def _raw_messages(self) -> tuple[list[ResponseRawMessageAndToken], list[ResponseRawMessageAndToken]]:
        """``enable_response_messages``: the prompt as rendered (text and tokens) and the output, as vLLM's
        ``SimpleContext`` reports them for a model without a parser (no output message when nothing was generated)."""
        prompt = ResponseRawMessageAndToken(message=self.prompt_text, tokens=list(self.prompt_token_ids))
        text = "".join(self.text)
        output = [ResponseRawMessageAndToken(message=text, tokens=list(self.token_ids))] if text or self.token_ids \
            else []
        return [prompt], output

    def _response(self, output: list[Any], status: str, usage: ResponseUsage | None) -> ResponsesResponse:
        """vLLM's response; the finished one (``usage`` given) with the raw messages when the request asked."""
        messages: dict[str, Any] = {}
        if usage is not None and self.request.enable_response_messages:
            messages["input_messages"], messages["output_messages"] = self._raw_messages()
        return ResponsesResponse.from_request(
            self.request, self.params, model_name=self.model, created_time=self.created, output=output,
            status=status, usage=usage, **messages,
        )

    def response(self) -> ResponsesResponse:
        """The whole response (vLLM's fallback output item when no parser runs: one assistant message)."""
        text = "".join(self.text)
        content = [ResponseOutputText(text=text, annotations=[], type="output_text",
                                      logprobs=self.logprobs if self.want_logprobs else None)] if text else []
        message = ResponseOutputMessage(id=f"msg_{random_uuid()}", content=content, role="assistant",
                                        status="completed", type="message")
        return self._response([message], self.status, self._usage())

    async def events(
        self, stream: AsyncIterator[node_pb2.GenerateResponse], first: node_pb2.GenerateResponse
    ) -> AsyncIterator[str]:
        """The stream as vLLM writes it: created, in_progress, the output item's events (vLLM's processor), then
        completed with the whole response; closing it closes ``stream``."""
        sequence = 0

        def sse(event: Any) -> str:
            nonlocal sequence
            if hasattr(event, "sequence_number"):
                event.sequence_number = sequence
            sequence += 1
            return f"event: {event.type}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"

        try:
            initial = self._response([], "in_progress", None).model_dump(mode="json", by_alias=True)
            yield sse(ResponseCreatedEvent(type="response.created", sequence_number=-1, response=initial))
            yield sse(ResponseInProgressEvent(type="response.in_progress", sequence_number=-1, response=initial))
            processor = SimpleStreamingEventProcessor(tools=self.request.tools)
            pending = [first]
            while True:
                try:
                    message = pending.pop() if pending else await anext(stream, None)
                except ServeError as e:  # after the stream began: an error event, as vLLM's generation errors
                    status, body = translate(e.code, e.message, e.field, renames=RENAMES)
                    error = {"type": "error", "code": str(status), "message": body["error"]["message"],
                             "param": body["error"]["param"], "sequence_number": sequence}
                    yield f"event: error\ndata: {json.dumps(error)}\n\n"
                    return
                if message is None:
                    break
                logprobs = self.add(message)
                if not message.text:
                    continue
                delta = DeltaMessage(content=message.text)
                output = CompletionOutput(index=0, text=message.text, token_ids=list(message.token_ids),
                                          cumulative_logprob=None, logprobs=None)
                if processor.needs_transition(_StateType.CONTENT, None):
                    for event in processor.close_current():
                        yield sse(event)
                    for event in processor.open(_StateType.CONTENT):
                        yield sse(event)
                for event in processor.emit_delta(delta, output, lambda _o, lp=logprobs: lp):
                    yield sse(event)
            for event in processor.close_current():
                yield sse(event)
            final = self._response(processor.output_items, self.status, self._usage())
            yield sse(ResponseCompletedEvent(type="response.completed", sequence_number=-1, response=final))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
