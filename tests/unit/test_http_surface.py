"""The rest of vLLM's OpenAI surface on the simulated engine over real loopback HTTP: /v1/messages (the anthropic
client), /v1/responses (the openai client), /version, /ping, /load, vLLM's extra sampling parameters carried to the
serving engine across a forward, echo and prompt log-probabilities, request chat templates, and the model's
generation-config defaults. The same calls against real vLLM engines, compared with a stock ``vllm serve``:
tests/integration/test_vllm_surface.py."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from p2pnode.client import build_request
from p2pnode.node import Node
from p2pnode.request import Request, SamplingOptions
from p2pnode.v1 import node_pb2_grpc
from tests.polling import until
from tests.unit.sim_nodes import BLOCK, make_node


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    node = make_node(token_delay_s=0.001)
    await node.start()
    yield node
    await node.stop()


@pytest.fixture
async def http(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as client:
        yield client


def oa(node: Node) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{node.http.address}/v1", api_key="none", max_retries=0)


async def test_version_ping_and_load(http: httpx.AsyncClient) -> None:
    from vllm.version import __version__

    assert (await http.get("/version")).json() == {"version": __version__}
    assert (await http.get("/ping")).status_code == 200 and (await http.post("/ping")).status_code == 200
    assert (await http.get("/load")).json() == {"server_load": 0}


async def test_messages_through_the_anthropic_client(node: Node) -> None:
    client = anthropic.AsyncAnthropic(base_url=f"http://{node.http.address}", api_key="none", max_retries=0)
    reply = await client.messages.create(model="sim", max_tokens=4, system="be brief",
                                         messages=[{"role": "user", "content": "hello"}])
    assert reply.type == "message" and reply.role == "assistant" and reply.stop_reason == "max_tokens"
    assert len(reply.content[0].text) == 4 and reply.usage.output_tokens == 4
    async with client.messages.stream(model="sim", max_tokens=3, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert len(text) == 3 and final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(model="sim", max_tokens=4, stop_sequences=list("abcde"),
                                     messages=[{"role": "user", "content": "hello"}])


async def test_responses_through_the_openai_client(node: Node) -> None:
    client = oa(node)
    reply = await client.responses.create(model="sim", input="hello", instructions="be brief", max_output_tokens=4)
    assert reply.object == "response" and reply.status == "incomplete" and len(reply.output_text) == 4
    assert reply.usage.output_tokens == 4 and reply.instructions == "be brief"
    events = [e async for e in await client.responses.create(model="sim", input="hi", max_output_tokens=3,
                                                             stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        events[-1].response.output_text and len(events[-1].response.output_text) == 3
    with pytest.raises(openai.NotFoundError) as err:  # vllm serve keeps no responses either (no store)
        await client.responses.create(model="sim", input="again", previous_response_id=reply.id)
    assert "not found" in err.value.body["message"]


async def test_responses_tokenize_the_rendered_chat_with_special_tokens_as_vllm_does(http: httpx.AsyncClient) -> None:
    """vLLM's Responses server adds the tokenizer's special tokens to the rendered chat (a chat completion does not):
    with the tiny model's template, a second BOS (26 input tokens for "hello" where the chat counts 25). Before, the
    Responses prompt was the chat completion's."""
    from p2pnode.api.http import responses_api

    assert responses_api.chat_of(responses_api.ResponsesRequest(model="sim", input="hello")).add_special_tokens
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    chat_prompt = (await http.post("/v1/chat/completions", json=chat)).json()["usage"]["prompt_tokens"]
    reply = await http.post("/v1/responses", json={"model": "sim", "input": "hello", "max_output_tokens": 1})
    assert reply.json()["usage"]["input_tokens"] == chat_prompt + 1  # the simulated engine's BOS


@pytest.mark.filterwarnings("error::UserWarning")  # pydantic warned serializing prompt_logprobs given as dicts
async def test_echo_and_prompt_logprobs(http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1}
    choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"].startswith("abc") and len(choice["text"]) == 5
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 5 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 3
    chat = {"model": "sim", "max_tokens": 2, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}
    assert (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]["message"]["content"] \
        .startswith("Hel")
    prompt_lp = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 1}
    assert (await http.post("/v1/chat/completions", json=prompt_lp)).json()["prompt_logprobs"][0] is None


async def test_request_chat_templates_are_refused_as_vllm_refuses_them(http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"}
    reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and "--trust-request-chat-template" in reply.json()["error"]["message"]
    trusted = make_node(trust_request_chat_template=True)
    await trusted.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{trusted.http.address}", timeout=30) as to_trusted:
            assert (await to_trusted.post("/v1/chat/completions", json={**body, "max_tokens": 1})).status_code == 200
    finally:
        await trusted.stop()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Node, Node]]:
    b = make_node("B", token_delay_s=0.001, mesh=True)
    await b.start()
    a = make_node("A", token_delay_s=0.001, mesh=True, seeds=(b.address,))
    await a.start()
    yield a, b
    for n in (a, b):
        await n.stop(leave=False)


def sampling_seen(node: Node, monkeypatch: pytest.MonkeyPatch) -> list[SamplingOptions]:
    """The sampling options of every sequence ``node``'s engine is asked to generate, from now on."""
    seen: list[SamplingOptions] = []
    generate = node.engine.generate

    def spy(request: Request, *args: Any, **kwargs: Any):
        seen.append(request.sampling)
        return generate(request, *args, **kwargs)

    monkeypatch.setattr(node.engine, "generate", spy)
    return seen


async def test_vllm_sampling_parameters_reach_the_serving_engine_across_a_forward(
    pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    seen = sampling_seen(b, monkeypatch)
    shared = "s" * (6 * BLOCK)
    async with httpx.AsyncClient(base_url=f"http://{b.http.address}", timeout=30) as to_b:
        await to_b.post("/v1/completions", json={"model": "sim", "prompt": shared + "1", "max_tokens": 1})
    await until(lambda: any(m.node_id == "B" and m.summary_hashes > 0 for m in a.peering.view.members()),
                "B's cache summary to reach A")
    body = {"model": "sim", "prompt": shared + "2", "max_tokens": 2, "min_p": 0.25, "stop_token_ids": [9],
            "include_stop_str_in_output": True, "logit_bias": {"7": 3.5}, "priority": 2, "prompt_logprobs": 1,
            "response_format": {"type": "json_object"}}
    async with httpx.AsyncClient(base_url=f"http://{a.http.address}", timeout=30) as to_a:
        reply = (await to_a.post("/v1/completions", json=body)).json()
    assert reply["choices"][0]["p2pnode"]["served_by"] == "B" and reply["choices"][0]["prompt_logprobs"]
    options = seen[-1]
    assert (options.min_p, options.stop_token_ids, options.include_stop_str_in_output) == (0.25, (9,), True)
    assert options.logit_bias == ((7, 3.5),) and options.priority == 2 and options.prompt_logprobs == 1
    assert json.loads(options.structured_outputs) == {"json_object": True}


async def test_each_seeded_sample_gets_its_own_seed_as_in_vllms_parallel_sampling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = make_node()
    seen = sampling_seen(node, monkeypatch)
    await node.start()
    body = {"model": "sim", "prompt": "hi", "max_tokens": 2, "n": 3, "temperature": 1.0}
    try:
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            for seed, seeds in ((11, [11, 12, 13]), (2**63 - 2, [0, 2**63 - 2, 2**63 - 1])):  # wrapped below 2^63
                seen.clear()
                assert (await http.post("/v1/completions", json={**body, "seed": seed})).status_code == 200
                assert sorted(o.seed for o in seen) == seeds
            seen.clear()
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert [o.seed for o in seen] == [None, None, None]  # unseeded samples stay unseeded
    finally:
        await node.stop()


async def test_the_models_generation_config_fills_unset_fields() -> None:
    """Before: a generation_config.json with top_k 1 and max_new_tokens 5 changed nothing (177 and 753 tokens)."""
    node = make_node()
    node.engine.info = dataclasses.replace(node.engine.info, sampling_defaults={"max_tokens": 5, "temperature": 0.0})
    await node.start()
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            messages = [m async for m in node_pb2_grpc.NodeStub(channel).Generate(build_request("hi"))]
        assert messages[-1].final.completion_tokens == 5
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
            reply = (await http.post("/v1/chat/completions", json=chat)).json()
            assert reply["usage"]["completion_tokens"] == 5
            explicit = (await http.post("/v1/chat/completions", json={**chat, "max_tokens": 7})).json()
            assert explicit["usage"]["completion_tokens"] == 7  # the request's own value wins
            greedy = await http.post("/v1/chat/completions", json={**chat, "n": 2})  # temperature 0: greedy
            assert greedy.status_code == 400 and greedy.json()["error"]["param"] == "n"
    finally:
        await node.stop()


async def test_unknown_fields_are_ignored_and_logged_as_vllm_logs_them(http: httpx.AsyncClient) -> None:
    """vLLM's request models log the fields they ignore (DEBUG, its own logger); p2pnode parses with them, so the same
    line appears and the request is served."""
    logger = logging.getLogger("vllm.entrypoints.serve.engine.protocol")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        body = {"model": "sim", "prompt": "abc", "max_tokens": 1, "frobnicate": 1}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records]
    assert any("present in the request but ignored" in line and "frobnicate" in line for line in lines), lines


async def test_adapter_load_errors_name_the_field_as_vllm_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path with no adapter is vLLM's 404 "Loading lora x failed: No adapter found for ..." naming no field (what a
    stock ``vllm serve`` answered); p2pnode's own checks name theirs. Before, every adapter error named
    ``lora_name``, a path's too (and a missing adapter was 400)."""
    from p2pnode.config import EngineConfig, LoraConfig
    from p2pnode.engine.vllm_engine import VllmEngine

    node = make_node()
    adapters = VllmEngine(EngineConfig(model=Path("unused"), lora=LoraConfig(enabled=True, allowed_dirs=(tmp_path,))))
    monkeypatch.setattr(node.engine, "load_adapter", adapters.load_adapter, raising=False)  # never reaches vLLM
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            async def load(name: str, path: Path) -> tuple[int, dict[str, Any]]:
                reply = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                return reply.status_code, reply.json()["error"]

            status, error = await load("x", tmp_path / "nope")
            assert (status, error["param"]) == (404, None)
            assert error["message"] == f"Loading lora x failed: No adapter found for {tmp_path / 'nope'}"
            status, error = await load("x", tmp_path.parent)
            assert (status, error["param"]) == (403, "lora_path")
            status, error = await load("a|b", tmp_path / "nope")
            assert (status, error["param"]) == (400, "lora_name")
    finally:
        await node.stop()


async def test_model_cards_are_vllms(http: httpx.AsyncClient, node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each card with vLLM's default permission; an adapter's with the path this node loaded it from as ``root``
    and no ``max_model_len``, as a stock ``vllm serve --enable-lora`` lists its adapters. Before, no permission, the
    adapter's name as its root and the base model's context as its max_model_len."""
    from p2pnode.lora import AdapterSet

    served = AdapterSet(frozenset({"tiny-lora-a"}), paths=(("tiny-lora-a", "/adapters/tiny-lora-a"),))
    monkeypatch.setattr(node.engine, "adapters", lambda: served)
    base, adapter = (await http.get("/v1/models")).json()["data"]
    assert (base["id"], base["max_model_len"]) == ("sim", 4096)
    assert (adapter["id"], adapter["root"], adapter["parent"]) == ("tiny-lora-a", "/adapters/tiny-lora-a", "sim")
    assert adapter["max_model_len"] is None
    for card in (base, adapter):
        [permission] = card["permission"]
        assert permission["object"] == "model_permission" and permission["allow_sampling"]


async def _sse(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        lines = [line async for line in response.aiter_lines()]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


async def test_return_token_ids_as_vllm_shapes_them(http: httpx.AsyncClient, node: Node) -> None:
    """vLLM's ``return_token_ids``: each choice's generated ``token_ids``; the prompt's in ``prompt_token_ids`` (a
    completion's choice, a chat's response; streamed: a completion's first chunk of each choice, a chat's role
    chunk, every chunk its new tokens); with echo, the prompt in ``prompt_token_ids`` instead of the text, as stock's
    answers. Before: refused (400 naming it)."""
    encode = node.engine.encode
    body = {"model": "sim", "prompt": "xyz", "max_tokens": 3, "return_token_ids": True}
    for echo in (False, True):
        reply = await http.post("/v1/completions", json={**body, "echo": echo})
        assert reply.status_code == 200, reply.text
        [choice] = reply.json()["choices"]
        assert choice["prompt_token_ids"] == encode("xyz") and len(choice["token_ids"]) == 3
        assert len(choice["text"]) == 3  # no echoed prompt in the text (the simulated model: a character a token)
    chunks = await _sse(http, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == encode("xyz")
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [len(c["choices"][0]["text"]) for c in chunks]

    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True}
    rendered = encode("user: hi\nassistant:")
    reply = (await http.post("/v1/chat/completions", json=chat)).json()
    assert reply["prompt_token_ids"] == rendered
    assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"] == 3
    role, *content = await _sse(http, "/v1/chat/completions", chat)
    assert role["prompt_token_ids"] == rendered and role["choices"][0]["delta"]["role"] == "assistant"
    assert sum(len(c["choices"][0]["token_ids"]) for c in content) == 3
    plain = (await http.post("/v1/chat/completions", json={**chat, "return_token_ids": False})).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


async def test_responses_report_the_raw_messages_when_asked(http: httpx.AsyncClient, node: Node) -> None:
    """``enable_response_messages``: the prompt as the template rendered it (text and tokens: the tokenizer's BOS
    among them) and the output, as stock's ``input_messages`` / ``output_messages``, whole and in the streamed
    ``response.completed``. Before: refused (400 naming it)."""
    body = {"model": "sim", "input": "hello", "max_output_tokens": 3, "enable_response_messages": True}
    reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    whole = reply.json()
    [prompt] = whole["input_messages"]
    rendered = "user: hello\nassistant:"
    assert prompt == {"message": rendered, "tokens": [1, *node.engine.encode(rendered)], "type": "raw_message_tokens"}
    [output] = whole["output_messages"]
    assert output["message"] == whole["output"][0]["content"][0]["text"] and len(output["tokens"]) == 3
    events = await _sse(http, "/v1/responses", body)
    assert events[0]["response"]["input_messages"] is None  # created: none yet, as vLLM's
    completed = events[-1]["response"]
    assert completed["input_messages"] == [prompt] and len(completed["output_messages"][0]["tokens"]) == 3
    assert (await http.post("/v1/responses", json={**body, "enable_response_messages": False})).json()[
        "input_messages"] is None
