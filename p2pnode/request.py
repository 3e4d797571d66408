"""A request to serve, as one object: built once at admission, handed whole from the front door to the engine.

Admission (``serving/admission.py``) turns a client's call into one ``Request`` per sequence -- its prompt tokens
and their cache namespace, its sampling converted once into ``SamplingOptions``, its segments, its routing key, its
deadline -- and every later step takes the object, not its fields: the router decides on it, the ingress hands it
to this node's engine or forwards it (``serving/forward.py`` gives its wire form, one function each way, so a peer
rebuilds the same object), and the engine serves it. A new property of a request is a field here and its readers,
not a parameter threaded through every signature on the way.

Invariants: a ``Request`` is immutable and already validated (its tokens lie inside the model's vocabulary and
context, its sampling inside the engine's limits; ``packed_tokens``, when set, are ``tokens`` as bytes); the routing
decision a step adds -- where its prefix's KV comes from (``kv_source``) -- is a copy with that field set
(``with_kv_source``), never a mutation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from p2pnode.cache.block_hash import block_hashes, block_hashes_packed
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.segments import SegmentReuse, SegmentSpans
from p2pnode.config import DEFAULT_TENANT
from p2pnode.frozen import fast_init

__all__ = ["KvSource", "Request", "SamplingOptions"]


@fast_init
@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Validated sampling parameters; every field already holds its final value."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: Alternatives per position to return log-probabilities for (0: the sampled token only); None: no logprobs.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    #: Token ids that end generation (kept in the output).
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    #: (token id, bias) pairs added to the logits before sampling.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Alternatives per prompt position to return prompt log-probabilities for (-1: all); None: none.
    prompt_logprobs: int | None = None
    #: vLLM's StructuredOutputsParams as a JSON object ("": unconstrained).
    structured_outputs: str = ""
    #: Scheduling priority (lower first), for engines that schedule by priority.
    priority: int = 0


@fast_init
@dataclass(frozen=True, slots=True)
class KvSource:
    """Where the serving node gets a prefix of the request's KV instead of computing it: the first ``blocks`` blocks
    from ``holder``'s engine (reached at ``address``), as routing decided (``Decision.pull``)."""

    holder: str
    address: str
    blocks: int


@fast_init
@dataclass(frozen=True, slots=True)
class Request:
    """One sequence to serve (module docstring). ``tokens`` are the prompt's token ids as the client sent them (an
    exact-mode layout is chosen where the request is served); times are this process's ``time.monotonic()``."""

    #: Unique among the requests running at its ingress (the call's id, ``<call>.<index>`` for a call's siblings).
    request_id: str
    tokens: Sequence[int]
    sampling: SamplingOptions
    #: Its LoRA adapter and cache salt: what its KV depends on besides its tokens.
    namespace: CacheNamespace = DEFAULT_NAMESPACE
    #: The reusable segments it names in ``tokens`` (None: prefix caching only).
    segments: SegmentSpans | None = None
    #: The client's routing key ("": derived from the prompt when a policy needs one).
    routing_key: str = ""
    #: Its place among its call's sequences (``n`` > 1, several prompts): the index of its messages.
    index: int = 0
    #: When this node admitted it, and when its client stops waiting (None: never).
    arrived: float = 0.0
    deadline: float | None = None
    #: The ingress that forwarded it here ("": admitted by this node).
    origin: str = ""
    #: The prefix to pull before serving, for the node routing chose (None: computed or cached there).
    kv_source: KvSource | None = None
    #: Who it is for (an API key's tenant, a tenant header, or the default): its fair share where it waits.
    tenant: str = DEFAULT_TENANT
    #: ``tokens`` in the block hash's byte form (4 little-endian bytes each), kept from the wire when the client sent
    #: token ids (``token_wire.read_tokens_packed``): the router then hashes the prompt without reading a Python int
    #: (~2.4 against ~5.7 us at 4,096 tokens). None: hashed from ``tokens``. A copy with other tokens drops it
    #: (``with_tokens``).
    packed_tokens: bytes | None = None

    @property
    def engine_request_id(self) -> str:
        """Its id in the serving engine: unique across the ingresses that may send it there."""
        return f"{self.origin}/{self.request_id}" if self.origin else self.request_id

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def approximate_segments(self) -> SegmentSpans | None:
        """Its segments when the engine itself reuses them (approximate mode); exact mode is a layout of the prompt."""
        segments = self.segments
        return segments if segments is not None and segments.mode is SegmentReuse.APPROXIMATE else None

    def remaining_s(self, now: float) -> float | None:
        """Seconds left before its deadline (at least a millisecond: an expired call still gets a prompt answer)."""
        return None if self.deadline is None else max(self.deadline - now, 0.001)

    def block_hashes(self, block_size: int) -> list[int]:
        """Its prompt's block hashes in its namespace (from ``packed_tokens`` when it has them)."""
        packed, root = self.packed_tokens, self.namespace.root
        if packed is not None and len(packed) == 4 * len(self.tokens):
            return block_hashes_packed(packed, block_size, root)
        return block_hashes(self.tokens, block_size, root)

    def with_tokens(self, tokens: Sequence[int], **changes: object) -> Request:
        """This request with other prompt tokens (and ``changes``), without the old ``packed_tokens``."""
        return dataclasses.replace(self, tokens=tokens, packed_tokens=None, **changes)  # type: ignore[arg-type]

    def with_kv_source(self, source: KvSource | None) -> Request:
        """This request with ``source``: itself when it has that one already (every sequence asks, most have none)."""
        if source == self.kv_source:
            return self
        return dataclasses.replace(self, kv_source=source)
