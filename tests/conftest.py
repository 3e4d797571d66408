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
