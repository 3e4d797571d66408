"""``adaptive``: every candidate policy over the cache, the one whose shadow cache hits most recently picks victims.

The simulator's form of what a node does (docs/eviction.md): ``Switchable`` keeps every candidate's order of the
real cache's blocks, and a ``PolicySelector`` fed with each admitted request (``observe``, called by the simulated
cache) decides which one evicts. A node runs the same two pieces split across processes: the selector in the node
(``p2pnode/engine/eviction_control.py``) and the ``Switchable`` inside vLLM's engine core
(``p2pnode/engine/eviction_hook.py``), which the node switches with a utility call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from p2pnode.cache.eviction.registry import get_static
from p2pnode.cache.eviction.selector import PolicySelector
from p2pnode.cache.eviction.switchable import Switchable
from p2pnode.config import EvictionConfig

__all__ = ["Adaptive"]


class Adaptive(Switchable):
    """A ``Switchable`` whose active policy follows its ``PolicySelector``."""

    name = "adaptive"

    def __init__(self, capacity_blocks: int, refs: Mapping[int, int], config: EvictionConfig | None = None) -> None:
        cfg = config if config is not None else EvictionConfig(policy="adaptive")
        super().__init__(capacity_blocks, refs, {n: get_static(n) for n in cfg.candidates}, cfg.candidates[0])
        self.selector = PolicySelector(capacity_blocks, cfg)

    def observe(self, blocks: Sequence[int], lookup: int, prompt_blocks: float) -> None:
        """One admitted request (see ``PolicySelector.observe``); switches when the selector does."""
        choice = self.selector.observe(blocks, lookup, prompt_blocks)
        if choice is not None:
            self.switch(choice)
