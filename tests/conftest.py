"""Fixtures for every suite: the tiny model that real vLLM engines serve (tests/integration, tests/slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from p2pnode.launcher import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model, built (or rebuilt if stale) on first use when ``make bootstrap`` has not built it yet."""
    model = tiny_model_dir()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)], check=True)
    return model


#: The two LoRA adapters of the tiny model the tests serve (scripts/make_tiny_lora.py; ``make bootstrap`` builds them).
TINY_ADAPTERS = {"tiny-lora-a": 1, "tiny-lora-b": 2}  # name -> seed


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path) -> dict[str, Path]:
    """The tiny model's two LoRA adapters, by name, built (or rebuilt if stale) beside it on first use."""
    paths = {}
    for name, seed in TINY_ADAPTERS.items():
        out = tiny_model.parent / name
        script = str(ROOT / "scripts" / "make_tiny_lora.py")
        subprocess.run([sys.executable, script, str(tiny_model), str(out), "--seed", str(seed)], check=True)
        paths[name] = out
    return paths
