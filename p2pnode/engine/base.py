"""The engine protocol: the small surface the node needs from an inference engine.

vLLM implements it in production (``vllm_engine``); a simulated engine implements it for fast unit tests and the
simulator. Requests arrive already tokenized and validated: the engine never sees text prompts, so routing and
the prefix index see exactly the tokens the engine caches.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2pnode.cache.events import CacheEvent
from p2pnode.kv.params import ExportAsk, ExportLease, PullResult, PullSource
from p2pnode.load import NO_LOAD, NodeLoad
from p2pnode.lora import AdapterSet
from p2pnode.request import Request, SamplingOptions


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests (its process died or it failed irrecoverably)."""


class EngineRequestFailed(RuntimeError):
    """The engine failed one request, not the engine (vLLM's finish reason ``error``: a grammar its core could not
    compile, an exception while preprocessing the request, a KV load that failed): INTERNAL, retryable elsewhere
    before any output, as vLLM's own server answers it 500 -- never a successful, empty completion."""


class EngineStartError(RuntimeError):
    """The engine could not start (its message is one line; the engine's own log above says more)."""


class EngineRejected(ValueError):
    """The engine refuses a request's parameters (a value outside its own limits).

    ``field`` names the ``SamplingOptions`` field at fault (``temperature``, ``logprobs``...) or ``prompt`` /
    ``messages``, "" when the engine's message names none; the API layer turns it into INVALID_ARGUMENT naming the
    client's field (``request_path``). Never retried elsewhere: every node of a mesh serves the same model with the
    same limits.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message

    @property
    def request_path(self) -> str:
        """The field's path in a ``GenerateRequest`` (``sampling.top_p``; ``sampling`` when no field is named)."""
        if self.field.split(".", 1)[0].split("[", 1)[0] in ("prompt", "messages", "model"):  # not prompt_logprobs
            return self.field
        return f"sampling.{self.field}" if self.field else "sampling"


class AdapterNotServed(Exception):
    """A request names a LoRA adapter this engine no longer serves (unloaded after the request's admission): unlike
    ``EngineRejected``, a peer serving the adapter may serve it."""


class AdapterError(Exception):
    """A LoRA adapter cannot be loaded or unloaded (``status``: the HTTP status vLLM answers it with; ``param``: the
    request field at fault, None where vLLM names none -- it names none for any adapter error, p2pnode only for the
    checks of its own: the name's characters, the allowed directories)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One candidate token at a position and its log-probability (``rank`` 1: the likeliest; 0: not reported)."""

    token_id: int
    logprob: float
    token: str
    rank: int = 0


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """Log-probabilities at one generated position: the sampled token, then the top alternatives."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """New output since the previous chunk. The last chunk of a request has ``finish_reason`` set.

    ``cached_tokens`` is the engine's own count of prompt tokens served from its prefix cache; it is known from
    the first chunk on. ``queue_s`` is the engine-measured wait before scheduling, when the engine reports it.
    """

    token_ids: tuple[int, ...]
    text: str
    cached_tokens: int
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    queue_s: float | None = None
    #: One entry per token in ``token_ids`` when the request asked for logprobs, else empty.
    logprobs: tuple[PositionLogprobs, ...] = ()
    #: On the last chunk of a request that pulled its prefix: what arrived (``kv/params.py``).
    pull: PullResult | None = None
    #: On the last chunk of a request with approximate segments: what was reused.
    segments: SegmentOutcome | None = None
    #: On the first chunk of a request that asked for prompt log-probabilities: one entry per prompt token (None for
    #: the first, which nothing precedes; ``sampled`` is the prompt's own token).
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()
    #: On the last chunk: of ``cached_tokens``, those the engine loaded from its host KV tier (``kv/tier/``), and
    #: those the disk tier below it supplied (through the host tier; not among ``host_tier_tokens``).
    host_tier_tokens: int = 0
    disk_tier_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SegmentOutcome:
    """What approximate reuse did for a request: ``loaded_tokens`` came from the segment store (``segments`` of its
    segments; the rest bridged partial blocks), after ``phases`` one-token requests that computed
    ``phase_tokens`` of its prompt first (``kv/segments.py``); ``error`` says why nothing could be reused."""

    loaded_tokens: int = 0
    segments: int = 0
    phases: int = 0
    phase_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """The engine's health and load as its scheduler last reported them (refreshed every engine step).

    ``load`` holds what the engine knows of the node's load (running, waiting, KV use; the serving core adds its own
    calls in flight and prefill backlog); ``unfinished`` counts the requests the engine still tracks; ``stalled_s``:
    seconds an engine that had work has gone without a step, once past its stall timeout (``engine/stall.py``; 0.0:
    it steps). ``healthy`` is False while it is dead or stalled: only a stalled one can become healthy again.
    """

    load: NodeLoad = NO_LOAD
    healthy: bool = True
    unfinished: int = 0
    stalled_s: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What the node must know about the served model to validate and hash requests."""

    name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    extra: dict[str, str] = field(default_factory=dict)
    #: The model's own sampling defaults (its generation_config.json as vLLM reads it: temperature, top_p, top_k,
    #: min_p, the penalties, and max_tokens from max_new_tokens), for the fields a request leaves unset.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    #: Its KV layout fingerprint and its block server's address ("": it lends and pulls no KV; ``p2pnode/kv/``).
    kv_layout: str = ""
    kv_address: str = ""


CacheEventSink = Callable[[list[CacheEvent]], None]


class Engine(Protocol):
    """An inference engine with a prefix cache that reports its cache changes."""

    info: ModelInfo

    async def start(self, on_cache_events: CacheEventSink) -> None:
        """Start serving; cache events are delivered to ``on_cache_events`` in engine order from now on."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The model's tokenizer (with its BOS etc. unless ``add_special_tokens`` is False)."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids back to text (special tokens skipped unless told otherwise)."""
        ...

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (the tokenizer's ``convert_ids_to_tokens``: a byte-level BPE writes
        a leading space as ``Ġ``), special tokens included: vLLM's ``/tokenize`` ``token_strs``."""
        ...

    def check(self, options: SamplingOptions) -> None:
        """Raise EngineRejected when the engine would refuse these options (its own bounds, e.g. vLLM's)."""
        ...

    async def render_chat(self, request: Any) -> list[int]:
        """The prompt tokens of a chat request, rendered with the model's chat template.

        ``request`` is vLLM's ``ChatCompletionRequest`` (its ``messages`` and chat-template fields). Raises
        EngineRejected (field ``messages``) when the conversation cannot be rendered.
        """
        ...

    async def render_chat_text(self, request: Any) -> str:
        """The chat as the model's template writes it, before tokenization (what vLLM's Responses API reports as its
        raw input message). Raises as ``render_chat`` does."""
        ...

    def generate(self, request: Request, pull: PullSource | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream a completion of ``request`` (its namespace: the LoRA adapter to run and the cache salt; its
        ``engine_request_id`` names it in the engine). Closing the iterator early aborts the request in the engine.

        ``pull``: load the prompt's prefix from a holder's engine instead of computing it (what fails to arrive is
        computed; the last chunk's ``pull`` says what arrived). Approximate segments (``request.approximate_segments``):
        reuse the stored KV of these spans wherever they sit (the last chunk's ``segments`` says what was reused);
        exact mode never reaches the engine (the node lays the prompt out). Raises EngineDeadError when the engine
        cannot serve, EngineRejected when it refuses the request.
        """
        ...

    async def export(self, request_id: str, prompt_token_ids: list[int], ask: ExportAsk) -> ExportLease:
        """Lease the cached blocks of a prompt's prefix to a puller (``info.kv_layout`` non-empty only); the lease says
        why not when the blocks are no longer cached."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a running request (no-op when it already finished)."""
        ...

    def status(self) -> EngineStatus:
        """Health and load as of the engine's last step."""
        ...

    def kv_capacity_blocks(self) -> int:
        """Blocks of the engine's KV cache (what its eviction policy and the selector's shadows size to)."""
        ...

    async def set_eviction(self, name: str) -> dict[str, Any]:
        """Make ``name`` (``config.EVICTION_POLICY_NAMES``) the engine's eviction policy from now on, without a
        restart; returns what the engine reports (``active``...)."""
        ...

    def adapters(self) -> AdapterSet:
        """The LoRA adapters this engine serves, and those it used most recently."""
        ...

    def segment_holdings(self) -> dict[int, int]:
        """The segment keys (-> tokens) the node believes its engine's segment store holds (empty: no store)."""
        ...

    def segment_store_bytes(self) -> int:
        """The engine's segment store in bytes (0: none: approximate requests are served as plain prompts)."""
        ...

    def kv_event_stats(self) -> object | None:
        """The KV-event subscriber's counters, when the engine publishes events over a wire."""
        ...

    async def log_stats(self) -> None:
        """Log the engine's own periodic stats line (vLLM's "Avg prompt throughput..."), if it has one."""
        ...

    async def shutdown(self) -> None: ...
