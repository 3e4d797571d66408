"""Every endpoint and parameter of vLLM's OpenAI surface on the two real-vLLM nodes of the shared mesh, compared with
what a stock ``vllm serve`` of the same model with the same engine settings answered (fixtures/vllm_serve_answers.json,
recorded by scripts/record_vllm_surface.py, which says how to re-record it): the status code, every field's name and
JSON type, a stream's events, and the values the same model must give (greedy text, finish reasons, token counts) --
greedy text as far as the recording's steps were decided, which any host's kernels choose alike (tests/greedy.py).
Each case is sent the way users send it: through the official ``openai`` client where it has the call (completions,
chat, responses, models), the ``anthropic`` client for /v1/messages, plain HTTP for the rest (/version, /ping, /load);
parameters the client does not know go in its ``extra_body``, as vLLM's docs say. The cases alternate between the two
nodes as ingress, so both local and forwarded calls are compared."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import httpx
import openai
import pytest

from p2pnode.launcher import NodeProcess
from tests.greedy import MIN_DECIDED_STEPS, decided_steps
from tests.integration.conftest import API_KEY, VLLM_NODES, wait_idle


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


def _call(create: Callable[..., Any], raw: Callable[..., Any], body: dict[str, Any]) -> httpx.Response:
    """``raw`` (a client call's ``with_raw_response`` twin) with ``body`` split into the call's own parameters and
    ``extra_body``; the HTTP reply, whatever its status (the clients raise on 4xx: their error carries it)."""
    known = inspect.signature(create).parameters
    params = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    try:
        reply = raw(**params, extra_body=extra or None).http_response
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        reply = e.response
    reply.read()
    return reply


def _send(address: str, method: str, path: str, body: dict[str, Any] | None) -> tuple[httpx.Response, str]:
    """The reply to one case, and which client sent it."""
    oa = openai.OpenAI(base_url=f"http://{address}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    calls = {
        "/v1/completions": oa.completions, "/v1/chat/completions": oa.chat.completions, "/v1/responses": oa.responses,
    }
    if method == "POST" and path in calls and body is not None:
        resource = calls[path]
        return _call(resource.create, resource.with_raw_response.create, body), "openai"
    if method == "GET" and path == "/v1/models":
        reply = oa.models.with_raw_response.list().http_response
        reply.read()
        return reply, "openai"
    if method == "POST" and path == "/v1/messages" and body is not None:
        # the mesh's key as a bearer token (vLLM's and p2pnode's API key check), not the x-api-key header
        an = anthropic.Anthropic(
            base_url=f"http://{address}", api_key=None, auth_token=API_KEY, max_retries=0, timeout=120
        )
        return _call(an.messages.create, an.messages.with_raw_response.create, body), "anthropic"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=f"http://{address}", headers=headers, timeout=120) as client:
        return client.request(method, path, json=body), "http"


def test_the_fixture_covers_every_case_the_recorder_sends() -> None:
    assert sorted(STOCK) == sorted(name for name, *_ in surface.CASES)


def test_the_fixture_knows_how_far_each_generation_was_decided() -> None:
    """Every case whose compared values come from a generation has its margins, decided as the margin now says (a
    new margin needs a new recording), enough of them."""
    for name, case in STOCK.items():
        greedy = case.get("greedy")
        assert (greedy is not None) == surface.generates(case["same"]), name
        if greedy is not None:
            assert greedy["decided_steps"] == decided_steps(greedy["margins"]), name
            assert greedy["decided_steps"] >= min(MIN_DECIDED_STEPS, greedy["steps"]), name


@pytest.mark.parametrize("name", sorted(STOCK))
def test_answers_as_stock_vllm_serve(name: str, shared_mesh: dict[str, NodeProcess]) -> None:
    case = STOCK[name]
    ingress = shared_mesh[VLLM_NODES[sorted(STOCK).index(name) % len(VLLM_NODES)]]
    # an ingress with work of its own (a test before may have just left it some) sends a request to an idle peer,
    # which may be n3, on the simulated engine: its answer is not the model's
    asyncio.run(wait_idle(ingress))
    reply, sender = _send(ingress.http_address or "", case["method"], case["path"], case["body"])
    ours = surface.answer_of(reply, tuple(case["same"]))
    assert surface.compare(case["answer"], ours, case.get("greedy")) == [], (sender, ours)
