"""Adapter changes at run time on the vLLM engine wrapper (``engine/vllm_engine.py``), vLLM's own loader faked: each
adapter under an id of its own however the loads interleave, and unloading refused where loading is."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from p2pnode.config import EngineConfig, LoraConfig
from p2pnode.engine.base import AdapterError
from p2pnode.engine.vllm_engine import VllmEngine


class _Loader:
    """vLLM's add_lora / remove_lora as they behave: a load takes a while; an id already loaded is not loaded again."""

    def __init__(self) -> None:
        self.loaded: dict[int, str] = {}

    async def add_lora(self, request: object) -> bool:
        await asyncio.sleep(0.01)  # reading the weights
        lora_id, path = request.lora_int_id, request.lora_path  # type: ignore[attr-defined]
        if lora_id in self.loaded:
            return False
        self.loaded[lora_id] = path
        return True

    async def remove_lora(self, lora_id: int) -> None:
        self.loaded.pop(lora_id, None)


def _adapter(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return path


def _engine(tmp_path: Path, allowed: bool = True) -> tuple[VllmEngine, _Loader]:
    lora = LoraConfig(enabled=True, allowed_dirs=(tmp_path,) if allowed else ())
    engine = VllmEngine(EngineConfig(model=tmp_path / "model", lora=lora))
    loader = _Loader()
    engine._llm = loader  # type: ignore[assignment]
    return engine, loader


async def test_adapters_loaded_at_once_each_get_their_own_weights(tmp_path: Path) -> None:
    """Before: both took the id the first had not yet moved past, vLLM loaded only the first, and requests for the
    second ran on the first one's weights while both loads answered success."""
    engine, loader = _engine(tmp_path)
    a, b = _adapter(tmp_path, "a"), _adapter(tmp_path, "b")
    await asyncio.gather(engine.load_adapter("A", str(a)), engine.load_adapter("B", str(b)))
    ids = {name: request.lora_int_id for name, request in engine._adapters.items()}
    assert len(set(ids.values())) == 2
    assert {loader.loaded[ids["A"]], loader.loaded[ids["B"]]} == {str(a), str(b)}
    results = await asyncio.gather(
        engine.load_adapter("C", str(a)), engine.load_adapter("C", str(b)), return_exceptions=True
    )
    assert sum(isinstance(r, AdapterError) for r in results) == 1  # the same name twice: one of them refused
    assert loader.loaded[engine._adapters["C"].lora_int_id] == engine._adapters["C"].lora_path


async def test_unloading_is_refused_where_loading_is(tmp_path: Path) -> None:
    """Without --lora-allowed-dir run-time changes are off: a load was refused 403, an unload of an adapter the node
    started with went through (anyone reaching the front could take it away)."""
    engine, _ = _engine(tmp_path, allowed=False)
    with pytest.raises(AdapterError) as load:
        await engine.load_adapter("x", str(_adapter(tmp_path, "x")))
    with pytest.raises(AdapterError) as unload:
        await engine.unload_adapter("x")
    assert load.value.status == unload.value.status == 403
