"""Fixtures for every suite: the tiny model that real vLLM engines serve (tests/integration, tests/slow)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from p2pnode.launcher import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]

#: The two LoRA adapters of the tiny model the tests serve (scripts/make_tiny_lora.py; ``make bootstrap`` builds them).
TINY_ADAPTERS = {"tiny-lora-a": 1, "tiny-lora-b": 2}  # name -> seed

#: The model is built once per session, by whichever asks first: a fixture, or a mesh started early in the
#: background (tests/integration/conftest.py).
_built: dict[str, object] = {}
_building = threading.Lock()


def built_tiny_model() -> Path:
    """The tiny model, built (or rebuilt if stale) on first use when ``make bootstrap`` has not built it yet."""
    with _building:
        if "model" not in _built:
            model = tiny_model_dir()
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)], check=True)
            _built["model"] = model
        return _built["model"]  # type: ignore[return-value]


def built_tiny_adapters() -> dict[str, Path]:
    """The tiny model's two LoRA adapters, by name, built (or rebuilt if stale) beside it on first use."""
    model = built_tiny_model()
    with _building:
        if "adapters" not in _built:
            paths = {}
            for name, seed in TINY_ADAPTERS.items():
                out = model.parent / name
                script = str(ROOT / "scripts" / "make_tiny_lora.py")
                subprocess.run([sys.executable, script, str(model), str(out), "--seed", str(seed)], check=True)
                paths[name] = out
            _built["adapters"] = paths
        return dict(_built["adapters"])  # type: ignore[call-overload]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return built_tiny_model()


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path) -> dict[str, Path]:
    return built_tiny_adapters()
