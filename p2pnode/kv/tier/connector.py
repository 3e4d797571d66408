"""``TierConnector``: vLLM's ``OffloadingConnector``, plus what p2pnode needs to know of each request's tier load.

The host tier is vLLM's offloading machinery as it ships -- its scheduler side (lookups, LRU/ARC, store threshold,
prompt-only stores, the KV events), its worker side, and its spec (``spec.py`` on the CPU build, vLLM's own on a GPU
build). This subclass only reports, and never changes what is loaded or stored:

- the tokens a request loaded from the tier, in the finished request's ``kv_transfer_params`` (``params.TIER_KEY``),
  for the node's final message and metrics (vLLM's own output counts them among ``num_cached_tokens`` only), those
  that came from the disk tier below it apart (vLLM's split of a load by source: they reach the engine through the
  host tier);
- the same on the request object itself (``params.TIER_LOADED_ATTR``), read by ``PeerPullConnector`` when it decides
  whether an export's blocks were cached (on the engine or in its tier) before it leases them;
- blocks whose load failed in p2pnode's worker (``worker.py``), as load errors vLLM recomputes.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from p2pnode.kv.params import TIER_KEY, TIER_LOADED_ATTR

log = logging.getLogger("p2pnode.kv.tier")

__all__ = ["TierConnector"]


class TierConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` that reports each request's tier load (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._loaded: dict[str, int] = {}  # scheduler: request -> tokens its (first) tier load brought
        self._from_disk: dict[str, int] = {}  # ...and of those, the tokens the disk tier supplied

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            # vLLM counts a request's cached tokens at its first admission: a load after a preemption is not added
            if request.request_id not in self._loaded:
                self._loaded[request.request_id] = num_external_tokens
                self._from_disk[request.request_id] = self._disk_tokens(request, num_external_tokens)
            setattr(request, TIER_LOADED_ATTR, self._loaded[request.request_id])

    def _disk_tokens(self, request: Any, num_external_tokens: int) -> int:
        """Of a load's tokens, those a tier of vLLM's on disk supplied (its split by source; 0 without one)."""
        try:
            sources = self.get_external_cache_hit_sources(request, num_external_tokens)
        except Exception:  # a report, never a reason to fail the request
            return 0
        return min(num_external_tokens, int(sources.get(CacheHitSource.DISK, 0)))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, answer = super().request_finished(request, block_ids)
        loaded = self._loaded.pop(request.request_id, 0)
        disk = self._from_disk.pop(request.request_id, 0)
        if loaded:
            answer = {**(answer or {}), TIER_KEY: {"host": loaded - disk, "disk": disk}}
        return delay, answer

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = getattr(self.connector_worker, "worker", None)
        take = getattr(worker, "take_load_errors", None)
        return take() if take is not None else set()
