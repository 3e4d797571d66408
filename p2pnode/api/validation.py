"""Checks a client's GenerateRequest before any work is done for it.

Every rejection is an ``InvalidRequest`` naming the offending field the way the proto spells it
(``sampling.top_p``, ``prompt.token_ids``...), so a client can fix the call without reading server logs. The
node turns it into gRPC ``INVALID_ARGUMENT`` (HTTP 400, with the OpenAI spelling of the field).

Two layers: the checks here are structural (present, finite, inside the model's vocabulary and context) and the
same for every engine; ``check_engine_limits`` then asks the engine itself whether it would take the values
(vLLM's own SamplingParams checks: temperature <= 2, penalties in [-2, 2], logprobs <= max_logprobs...), so
the bounds are the engine's and a value it would refuse never reaches it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pnode.config import (
    MAX_N,
    MAX_REQUEST_ID_CHARS,
    MAX_ROUTING_KEY_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_USER_CHARS,
    SamplingDefaults,
)
from p2pnode.engine.base import Engine, EngineRejected, ModelInfo, SamplingOptions
from p2pnode.v1 import node_pb2


class InvalidRequest(ValueError):
    """A request field is out of range; ``field`` is its proto path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """The prompt as the client gave it: exactly one of text / token ids."""

    text: str | None
    token_ids: list[int] | None


def check_identity(request: node_pb2.GenerateRequest) -> None:
    """request_id and routing_key: bounded, printable."""
    rid = request.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    if rid and not rid.isprintable():
        raise InvalidRequest("request_id", "must be printable characters")
    if len(request.routing_key) > MAX_ROUTING_KEY_CHARS:
        raise InvalidRequest(
            "routing_key", f"at most {MAX_ROUTING_KEY_CHARS} characters, got {len(request.routing_key)}"
        )
    if len(request.user) > MAX_USER_CHARS:
        raise InvalidRequest("user", f"at most {MAX_USER_CHARS} characters, got {len(request.user)}")
    if request.n > MAX_N:
        raise InvalidRequest("n", f"at most {MAX_N} sequences per call, got {request.n}")


def check_prompt(request: node_pb2.GenerateRequest, max_prompt_chars: int, vocab_size: int) -> PromptSpec:
    """The prompt is present, non-empty, and (for token ids) inside the model's vocabulary."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "set either text or token_ids")
    if kind == "text":
        text = request.text
        if not text:
            raise InvalidRequest("prompt.text", "must not be empty")
        if len(text) > max_prompt_chars:
            raise InvalidRequest("prompt.text", f"at most {max_prompt_chars} characters, got {len(text)}")
        return PromptSpec(text=text, token_ids=None)
    ids = list(request.token_ids.ids)
    check_token_ids(ids, vocab_size, "prompt.token_ids")
    return PromptSpec(text=None, token_ids=ids)


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """Non-empty and inside the model's vocabulary."""
    if not ids:
        raise InvalidRequest(field, "must not be empty")
    if max(ids) >= vocab_size:
        position = next(i for i, t in enumerate(ids) if t >= vocab_size)
        raise InvalidRequest(
            field, f"token {ids[position]} at position {position} is outside the vocabulary (size {vocab_size})"
        )


def check_prompt_length(num_tokens: int, info: ModelInfo, field: str) -> None:
    if num_tokens == 0:
        raise InvalidRequest(field, "tokenizes to no tokens")
    if num_tokens >= info.max_model_len:
        raise InvalidRequest(
            field,
            f"prompt is {num_tokens} tokens; the model allows at most {info.max_model_len - 1} "
            f"(max_model_len {info.max_model_len} includes at least one generated token)",
        )


def _check_finite(field: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidRequest(field, f"must be a finite number, got {value}")


def check_sampling(
    sampling: node_pb2.SamplingParams, defaults: SamplingDefaults, info: ModelInfo, prompt_tokens: int
) -> SamplingOptions:
    """Fill unset fields from ``defaults`` and range-check every value against the model."""
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else defaults.max_tokens
    room = info.max_model_len - prompt_tokens
    if max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens", f"must be at least 1, got {max_tokens}")
    if max_tokens > room:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"{max_tokens} does not fit: prompt is {prompt_tokens} tokens and max_model_len is "
            f"{info.max_model_len}, leaving {room}",
        )
    temperature = sampling.temperature if sampling.HasField("temperature") else defaults.temperature
    _check_finite("sampling.temperature", temperature)
    if temperature < 0.0:
        raise InvalidRequest("sampling.temperature", f"must not be negative, got {temperature:g}")
    top_p = sampling.top_p if sampling.HasField("top_p") else defaults.top_p
    _check_finite("sampling.top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p:g}")
    top_k = sampling.top_k if sampling.HasField("top_k") else defaults.top_k
    if top_k < -1 or top_k > info.vocab_size:
        raise InvalidRequest(
            "sampling.top_k", f"must be -1 or 0 (disabled) or 1..{info.vocab_size}, got {top_k}"
        )
    stop = tuple(sampling.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"sampling.stop[{i}]", "must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"sampling.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters")
    seed = sampling.seed if sampling.HasField("seed") else None
    if seed is not None and seed >= 2**63:
        raise InvalidRequest("sampling.seed", f"must be below 2^63, got {seed}")
    penalties = {}
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        value = getattr(sampling, name) if sampling.HasField(name) else default
        _check_finite(f"sampling.{name}", value)
        penalties[name] = float(value)
    min_tokens = sampling.min_tokens if sampling.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"must not exceed max_tokens ({max_tokens}), got {min_tokens}")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        seed=seed,
        stop=stop,
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        min_tokens=min_tokens,
        **penalties,
    )


#: Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


def check_n(n: int, options: SamplingOptions) -> None:
    """Several samples need sampling: vLLM refuses n > 1 with greedy decoding (they would be identical)."""
    if n > 1 and options.temperature < GREEDY_TEMPERATURE:
        raise InvalidRequest("n", f"must be 1 when using greedy sampling (temperature 0), got {n}")


def check_engine_limits(engine: Engine, options: SamplingOptions) -> None:
    """The engine's own bounds (vLLM's checks): a value it would refuse is INVALID_ARGUMENT here, naming the field."""
    try:
        engine.check(options)
    except EngineRejected as e:
        raise InvalidRequest(f"sampling.{e.field}", e.message) from e


def to_proto(options: SamplingOptions) -> node_pb2.SamplingParams:
    """Validated options back on the wire (every field set), for forwarding to a peer."""
    sampling = node_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        stop=list(options.stop),
        ignore_eos=options.ignore_eos,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        min_tokens=options.min_tokens,
    )
    if options.seed is not None:
        sampling.seed = options.seed
    if options.logprobs is not None:
        sampling.logprobs = options.logprobs
    return sampling
