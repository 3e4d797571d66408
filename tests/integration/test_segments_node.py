"""Segments through a real node of the shared mesh (n1, vLLM on the tiny model): a document cached after one system
prompt is reused after another, in exact mode (the layout puts it first: plain prefix caching, the greedy tokens of
a plain prompt of that layout as far as they were decided: tests/greedy.py) and in approximate mode (its stored KV
moved to where it now sits); the OpenAI front takes the same as ``extra_body``; bad segments are refused naming the
field. The engine-level mechanics are in test_segments_engine.py."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.client import GenerateResult, build_request, collect, collect_call
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.greedy import assert_same_greedy, tap_margins
from tests.integration.conftest import API_KEY, BLOCK_SIZE, channel, wait_idle

pytestmark = pytest.mark.integration

BOS = 1  # the tiny model's


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(f"test_segments_node-{seed}")  # apart from the other modules' prompts on the shared mesh
    return [rng.randrange(3, 512) for _ in range(n)]


@pytest.fixture
def node(shared_mesh: dict[str, NodeProcess]) -> NodeProcess:
    return shared_mesh["n1"]


@pytest.fixture
async def stub(node: NodeProcess) -> AsyncIterator[node_pb2_grpc.NodeStub]:
    await wait_idle(node)  # n1 keeps a request nothing else holds
    async with channel(node.address or "") as ch:
        yield node_pb2_grpc.NodeStub(ch)


async def generate(
    stub: node_pb2_grpc.NodeStub, prompt: list[int], margins: list[float] | None = None, **kw: object
) -> GenerateResult:
    """Greedy tokens of ``prompt``; ``margins``: filled with each step's (tests/greedy.py)."""
    request = build_request(prompt, max_tokens=8, temperature=0.0, **kw)  # type: ignore[arg-type]
    if margins is None:
        return await collect(stub, request, timeout=120)
    request.sampling.logprobs = 2
    return await collect_call(tap_margins(stub.Generate(request, timeout=120), margins))


async def test_exact_mode_reuses_a_document_after_another_system_prompt_with_a_full_prefills_output(
    stub: node_pb2_grpc.NodeStub, node: NodeProcess
) -> None:
    doc = tokens("exact-doc", 200)
    first = [BOS, *tokens("exact-system-a", 40), *doc, *tokens("exact-q1", 10)]
    result = await generate(stub, first, segments=[(41, 241)], segment_reuse="exact")
    assert result.served_by == "n1"
    assert result.segments is not None and result.segments["order"] == [0] and result.segments["mode"] == "exact"
    await wait_idle(node)
    system_b, question = tokens("exact-system-b", 60), tokens("exact-q2-0", 10)  # its first steps decided by far
    second = [BOS, *system_b, *doc, *question]
    reused = await generate(stub, second, segments=[(61, 261)], segment_reuse="exact")
    assert reused.served_by == "n1"
    assert reused.prompt_tokens == len(second)
    # every full block of [BOS][document] came from the prefix cache, as the engine reports it
    assert reused.cached_tokens >= (1 + len(doc)) // BLOCK_SIZE * BLOCK_SIZE
    # the layout served: the document first; the same tokens sent as a plain prompt give the same output
    await wait_idle(node)
    layout = [BOS, *doc, *system_b, *question]
    margins: list[float] = []
    plain = await generate(stub, layout, margins)
    assert_same_greedy(plain.token_ids, margins, reused.token_ids)  # more of it cached: computed in other steps
    assert plain.cached_tokens == (len(layout) - 1) // BLOCK_SIZE * BLOCK_SIZE  # all of it: the exact request's


async def test_exact_mode_keeps_a_cached_system_prompt_in_front_and_reuses_it_and_the_documents_behind_it(
    stub: node_pb2_grpc.NodeStub, node: NodeProcess
) -> None:
    """Before, exact mode laid every request's documents out ahead of its system prompt, so a system prompt that
    plain requests had cached was never reused by an exact request (0 cached here)."""
    system, doc = tokens("lead-system", 70), tokens("lead-doc", 100)
    plain = await generate(stub, [BOS, *system, *tokens("lead-q0", 10)])  # the system prompt, cached as a prefix
    assert plain.served_by == "n1"
    await wait_idle(node)
    first = await generate(stub, [BOS, *system, *doc, *tokens("lead-q1", 10)], segments=[(71, 171)],
                           segment_reuse="exact")
    assert first.served_by == "n1" and first.segments is not None and first.segments["order"] == [0]
    assert first.cached_tokens == (1 + len(system)) // BLOCK_SIZE * BLOCK_SIZE  # the system prompt, in front
    await wait_idle(node)
    prompt = [BOS, *system, *doc, *tokens("lead-q2", 10)]
    second = await generate(stub, prompt, segments=[(71, 171)], segment_reuse="exact")
    assert second.served_by == "n1"
    assert second.cached_tokens == (1 + len(system) + len(doc)) // BLOCK_SIZE * BLOCK_SIZE  # and the document
    await wait_idle(node)
    margins: list[float] = []
    laid = await generate(stub, prompt, margins)  # the layout served is the prompt as sent
    assert_same_greedy(laid.token_ids, margins, second.token_ids)


async def test_approximate_mode_loads_a_document_computed_after_another_system_prompt(
    stub: node_pb2_grpc.NodeStub, node: NodeProcess
) -> None:
    doc = tokens("approx-doc", 200)
    first = [BOS, *tokens("approx-system-a", 45), *doc, *tokens("approx-q1", 10)]
    stored = await generate(stub, first, segments=[(46, 246)], segment_reuse="approximate")
    assert stored.segments is not None and stored.segments["error"] == ""
    assert stored.segments["reused_segments"] == 0  # computed here, then stored
    await wait_idle(node)
    second = [BOS, *tokens("approx-system-b", 70), *doc, *tokens("approx-q2", 10)]
    reused = await generate(stub, second, segments=[(71, 271)], segment_reuse="approximate")
    assert reused.served_by == "n1"
    assert reused.segments is not None
    assert reused.segments["reused_segments"] == 1 and reused.segments["reused_tokens"] >= len(doc)
    assert reused.segments["phases"] == 1  # the new system prompt, computed first
    assert reused.cached_tokens >= len(doc)  # the engine counts the loaded document as cached; the phase's work not
    # approximate blocks never answer a plain request: the same tokens without segments are computed in full
    await wait_idle(node)
    plain = await generate(stub, second)
    assert plain.cached_tokens == 0


async def test_bad_segments_are_refused_naming_the_field(stub: node_pb2_grpc.NodeStub) -> None:
    prompt = [BOS, *tokens("bad", 100)]
    cases = [
        (dict(segments=["never in this prompt"], segment_reuse="exact"), "segments[0].text"),
        (dict(segments=[(10, 20)]), "segment_reuse"),
        (dict(segments=[(10, 200)], segment_reuse="approximate"), "segments[0].tokens"),
        (dict(segments=[(30, 40), (35, 50)], segment_reuse="exact"), "segments[1].tokens"),
        (dict(segments=[(10, 20)], segment_reuse="exact", segment_recompute_tokens=4), "segment_recompute_tokens"),
    ]
    for kw, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, prompt, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
        assert e.value.details().startswith(f"{field}: "), e.value.details()


def test_the_openai_client_reuses_a_document_through_extra_body(node: NodeProcess) -> None:
    client = openai.OpenAI(base_url=node.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    doc = "\n".join(f"Clause {i}: the holder of a cached prefix serves its next turn; gossip says who holds what."
                    for i in range(6))
    cached = []
    for system in ("You are the contracts desk.", "You answer questions about clauses, tersely and exactly."):
        completion = client.completions.create(
            model="tiny",
            prompt=f"{system}\n{doc}\nQ: which clause says who serves?\nA:",
            max_tokens=4,
            temperature=0.0,
            extra_body={"segments": [doc], "segment_reuse": "exact"},
        )
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        cached.append(completion.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] < BLOCK_SIZE <= cached[1]  # the document's blocks, after another system prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt=f"x\n{doc}", max_tokens=1, extra_body={"segments": [doc], "segment_reuse": "fuzzy"}
        )
    assert "segment_reuse" in str(e.value)


async def test_status_and_metrics_count_requests_with_segments(stub: node_pb2_grpc.NodeStub, node: NodeProcess) -> None:
    before = (await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5)).segments
    doc = tokens("status-doc", 160)
    for n, mode in enumerate(("exact", "approximate", "approximate")):
        await wait_idle(node)
        prompt = [BOS, *tokens(f"status-system-{n}", 40 + 10 * n), *doc, *tokens(f"status-q{n}", 8)]
        start = 41 + 10 * n
        await generate(stub, prompt, segments=[(start, start + len(doc))], segment_reuse=mode)
    seg = (await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5)).segments
    assert seg.store_bytes > 0
    assert seg.requests["exact"] == before.requests.get("exact", 0) + 1
    assert seg.requests["approximate"] == before.requests.get("approximate", 0) + 2
    assert seg.loaded_segments == before.loaded_segments + 1 and seg.phases == before.phases + 1
    assert seg.held_tokens >= len(doc)
    text = httpx.get(f"http://{node.http_address}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("p2pnode:segment_requests_total", (("mode", "approximate"),))] == seg.requests["approximate"]
    assert samples[("p2pnode:segment_loaded_total", ())] == seg.loaded_segments
    assert samples[("p2pnode:segment_store_tokens", ())] == seg.held_tokens
