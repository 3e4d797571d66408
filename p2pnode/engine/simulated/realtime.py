"""A simulated engine with a real paged prefix cache, for fast unit tests (never in place of vLLM in
integration tests).

It keeps an LRU prefix cache of full blocks with vLLM's semantics (a prompt reuses its longest cached prefix of
full blocks, never its last token; blocks of a finished sequence are cached; eviction emits ``BlockRemoved``),
and "generates" deterministic tokens: token i of a completion is a function of the prompt and i. Text is one
character per token (``chr(ord('a') + id % 26)``), so tests can reason about it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator

from p2pnode.engine.base import (
    CacheEventSink,
    EngineDeadError,
    EngineLoad,
    FinishReason,
    GenerationChunk,
    ModelInfo,
    SamplingOptions,
)
from p2pnode.engine.events import BlockRemoved, BlockStored

SIM_VOCAB_SIZE = 512
SIM_EOS_TOKEN_ID = 2


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

    def encode(self, text: str) -> list[int]:
        """Bytes as tokens, shifted past the special ids."""
        return [3 + (b % (SIM_VOCAB_SIZE - 3)) for b in text.encode()]

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            kv_usage=len(self._cache) / self.num_blocks,
            unfinished=len(self._running),
            healthy=not self.dead,
        )

    def kv_event_stats(self) -> None:
        return None

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
                yield GenerationChunk(
                    token_ids=(token,),
                    text=chr(ord("a") + token % 26),
                    cached_tokens=cached,
                    finish_reason=FinishReason.LENGTH if last else None,
                )
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)
            self._store(sequence)
