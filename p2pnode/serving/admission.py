"""Admission: every check a request passes before any work is done for it, for each way into a node.

- a client call (gRPC ``Generate`` or an OpenAI HTTP call, both as ``GenerateRequest`` messages): ``Admission.call``
  -- the node is not draining, the model is served, each request's fields, its prompt (tokenized off the event loop
  when long), the engine's own limits, ``n``, the node's cap on calls (in flight plus waiting), unique request ids,
  and last its tenant's rate limits (``flow/rate_limit.py``: charged only for a call that is admitted);
- a chat to render with the model's template first (HTTP): ``Admission.render``;
- a request a peer forwarded here: ``Admission.forwarded`` -- hop, origin, the prompt and sampling again (a peer's
  bug must not reach the engine).

Every refusal is a ``ServeError`` whose message names the offending field the way the proto spells it
(``sampling.top_p``, ``prompt.token_ids``...), so a client can fix the call without reading server logs; the front
doors turn INVALID_ARGUMENT into their own status (gRPC's, HTTP 400 with the OpenAI spelling of the field).

The field checks have two layers: the structural ones below (present, finite, inside the model's vocabulary and
context) are the same for every engine; ``check_engine_limits`` then asks the engine itself whether it would take
the values (vLLM's own SamplingParams checks: temperature <= 2, penalties in [-2, 2], logprobs <= max_logprobs...),
so the bounds are the engine's and a value it would refuse never reaches it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from p2pnode.cache.namespace import RESERVED_SALT_PREFIX, CacheNamespace
from p2pnode.config import (
    MAX_CACHE_SALT_CHARS,
    MAX_MODEL_NAME_CHARS,
    MAX_N,
    MAX_REQUEST_ID_CHARS,
    MAX_ROUTING_KEY_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_USER_CHARS,
    TOKENIZE_OFF_LOOP_CHARS,
    NodeConfig,
    SamplingDefaults,
)
from p2pnode.engine.base import Engine, EngineDeadError, EngineRejected, ModelInfo
from p2pnode.request import Request, SamplingOptions
from p2pnode.serving import segments as segment_checks
from p2pnode.serving.errors import ServeCode, ServeError, Throttle
from p2pnode.serving.tenants import DEFAULT_CALLER, Caller, check_name
from p2pnode.token_wire import read_tokens, read_tokens_packed
from p2pnode.v1 import forward_pb2, node_pb2

if TYPE_CHECKING:  # types only: the ingress owns them
    from p2pnode.flow.rate_limit import TenantRateLimits
    from p2pnode.serving.engine_queue import EngineQueue
    from p2pnode.serving.ingress import IngressContext
    from p2pnode.serving.local import ActivityTracker
    from p2pnode.serving.tenant_usage import TenantUsage


#: What a rendering yields (``Admission.render``): the prompt's tokens, or its text.
T = TypeVar("T")


class InvalidRequest(ServeError):
    """A request field is out of range (INVALID_ARGUMENT); ``field`` is its proto path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(ServeCode.INVALID_ARGUMENT, f"{field}: {message}", field)


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """The prompt as the client gave it: text or token ids (these with their bytes, ``Request.packed_tokens``)."""

    text: str | None
    token_ids: list[int] | None
    packed_tokens: bytes | None = None


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




def check_cache_salt(salt: str, field: str = "cache_salt") -> str:
    """A client's cache salt: bounded, printable, not one of p2pnode's own."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(field, f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    if salt and not salt.isprintable():
        raise InvalidRequest(field, "must be printable characters")
    if salt.startswith(RESERVED_SALT_PREFIX):
        raise InvalidRequest(field, f"{RESERVED_SALT_PREFIX!r} starts salts p2pnode reserves for itself")
    return salt


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
    ids, top, packed = read_tokens_packed(request.token_ids, "ids")
    check_token_ids(ids, vocab_size, "prompt.token_ids", top)
    return PromptSpec(text=None, token_ids=ids, packed_tokens=packed)


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str, top: int | None = None) -> None:
    """Non-empty and inside the model's vocabulary (``top``: their maximum, when the caller read it already)."""
    if not ids:
        raise InvalidRequest(field, "must not be empty")
    if (max(ids) if top is None else top) >= vocab_size:
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


def stop_count_error(count: int) -> str:
    """Why ``count`` stop strings are refused (every front door says the same)."""
    return f"at most {MAX_STOP_STRINGS} stop strings (vLLM's limit, VLLM_MAX_STOP_STRINGS), got {count}"


def _check_finite(field: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidRequest(field, f"must be a finite number, got {value}")


#: Seeds are below this (a forwarded request is admitted again at its server, so a sample's seed stays below it too).
SEED_LIMIT = 2**63

#: Longest ``structured_outputs`` JSON accepted (characters): a JSON schema or grammar, never a document.
MAX_STRUCTURED_OUTPUTS_CHARS = 65_536


def check_sampling(
    sampling: node_pb2.SamplingParams, defaults: SamplingDefaults, info: ModelInfo, prompt_tokens: int
) -> SamplingOptions:
    """Fill unset fields from the model's own defaults (``info.sampling_defaults``: its generation_config.json, as
    vLLM applies it), then from ``defaults`` (OpenAI's), and range-check every value against the model."""
    value = _field_values(sampling, info.sampling_defaults)
    max_tokens = _max_tokens(sampling, info, prompt_tokens, int(value("max_tokens", defaults.max_tokens)))
    temperature = _finite("temperature", value("temperature", defaults.temperature))
    if temperature < 0.0:
        raise InvalidRequest("sampling.temperature", f"must not be negative, got {temperature:g}")
    top_p = _finite("top_p", value("top_p", defaults.top_p))
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p:g}")
    top_k = int(value("top_k", defaults.top_k))
    if top_k < -1 or top_k > info.vocab_size:
        raise InvalidRequest(
            "sampling.top_k", f"must be -1 or 0 (disabled) or 1..{info.vocab_size}, got {top_k}"
        )
    min_tokens = sampling.min_tokens if sampling.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"must not exceed max_tokens ({max_tokens}), got {min_tokens}")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        seed=_seed(sampling),
        stop=_stop_strings(sampling),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        min_tokens=min_tokens,
        min_p=float(_finite("min_p", value("min_p", 0.0))),
        stop_token_ids=_stop_token_ids(sampling, info.vocab_size),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        logit_bias=_logit_bias(sampling, info.vocab_size),
        prompt_logprobs=_prompt_logprobs(sampling),
        structured_outputs=_structured_outputs(sampling),
        priority=sampling.priority,
        **{name: float(_finite(name, value(name, default))) for name, default in _PENALTIES},
    )


#: The penalties and their neutral values.
_PENALTIES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))


def _field_values(sampling: node_pb2.SamplingParams, model: dict[str, float]) -> Callable[[str, float], float]:
    """``value(name, fallback)``: the request's field when set, else the model's default, else ``fallback``."""

    def value(name: str, fallback: float) -> float:
        return getattr(sampling, name) if sampling.HasField(name) else model.get(name, fallback)

    return value


def _finite(name: str, value: float) -> float:
    _check_finite(f"sampling.{name}", value)
    return value


def _max_tokens(sampling: node_pb2.SamplingParams, info: ModelInfo, prompt_tokens: int, max_tokens: int) -> int:
    """At least one, and within the context the prompt leaves (the model's own default is capped to it)."""
    room = info.max_model_len - prompt_tokens
    if max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens", f"must be at least 1, got {max_tokens}")
    if max_tokens <= room:
        return max_tokens
    if not sampling.HasField("max_tokens") and "max_tokens" in info.sampling_defaults:
        return room  # the model's default caps the rest of the context, as in vLLM
    raise InvalidRequest(
        "sampling.max_tokens",
        f"{max_tokens} does not fit: prompt is {prompt_tokens} tokens and max_model_len is "
        f"{info.max_model_len}, leaving {room}",
    )


def _stop_strings(sampling: node_pb2.SamplingParams) -> tuple[str, ...]:
    stop = tuple(sampling.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", stop_count_error(len(stop)))
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"sampling.stop[{i}]", "must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"sampling.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters")
    return stop


def _stop_token_ids(sampling: node_pb2.SamplingParams, vocab_size: int) -> tuple[int, ...]:
    stop_token_ids = tuple(dict.fromkeys(sampling.stop_token_ids))
    _check_vocab("sampling.stop_token_ids", stop_token_ids, vocab_size)
    return stop_token_ids


def _logit_bias(sampling: node_pb2.SamplingParams, vocab_size: int) -> tuple[tuple[int, float], ...]:
    _check_vocab("sampling.logit_bias", sampling.logit_bias.keys(), vocab_size)
    logit_bias = tuple(sorted(sampling.logit_bias.items()))
    for token, bias in logit_bias:
        _check_finite(f"sampling.logit_bias[{token}]", bias)
    return logit_bias


def _prompt_logprobs(sampling: node_pb2.SamplingParams) -> int | None:
    prompt_logprobs = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs < -1:
        raise InvalidRequest("sampling.prompt_logprobs", f"must be -1 (all) or at least 0, got {prompt_logprobs}")
    return prompt_logprobs


def _structured_outputs(sampling: node_pb2.SamplingParams) -> str:
    if len(sampling.structured_outputs) > MAX_STRUCTURED_OUTPUTS_CHARS:
        raise InvalidRequest("sampling.structured_outputs", f"at most {MAX_STRUCTURED_OUTPUTS_CHARS} characters")
    return sampling.structured_outputs


def _seed(sampling: node_pb2.SamplingParams) -> int | None:
    seed = sampling.seed if sampling.HasField("seed") else None
    if seed is not None and seed >= SEED_LIMIT:
        raise InvalidRequest("sampling.seed", f"must be below 2^63, got {seed}")
    return seed


def _check_vocab(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    bad = sorted(t for t in token_ids if t >= vocab_size)
    if bad:
        raise InvalidRequest(field, f"token {bad[0]} is outside the vocabulary (size {vocab_size})")


#: Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


def check_n(n: int, options: SamplingOptions) -> None:
    """Several samples need sampling: vLLM refuses n > 1 with greedy decoding (they would be identical)."""
    if n > 1 and options.temperature < GREEDY_TEMPERATURE:
        raise InvalidRequest("n", f"must be 1 when using greedy sampling (temperature 0), got {n}")


def sample_seed(options: SamplingOptions, j: int) -> SamplingOptions:
    """The options of a call's ``j``-th sample: with a seed, ``seed + j`` (vLLM's parallel sampling gives each child
    its own seed so, else n seeded samples would be n copies of one), wrapped below 2^63 as admission requires."""
    if options.seed is None or j == 0:
        return options
    return dataclasses.replace(options, seed=(options.seed + j) % SEED_LIMIT)


def check_engine_limits(engine: Engine, options: SamplingOptions) -> None:
    """The engine's own bounds (vLLM's checks): a value it would refuse is INVALID_ARGUMENT here, naming the field."""
    try:
        engine.check(options)
    except EngineRejected as e:
        raise InvalidRequest(e.request_path, e.message) from e


# --- the admission steps ----------------------------------------------------------------------------------------


@dataclass
class Call:
    """An admitted client call and what it has produced so far (for the access log and the metrics)."""

    call_id: str
    api: str
    arrived: float
    deadline: float | None
    #: One request per sequence, in index order.
    sequences: list[Request]
    finals: dict[int, node_pb2.GenerateFinal] = field(default_factory=dict)
    first_token_at: dict[int, float] = field(default_factory=dict)
    policy: str = ""
    #: Per sequence until its final message (a call cut short is still logged with what it did): the node streaming
    #: it, the attempt it is on (1: no retry), the tokens streamed so far, the times it was continued elsewhere.
    serving: dict[int, str] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    streamed_tokens: dict[int, int] = field(default_factory=dict)
    migrations: dict[int, int] = field(default_factory=dict)


class Admission:
    """The node's admission steps (module docstring). ``in_flight``: the ingress's calls in flight (their request
    ids); ``draining``: whether the node refuses new calls; ``limits``: the tenants' rate limits (None: none);
    ``queue``: the engine's queue, where refusals are counted (None: not counted); ``usage``: where admitted calls
    are counted for the mesh-wide limits (None: not counted)."""

    def __init__(
        self,
        config: NodeConfig,
        engine: Engine,
        context: IngressContext,
        in_flight: ActivityTracker,
        draining: Callable[[], bool],
        *,
        limits: TenantRateLimits | None = None,
        queue: EngineQueue | None = None,
        usage: TenantUsage | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.limits = limits
        self.queue = queue
        self.usage = usage
        self.served_model_names = context.served_model_names
        self._in_flight = in_flight
        self._draining = draining
        #: The adapters some node of the mesh serves (by default this engine's alone).
        self.mesh_adapters: Callable[[], frozenset[str]] = context.mesh_adapters or (lambda: engine.adapters().served)

    def check_open(self) -> None:
        """A draining node takes no new call (it lets those it admitted finish)."""
        if self._draining():
            raise ServeError(ServeCode.UNAVAILABLE, "node is draining; send to another node")

    def check_model(self, model: str | None) -> str:
        """The model a call names is one this mesh serves (empty: the default): the base model (returns "") or a
        LoRA adapter some node serves (returns its name)."""
        if not model or not self.served_model_names or model in self.served_model_names:
            return ""
        if len(model) > MAX_MODEL_NAME_CHARS:  # no adapter or served name is that long; its echo would be as long
            raise ServeError(
                ServeCode.INVALID_ARGUMENT, f"model: at most {MAX_MODEL_NAME_CHARS} characters, got {len(model)}",
                "model",
            )
        adapters = self.mesh_adapters()
        if model in adapters:
            return model
        served = ", ".join(repr(n) for n in (*self.served_model_names, *sorted(adapters)))
        raise ServeError(
            ServeCode.NOT_FOUND, f"model: {model!r} is not served by this mesh (served: {served})", "model"
        )

    async def render(self, rendering: Awaitable[T]) -> T:
        """A prompt the engine renders (a chat with the model's template), refused like any other prompt: the node is
        not draining, the engine takes the conversation (INVALID_ARGUMENT naming the field) and is alive."""
        self.check_open()
        try:
            return await rendering
        except EngineRejected as e:
            raise ServeError(ServeCode.INVALID_ARGUMENT, f"{e.field}: {e.message}", e.field) from e
        except EngineDeadError as e:
            raise ServeError(ServeCode.UNAVAILABLE, f"engine unavailable: {e}") from e

    async def _prompt_tokens(self, spec: PromptSpec) -> list[int]:
        if spec.token_ids is not None:
            return spec.token_ids
        assert spec.text is not None
        if len(spec.text) > TOKENIZE_OFF_LOOP_CHARS:  # the event loop keeps serving meanwhile
            return await asyncio.to_thread(self.engine.encode, spec.text)
        return self.engine.encode(spec.text)

    async def _sequences_of(self, request: node_pb2.GenerateRequest, first_index: int, arrived: float) -> list[Request]:
        server = self.config.server
        info = self.engine.info
        check_identity(request)
        namespace = CacheNamespace(self.check_model(request.model), check_cache_salt(request.cache_salt))
        spec = check_prompt(request, server.max_prompt_chars, info.vocab_size)
        tokens = await self._prompt_tokens(spec)
        field_name = "prompt.text" if spec.text is not None else "prompt.token_ids"
        check_prompt_length(len(tokens), info, field_name)
        options = check_sampling(request.sampling, server.sampling, info, len(tokens))
        check_engine_limits(self.engine, options)
        check_n(request.n, options)
        segments = segment_checks.resolve(request, tokens, self._encode_segment, namespace)
        one = Request(
            "", tokens, options, namespace, segments, request.routing_key, arrived=arrived,
            packed_tokens=spec.packed_tokens,
        )
        return [
            dataclasses.replace(one, index=first_index + j, sampling=sample_seed(options, j))
            for j in range(max(request.n, 1))
        ]

    def _encode_segment(self, text: str) -> list[int]:
        return self.engine.encode(text, add_special_tokens=False)

    async def call(
        self,
        requests: list[node_pb2.GenerateRequest],
        api: str,
        new_call_id: Callable[[], str],
        deadline: float | None,
        caller: Caller = DEFAULT_CALLER,
    ) -> Call:
        """A client call of one request per prompt (each with its ``n``), validated and tokenized, for ``caller``
        (its tenant, and the priority of its requests that name none); ``new_call_id`` names it when its first
        request names none."""
        arrived = time.monotonic()
        tenant, priority = caller.tenant, caller.priority
        self.check_open()
        sequences: list[Request] = []
        for request in requests:
            sequences += await self._sequences_of(request, len(sequences), arrived)
        if len(sequences) > MAX_N:
            raise InvalidRequest("n", f"at most {MAX_N} sequences per call, got {len(sequences)}")
        self._check_capacity(len(sequences), tenant)
        call_id = requests[0].request_id or new_call_id()
        single = len(sequences) == 1
        named = [
            dataclasses.replace(
                s,
                request_id=call_id if single else f"{call_id}.{s.index}",
                deadline=deadline,
                tenant=tenant,
                sampling=s.sampling
                if not priority or s.sampling.priority
                else dataclasses.replace(s.sampling, priority=priority),
            )
            for s in sequences
        ]
        for s in named:
            if s.request_id in self._in_flight:
                raise ServeError(
                    ServeCode.ALREADY_EXISTS, f"request_id: {s.request_id!r} is already running here", "request_id"
                )
        self._check_rate(tenant, sum(len(s.tokens) + s.max_tokens for s in named))
        return Call(call_id, api, arrived, deadline, named)

    def _check_capacity(self, sequences: int, tenant: str) -> None:
        """The node relays at most max_in_flight calls' sequences plus as many as may wait (a bound on memory: the
        engine's own slots and the queue's order are decided where each sequence is served)."""
        server, flow = self.config.server, self.config.flow
        limit = server.max_in_flight + flow.max_queue_length
        if len(self._in_flight) + sequences <= limit:
            return
        if self.queue is not None:
            self.queue.refuse(tenant, "queue_full" if flow.max_queue_length else "in_flight_full")
        raise ServeError(
            ServeCode.RESOURCE_EXHAUSTED,
            f"overloaded: node {self.config.node_id} has {len(self._in_flight)} requests in flight or waiting "
            f"(max_in_flight {server.max_in_flight} + max_queue_length {flow.max_queue_length})",
            throttle=Throttle.OVERLOAD,
            retry_after_s=1.0,
        )

    def _check_rate(self, tenant: str, tokens: int) -> None:
        """The tenant's rate limits take one request and ``tokens`` more (charged only when they do)."""
        if self.limits is None:
            return
        wait = self.limits.admit(tenant, tokens, time.monotonic())
        if wait <= 0:
            if self.usage is not None:
                self.usage.record(tenant, tokens)
            return
        if self.queue is not None:
            self.queue.refuse(tenant, "rate_limit")
        raise ServeError(
            ServeCode.RESOURCE_EXHAUSTED,
            f"rate limit: tenant {tenant!r} is over its rate limit (this call: 1 request, {tokens} tokens); "
            f"retry after {wait:.1f} s",
            throttle=Throttle.RATE_LIMIT,
            retry_after_s=wait,
        )

    def forwarded(
        self, message: forward_pb2.ForwardRequest, sender_id: str, data: bytes | None = None
    ) -> tuple[SamplingOptions, list[int]]:
        """A request ``sender_id`` forwarded here, checked again (a peer's bug must not reach the engine): served where
        it lands (hop 1, never forwarded again), from its sender, with a prompt, sampling and an adapter this engine
        takes (an adapter it does not serve is UNAVAILABLE: the sender's picture of it was stale, and another node
        may serve it); its sampling converted once, and its prompt read into a list once, from ``data`` (the
        message's bytes) when given (``token_wire.read_tokens``: a protobuf repeated field is several times slower to
        walk; ``forward.request_of`` rebuilds the request from both, its segments checked there)."""
        info = self.engine.info
        if message.hop != 1:
            raise InvalidRequest("hop", f"must be 1 (forwarded requests are never re-forwarded), got {message.hop}")
        if message.origin != sender_id:
            raise InvalidRequest("origin", f"{message.origin!r} is not the sender")
        if not message.request_id:
            raise InvalidRequest("request_id", "must not be empty")
        tokens, top = read_tokens(message, "prompt_token_ids", data)
        check_token_ids(tokens, info.vocab_size, "prompt_token_ids", top)
        check_prompt_length(len(tokens), info, "prompt_token_ids")
        options = check_sampling(message.sampling, self.config.server.sampling, info, len(tokens))
        check_engine_limits(self.engine, options)
        check_cache_salt(message.cache_salt)
        check_name(message.tenant, "tenant")
        if message.adapter and message.adapter not in self.engine.adapters().served:
            raise ServeError(ServeCode.UNAVAILABLE, f"adapter {message.adapter!r} is not served by this node")
        return options, tokens
