"""What a node's HTTP front takes as input: text that is valid Unicode (every string of a body, named when it is not),
bodies declared JSON (as ``vllm serve`` decides it), and refusals that name the parameter the client sent, for every
sampling field. The fuzz test over the same endpoints: test_http_fuzz.py."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from p2pnode.api.http.json_body import UNSUPPORTED_MEDIA_TYPE, unencodable_text
from p2pnode.config import EngineConfig
from p2pnode.engine.base import EngineRejected
from p2pnode.engine.vllm_engine import VllmEngine, _rejection
from p2pnode.node import Node
from p2pnode.request import SamplingOptions
from p2pnode.v1 import node_pb2
from tests.unit.sim_nodes import make_node

LONE = "\ud800"


@pytest.fixture(scope="module")
async def node() -> AsyncIterator[Node]:
    node = make_node("inputs")
    await node.start()
    yield node
    await node.stop()


@pytest.fixture
async def http(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as client:
        yield client


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def raw_json(body: Any, *, raw_surrogates: bool = False) -> bytes:
    """``body`` as JSON bytes: lone surrogates as ``\\ud800`` escapes, or (``raw_surrogates``) as their raw UTF-8
    bytes, which Python's JSON parser decodes too."""
    if raw_surrogates:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


COMPLETION = {"model": "sim", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}

#: (path, body, the parameter the refusal names): a lone surrogate in every kind of text field.
SURROGATES = [
    ("/v1/completions", {**COMPLETION, "prompt": LONE}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", f"a{LONE}b"]}, "prompt[1]"),
    ("/v1/completions", {**COMPLETION, "stop": ["x", LONE]}, "stop[1]"),
    ("/v1/completions", {**COMPLETION, "stop": LONE}, "stop"),
    ("/v1/completions", {**COMPLETION, "user": LONE}, "user"),
    ("/v1/completions", {**COMPLETION, "model": LONE}, "model"),
    ("/v1/completions", {**COMPLETION, "request_id": LONE}, "request_id"),
    ("/v1/completions", {**COMPLETION, "cache_salt": LONE}, "cache_salt"),
    ("/v1/completions", {**COMPLETION, "segments": [LONE]}, "segments[0]"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {LONE: 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": LONE}}, "structured_outputs.regex"),
    ("/v1/completions", {**COMPLETION, LONE: 1}, "body"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "stop": [LONE]}, "stop[0]"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"k": LONE}}, "chat_template_kwargs.k"),
    ("/v1/responses", {"model": "sim", "input": LONE, "max_output_tokens": 2}, "input"),
    ("/v1/messages", {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/tokenize", {"model": "sim", "prompt": LONE}, "prompt"),
    ("/tokenize", {"model": "sim", "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/detokenize", {"model": LONE, "tokens": [1]}, "model"),
]


@pytest.mark.parametrize("raw_surrogates", [False, True], ids=["escaped", "raw-bytes"])
@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
async def test_a_lone_surrogate_is_a_400_naming_its_field(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, path: str, body: dict, param: str, raw_surrogates: bool
) -> None:
    """Before: ``{"prompt": "\\ud800"}`` on /v1/completions answered 500 UnicodeEncodeError with two tracebacks."""
    caplog.set_level(logging.INFO)
    reply = await http.post(path, content=raw_json(body, raw_surrogates=raw_surrogates),
                            headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: must be valid Unicode text"), error
    assert tracebacks(caplog) == []


async def test_valid_unicode_is_served_unchanged(http: httpx.AsyncClient) -> None:
    """A surrogate pair (an escaped emoji), an escaped backslash before ``ud800`` and non-ASCII text are all text."""
    for prompt in ("\U0001f600 smile", "\\ud800 is six characters", "élan 世界"):
        reply = await http.post("/v1/completions", content=raw_json({**COMPLETION, "prompt": prompt}),
                                headers={"content-type": "application/json"})
        assert reply.status_code == 200, reply.text
    reply = await http.post("/v1/completions", content=json.dumps(COMPLETION).encode("utf-16"),
                            headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text  # JSON in UTF-16: Python's parser (and so FastAPI's) detects it


def test_the_walk_names_the_first_bad_string_in_document_order() -> None:
    assert unencodable_text({"a": ["ok", {"b": LONE}], "c": LONE}) == ("a[1].b", LONE)
    assert unencodable_text([[1, 2.5, None, True], "fine"]) is None
    assert unencodable_text(LONE) == ("body", LONE)


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 400),
        ("text/plain", 400),
        ("application/x-www-form-urlencoded", 400),
        ("multipart/form-data; boundary=x", 400),
        ("application/jsonp", 400),
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
    ],
)
async def test_bodies_must_be_declared_json_as_vllm_serve_decides(
    http: httpx.AsyncClient, content_type: str | None, status: int
) -> None:
    """``vllm serve`` (validate_json_request on every JSON route) refuses any media type but application/json with
    400 "Unsupported Media Type"; before, a JSON body sent as text/plain or form-encoded was served."""
    headers = {} if content_type is None else {"content-type": content_type}
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                       ("/tokenize", {"model": "sim", "prompt": "hi"}), ("/detokenize", {"tokens": [70]})):
        reply = await http.post(path, content=json.dumps(body).encode(), headers=headers)
        assert reply.status_code == status, (path, reply.text)
        if status == 400:
            assert reply.json()["error"]["message"] == UNSUPPORTED_MEDIA_TYPE


def test_the_media_type_refusal_is_vllms_own() -> None:
    import inspect

    from vllm.entrypoints.serve.utils import api_utils

    source = inspect.getsource(api_utils.validate_json_request)
    assert UNSUPPORTED_MEDIA_TYPE in source and '!= "application/json"' in source


# --- every sampling field's refusal names the client's parameter ------------------------------------------------

#: Per field of the gRPC request's SamplingParams: (endpoint, the invalid parameters, the parameter the refusal names).
#: Each refusal comes from a different layer (vLLM's pydantic models, the request conversion, admission, the engine's
#: check), and each names what the client sent.
SAMPLING_CASES: dict[str, list[tuple[str, dict[str, Any], str]]] = {
    "max_tokens": [("/v1/completions", {"max_tokens": 5000}, "max_tokens"),
                   ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens"),
                   ("/v1/chat/completions", {"max_tokens": 5000}, "max_tokens")],
    "temperature": [("/v1/completions", {"temperature": 2.5}, "temperature")],
    "top_p": [("/v1/completions", {"top_p": 1.5}, "top_p")],
    "top_k": [("/v1/completions", {"top_k": -2}, "top_k")],
    "seed": [("/v1/completions", {"seed": -5}, "seed"), ("/v1/completions", {"seed": 2**63}, "seed")],
    "stop": [("/v1/completions", {"stop": [""]}, "stop[0]"), ("/v1/chat/completions", {"stop": [1]}, "stop")],
    "ignore_eos": [("/v1/completions", {"ignore_eos": "maybe"}, "ignore_eos")],
    "logprobs": [("/v1/completions", {"logprobs": 21}, "logprobs"),
                 ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs")],
    "presence_penalty": [("/v1/completions", {"presence_penalty": 3}, "presence_penalty")],
    "frequency_penalty": [("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty")],
    "repetition_penalty": [("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty")],
    "min_tokens": [("/v1/completions", {"min_tokens": 20}, "min_tokens")],
    "min_p": [("/v1/completions", {"min_p": 1.5}, "min_p")],
    "stop_token_ids": [("/v1/completions", {"stop_token_ids": [1_000_000]}, "stop_token_ids")],
    "include_stop_str_in_output": [("/v1/completions", {"include_stop_str_in_output": "x"},
                                    "include_stop_str_in_output")],
    "logit_bias": [("/v1/completions", {"logit_bias": {"1000000": 1}}, "logit_bias"),
                   ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias")],
    "prompt_logprobs": [("/v1/completions", {"prompt_logprobs": -2}, "prompt_logprobs")],
    "structured_outputs": [("/v1/completions", {"structured_outputs": {}}, "structured_outputs"),
                           ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
                           ("/v1/completions", {"structured_outputs": {"choice": ["a"], "regex": "a"}},
                            "structured_outputs"),
                           ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format")],
    "priority": [("/v1/completions", {"priority": 2**40}, "priority")],
}


def test_every_sampling_field_has_a_case() -> None:
    """A new field of SamplingParams needs a case here (so that its refusals are checked to name it)."""
    assert set(SAMPLING_CASES) == {f.name for f in node_pb2.SamplingParams.DESCRIPTOR.fields}


@pytest.mark.parametrize(("field", "path", "extra", "param"),
                         [(f, *case) for f, cases in SAMPLING_CASES.items() for case in cases])
async def test_a_refused_sampling_field_is_named_as_the_client_sent_it(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, field: str, path: str, extra: dict, param: str
) -> None:
    """Before: an invalid ``structured_outputs`` was reported as ``sampling.sampling: ...``."""
    base = dict(CHAT if "chat" in path else COMPLETION)
    if "max_completion_tokens" in extra:
        base.pop("max_tokens")
    reply = await http.post(path, json={**base, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    request_model = ChatCompletionRequest if "chat" in path else CompletionRequest
    assert param.split("[")[0].split(".")[0] in request_model.model_fields
    assert tracebacks(caplog) == []


#: Per SamplingOptions field the engine checks: a value vLLM's SamplingParams (or StructuredOutputsParams) refuses.
ENGINE_REFUSALS = [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("stop", ("",)), ("logprobs", -5),
    ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("min_tokens", 20),
    ("min_p", 2.0), ("prompt_logprobs", -5), ("structured_outputs", "{}"), ("structured_outputs", "[]"),
    ("structured_outputs", '{"choice": ["a"], "regex": "a"}'), ("structured_outputs", "{"),
]


@pytest.mark.parametrize(("field", "value"), ENGINE_REFUSALS)
def test_vllms_refusals_name_the_field(field: str, value: Any) -> None:
    """VllmEngine.check (not started: SamplingParams' own checks) names the SamplingOptions field, never a bare
    "sampling" (which the node reported as ``sampling.sampling``)."""
    import dataclasses

    engine = VllmEngine(EngineConfig(model=Path("unused")))
    options = SamplingOptions(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
    with pytest.raises(EngineRejected) as err:
        engine.check(dataclasses.replace(options, **{field: value}))
    assert err.value.field == field
    assert err.value.request_path == f"sampling.{field}"


def test_a_structured_outputs_check_of_vllms_verify_is_named() -> None:
    """vLLM's verify (a started engine's) refuses an empty choice in ``_validate_structured_outputs`` with a message
    naming no parameter: the check it was raised in names it."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=[]))
    with pytest.raises(VLLMValidationError) as err:
        params._validate_structured_outputs(SimpleNamespace(is_diffusion=False), StructuredOutputsConfig(), object())
    assert not err.value.parameter  # vLLM names nothing
    assert _rejection(err.value).field == "structured_outputs"
    assert _rejection(ValueError("something else")).field == ""
    assert EngineRejected("", "something else").request_path == "sampling"
