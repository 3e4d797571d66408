"""The OpenAI-compatible HTTP API over real loopback HTTP, on the simulated engine (the real-vLLM mesh and the
official openai client are in tests/integration/test_openai_api.py): responses, streams, n, logprobs, errors,
cancellation on disconnect (local and forwarded), drain, and the gRPC API's new fields."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from p2pnode.client import build_request
from p2pnode.node import Node
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.polling import until
from tests.unit.sim_nodes import BLOCK, make_node

TINY_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny"


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    node = make_node(token_delay_s=0.001)
    await node.start()
    yield node
    if not node._stopped.is_set():
        await node.stop()


@pytest.fixture
async def http(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as client:
        yield client


async def events(response: httpx.Response) -> list[Any]:
    """The data payloads of a server-sent event stream ("[DONE]" kept as a string)."""
    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_models_lists_the_served_name(http: httpx.AsyncClient) -> None:
    reply = (await http.get("/v1/models")).json()
    assert [m["id"] for m in reply["data"]] == ["sim"]  # the model directory's name
    assert reply["data"][0]["max_model_len"] == 4096


async def test_completion_reports_usage_and_who_served_it(http: httpx.AsyncClient) -> None:
    prompt = "x" * (3 * BLOCK + 5)
    first = (await http.post("/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 5})).json()
    choice = first["choices"][0]
    assert len(choice["text"]) == 5 and choice["finish_reason"] == "length"
    assert first["usage"] == {**first["usage"], "prompt_tokens": len(prompt), "completion_tokens": 5,
                              "total_tokens": len(prompt) + 5}
    assert choice["p2pnode"]["served_by"] == "h1" and choice["p2pnode"]["policy"] == "p2p"
    again = (await http.post("/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 5})).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK


async def test_streamed_completion_with_usage(http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": "hello", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        got = await events(response)
    assert got[-1] == "[DONE]"
    usage = got[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    text_chunks = got[:-2]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) and len(text_chunks) == 4
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in text_chunks)


async def test_streamed_usage_has_the_fields_of_vllms(http: httpx.AsyncClient) -> None:
    """The usage a stream sends as a stock ``vllm serve`` sends it: chat's running usage (``continuous_usage_stats``)
    with ``completion_tokens_details`` null, a completion's without; the final usage chunk with vLLM's three counts
    (and p2pnode's cached tokens). Before, chat's running usage had no ``completion_tokens_details``."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": options}
    completion = {"model": "sim", "prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": options}
    for path, body, running_details in (("/v1/chat/completions", chat, True), ("/v1/completions", completion, False)):
        async with http.stream("POST", path, json=body) as response:
            got = await events(response)
        *chunks, final, done = got
        assert done == "[DONE]" and final["choices"] == []
        assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(final["usage"])
        assert "completion_tokens_details" not in final["usage"]
        for chunk in chunks:
            assert ("completion_tokens_details" in chunk["usage"]) == running_details, chunk
            if running_details:
                assert chunk["usage"]["completion_tokens_details"] is None


async def test_chat_stream_with_n_siblings(http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
            "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        got = await events(response)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    roles = [c["choices"][0] for c in chunks[:2]]
    assert [r["index"] for r in roles] == [0, 1] and all(r["delta"]["role"] == "assistant" for r in roles)
    finals = [c["choices"][0] for c in chunks if c["choices"][0].get("finish_reason")]
    assert sorted(f["index"] for f in finals) == [0, 1]
    for k in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == k)
        assert len(text) == 3


async def test_several_prompts_times_n_are_choices_in_order(http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": ["aa", "bbbb"], "n": 2, "max_tokens": 2}
    reply = (await http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert reply["usage"]["prompt_tokens"] == 2 + 4  # each prompt once
    assert reply["usage"]["completion_tokens"] == 8


async def test_logprobs_are_returned_per_token(http: httpx.AsyncClient) -> None:
    reply = (await http.post("/v1/completions", json={"model": "sim", "prompt": "ab", "max_tokens": 3,
                                                      "logprobs": 2})).json()
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(top) == 2 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"]
    body = {"model": "sim", "prompt": "ab", "max_tokens": 3, "logprobs": 1, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [e for e in await events(response) if e != "[DONE]"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert [t for lp in streamed for t in lp["tokens"]] == lp["tokens"]  # the same tokens, streamed
    assert all(len(lp["top_logprobs"]) == len(lp["tokens"]) == len(lp["token_logprobs"]) for lp in streamed)
    chat = (await http.post("/v1/chat/completions", json={
        "model": "sim", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 3})).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(c["top_logprobs"]) == 3 for c in content)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "sim", "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"model": "sim", "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": "other", "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                                  "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ],
)
async def test_bad_requests_get_openai_errors_naming_the_parameter(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    reply = await http.post(path, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == status and error["type"] in ("BadRequestError", "NotFoundError")
    assert error["message"].startswith(f"{param}:"), error
    assert (await http.post("/v1/completions", json={"model": "sim", "prompt": "ok", "max_tokens": 1})).status_code \
        == 200


async def test_malformed_and_oversized_bodies(node: Node, http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body"
    limit = node.config.api.http_max_request_bytes
    reply = await http.post("/v1/completions", content=b"x" * (limit + 1))
    assert reply.status_code == 413 and reply.json()["error"]["code"] == 413


async def test_a_running_request_id_is_a_conflict(node: Node, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": "long", "max_tokens": 3000, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body, headers={"x-request-id": "same"}) as first:
        await anext(first.aiter_lines())
        reply = await http.post("/v1/completions", json={"model": "sim", "prompt": "b", "max_tokens": 1},
                                headers={"x-request-id": "same"})
        assert reply.status_code == 409 and reply.json()["error"]["param"] == "request_id"


async def test_disconnect_mid_stream_aborts_the_engine_request(node: Node, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": "abort me", "max_tokens": 3000, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass
        assert node.engine.status().unfinished == 1
    # The client closed the connection: the stream is cancelled and the engine request aborted.
    await until(lambda: node.engine.status().unfinished == 0 and not node.ingress.relays, "the abort")
    assert node.ingress.counters.by_api[("http", "cancelled")] == 1
    assert node.ingress.counters.by_api[("http", "success")] == 0


async def test_disconnect_while_waiting_for_a_whole_response_aborts_it(node: Node, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": "abort me too", "max_tokens": 3000}
    call = asyncio.create_task(http.post("/v1/completions", json=body))
    await until(lambda: node.engine.status().unfinished == 1, "the request to start")
    call.cancel()  # httpx closes the connection
    await until(lambda: node.engine.status().unfinished == 0 and not node.ingress.relays, "the abort")
    assert node.ingress.counters.by_api[("http", "cancelled")] == 1


async def test_drain_refuses_new_calls_finishes_running_ones_and_ready_turns_503(
    node: Node, http: httpx.AsyncClient
) -> None:
    assert (await http.get("/ready")).status_code == 200
    body = {"model": "sim", "prompt": "finish me", "max_tokens": 400, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as running:
        lines = running.aiter_lines()
        first = await anext(lines)
        drain = asyncio.create_task(node.drain())
        await until(lambda: node.ingress.draining, "the drain to start")
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        late = await http.post("/v1/completions", json={"model": "sim", "prompt": "late", "max_tokens": 1})
        assert late.status_code == 503 and late.json()["error"]["type"] == "ServiceUnavailableError"
        rest = [first] + [line async for line in lines]
    payloads = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert sum(len(p["choices"][0]["text"]) for p in payloads) == 400
    assert [x for x in rest if x][-1] == "data: [DONE]"
    await drain


async def test_tokenize_and_detokenize_use_the_nodes_tokenizer(node: Node, http: httpx.AsyncClient) -> None:
    reply = (await http.post("/tokenize", json={"model": "sim", "prompt": "héllo", "return_token_strs": True})).json()
    assert reply["tokens"] == node.engine.encode("héllo") and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == 4096 and len(reply["token_strs"]) == reply["count"]
    back = (await http.post("/detokenize", json={"model": "sim", "tokens": reply["tokens"]})).json()
    assert back["prompt"] == "héllo"
    chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert chat["tokens"] == node.engine.encode("user: hi\nassistant:")
    assert (await http.post("/tokenize", json={"model": "other", "prompt": "x"})).status_code == 404
    bad = await http.post("/detokenize", json={"tokens": [1, 99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


async def test_tokenizer_endpoints_answer_as_vllms(http: httpx.AsyncClient) -> None:
    """/detokenize keeps special tokens and /tokenize always has ``token_strs`` (null unless asked for), as a stock
    ``vllm serve`` of the tiny model answered: ``"<s>\\ufffd</s><unk>..."``, ``"token_strs": null``. Before, the
    special tokens were dropped and the field left out."""
    assert (await http.post("/detokenize", json={"tokens": [1, 3 + ord("a"), 2]})).json() == {"prompt": "<s>a</s>"}
    plain = (await http.post("/tokenize", json={"model": "sim", "prompt": "hi"})).json()
    assert "token_strs" in plain and plain["token_strs"] is None


def test_token_strs_spell_tokens_as_the_vocabulary_does() -> None:
    """vLLM's ``token_strs`` are the tokenizer's ``convert_ids_to_tokens`` (``Ġth``: a byte-level BPE's space), not
    each token decoded alone (``" th"``): what a stock ``vllm serve`` of the tiny model answered for "hello there"."""
    from transformers import AutoTokenizer

    from p2pnode.config import EngineConfig
    from p2pnode.engine.vllm_engine import VllmEngine

    engine = VllmEngine(EngineConfig(model=Path("unused")))  # not started: its tokenizer alone
    engine._tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL), local_files_only=True)
    tokens = engine.encode("hello there")
    assert tokens == [1, 75, 478, 82, 263, 299]
    assert engine.token_strings(tokens) == ["<s>", "h", "ell", "o", "\u0120th", "ere"]


async def test_grpc_n_and_logprobs(node: Node) -> None:
    request = build_request("sample twice", max_tokens=3, temperature=0.8)
    request.n = 2
    request.sampling.logprobs = 1
    async with grpc.aio.insecure_channel(node.address) as channel:
        messages = [m async for m in node_pb2_grpc.NodeStub(channel).Generate(request)]
    finals = {m.index: m.final for m in messages if m.HasField("final")}
    assert sorted(finals) == [0, 1] and all(f.completion_tokens == 3 for f in finals.values())
    for k in (0, 1):
        tokens = [t for m in messages if m.index == k for t in m.token_ids]
        positions = [p for m in messages if m.index == k for p in m.logprobs]
        assert len(tokens) == len(positions) == 3
        assert [p.sampled.token_id for p in positions] == tokens and all(len(p.top) == 1 for p in positions)


async def test_grpc_wrong_model_is_not_found(node: Node) -> None:
    request = build_request("hi", max_tokens=1)
    request.model = "not-this-one"
    async with grpc.aio.insecure_channel(node.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in node_pb2_grpc.NodeStub(channel).Generate(request):
                pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("model:")


async def test_http_listen_off_runs_without_http() -> None:
    node = make_node(http_listen="")
    await node.start()
    try:
        assert node.http is None
        async with grpc.aio.insecure_channel(node.address) as channel:
            status = await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest())
        assert status.http_address == ""
    finally:
        await node.stop()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Node, Node]]:
    b = make_node("B", token_delay_s=0.002, mesh=True)
    await b.start()
    a = make_node("A", token_delay_s=0.002, mesh=True, seeds=(b.address,))
    await a.start()
    yield a, b
    for n in (a, b):
        if not n._stopped.is_set():
            await n.stop(leave=False)


async def test_http_ingress_forwards_to_the_prefix_holder_and_a_disconnect_aborts_there(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    shared = "s" * (6 * BLOCK)
    async with httpx.AsyncClient(base_url=f"http://{b.http.address}", timeout=30) as to_b:
        seeded = (await to_b.post("/v1/completions", json={"model": "sim", "prompt": shared + "1",
                                                            "max_tokens": 1})).json()
        assert seeded["choices"][0]["p2pnode"]["served_by"] == "B"
    await until(lambda: any(m.node_id == "B" and m.summary_hashes > 0 for m in a.peering.view.members()),
                     "B's cache summary to reach A")
    async with httpx.AsyncClient(base_url=f"http://{a.http.address}", timeout=30) as to_a:
        reply = (await to_a.post("/v1/completions", json={"model": "sim", "prompt": shared + "2",
                                                           "max_tokens": 2})).json()
        info = reply["choices"][0]["p2pnode"]
        assert (info["ingress"], info["served_by"]) == ("A", "B")
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK
        body = {"model": "sim", "prompt": shared + "3", "max_tokens": 3000, "stream": True}
        async with to_a.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            assert b.engine.status().unfinished == 1
    await until(lambda: b.engine.status().unfinished == 0 and not b.local.in_flight, "B to abort the request")
    assert a.ingress.counters.by_api[("http", "cancelled")] == 1


async def test_an_http_address_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        node = make_node(http_listen=f"127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(OSError, match=r"HTTP API .*--http-listen"):
            await node.start()
        await node.stop(leave=False)


def test_a_choice_shows_its_kv_pull_as_grpcs_final_does() -> None:
    """``p2pnode.pull``: the serving node's pull of the prefix (GenerateFinal.pull), whole and streamed; null when it
    pulled nothing. Before, the HTTP answer did not show it."""
    from p2pnode.api.http.openai_responses import ResponseBuilder

    pull = node_pb2.KvPull(holder="n1", outcome="ok", tokens=256, bytes=1 << 20, seconds=0.25)
    for chat in (False, True):
        builder = ResponseBuilder(chat=chat, call_id="c", model="sim", prompt_tokens=[[5] * 300, [5] * 300], n=2,
                                  logprobs=False)
        streamed = [builder.add(node_pb2.GenerateResponse(
            index=k, token_ids=[7], text="x", final=node_pb2.GenerateFinal(served_by="n2", pull=pull if k else None),
        )) for k in (0, 1)]
        choices = builder.response().model_dump()["choices"]
        assert choices[0]["p2pnode"]["pull"] is None
        assert choices[1]["p2pnode"]["pull"] == {"holder": "n1", "outcome": "ok", "tokens": 256, "bytes": 1 << 20,
                                                 "seconds": 0.25}
        [chunk] = json.loads(streamed[1].removeprefix("data: "))["choices"]
        assert chunk["p2pnode"]["pull"]["holder"] == "n1" and chunk["p2pnode"]["served_by"] == "n2"
