"""One real node (vLLM on the tiny model, real gRPC on loopback): generation, prefix-cache hits that the local
index predicts exactly, evictions reaching the index, bad input and cancellation. The node is n1 of the shared
mesh (conftest.py): the prompts here are this module's own, so n1 serves them itself (nothing cached elsewhere, and
an idle ingress keeps a request rather than hop). Its SIGTERM drain is in test_shutdown.py."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import grpc
import pytest

from p2pnode.client import build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import BLOCK_SIZE, LONG_KV_CACHE_BLOCKS, LONG_MAX_MODEL_LEN, channel, wait_idle
from tests.polling import until

pytestmark = pytest.mark.integration

VOCAB = 512


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(f"test_vllm_node-{seed}")  # apart from the other modules' prompts on the shared mesh
    return [rng.randrange(3, VOCAB) for _ in range(length)]


@pytest.fixture
def vllm_node(shared_mesh: dict[str, NodeProcess]) -> NodeProcess:
    return shared_mesh["n1"]


@pytest.fixture
async def stub(vllm_node: NodeProcess) -> AsyncIterator[node_pb2_grpc.NodeStub]:
    await wait_idle(vllm_node)  # whatever the test before sent has left: n1 keeps what it is sent
    async with channel(vllm_node.address or "") as ch:
        yield node_pb2_grpc.NodeStub(ch)


#: A client that does not read a stream holds the node's side of it open: HTTP/2 flow control stops the node's
#: writes once this much is unread (no BDP probing to grow the window), so a request stays in flight as long as a
#: test needs, however fast the engine finishes it.
UNREAD_WINDOW_BYTES = 1024


@pytest.fixture
async def unread_stub(vllm_node: NodeProcess) -> AsyncIterator[node_pb2_grpc.NodeStub]:
    options = [("grpc.http2.lookahead_bytes", UNREAD_WINDOW_BYTES), ("grpc.http2.bdp_probe", 0)]
    async with channel(vllm_node.address or "", options=options) as ch:
        yield node_pb2_grpc.NodeStub(ch)


async def status(stub: node_pb2_grpc.NodeStub) -> node_pb2.NodeStatus:
    return await stub.GetStatus(node_pb2.GetStatusRequest())


async def test_text_prompt_is_served_by_the_real_engine(stub: node_pb2_grpc.NodeStub) -> None:
    result = await collect(stub, build_request("the quick brown fox", max_tokens=12, ignore_eos=True, seed=7))
    assert result.served_by == "n1"
    assert result.completion_tokens == 12 == len(result.token_ids)
    assert result.finish_reason == "length"
    assert result.prompt_tokens > 0
    assert result.text  # detokenized by vLLM


async def test_repeat_prompt_hits_cache_and_index_agrees_with_engine(stub: node_pb2_grpc.NodeStub) -> None:
    prompt = random_prompt(1, 3 * BLOCK_SIZE + 11)  # 3 full blocks + a partial one
    before = await status(stub)
    first = await collect(stub, build_request(prompt, max_tokens=4))
    assert first.cached_tokens == 0
    stored = before.index.stored_blocks_total + 3
    await until(lambda: status(stub), "the prompt's blocks", holds=lambda s: s.index.stored_blocks_total >= stored)
    second = await collect(stub, build_request(prompt, max_tokens=4))
    assert second.cached_tokens > 0
    assert second.cached_tokens == 3 * BLOCK_SIZE
    assert second.index_match_tokens == second.cached_tokens
    # status reports the engine's own prefix-cache hit rate and the KV holding cached prefixes (0% when idle before)
    after = await until(lambda: status(stub), "the engine's prefix-cache hit rate",
                        holds=lambda s: s.load.prefix_cache_hit_rate > 0)
    assert 0 < after.load.kv_cached <= 1 and after.engine_version and after.version


async def test_evictions_under_a_small_kv_budget_reach_the_index(
    stub: node_pb2_grpc.NodeStub, vllm_node: NodeProcess
) -> None:
    blocks_per_prompt = 12
    prompts = [random_prompt(100 + i, blocks_per_prompt * BLOCK_SIZE + 5) for i in range(16)]
    assert len(prompts) * blocks_per_prompt > LONG_KV_CACHE_BLOCKS
    before = await status(stub)
    for p in prompts:  # all on n1's engine: more blocks than it holds
        await wait_idle(vllm_node)
        assert (await collect(stub, build_request(p, max_tokens=2))).served_by == "n1"
    removed = before.index.removed_blocks_total
    after = await until(
        lambda: status(stub), "BlockRemoved events", holds=lambda s: s.index.removed_blocks_total > removed
    )
    assert after.index.blocks <= LONG_KV_CACHE_BLOCKS
    assert after.index.unknown_removals == 0 and after.index.orphaned_blocks == 0
    # LRU evicted the oldest prompt: the index says so, and the engine agrees.
    again = await collect(stub, build_request(prompts[0], max_tokens=2))
    assert again.index_match_tokens < blocks_per_prompt * BLOCK_SIZE
    assert again.cached_tokens == again.index_match_tokens


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (build_request(""), grpc.StatusCode.INVALID_ARGUMENT, "prompt.text"),
        (build_request([7] * LONG_MAX_MODEL_LEN), grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
        (build_request([7, 8, VOCAB + 1]), grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
        (build_request("hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        # vLLM's own bound (<= 2), refused before routing (it was UNKNOWN, and retried on other nodes)
        (build_request("hi", temperature=2.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        (build_request("hi", top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        (build_request("hi", max_tokens=LONG_MAX_MODEL_LEN), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
        (build_request("z" * (5 * 1024 * 1024)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ],
)
async def test_bad_input_gets_a_clear_status_and_the_node_keeps_serving(
    stub: node_pb2_grpc.NodeStub, request_: node_pb2.GenerateRequest, code: grpc.StatusCode, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, request_)
    assert err.value.code() == code
    assert err.value.details().startswith(field), err.value.details()
    assert (await collect(stub, build_request("still serving", max_tokens=1))).completion_tokens == 1


async def test_client_cancellation_aborts_the_engine_request(
    stub: node_pb2_grpc.NodeStub, unread_stub: node_pb2_grpc.NodeStub
) -> None:
    """The engine stops generating once the client cancels: it caches the prompt's blocks but far fewer than the
    whole request would fill. The cancel is sent once the engine has cached a block of the request's output: seconds
    before the end of a request that decodes for ~8 s, however starved of CPU the test is."""
    prompt_len, long = 2 * BLOCK_SIZE + 6, 4000  # ~8 s of decoding on 2 cores if nothing stops it
    full_blocks = (prompt_len + long) // BLOCK_SIZE
    before = await status(stub)
    call = unread_stub.Generate(build_request(random_prompt(5, prompt_len), max_tokens=long, ignore_eos=True))
    generating = before.index.stored_blocks_total + 3  # the prompt's two blocks and one of the output's
    await until(lambda: status(stub), "an output block", holds=lambda s: s.index.stored_blocks_total >= generating)
    call.cancel()
    after = await until(
        lambda: status(stub), "the node to drop the request",
        holds=lambda s: s.load.engine_unfinished == 0 and s.load.in_flight == 0,
    )
    assert after.requests_cancelled == before.requests_cancelled + 1
    assert after.requests_failed == before.requests_failed
    assert after.routing.served == before.routing.served  # no final message was ever built
    stored = after.index.stored_blocks_total - before.index.stored_blocks_total
    assert 3 <= stored < full_blocks, f"{stored} blocks stored of the {full_blocks} the whole request fills"
