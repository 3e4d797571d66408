"""The vLLM engine wrapper's own lifetime, without an engine: its run directory, and a stop while the engine loads
(``launch`` stood in by a thread that takes a while and builds a stand-in; tests/slow start real engines)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from p2pnode.config import EngineConfig
from p2pnode.engine.vllm_engine import KV_PORT_FILE, VllmEngine


async def test_its_own_run_directory_is_removed_whatever_the_run_left_there() -> None:
    """The block server writes its port file there (KV pulls on): the directory was left in /tmp for each run."""
    engine = VllmEngine(EngineConfig(model=Path("unused")))
    run_dir = engine._run_dir
    (run_dir / KV_PORT_FILE).write_text("12345")
    await engine.shutdown()
    assert not run_dir.exists()


async def test_a_stop_while_the_engine_loads_shuts_down_the_engine_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal while the engine loads cancels ``start``; the thread building the engine went on, and the engine it
    built then ran unowned (``shutdown`` had seen none) until the process's exit killed its core."""
    built = threading.Event()
    release = threading.Event()

    class Built:
        shut = False

        def shutdown(self) -> None:
            Built.shut = True

    def slow_launch(self: Any) -> None:
        built.set()
        release.wait(10)
        self._llm = Built()

    monkeypatch.setattr(VllmEngine, "launch", slow_launch)
    engine = VllmEngine(EngineConfig(model=Path("unused")))
    start = asyncio.ensure_future(engine.start(lambda events: None))
    await asyncio.to_thread(built.wait, 10)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    release.set()
    await engine.shutdown()
    assert Built.shut and engine._llm is None


async def test_an_abort_reaches_the_segment_phase_a_request_runs_and_ends_its_phases() -> None:
    """vLLM aborts an id exactly: a request running its approximate-segment phases (``<id>/phase<n>``) went on
    through the abort a stalled engine's requests get, held for the whole stall."""
    engine = VllmEngine(EngineConfig(model=Path("unused")))
    aborted: list[list[str]] = []

    class Llm:
        async def abort(self, ids: list[str]) -> None:
            aborted.append(list(ids))

    engine._llm = Llm()
    await engine.abort("r0")  # no phase running: the id alone, nothing remembered
    engine._phase_of["r1"] = "r1/phase0"
    await engine.abort("r1")
    assert aborted == [["r0"], ["r1", "r1/phase0"]]
    assert engine._aborted_phases == {"r1"}  # its phases stop; generate ends it aborted
    engine._llm = None
