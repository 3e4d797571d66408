"""The simulated engine serving for real: the simulator's ``NodeEngine`` (continuous batching over a paged prefix cache,
timed by a cost profile) driven by the node's event loop, behind the ``Engine`` protocol.

For fast unit tests, demos and meshes of many nodes on one machine -- never in place of vLLM in integration tests. It
behaves like vLLM where routing can tell: a prompt reuses its longest cached prefix of full blocks (never its last
token), full blocks of finished sequences are cached, eviction follows the chosen policy and every change reaches the
node as ``BlockStored`` / ``BlockRemoved`` events; requests queue (``waiting``) when the batch or the KV cache is full,
and the load the node gossips is the scheduler's. Steps take the profile's time (``fixed_step_profile(0)``: instant).

Output is deterministic: token i of a completion is a function of the prompt and i (never EOS), and its text is one
character per token (``chr(ord('a') + id % 26)``), so tests can reason about it; a requested logprob is
``-(rank + 1) / 8`` for the rank-th candidate. Stop strings are not applied. It refuses sampling values with vLLM's
own bounds (``check``; a unit test pins them against vLLM's SamplingParams), and renders chat messages with a fixed
plain template.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import CacheEvent
from p2pnode.cache.eviction.registry import get_static
from p2pnode.cache.eviction.switchable import Switchable
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    EVICTION_POLICY_NAMES,
    VLLM_EVICTION_POLICY,
)
from p2pnode.cost import CostProfile, fixed_step_profile, get_profile
from p2pnode.engine.base import (
    CacheEventSink,
    EngineDeadError,
    EngineRejected,
    EngineStatus,
    FinishReason,
    GenerationChunk,
    ModelInfo,
    PositionLogprobs,
    SegmentOutcome,
    TokenLogprob,
)
from p2pnode.engine.simulated.batching import NodeEngine, Scheduler
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.engine.stall import StepWatch
from p2pnode.kv.params import ExportAsk, ExportLease, PullSource
from p2pnode.lora import NO_ADAPTERS, AdapterSet
from p2pnode.request import Request, SamplingOptions

__all__ = ["SIM_EOS_TOKEN_ID", "SIM_VOCAB_SIZE", "SimEngine"]

SIM_VOCAB_SIZE = 512
SIM_EOS_TOKEN_ID = 2
SIM_BOS_TOKEN_ID = 1
#: How the simulated vocabulary spells its special tokens (ids below 3: no byte maps to them).
SIM_SPECIAL_TOKENS = {0: "<unk>", SIM_BOS_TOKEN_ID: "<s>", SIM_EOS_TOKEN_ID: "</s>"}
#: Longest prompt + completion the simulated model takes when none is set.
SIM_MAX_MODEL_LEN = 2048
#: vLLM's bounds, mirrored (tests/unit/test_engine_limits.py holds them to vLLM's SamplingParams): the largest
#: temperature, the penalty range, and the model config's default max_logprobs.
SIM_MAX_TEMPERATURE = 2.0
SIM_PENALTY_RANGE = (-2.0, 2.0)
SIM_MAX_LOGPROBS = 20
#: vLLM's kinds of structured outputs constraint (StructuredOutputsParams): a request sets exactly one.
SIM_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
NO_SEGMENT_STORE = SegmentOutcome(error="a simulated engine keeps no segment store")


def _token_text(token: int) -> str:
    return chr(ord("a") + token % 26)


class _Clock:
    """``NodeEngine``'s loop on the running asyncio loop: simulated time is seconds since the engine started."""

    __slots__ = ("_loop", "_t0")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._t0 = loop.time()

    @property
    def now(self) -> float:
        return self._loop.time() - self._t0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._loop.call_at(self._t0 + t, fn, arg)


class _Hangable:
    """A clock whose callbacks can be held back: while ``hung``, what falls due waits (a core that stopped stepping,
    its process and state kept) and runs, in order, on ``resume``."""

    __slots__ = ("_held", "_inner", "hung")

    def __init__(self, inner: Scheduler) -> None:
        self._inner = inner
        self._held: list[tuple[Callable[[Any], None], Any]] = []
        self.hung = False

    @property
    def now(self) -> float:
        return self._inner.now

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._inner.at(t, self._due, (fn, arg))

    def _due(self, call: tuple[Callable[[Any], None], Any]) -> None:
        if self.hung:
            self._held.append(call)
        else:
            call[0](call[1])

    def resume(self) -> None:
        self.hung = False
        held, self._held = self._held, []
        for fn, arg in held:
            self._inner.at(self._inner.now, fn, arg)


class _LiveRequest(SimRequest):
    """A request being served: its tokens (prompt, then the completion it will produce), its cache namespace (its
    blocks are hashed in it, like vLLM's, and reported in it) and who waits for it."""

    __slots__ = ("aborted", "namespace", "tokens", "wake")

    def __init__(
        self,
        rid: int,
        arrival: float,
        prompt: list[int],
        output: list[int],
        block_size: int,
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
    ) -> None:
        tokens = prompt + output
        chain = block_hashes(tokens, block_size, namespace.root)
        super().__init__(rid, arrival, "", len(prompt), len(output), chain, [], block_size)
        self.tokens = tokens
        self.namespace = namespace
        self.wake = asyncio.Event()
        #: Aborted by the node: its stream ends at once, as vLLM's front end ends an aborted request's.
        self.aborted = False


class SimEngine:
    """``Engine`` over the simulator's batching engine (see the module docstring)."""

    def __init__(
        self,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        max_model_len: int = SIM_MAX_MODEL_LEN,
        profile: CostProfile | str | None = None,
        token_delay_s: float = 0.0,
        eviction: str = VLLM_EVICTION_POLICY,
        name: str = "sim",
        clock: Scheduler | None = None,
        stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S,
        stall_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``profile``: a cost profile or its name; None: every step takes ``token_delay_s``. ``num_blocks``: the KV
        cache in blocks; None: the profile's capacity. ``clock``: what times the steps (tests step a manual one);
        None: the running event loop's. ``stall_timeout_s``, ``stall_clock``: when it counts as stalled
        (``engine/stall.py``; ``hang`` makes it stop stepping)."""
        if profile is None:
            profile = fixed_step_profile(token_delay_s)
        elif isinstance(profile, str):
            profile = get_profile(profile)
        self.profile = profile
        self.info = ModelInfo(
            name=name,
            vocab_size=SIM_VOCAB_SIZE,
            max_model_len=max_model_len,
            block_size=block_size,
            eos_token_id=SIM_EOS_TOKEN_ID,
        )
        self.num_blocks = num_blocks if num_blocks is not None else profile.kv_blocks(block_size)
        if self.num_blocks * block_size < max_model_len:  # vLLM refuses to start the same way
            raise ValueError(
                f"max_model_len {max_model_len} does not fit the KV cache ({self.num_blocks} blocks of {block_size})"
            )
        self.eviction = eviction
        self._clock = clock
        self._sink: CacheEventSink | None = None
        self._engine: NodeEngine | None = None
        self._active: dict[str, _LiveRequest] = {}
        self._rids = itertools.count()
        #: Set to make the engine fail: new requests are refused and running ones end with EngineDeadError.
        self.dead = False
        self._steps = StepWatch(stall_timeout_s, stall_clock)
        self._hangable: _Hangable | None = None

    async def start(self, on_cache_events: CacheEventSink) -> None:
        self._sink = on_cache_events
        bs = self.info.block_size
        # Every policy over the cache, so that the node can switch at run time (as in vLLM's engine).
        candidates = {n: get_static(n) for n in EVICTION_POLICY_NAMES}
        active = self.eviction

        def policy(capacity: int, refs: Mapping[int, int]) -> Switchable:
            return Switchable(capacity, refs, candidates, active)

        cache = PagedPrefixCache(self.num_blocks, bs, policy, self._block_tokens, emit=self._emit)
        self._hangable = _Hangable(self._clock or _Clock(asyncio.get_running_loop()))
        self._engine = NodeEngine(
            0, self._hangable, self.profile, cache, self._finished, step_by_step=True, on_step=self._stepped
        )

    def hang(self) -> None:
        """Stop stepping, state and requests kept (a core process stopped, or stuck in a driver call): a fault to
        test the node's stall watch with. ``resume`` steps again."""
        assert self._hangable is not None, "start the engine first"
        self._hangable.hung = True

    def resume(self) -> None:
        assert self._hangable is not None, "start the engine first"
        self._hangable.resume()

    async def shutdown(self) -> None:
        self._sink = None

    def _block_tokens(self, r: SimRequest, lo: int, hi: int) -> list[int]:
        bs = self.info.block_size
        return r.tokens[lo * bs : hi * bs]  # type: ignore[attr-defined]

    def _emit(self, event: CacheEvent) -> None:
        if self._sink is not None:
            self._sink([event])

    def _stepped(self) -> None:
        self._steps.stepped()
        for r in self._active.values():
            r.wake.set()

    def _finished(self, r: SimRequest) -> None:
        r.wake.set()  # type: ignore[attr-defined]

    # --- the Engine protocol ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Bytes as tokens, shifted past the special ids (no special tokens are added)."""
        return [3 + (b % (SIM_VOCAB_SIZE - 3)) for b in text.encode()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The inverse of ``encode`` (ids that no byte maps to decode as U+FFFD; the special ones as their names
        when not skipped)."""
        if skip_special_tokens or not any(t in SIM_SPECIAL_TOKENS for t in token_ids):
            return bytes(t - 3 if 3 <= t < 259 else 0xFF for t in token_ids).decode(errors="replace")
        out, run = [], []
        for t in [*token_ids, None]:
            if t is None or t in SIM_SPECIAL_TOKENS:
                out.append(self.decode(run))
                run = []
                if t is not None:
                    out.append(SIM_SPECIAL_TOKENS[t])
            else:
                run.append(t)
        return "".join(out)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token alone: its special name, else its byte (U+FFFD for a byte that is no character alone)."""
        return [SIM_SPECIAL_TOKENS.get(t) or self.decode([t]) for t in token_ids]

    async def log_stats(self) -> None:
        return None

    def check(self, options: SamplingOptions) -> None:
        """vLLM's SamplingParams checks for the fields p2pnode passes, with vLLM's messages."""
        if not math.isfinite(options.temperature) or not 0.0 <= options.temperature <= SIM_MAX_TEMPERATURE:
            raise EngineRejected("temperature", f"must be in [0, {SIM_MAX_TEMPERATURE:g}], got {options.temperature}.")
        if not 0.0 < options.top_p <= 1.0:
            raise EngineRejected("top_p", f"must be in (0, 1], got {options.top_p}.")
        if options.top_k < -1:
            raise EngineRejected("top_k", f"must be 0 (disable), or at least 1, got {options.top_k}.")
        low, high = SIM_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(options, name)
            if not low <= value <= high:
                raise EngineRejected(name, f"must be in [{low:g}, {high:g}], got {value}.")
        if not math.isfinite(options.repetition_penalty) or options.repetition_penalty <= 0.0:
            raise EngineRejected("repetition_penalty", f"must be greater than zero, got {options.repetition_penalty}.")
        if options.max_tokens < 1:
            raise EngineRejected("max_tokens", f"must be at least 1, got {options.max_tokens}.")
        if options.min_tokens < 0 or options.min_tokens > options.max_tokens:
            raise EngineRejected(
                "min_tokens", f"must be in [0, max_tokens={options.max_tokens}], got {options.min_tokens}."
            )
        if options.logprobs is not None and not 0 <= options.logprobs <= SIM_MAX_LOGPROBS:
            raise EngineRejected(
                "logprobs", f"Requested sample logprobs of {options.logprobs}, max allowed: {SIM_MAX_LOGPROBS}"
            )
        if not 0.0 <= options.min_p <= 1.0:
            raise EngineRejected("min_p", f"must be in [0, 1], got {options.min_p}.")
        if options.structured_outputs:
            _check_structured_outputs(options.structured_outputs)

    async def render_chat(self, request: Any) -> list[int]:
        """``render_chat_text``'s tokens. With ``add_special_tokens`` (vLLM's chat field) a BOS first, as a tokenizer
        that adds one does."""
        bos = [SIM_BOS_TOKEN_ID] if getattr(request, "add_special_tokens", False) else []
        return bos + self.encode(await self.render_chat_text(request))

    async def render_chat_text(self, request: Any) -> str:
        """``<role>: <text>`` lines, then ``assistant:``: enough for tests of the chat path's plumbing."""
        lines = []
        for i, message in enumerate(request.messages):
            content = message.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                if any(not isinstance(t, str) for t in parts):
                    raise EngineRejected(f"messages[{i}].content", "only text parts are supported")
                content = "".join(parts)
            if not isinstance(content, str):
                raise EngineRejected(f"messages[{i}].content", "must be text")
            lines.append(f"{message.get('role', '')}: {content}\n")
        return "".join(lines) + "assistant:"

    def status(self) -> EngineStatus:
        eng = self._engine
        if eng is None:
            return EngineStatus(healthy=not self.dead)
        unfinished = len(self._active)
        stalled_s = 0.0 if self.dead else self._steps.stalled_s(unfinished)  # dead is dead, not stalled
        return EngineStatus(
            load=eng.load(), unfinished=unfinished, healthy=not self.dead and not stalled_s, stalled_s=stalled_s
        )

    def kv_capacity_blocks(self) -> int:
        return self.num_blocks

    async def set_eviction(self, name: str) -> dict[str, object]:
        """Switch the cache's eviction policy (one of ``EVICTION_POLICY_NAMES``) at once."""
        self.eviction = name
        if self._engine is not None:
            policy = self._engine.cache.policy
            assert isinstance(policy, Switchable)
            policy.switch(name)
        return {"active": name}

    def adapters(self) -> AdapterSet:
        return NO_ADAPTERS

    def segment_holdings(self) -> dict[int, int]:
        return {}  # no segment store (module docstring of generate)

    def segment_store_bytes(self) -> int:
        return 0

    def kv_event_stats(self) -> None:
        return None

    async def abort(self, request_id: str) -> None:
        """End the request: its stream at once (a last chunk finished ABORT), its place in the batch at the next
        step boundary."""
        r = self._active.get(request_id)
        if r is not None and self._engine is not None:
            r.aborted = True
            r.wake.set()
            self._engine.abort(r)

    async def export(self, request_id: str, prompt_token_ids: list[int], ask: ExportAsk) -> ExportLease:
        """A simulated engine has no KV to lend (its ``info.kv_layout`` is empty)."""
        return ExportLease(ask.lease, error="unavailable: a simulated engine lends no KV")

    async def generate(self, request: Request, pull: PullSource | None = None) -> AsyncIterator[GenerationChunk]:
        """``pull`` is ignored: a simulated engine computes every prefix (a node on one never gets a pull hint, its
        layout being empty). Approximate segments are served as a plain prompt: this engine keeps no segment store
        (the simulator models one, ``p2pnode/sim/``), and its last chunk says so."""
        options, namespace, prompt_token_ids = request.sampling, request.namespace, request.tokens
        request_id, segments = request.engine_request_id, request.approximate_segments
        eng = self._engine
        if self.dead or eng is None:
            raise EngineDeadError("simulated engine is not running")
        if namespace.adapter:
            raise EngineRejected("model", f"adapter {namespace.adapter!r}: a simulated engine serves no adapters")
        seed = hash(tuple(prompt_token_ids)) & 0xFFFF
        output = [3 + (seed + 7 * i) % (SIM_VOCAB_SIZE - 3) for i in range(options.max_tokens)]
        r = _LiveRequest(
            next(self._rids), eng.loop.now, list(prompt_token_ids), output, self.info.block_size, namespace
        )
        self._active[request_id] = r
        eng.submit(r)
        sent = 0
        prompt_logprobs = _prompt_logprobs(prompt_token_ids, options.prompt_logprobs)
        try:
            while True:
                await r.wake.wait()
                r.wake.clear()
                if self.dead:
                    raise EngineDeadError("simulated engine died")
                if r.aborted and r.t_done < 0:
                    yield GenerationChunk(
                        token_ids=(), text="", cached_tokens=r.cached_tokens, finish_reason=FinishReason.ABORT
                    )
                    return
                done = r.t_done >= 0
                produced = 0 if r.dropped else r.output_tokens if done else eng.produced(r)
                if produced > sent or done:
                    new = tuple(output[sent:produced])
                    sent = produced
                    finish = None
                    if done:
                        finish = FinishReason.LENGTH if produced == options.max_tokens else FinishReason.ABORT
                    yield GenerationChunk(
                        token_ids=new,
                        text="".join(_token_text(t) for t in new),
                        cached_tokens=r.cached_tokens,
                        finish_reason=finish,
                        logprobs=_logprobs(new, options.logprobs),
                        segments=NO_SEGMENT_STORE if done and segments is not None else None,
                        prompt_logprobs=prompt_logprobs,
                    )
                    prompt_logprobs = ()  # on the first chunk only
                    if done:
                        return
        finally:
            self._active.pop(request_id, None)
            if r.t_done < 0:
                eng.abort(r)


def _prompt_logprobs(prompt: list[int], k: int | None) -> tuple[PositionLogprobs | None, ...]:
    """The prompt's log-probabilities as an engine reports them: none for the first token, then each token's (rank 1)
    and ``k`` alternatives; nothing unless asked for."""
    if k is None:
        return ()
    return (None, *_logprobs(tuple(prompt[1:]), k))


def _logprobs(tokens: tuple[int, ...], k: int | None) -> tuple[PositionLogprobs, ...]:
    """Each token's logprob and the top ``k`` candidates (``-(rank + 1) / 8`` for the rank-th), when asked for."""
    if k is None:
        return ()
    out = []
    for token in tokens:
        candidates = [token, *(3 + (token + i) % (SIM_VOCAB_SIZE - 3) for i in range(1, 21))]
        top = tuple(TokenLogprob(t, -(rank + 1) / 8, _token_text(t), rank + 1) for rank, t in enumerate(candidates))
        out.append(PositionLogprobs(TokenLogprob(token, -1 / 8, _token_text(token), 1), top[: k if k >= 0 else None]))
    return tuple(out)


def _check_structured_outputs(spec: str) -> None:
    """vLLM's own checks of a StructuredOutputsParams' JSON that need no model: an object setting exactly one kind of
    constraint (a choice not empty). The grammar itself is the real engine's to judge."""
    try:
        fields = json.loads(spec)
    except ValueError as e:
        raise EngineRejected("structured_outputs", f"is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise EngineRejected("structured_outputs", "must be a JSON object")
    kinds = [k for k in SIM_STRUCTURED_KINDS if fields.get(k) is not None]
    if len(kinds) != 1:
        raise EngineRejected("structured_outputs", f"must set exactly one kind of constraint, got {len(kinds)}")
    if fields.get("choice") == []:
        raise EngineRejected("structured_outputs", "a choice cannot be an empty list")
