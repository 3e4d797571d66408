"""The official ``openai`` client against the real vLLM engines of the shared mesh (conftest.py: n1 and n2 on the
tiny model), through the OpenAI-compatible HTTP API every node serves (with an API key): models, completion, chat
rendered with the model's chat template, streamed chat with usage, a shared system prompt served by the node that
holds it with the engine's own ``cached_tokens``, errors a client can act on, ``/metrics`` parsed by
prometheus_client, and a disconnect that aborts the engine request (served locally and forwarded). SIGTERM drain
turning ``/ready`` 503: test_shutdown.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.client import auth_metadata
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import (
    API_KEY,
    BLOCK_SIZE,
    LONG_MAX_MODEL_LEN,
    LORA_ADAPTER_A,
    VLLM_NODES,
    wait_idle,
)
from tests.polling import until_sync

pytestmark = pytest.mark.integration

KEY = API_KEY
#: Requests of up to 4k tokens: a long one decodes for seconds, so a disconnect can be seen to stop it mid-way even
#: when the serving node's loop is held up a while by its engine's outputs.
MAX_MODEL_LEN = LONG_MAX_MODEL_LEN
MODEL = "tiny"  # the served name defaults to the model directory's name
SYSTEM = {
    "role": "system",
    "content": (
        "You are the help desk of the p2pnode serving mesh. Every node keeps a radix tree of the prefixes its "
        "engine has cached, gossips a compact summary of it to its peers, and routes each request to the peer "
        "with the longest estimated match under a load guard. Answer in one short sentence and name the node "
        "that served you. Never invent facts about the cluster, its members or their caches."
    ),
}


@pytest.fixture
def mesh(shared_mesh: dict[str, NodeProcess]) -> dict[str, NodeProcess]:
    """The mesh's nodes on real vLLM (n3, on the simulated engine, serves another model)."""
    return {n: shared_mesh[n] for n in VLLM_NODES}


def client(node: NodeProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.base_url, api_key=key, max_retries=0, timeout=60)


async def _status(address: str) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        return await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5, metadata=auth_metadata(KEY))


def status(node: NodeProcess) -> node_pb2.NodeStatus:
    return asyncio.run(_status(node.address or ""))


def wait_for(node: NodeProcess, predicate: Callable[[node_pb2.NodeStatus], bool], what: str) -> node_pb2.NodeStatus:
    return until_sync(lambda: status(node), what, holds=predicate)


def metrics(node: NodeProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{node.http_address}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for_metric(node: NodeProcess, key: tuple[str, tuple[tuple[str, str], ...]], value: float) -> None:
    """Wait for a counter of ``node`` to reach ``value`` (a node counts a call when its handler ends, which for a
    relayed call comes after the serving node has dropped it)."""
    seen = until_sync(lambda: metrics(node).get(key, 0.0), f"{key} to reach {value}", holds=lambda v: v >= value)
    assert seen == value, f"{key} went past {value}: {seen}"


def chat_prompt_tokens(tiny_model: Path, messages: list[dict[str, str]]) -> int:
    """The prompt length the model's own chat template gives (as transformers renders it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_models_are_listed_on_every_node(mesh: dict[str, NodeProcess]) -> None:
    for node in mesh.values():
        models = client(node).models.list()
        assert models.data[0].id == MODEL and models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
        # then the LoRA adapters the node serves (the shared mesh gives n1 and n2 some), each naming its base
        assert all(m.model_extra["parent"] == MODEL for m in models.data[1:])


def test_completion(mesh: dict[str, NodeProcess]) -> None:
    reply = client(mesh["n1"]).completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=8, seed=1, extra_body={"ignore_eos": True}
    )
    choice = reply.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8
    assert choice.model_extra["p2pnode"]["ingress"] == "n1"


def test_seeded_samples_are_different_draws_as_vllm_makes_them(mesh: dict[str, NodeProcess]) -> None:
    """``n`` samples with a ``seed`` are n draws (vLLM's parallel sampling seeds the i-th with seed + i), on
    completions and chat; before, they were n copies of one. Under an adapter only the vLLM nodes serve: the shared
    mesh's simulated n3 answers by the prompt alone, seed or not."""
    openai_client = client(mesh["n1"])
    sampled = {"max_tokens": 8, "n": 3, "seed": 5, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    completion = openai_client.completions.create(model=LORA_ADAPTER_A, prompt="the quick brown fox", **sampled)
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    assert {c.model_extra["p2pnode"]["served_by"] for c in completion.choices} <= set(VLLM_NODES)
    assert len({c.text for c in completion.choices}) == 3
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = openai_client.chat.completions.create(model=LORA_ADAPTER_A, messages=messages, **sampled)
    assert len({c.message.content for c in chat.choices}) == 3


def test_chat_is_rendered_with_the_models_template(mesh: dict[str, NodeProcess], tiny_model: Path) -> None:
    messages = [{"role": "user", "content": "Say hello to the mesh."}]
    asyncio.run(wait_idle(mesh["n2"]))  # so that n2 serves it
    reply = client(mesh["n2"]).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=2)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.usage.prompt_tokens == chat_prompt_tokens(tiny_model, messages)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_streamed_chat_reports_usage(mesh: dict[str, NodeProcess]) -> None:
    stream = client(mesh["n1"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream a few words."}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 12 and finish == ["length"] and content


def summary_of(viewer: NodeProcess, holder: str) -> int:
    """How many of ``holder``'s summary hashes ``viewer`` has."""
    return next((m.summary_hashes for m in status(viewer).members if m.node_id == holder), 0)


def test_a_shared_system_prompt_is_served_by_its_holder_from_cache(mesh: dict[str, NodeProcess]) -> None:
    before = summary_of(mesh["n2"], "n1")
    asyncio.run(wait_idle(mesh["n1"]))  # so that n1 serves it
    first = client(mesh["n1"]).chat.completions.create(
        model=MODEL, messages=[SYSTEM, {"role": "user", "content": "What is a prefix cache?"}], max_tokens=4
    )
    assert first.choices[0].model_extra["p2pnode"]["served_by"] == "n1"  # nothing cached anywhere: the ingress
    assert first.usage.prompt_tokens >= 4 * BLOCK_SIZE
    # Grown, not just non-empty: n1 may have published other modules' prefixes before this one.
    wait_for(mesh["n2"], lambda s: any(m.node_id == "n1" and m.summary_hashes > before for m in s.members),
             "n1's new prefix to reach n2's view of its summary")
    second = client(mesh["n2"]).chat.completions.create(
        model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Why route by the longest match?"}], max_tokens=4
    )
    info = second.choices[0].model_extra["p2pnode"]
    assert (info["ingress"], info["served_by"]) == ("n2", "n1")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached == info["cached_tokens"]


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda c: c.completions.create(model=MODEL, prompt="hi", temperature=3.0), "temperature"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=1.5),
         "top_p"),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN * 2), "max_tokens"),
        (lambda c: c.completions.create(model=MODEL, prompt="hi", logprobs=50), "logprobs"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(mesh: dict[str, NodeProcess], call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call(client(mesh["n2"]))
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["message"].startswith(f"{param}:")


def test_an_unknown_model_is_a_404(mesh: dict[str, NodeProcess]) -> None:
    with pytest.raises(openai.NotFoundError):
        client(mesh["n1"]).completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def test_a_wrong_api_key_is_a_401(mesh: dict[str, NodeProcess]) -> None:
    for key in ("wrong-key", "sk-integration-tes"):
        with pytest.raises(openai.AuthenticationError) as err:
            client(mesh["n1"], key=key).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert err.value.status_code == 401


def test_metrics_expose_vllm_and_mesh_families_that_move(
    mesh: dict[str, NodeProcess], shared_mesh: dict[str, NodeProcess]
) -> None:
    node = mesh["n1"]
    text = httpx.get(f"http://{node.http_address}/metrics", timeout=10).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens"} <= families
    model_names = {s.labels["model_name"] for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")
                   for s in f.samples if "model_name" in s.labels}
    assert model_names == {MODEL}  # the served name, as vllm serve labels them (was the model's path)
    assert "http_requests" in families
    assert {"p2pnode:requests", "p2pnode:routed_requests", "p2pnode:members", "p2pnode:gossip_sent_bytes",
            "p2pnode:time_to_first_token_seconds", "p2pnode:prefix_index_blocks", "p2pnode:plan_epoch"} <= families
    before = metrics(node)
    client(node).completions.create(model=MODEL, prompt="count this one", max_tokens=5,
                                    extra_body={"ignore_eos": True})
    after = metrics(node)
    ok = ("p2pnode:requests_total", (("api", "http"), ("outcome", "success")))
    assert after[ok] == before[ok] + 1
    assert after[("vllm:generation_tokens_total", ())] >= before[("vllm:generation_tokens_total", ())] + 5
    assert after[("p2pnode:members", (("state", "alive"),))] == len(shared_mesh)


def _abort_mid_stream(ingress: NodeProcess, messages: list[dict[str, str]], max_tokens: int) -> None:
    with client(ingress).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # the first token arrived: the request is running; leaving closes the connection


# Forwarded first: its tries refresh n1's copy of the shared prompt, which long local tries could evict.
@pytest.mark.parametrize("forwarded", [True, False], ids=["forwarded", "local"])
def test_a_client_disconnect_aborts_the_engine_request(mesh: dict[str, NodeProcess], forwarded: bool) -> None:
    """The serving engine stops well before max_tokens once the client goes away, wherever it runs: with the
    shared system prompt n2 forwards to n1; a fresh prompt is served by n1 itself. Every try must end the engine
    request and count the call cancelled; a node whose loop is held up by its engine's outputs (docs/vllm.md,
    "Front end behind its engine") may see the cancel only once the engine is done, so one try in three must show
    it stopped mid-generation."""
    ingress, server = (mesh["n2"], mesh["n1"]) if forwarded else (mesh["n1"], mesh["n1"])
    max_tokens = 3500  # ~7 s of decoding on 2 cores if nothing stops it
    generated_per_try = []
    for attempt in range(3):
        where = "forwarded" if forwarded else "local"
        question = {"role": "user", "content": f"Tell a long story ({where} {attempt})."}
        messages = [SYSTEM, question] if forwarded else [question]
        asyncio.run(wait_idle(ingress))  # a fresh prompt stays on an idle ingress
        routed_before = status(ingress).routing
        cancelled_key = ("p2pnode:requests_total", (("api", "http"), ("outcome", "cancelled")))
        cancelled_before = metrics(ingress)[cancelled_key]
        generated_before = metrics(server)[("vllm:generation_tokens_total", ())]
        _abort_mid_stream(ingress, messages, max_tokens)
        after = wait_for(server, lambda s: s.load.engine_unfinished == 0 and s.load.in_flight == 0,
                         "the serving engine to drop the request")
        assert after.requests_failed == 0
        routed = status(ingress).routing
        assert routed.forwarded - routed_before.forwarded == (1 if forwarded else 0)
        wait_for_metric(ingress, cancelled_key, cancelled_before + 1)
        generated = metrics(server)[("vllm:generation_tokens_total", ())] - generated_before
        generated_per_try.append(generated)
        if 0 < generated < max_tokens / 2:
            return
    raise AssertionError(f"no try was stopped mid-generation: tokens generated per try {generated_per_try}")


def test_json_logs_are_json_from_the_first_line(shared_mesh: dict[str, NodeProcess]) -> None:
    """n2 runs with --log-format json: every line it wrote since it started -- vLLM's engine processes, native
    warnings, progress bars, the ready line -- is a JSON object (14 of 216 lines were plain text)."""
    node = shared_mesh["n2"]
    assert node.log_path is not None
    lines = [line for line in node.log_path.read_text().splitlines() if line.strip()]
    plain = [line for line in lines if not line.startswith("{")]
    assert not plain, plain[:5]
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) for r in records)
    names = {r.get("name", "") for r in records}
    assert any(n.startswith("vllm") for n in names) and any(n.startswith("p2pnode") for n in names), names
    assert any("ready on" in r.get("message", "") for r in records)
