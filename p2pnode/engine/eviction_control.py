"""The node's side of KV eviction: which policy its engine runs, and (``adaptive``) the selector that chooses it.

A static policy (``--eviction-policy lru|s3fifo|sieve|arc``) is set in the engine once, at start. Under
``adaptive``, every request this node serves is offered, when it finishes, to a ``PolicySelector`` (the block
hashes of its prompt and output -- the blocks it leaves cached -- and how many of them a later request can hit):
the same selector the simulator runs (``cache/eviction/adaptive.py``). When the selector switches, the engine is
told (``Engine.set_eviction``: for vLLM a utility call into the engine core, ``engine/eviction_hook.py``); the
engine's queue keeps every candidate's order of the cached blocks, so the new policy applies from the next
eviction, with no restart and no block moved.

The simulator offers a request at admission, the node at completion (only then are its output tokens known);
both feed the shadows each request once, in the order the engine saw them within a few requests.

Costs: none for a static policy. Under ``adaptive``: per finished request, hashing its tokens (C, ~0.1 us per
token) and one replay per candidate (~1-2 us per block each); memory bounded by ``shadow_max_blocks`` per
candidate (``config.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.eviction.selector import PolicySelector, SelectorSnapshot
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.config import VLLM_EVICTION_POLICY, EvictionConfig
from p2pnode.request import Request

#: How long after a failed switch the engine is asked again (seconds): a dying engine is not asked per request.
APPLY_RETRY_S = 10.0

log = logging.getLogger("p2pnode.eviction")

__all__ = ["EvictionControl"]


class EvictionControl:
    """Sets the engine's eviction policy and, under ``adaptive``, chooses it from the requests served here."""

    def __init__(self, config: EvictionConfig, engine: Any, block_size: int) -> None:
        self.config = config
        self.engine = engine
        self.block_size = block_size
        self.selector: PolicySelector | None = None
        #: The policy the engine last confirmed (None until it did, or when it cannot switch).
        self.engine_policy: str | None = None
        self.supported = callable(getattr(engine, "set_eviction", None))
        self._tasks: set[asyncio.Task[None]] = set()
        #: When a switch the engine failed to take is asked for again (``observe``; the loop's clock).
        self._retry_at = 0.0

    @property
    def adaptive(self) -> bool:
        return self.config.policy == "adaptive"

    async def start(self) -> None:
        """Set the configured policy in the engine (the selector's first choice under ``adaptive``)."""
        initial = self.config.candidates[0] if self.adaptive else self.config.policy
        if self.adaptive:
            capacity = int(self.engine.kv_capacity_blocks()) if self.supported else 0
            if capacity > 0:
                self.selector = PolicySelector(capacity, self.config, initial)
        if self.supported:
            await self._apply(initial)
        elif self.config.policy != VLLM_EVICTION_POLICY:
            log.warning("this engine cannot change its eviction policy: it keeps its own (LRU)")

    async def _apply(self, name: str) -> None:
        try:
            reply = await self.engine.set_eviction(name)
        except Exception as e:  # a dying engine: the node's health check reports it
            log.warning("could not set the engine's eviction policy to %s: %s", name, e)
            self._retry_at = asyncio.get_running_loop().time() + APPLY_RETRY_S
            return
        self.engine_policy = reply.get("active", name) if isinstance(reply, dict) else name

    def observe(self, request: Request, output: Sequence[int]) -> None:
        """``request`` finished here, as the engine served it, with ``output``: replay it through the shadows, its
        blocks hashed in its namespace (an adapter's or a salted request's blocks are not another's, in the engine or
        its shadows); switch the engine when the selector does, and again while the engine has not taken the
        selector's choice."""
        self.observe_tokens(request.tokens, output, request.namespace)

    def observe_tokens(
        self, prompt: Sequence[int], output: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> None:
        """``observe`` from a request's parts."""
        selector = self.selector
        if selector is None:
            return
        bs = self.block_size
        tokens = list(prompt) + list(output)
        if len(tokens) < bs:
            selector.observe((), 0, len(prompt) / bs)
            return
        try:
            hashes = block_hashes(tokens, bs, namespace.root)
        except ValueError:
            return
        choice = selector.observe(hashes, max(0, (len(prompt) - 1) // bs), len(prompt) / bs)
        if choice is not None:
            log.info(
                "eviction: switching to %s (recent shadow hit rates %s)",
                choice,
                {n: round(r, 3) for n, r in selector.hit_rates().items()},
            )
            self._switch(choice)
        elif (
            self.engine_policy is not None and selector.active != self.engine_policy and not self._tasks
            and asyncio.get_running_loop().time() >= self._retry_at
        ):  # a switch the engine failed to take: the selector reports a choice only when it changes
            self._switch(selector.active)

    def _switch(self, name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._apply(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def snapshot(self) -> tuple[str, str, SelectorSnapshot | None]:
        """(configured policy, the engine's active policy, the selector's state or None)."""
        active = self.engine_policy or (VLLM_EVICTION_POLICY if not self.supported else "")
        return self.config.policy, active, self.selector.snapshot() if self.selector is not None else None
