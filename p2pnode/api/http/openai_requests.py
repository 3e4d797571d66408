"""OpenAI request bodies (parsed by vLLM's own pydantic models) -> the node's GenerateRequest.

The HTTP front parses a body with vLLM's ``CompletionRequest`` / ``ChatCompletionRequest`` (so the schema, its
defaults and its checks are vLLM's), then this module turns it into the gRPC API's ``GenerateRequest`` — one per
prompt — which goes through the very same admission as a gRPC call. A parameter p2pnode does not implement is
refused with 400 naming it, never silently ignored; parameters left at their defaults are fine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from p2pnode.config import MAX_N, MAX_STOP_STRINGS
from p2pnode.serving.admission import stop_count_error
from p2pnode.token_wire import fill_tokens
from p2pnode.v1 import node_pb2


class BadParameter(ValueError):
    """A parameter p2pnode cannot take: not implemented, or a value the gRPC request cannot carry."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


#: Parameters both endpoints implement (others are refused unless left at their default).
_COMMON = frozenset({
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
    "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "user",
    "request_id", "cache_salt", "min_p", "stop_token_ids", "include_stop_str_in_output", "logit_bias",
    "prompt_logprobs", "priority", "response_format", "structured_outputs", "echo", "return_token_ids",
})
COMPLETION_PARAMS = _COMMON | {"prompt"}
CHAT_PARAMS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "documents", "add_special_tokens", "chat_template",
}
#: A bias vLLM clamps every logit_bias value to (OpenAI's documented range).
LOGIT_BIAS_LIMIT = 100.0
#: p2pnode's own parameters (``extra_body`` of the ``openai`` client): a request's reusable segments
#: (docs/segments.md): ``segments`` (each a string found in the prompt, ``{"text": ...}`` or ``{"start": i, "end": j}``
#: token positions), ``segment_reuse`` ("exact" or "approximate"), ``segment_recompute_tokens``.
SEGMENT_PARAMS = ("segments", "segment_reuse", "segment_recompute_tokens")
SEGMENT_MODES = {"exact": node_pb2.SEGMENT_REUSE_EXACT, "approximate": node_pb2.SEGMENT_REUSE_APPROXIMATE}
#: Chat parameters that default to a value meaning "nothing asked" but are not the field default in vLLM's model.
_NEUTRAL = {"tool_choice": ("none", None), "parallel_tool_calls": (True, None), "include_reasoning": (True,)}


def check_stop_count(data: Mapping[str, Any], param: str = "stop") -> None:
    """Too many stop strings, refused before vLLM's model does it with "Input should be a valid string" (its
    ``str | list[str]`` union reports the string branch): the message names the limit, as the gRPC API's does."""
    stop = data.get(param)
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise BadParameter(param, stop_count_error(len(stop)))


#: vLLM's parameter objects whose own checks name no parameter (``__post_init__``), and the request field holding one.
_PARAMETER_OBJECTS = {"StructuredOutputsParams": "structured_outputs"}


def vllm_error_param(error: BaseException, data: Mapping[str, Any]) -> str | None:
    """The parameter a vLLM validation error is about: its own ``parameter``, else the request field whose parameter
    object raised it (``structured_outputs: {}`` fails in StructuredOutputsParams' checks, which name nothing; asked
    through ``response_format``, that is the parameter named), else None."""
    param = getattr(error, "parameter", None)
    if param:
        return str(param)
    tb = error.__traceback__
    while tb is not None:
        owner = type(tb.tb_frame.f_locals.get("self")).__name__
        if owner in _PARAMETER_OBJECTS:
            field = _PARAMETER_OBJECTS[owner]
            return "response_format" if field == "structured_outputs" and field not in data and \
                "response_format" in data else field
        tb = tb.tb_next
    return None


def crashed_param(error: BaseException, data: Mapping[str, Any]) -> str | None:
    """The body field a crash in vLLM's validators was reading: the field whose value (a list or an object, matched
    by identity, never by equality) a frame of the crash holds, innermost first; None when none does."""
    values = {id(v): k for k, v in data.items() if isinstance(v, list | dict)}
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for local in frame.f_locals.values():
            if id(local) in values:
                return values[id(local)]
    return None


def _raw(request: Any, name: str) -> Any:
    """A field's value without the deprecation warning its attribute raises (chat's ``max_tokens``)."""
    return request.__dict__.get(name)


def check_supported(request: Any, supported: frozenset[str], sent: Iterable[str] | None = None) -> None:
    """Refuse any parameter outside ``supported`` that the client set to something other than its default.

    ``sent``: the keys of the client's JSON body (vLLM's validators may fill others, e.g. ``tool_choice`` for
    ``tools``; the error names what the client sent).
    """
    fields = type(request).model_fields
    names = request.model_fields_set if sent is None else set(sent)
    for name in sorted(names - supported):
        info = fields.get(name)
        if info is None:
            continue
        value = _raw(request, name)
        default = info.get_default(call_default_factory=True)
        if value == default or value in _NEUTRAL.get(name, ()) or (value in (None, [], {}, "") and not default):
            continue
        raise BadParameter(name, "is not supported by p2pnode")


def _fits(value: int, param: str, bits: int = 32) -> int:
    """``value`` as an unsigned field of the gRPC request, or 400 naming ``param`` (a JSON number has no bound;
    the proto setter would raise, which answered 500 with a traceback)."""
    if not 0 <= value < 1 << bits:
        raise BadParameter(param, f"out of range, got {value}")
    return value


def _fill_prompt(base: node_pb2.GenerateRequest, tokens: list[int]) -> None:
    """A client's token-id prompt into the gRPC request, or 400 naming ``prompt`` when a token does not fit."""
    try:
        fill_tokens(base.token_ids, "ids", tokens)
    except (TypeError, ValueError):
        for t in tokens:
            _fits(t, "prompt")
        raise


def _sampling(request: Any, max_tokens: int | None, logprobs: int | None) -> node_pb2.SamplingParams:
    sampling = node_pb2.SamplingParams(ignore_eos=bool(request.ignore_eos))
    stop = request.stop
    if isinstance(stop, str):
        stop = [stop]
    sampling.stop.extend(stop or [])
    if max_tokens is not None:
        if max_tokens < 0:
            raise BadParameter("max_tokens", f"must be at least 1, got {max_tokens}")
        sampling.max_tokens = _fits(max_tokens, "max_tokens")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(request, name)
        if value is not None:
            setattr(sampling, name, value)
    if request.top_k is not None:
        if not -(2**31) <= request.top_k < 2**31:
            raise BadParameter("top_k", f"out of range, got {request.top_k}")
        sampling.top_k = request.top_k
    if request.seed is not None and request.seed != -1:  # vLLM: -1 means no seed
        if request.seed < 0:
            raise BadParameter("seed", f"must be non-negative (or -1: none), got {request.seed}")
        sampling.seed = _fits(request.seed, "seed", 64)
    if request.min_tokens:
        if request.min_tokens < 0:
            raise BadParameter("min_tokens", f"must not be negative, got {request.min_tokens}")
        sampling.min_tokens = _fits(request.min_tokens, "min_tokens")
    if logprobs is not None:
        if logprobs < 0:
            raise BadParameter("logprobs", f"must not be negative, got {logprobs}")
        sampling.logprobs = _fits(logprobs, "logprobs")
    _vllm_sampling(request, sampling)
    return sampling


def _vllm_sampling(request: Any, sampling: node_pb2.SamplingParams) -> None:
    """The vLLM sampling parameters beyond OpenAI's: min_p, stop_token_ids, include_stop_str_in_output, logit_bias,
    prompt_logprobs (echo asks for the prompt's with ``logprobs`` alternatives, as vLLM does), priority, and
    structured outputs (``response_format`` or ``structured_outputs``, normalized by vLLM's own
    ``extract_structured_outputs``)."""
    if request.min_p is not None:
        sampling.min_p = request.min_p
    sampling.stop_token_ids.extend(_fits(t, "stop_token_ids") for t in request.stop_token_ids or ())
    sampling.include_stop_str_in_output = bool(request.include_stop_str_in_output)
    for key, bias in (request.logit_bias or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadParameter("logit_bias", f"keys must be token ids, got {key!r}") from None
        sampling.logit_bias[_fits(token, "logit_bias")] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and getattr(request, "echo", False) and not _is_chat(request):
        prompt_logprobs = request.logprobs
    if prompt_logprobs is not None:
        if not -1 <= prompt_logprobs < 2**31:
            raise BadParameter("prompt_logprobs", f"must be -1 (all) or at least 0, got {prompt_logprobs}")
        sampling.prompt_logprobs = prompt_logprobs
    if request.priority:
        if not -(2**31) <= request.priority < 2**31:
            raise BadParameter("priority", f"out of range, got {request.priority}")
        sampling.priority = request.priority
    structured = request.extract_structured_outputs()
    if structured is not None:
        sampling.structured_outputs = structured_outputs_json(structured)


def sampling_from_vllm(params: Any) -> node_pb2.SamplingParams:
    """vLLM's SamplingParams (built by vLLM's own ``to_sampling_params``) as the gRPC request's, every value set."""
    sampling = node_pb2.SamplingParams(
        max_tokens=_fits(params.max_tokens, "max_tokens"),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=_fits(params.min_tokens, "min_tokens"),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        stop=list(params.stop or ()),
        stop_token_ids=[_fits(t, "stop_token_ids") for t in params.stop_token_ids or ()],
    )
    if params.seed is not None:
        if params.seed < 0:
            raise BadParameter("seed", f"must be non-negative, got {params.seed}")
        sampling.seed = _fits(params.seed, "seed", 64)
    if params.logprobs is not None:
        sampling.logprobs = _fits(params.logprobs, "logprobs")
    if params.prompt_logprobs is not None:
        sampling.prompt_logprobs = params.prompt_logprobs
    for token, bias in (params.logit_bias or {}).items():
        sampling.logit_bias[_fits(int(token), "logit_bias")] = bias
    if params.structured_outputs is not None:
        sampling.structured_outputs = structured_outputs_json(params.structured_outputs)
    return sampling


def structured_outputs_json(params: Any) -> str:
    """vLLM's StructuredOutputsParams as the JSON object the gRPC request carries (its init fields that are set)."""
    fields = {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if f.init and getattr(params, f.name) != f.default
    }
    return json.dumps(fields, separators=(",", ":"))


def _is_chat(request: Any) -> bool:
    return hasattr(request, "messages")


def _base(request: Any, request_id: str, max_tokens: int | None, logprobs: int | None) -> node_pb2.GenerateRequest:
    n = 1 if request.n is None else request.n
    if n < 1:
        raise BadParameter("n", f"must be at least 1, got {n}")
    if n > MAX_N:  # here, not only at admission: the front sizes per-choice state by n before that
        raise BadParameter("n", f"at most {MAX_N} sequences per call, got {n}")
    return node_pb2.GenerateRequest(
        request_id=request_id,
        sampling=_sampling(request, max_tokens, logprobs),
        n=min(n, 2**32 - 1),
        user=request.user or "",
        model=request.model or "",
        cache_salt=getattr(request, "cache_salt", None) or "",
    )


def _segments(request: Any, base: node_pb2.GenerateRequest) -> None:
    """p2pnode's segment parameters (``SEGMENT_PARAMS``, extra fields of vLLM's models) onto ``base``."""
    extra = request.model_extra or {}
    segments = extra.get("segments")
    reuse = extra.get("segment_reuse")
    recompute = extra.get("segment_recompute_tokens")
    if segments is None and reuse is None and recompute is None:
        return
    if not isinstance(segments, list):
        raise BadParameter("segments", "must be a list of strings or {text} / {start, end} objects")
    for i, segment in enumerate(segments):
        if isinstance(segment, dict) and set(segment) == {"text"}:
            segment = segment["text"]
        if isinstance(segment, str):
            base.segments.add(text=segment)
        elif isinstance(segment, dict) and set(segment) == {"start", "end"}:
            start, end = segment["start"], segment["end"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
                raise BadParameter(f"segments[{i}]", "start and end must be integers")
            span = base.segments.add().tokens
            span.start = _fits(start, f"segments[{i}].start")
            span.end = _fits(end, f"segments[{i}].end")
        else:
            raise BadParameter(f"segments[{i}]", "must be a string, {text} or {start, end}")
    if reuse is not None:
        if reuse not in SEGMENT_MODES:
            raise BadParameter("segment_reuse", f"must be one of {', '.join(SEGMENT_MODES)}, got {reuse!r}")
        base.segment_reuse = SEGMENT_MODES[reuse]
    if recompute is not None:
        if not isinstance(recompute, int) or isinstance(recompute, bool):
            raise BadParameter("segment_recompute_tokens", f"must be an integer, got {recompute!r}")
        base.segment_recompute_tokens = _fits(recompute, "segment_recompute_tokens")


def call_request_id(request: Any, headers: Mapping[str, str]) -> str:
    """The client's id for the call: the body's ``request_id`` if it set one, else ``X-Request-Id``, else none."""
    if "request_id" in request.model_fields_set and request.request_id:
        return str(request.request_id)
    return headers.get("x-request-id", "")


def completion_requests(
    request: Any, request_id: str, sent: Iterable[str] | None = None
) -> list[node_pb2.GenerateRequest]:
    """A CompletionRequest as one GenerateRequest per prompt (text, or token ids)."""
    check_supported(request, COMPLETION_PARAMS, sent)
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt or [])
    if not prompts:
        raise BadParameter("prompt", "must not be empty")
    out = []
    for p in prompts:
        base = _base(request, request_id, request.max_tokens, request.logprobs)
        if isinstance(p, str):
            base.text = p
        else:
            _fill_prompt(base, p)
        _segments(request, base)
        out.append(base)
    return out


def chat_request(
    request: Any, request_id: str, prompt_tokens: list[int], max_model_len: int, model_max_tokens: float | None = None
) -> node_pb2.GenerateRequest:
    """A ChatCompletionRequest whose messages are already rendered to ``prompt_tokens``.

    No ``max_tokens`` / ``max_completion_tokens``: the model's own default (``model_max_tokens``, its
    generation_config's max_new_tokens) within the rest of the context, else the rest of the context, as vLLM does.
    """
    room = max(max_model_len - len(prompt_tokens), 1)
    if request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    elif _raw(request, "max_tokens") is not None:
        max_tokens = _raw(request, "max_tokens")
    elif model_max_tokens is not None:
        max_tokens = min(int(model_max_tokens), room)
    else:
        max_tokens = room
    logprobs = (request.top_logprobs or 0) if request.logprobs else None  # vLLM checked top_logprobs needs logprobs
    base = _base(request, request_id, max_tokens, logprobs)
    fill_tokens(base.token_ids, "ids", prompt_tokens)
    _segments(request, base)
    return base


def chat_echo(request: Any) -> str:
    """What chat's ``echo`` puts before the reply: the last message's content when it is the assistant's (a reply
    being continued), as vLLM does; else nothing."""
    last = request.messages[-1] if request.messages else None
    role = last.get("role") if isinstance(last, dict) else getattr(last, "role", None)
    content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
    if role != "assistant" or content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def chat_renames(request: Any) -> dict[str, str]:
    """Proto field -> the chat parameter the client used for it."""
    renames = {"sampling.logprobs": "top_logprobs", **structured_renames(request)}
    if request.max_completion_tokens is not None or _raw(request, "max_tokens") is None:
        renames["sampling.max_tokens"] = "max_completion_tokens"
    return renames


def structured_renames(request: Any) -> dict[str, str]:
    """Structured outputs asked through ``response_format``: the engine's refusals name it."""
    return {"sampling.structured_outputs": "response_format"} if request.response_format is not None else {}
