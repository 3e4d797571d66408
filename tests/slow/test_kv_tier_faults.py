"""The host KV tier when it is full, on a real engine: every answer is still the computed one, the tier drops blocks
to take new ones (counted), a store it cannot make at all is counted and said in one log line, and a prefix it no
longer holds whole is recomputed.

One standalone ``p2pnode serve`` on the tiny model: a 64-block KV cache over a 12-block host tier (384 KiB), and
prompts of 8 and 16 blocks -- two 8-block prompts overflow the tier, a 16-block one can never fit it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import GenerateResult, build_request, collect_call
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.greedy import MIN_DECIDED_STEPS, assert_same_greedy, decided_steps, tap_margins
from tests.integration.conftest import BLOCK_SIZE, KV_BLOCK_BYTES, MULTI_ENGINE_ENV, make_vllm_node
from tests.polling import until

pytestmark = pytest.mark.integration

TIER_BLOCKS = 12


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(f"kv-tier-faults-{seed}")
    return [rng.randrange(3, 512) for _ in range(blocks * BLOCK_SIZE + 9)]


@pytest.fixture(scope="module")
def node(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("kv-tier-faults")
    node = make_vllm_node(
        tiny_model, "t1", tmp, "--host-kv-bytes", str(TIER_BLOCKS * KV_BLOCK_BYTES), "--http-listen", "off",
        env=MULTI_ENGINE_ENV,
    )
    node.start()
    yield node
    node.kill()


async def generate(node: NodeProcess, tokens: list[int], margins: list[float] | None = None) -> GenerateResult:
    """Greedy tokens of ``tokens``; ``margins``: filled with each step's (tests/greedy.py)."""
    request = build_request(tokens, max_tokens=8, temperature=0.0)
    request.sampling.logprobs = 2
    async with grpc.aio.insecure_channel(node.address or "") as channel:
        return await collect_call(tap_margins(node_pb2_grpc.NodeStub(channel).Generate(request, timeout=120),
                                              margins if margins is not None else []))


async def decided(node: NodeProcess, seed: int, blocks: int) -> tuple[list[int], GenerateResult, list[float]]:
    """A prompt of ``blocks`` blocks computed from scratch whose first greedy steps are decided (tests/greedy.py: the
    first of the seed's candidates that decides ``MIN_DECIDED_STEPS``), its answer and margins."""
    for candidate in range(20):
        tokens = prompt(seed * 100 + candidate, blocks)
        margins: list[float] = []
        reference = await generate(node, tokens, margins)
        if decided_steps(margins) >= MIN_DECIDED_STEPS:
            return tokens, reference, margins
    raise AssertionError(f"none of seed {seed}'s prompts decides its first {MIN_DECIDED_STEPS} greedy steps")


async def tier_status(node: NodeProcess) -> node_pb2.TierStatus:
    async with grpc.aio.insecure_channel(node.address or "") as channel:
        status = await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=10)
    return status.tier


async def test_a_full_tier_costs_recomputes_never_a_wrong_token(node: NodeProcess) -> None:
    first, first_reference, first_margins = await decided(node, 1, 8)
    second, second_reference, second_margins = await decided(node, 2, 8)  # its blocks push the first's out of the tier
    tier = await tier_status(node)
    assert tier.host_blocks <= TIER_BLOCKS and tier.evicted_blocks > 0, tier
    for k in range(3):  # through the engine's 63 blocks: both prefixes leave it
        await generate(node, prompt(10 + k, 20))
    for p, reference, m in ((first, first_reference, first_margins), (second, second_reference, second_margins)):
        again = await generate(node, p)
        assert_same_greedy(reference.token_ids, m, again.token_ids)  # whatever the tier still held, or recomputed
        assert again.tier_hits["host"] <= TIER_BLOCKS * BLOCK_SIZE


async def test_a_store_the_tier_can_never_take_is_counted_and_logged_once(node: NodeProcess) -> None:
    before = (await tier_status(node)).store_failures
    huge, reference, margins = await decided(node, 3, 16)  # 16 blocks to store at once into a 12-block tier
    for k in range(3):
        await generate(node, prompt(20 + k, 20))
    again = await generate(node, huge)
    assert again.tier_hits["host"] < 16 * BLOCK_SIZE
    assert_same_greedy(reference.token_ids, margins, again.token_ids)
    assert (await tier_status(node)).store_failures > before
    assert node.log_path is not None
    log_path = node.log_path

    def said() -> list[str]:
        return [line for line in log_path.read_text().splitlines() if "host KV tier full" in line]

    # the node wrote it before answering; this process copies the node's output into the log on its own thread
    lines = await until(said, "the node's log to say its host tier is full")
    assert len(lines) <= 5, lines  # said, and rate-limited
