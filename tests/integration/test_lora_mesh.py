"""LoRA adapters across the shared mesh (n1 serves tiny-lora-a and tiny-lora-b, n2 only tiny-lora-a; both vLLM on
the tiny model): a prompt cached under one adapter or cache salt is no hit -- estimated or engine-reported -- for
another; each adapter's repeat prompts follow their holder across ingresses; a request for an adapter only n1 serves
reaches n1 from any ingress; an adapter no node serves is NOT_FOUND; adapters loaded and unloaded at run time reach
the mesh through gossip; ``/v1/models``, status and metrics list them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.client import GenerateResult, build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.conftest import built_tiny_adapters
from tests.integration.conftest import (
    API_KEY,
    BLOCK_SIZE,
    LORA_ADAPTER_A,
    LORA_ADAPTER_B,
    channel,
    stored_blocks,
    wait_idle,
    wait_summary_reaches,
    wait_until_status,
)

pytestmark = pytest.mark.integration

BOS = 1


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(f"test_lora_mesh-{seed}")  # apart from the other modules' prompts on the shared mesh
    return [BOS, *(rng.randrange(3, 512) for _ in range(n - 1))]


@pytest.fixture
def n1(shared_mesh: dict[str, NodeProcess]) -> NodeProcess:
    return shared_mesh["n1"]


@pytest.fixture
def n2(shared_mesh: dict[str, NodeProcess]) -> NodeProcess:
    return shared_mesh["n2"]


async def generate(node: NodeProcess, prompt: list[int], **kw: object) -> GenerateResult:
    async with channel(node.address or "") as ch:
        request = build_request(prompt, max_tokens=6, temperature=0.0, **kw)  # type: ignore[arg-type]
        return await collect(node_pb2_grpc.NodeStub(ch), request, timeout=120)


async def status(node: NodeProcess) -> node_pb2.NodeStatus:
    async with channel(node.address or "") as ch:
        return await node_pb2_grpc.NodeStub(ch).GetStatus(node_pb2.GetStatusRequest(), timeout=5)


@pytest.fixture
async def idle(n1: NodeProcess, n2: NodeProcess) -> AsyncIterator[None]:
    await wait_idle(n1)
    await wait_idle(n2)
    yield


async def test_a_prompt_cached_under_one_adapter_or_salt_is_no_hit_for_another(n1: NodeProcess, idle: None) -> None:
    prompt = tokens("namespaces", 5 * BLOCK_SIZE + 3)
    first = await generate(n1, prompt, model=LORA_ADAPTER_A)
    assert first.cached_tokens == 0
    holder = first.served_by
    await wait_idle(n1)
    again = await generate(n1, prompt, model=LORA_ADAPTER_A)
    assert again.served_by == holder and again.cached_tokens == 5 * BLOCK_SIZE  # the same namespace: a hit
    for kw in ({"model": LORA_ADAPTER_B}, {"model": LORA_ADAPTER_A, "cache_salt": "tenant-1"}, {}):
        await wait_idle(n1)
        other = await generate(n1, prompt, **kw)
        assert other.cached_tokens == 0, kw  # the engine's word
        assert other.estimated_match_tokens == 0 and other.index_match_tokens == 0, kw  # routing's and the index's
    # and the adapter is applied: three namespaces, three greedy answers
    base = await generate(n1, prompt)
    under_b = await generate(n1, prompt, model=LORA_ADAPTER_B)
    assert len({tuple(first.token_ids), tuple(base.token_ids), tuple(under_b.token_ids)}) == 3


async def test_each_adapters_repeat_prompts_follow_their_holder_across_ingresses(
    n1: NodeProcess, n2: NodeProcess, idle: None
) -> None:
    history = tokens("follow-a", 6 * BLOCK_SIZE)
    stored = {"n1": await stored_blocks(n1), "n2": await stored_blocks(n2)}
    first = await generate(n1, [*history, 7], model=LORA_ADAPTER_A)
    holder = first.served_by
    holder_node, other, other_id = (n1, n2, "n2") if holder == "n1" else (n2, n1, "n1")
    await wait_idle(n1)
    await wait_idle(n2)
    # the holder's summary of the prompt's 6 blocks, as the other ingress sees it
    await wait_summary_reaches(holder_node, [other], stored[holder], 6)
    turn = await generate(other, [*history, 8, 9], model=LORA_ADAPTER_A)
    assert turn.ingress == other_id and turn.served_by == holder
    # estimated from the holder's summary (every 4th depth published); the engine reused all of it
    assert turn.estimated_match_tokens >= 4 * BLOCK_SIZE and turn.cached_tokens == 6 * BLOCK_SIZE
    # the same history under the other adapter, from the holder's ingress: no estimate, no hit
    under_b = await generate(n1, [*history, 8, 9], model=LORA_ADAPTER_B)
    assert under_b.estimated_match_tokens == 0 and under_b.cached_tokens == 0


async def test_an_adapter_only_one_node_serves_reaches_it_from_any_ingress(
    n1: NodeProcess, n2: NodeProcess, idle: None
) -> None:
    for n in range(3):
        result = await generate(n2, tokens(f"only-n1-{n}", 3 * BLOCK_SIZE), model=LORA_ADAPTER_B)
        assert result.served_by == "n1"  # n2 does not serve it: never a candidate, whatever its load
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(n2, tokens("nowhere", 40), model="no-such-adapter")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in (e.value.details() or "") and LORA_ADAPTER_B in (e.value.details() or "")


def test_models_lists_the_adapters_and_an_unknown_one_is_404(n1: NodeProcess) -> None:
    client = openai.OpenAI(base_url=n1.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert {LORA_ADAPTER_A, LORA_ADAPTER_B} <= set(cards)
    assert cards[LORA_ADAPTER_A].model_extra.get("parent") == "tiny"  # type: ignore[union-attr]
    # as vLLM's cards: n1's adapter with the path n1 loaded it from, no max_model_len, a permission
    extra = cards[LORA_ADAPTER_A].model_extra or {}
    assert Path(extra["root"]).resolve() == built_tiny_adapters()[LORA_ADAPTER_A].resolve()
    assert extra["max_model_len"] is None and len(extra["permission"]) == 1
    completion = client.completions.create(model=LORA_ADAPTER_B, prompt="hello adapter", max_tokens=3)
    assert completion.model == LORA_ADAPTER_B and completion.choices[0].text is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hello", max_tokens=1)


async def test_adapters_loaded_and_unloaded_at_run_time_reach_the_mesh(
    n1: NodeProcess, n2: NodeProcess, tiny_adapters: dict, idle: None
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(timeout=60, headers=headers) as http:
        url = f"http://{n2.http_address}/v1"
        refused = await http.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})
        assert refused.status_code == 403
        loaded = await http.post(
            f"{url}/load_lora_adapter",
            json={"lora_name": "late", "lora_path": str(tiny_adapters[LORA_ADAPTER_B])},
        )
        assert loaded.status_code == 200, loaded.text
        await wait_until_status(
            n1.address or "", lambda s: any(m.node_id == "n2" and "late" in m.adapters for m in s.members),
            "n2's new adapter to reach n1",
        )
        result = await generate(n1, tokens("late", 50), model="late")
        assert result.served_by == "n2"  # only n2 serves it
        gone = await http.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 200
        again = await http.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"})
        assert again.status_code == 404
        await wait_until_status(
            n1.address or "", lambda s: any(m.node_id == "n2" and "late" not in m.adapters for m in s.members),
            "n2's unloaded adapter to leave n1's view",
        )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(n1, tokens("late-again", 50), model="late")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_status_and_metrics_show_adapters_per_node(n1: NodeProcess) -> None:
    await generate(n1, tokens("metrics", 40), model=LORA_ADAPTER_B)
    s = await status(n1)
    assert list(s.adapters) == [LORA_ADAPTER_A, LORA_ADAPTER_B]
    assert s.adapter_requests[LORA_ADAPTER_B] >= 1
    members = {m.node_id: list(m.adapters) for m in s.members}
    assert members["n2"] == [LORA_ADAPTER_A] and members["n3"] == []
    text = await asyncio.to_thread(lambda: httpx.get(f"http://{n1.http_address}/metrics", timeout=10).text)
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }
    served = {dict(labels)["adapter"] for (name, labels) in samples if name == "p2pnode:lora_adapter"}
    assert served == {LORA_ADAPTER_A, LORA_ADAPTER_B}
    assert samples[("p2pnode:lora_requests_total", (("adapter", LORA_ADAPTER_B),))] == s.adapter_requests[
        LORA_ADAPTER_B
    ]
