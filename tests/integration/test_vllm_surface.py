"""Every endpoint and parameter of vLLM's OpenAI surface on the two real-vLLM nodes of the shared mesh, compared with
what a stock ``vllm serve`` of the same model with the same engine settings answered (fixtures/vllm_serve_answers.json,
recorded by scripts/record_vllm_surface.py, which says how to re-record it): the status code, every field's name and
JSON type, a stream's events, and the values the same model must give (greedy text, finish reasons, token counts).
The cases alternate between the two nodes as ingress, so both local and forwarded calls are compared."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from p2pnode.launcher import NodeProcess
from tests.integration.conftest import API_KEY, VLLM_NODES


def _recorder() -> ModuleType:
    """scripts/record_vllm_surface.py: its cases, and how it records and compares an answer."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "record_vllm_surface.py"
    spec = importlib.util.spec_from_file_location("record_vllm_surface", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


surface = _recorder()
STOCK = json.loads(surface.FIXTURE.read_text())


def test_the_fixture_covers_every_case_the_recorder_sends() -> None:
    assert sorted(STOCK) == sorted(name for name, *_ in surface.CASES)


@pytest.mark.parametrize("name", sorted(STOCK))
def test_answers_as_stock_vllm_serve(name: str, shared_mesh: dict[str, NodeProcess]) -> None:
    case = STOCK[name]
    ingress = shared_mesh[VLLM_NODES[sorted(STOCK).index(name) % len(VLLM_NODES)]]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=f"http://{ingress.http_address}", headers=headers, timeout=120) as client:
        ours = surface.answer(client, case["method"], case["path"], case["body"], tuple(case["same"]))
    assert surface.compare(case["answer"], ours) == [], ours
