"""A simulated engine with a real paged prefix cache, for fast unit tests (never in place of vLLM in
integration tests).

It keeps an LRU prefix cache of full blocks with vLLM's semantics (a prompt reuses its longest cached prefix of
full blocks, never its last token; blocks of a finished sequence are cached; eviction emits ``BlockRemoved``),
and "generates" deterministic tokens: token i of a completion is a function of the prompt and i. Text is one
character per token (``chr(ord('a') + id % 26)``), so tests can reason about it; a requested logprob is
``-(rank + 1) / 8`` for the rank-th candidate. It refuses sampling values with vLLM's own bounds (``check``; a
unit test pins them against vLLM's SamplingParams), and renders chat messages with a fixed plain template.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from p2pnode.engine.base import (
    CacheEventSink,
    EngineDeadError,
    EngineLoad,
    EngineRejected,
    FinishReason,
    GenerationChunk,
    ModelInfo,
    PositionLogprobs,
    SamplingOptions,
    TokenLogprob,
)
from p2pnode.engine.events import BlockRemoved, BlockStored

SIM_VOCAB_SIZE = 512
SIM_EOS_TOKEN_ID = 2
#: vLLM's bounds, mirrored (tests/unit/test_sim_engine_bounds.py holds them to vLLM's SamplingParams): the
#: largest temperature, the penalty range, and the model config's default max_logprobs.
SIM_MAX_TEMPERATURE = 2.0
SIM_PENALTY_RANGE = (-2.0, 2.0)
SIM_MAX_LOGPROBS = 20


def _token_text(token: int) -> str:
    return chr(ord("a") + token % 26)


class SimEngine:
    """``Engine`` with an exact LRU prefix cache of ``num_blocks`` blocks and a fixed time per token."""

    def __init__(
        self,
        *,
        block_size: int = 32,
        num_blocks: int = 256,
        max_model_len: int = 2048,
        token_delay_s: float = 0.0,
        name: str = "sim",
    ) -> None:
        self.info = ModelInfo(
            name=name,
            vocab_size=SIM_VOCAB_SIZE,
            max_model_len=max_model_len,
            block_size=block_size,
            eos_token_id=SIM_EOS_TOKEN_ID,
        )
        self.num_blocks = num_blocks
        self.token_delay_s = token_delay_s
        # engine block hash (hash of the token prefix tuple) -> None, in LRU order (oldest first)
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._sink: CacheEventSink | None = None
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self.dead = False

    async def start(self, on_cache_events: CacheEventSink) -> None:
        self._sink = on_cache_events

    async def shutdown(self) -> None:
        self._sink = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Bytes as tokens, shifted past the special ids (no special tokens are added)."""
        return [3 + (b % (SIM_VOCAB_SIZE - 3)) for b in text.encode()]

    def decode(self, token_ids: list[int]) -> str:
        """The inverse of ``encode`` (ids that no byte maps to decode as U+FFFD)."""
        return bytes(t - 3 if 3 <= t < 259 else 0xFF for t in token_ids).decode(errors="replace")

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            kv_usage=len(self._cache) / self.num_blocks,
            unfinished=len(self._running),
            healthy=not self.dead,
        )

    def kv_event_stats(self) -> None:
        return None

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

    async def render_chat(self, request: Any) -> list[int]:
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
        return self.encode("".join(lines) + "assistant:")

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    def _block_hashes(self, token_ids: list[int]) -> list[int]:
        bs = self.info.block_size
        return [hash(tuple(token_ids[: (i + 1) * bs])) for i in range(len(token_ids) // bs)]

    def _cached_prefix_tokens(self, token_ids: list[int]) -> int:
        bs = self.info.block_size
        hit = 0
        for h in self._block_hashes(token_ids)[: (len(token_ids) - 1) // bs]:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            hit += bs
        return hit

    def _store(self, token_ids: list[int]) -> None:
        """Cache every full block of the sequence, evicting least recently used blocks beyond capacity."""
        bs = self.info.block_size
        hashes = self._block_hashes(token_ids)
        new = [i for i, h in enumerate(hashes) if h not in self._cache]
        for h in hashes:
            self._cache[h] = None
            self._cache.move_to_end(h)
        evicted: list[int] = []
        while len(self._cache) > self.num_blocks:
            evicted.append(self._cache.popitem(last=False)[0])
        if self._sink is None:
            return
        events: list = []
        if new:
            first = new[0]
            parent = hashes[first - 1] if first > 0 else None
            events.append(
                BlockStored(
                    engine_block_hashes=tuple(hashes[first:]),
                    parent_engine_hash=parent,
                    token_ids=tuple(token_ids[first * bs : len(hashes) * bs]),
                    block_size=bs,
                )
            )
        if evicted:
            events.append(BlockRemoved(engine_block_hashes=tuple(evicted)))
        if events:
            self._sink(events)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], options: SamplingOptions
    ) -> AsyncIterator[GenerationChunk]:
        if self.dead:
            raise EngineDeadError("simulated engine is dead")
        cached = self._cached_prefix_tokens(prompt_token_ids)
        self._running.add(request_id)
        sequence = list(prompt_token_ids)
        try:
            seed = hash(tuple(prompt_token_ids)) & 0xFFFF
            for i in range(options.max_tokens):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                else:
                    await asyncio.sleep(0)
                if self.dead:
                    raise EngineDeadError("simulated engine died")
                if request_id in self._aborted:
                    yield GenerationChunk((), "", cached, FinishReason.ABORT)
                    return
                token = 3 + (seed + 7 * i) % (SIM_VOCAB_SIZE - 3)
                sequence.append(token)
                last = i == options.max_tokens - 1
                logprobs: tuple[PositionLogprobs, ...] = ()
                if options.logprobs is not None:
                    candidates = [token, *(3 + (token + k) % (SIM_VOCAB_SIZE - 3) for k in range(1, 21))]
                    top = tuple(
                        TokenLogprob(t, -(rank + 1) / 8, _token_text(t)) for rank, t in enumerate(candidates)
                    )[: options.logprobs]
                    logprobs = (PositionLogprobs(TokenLogprob(token, -1 / 8, _token_text(token)), top),)
                yield GenerationChunk(
                    token_ids=(token,),
                    text=_token_text(token),
                    cached_tokens=cached,
                    finish_reason=FinishReason.LENGTH if last else None,
                    logprobs=logprobs,
                )
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)
            self._store(sequence)
