"""The slow suite (``make test-slow``; a plain ``pytest`` does not collect it): scenarios that run for minutes on
real processes -- the fault suite, the live plan and platform meshes, a node whose engine dies, the host KV tier's
engines.

Fixtures of the fault suite (test_faults.py): the chaos driver (scripts/chaos.py) and one mesh of real processes
shared by the module (n1 on real vLLM, n2 and n3 on the simulated engine, each behind a proxy; see the driver's
docstring)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def load_chaos() -> ModuleType:
    if "chaos" in sys.modules:
        return sys.modules["chaos"]
    return load_script("chaos")


@pytest.fixture(scope="session")
def chaos() -> ModuleType:
    return load_chaos()


@pytest.fixture(scope="module")
def hub(chaos: ModuleType) -> Iterator[object]:
    hub = chaos.ProxyHub()
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def mesh(
    chaos: ModuleType, hub: object, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    mesh = chaos.standard_mesh(tmp_path_factory.mktemp("chaos"), hub)
    try:
        yield mesh
    finally:
        mesh.stop()
