"""A holder killed while a peer pulls a prefix that sits only in its host KV tier: the request still ends in the
computed answer at the puller, the pull counted as failed, and one log line says so.

Two ``p2pnode serve`` nodes on the tiny model, as in test_kv_tier.py (a 64-block KV cache over a 16 MiB host tier,
moving KV), except that n1 lends each block late (``--chaos-kv-block-delay``: an 8-block pull lasts ~1.6 s, long
enough to kill n1 in the middle of it). A mesh of its own: the test kills its holder.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from p2pnode.launcher import NodeProcess
from p2pnode.v1 import forward_pb2
from tests.conftest import built_tiny_model
from tests.greedy import assert_same_greedy
from tests.integration.conftest import BLOCK_SIZE, MULTI_ENGINE_ENV, free_port, kill_all, make_vllm_node, start_in_turn
from tests.polling import until
from tests.slow.test_kv_tier import BLOCKS, SECRET, TIER, computed_then_cached, evict, forward, status

pytestmark = pytest.mark.integration

#: n1 lends each block this late: the 8-block pull below lasts ~1.6 s.
BLOCK_DELAY_S = 0.2


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    tmp = tmp_path_factory.mktemp("tier_pull_kill")
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    common = ["--cluster-secret-file", str(secret), *TIER, "--http-listen", "off"]
    first = f"127.0.0.1:{free_port()}"
    model = built_tiny_model()
    nodes = {
        "n1": make_vllm_node(
            model, "n1", tmp, *common, "--chaos-kv-block-delay", str(BLOCK_DELAY_S), "--listen", first,
            env=MULTI_ENGINE_ENV,
        ),
        "n2": make_vllm_node(model, "n2", tmp, *common, "--kv-pull-force", "--seeds", first, env=MULTI_ENGINE_ENV),
    }  # fmt: skip
    try:
        start_in_turn(nodes.values())
        yield nodes
    finally:
        kill_all(nodes.values())


async def test_a_holder_killed_while_lending_from_its_tier_costs_a_recompute_not_the_request(
    mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = mesh["n1"], mesh["n2"]
    tokens, computed, margins, _ = await computed_then_cached(n1, "n1", seed=5)
    await evict(n1, "n1", seed=5)  # gone from n1's engine, still in n1's host tier
    exports = (await status(n1)).tier.exports
    hint = forward_pb2.KvPullHint(holder="n1", holder_address=n1.address, blocks=BLOCKS)
    request = asyncio.create_task(forward(n2, "n2", tokens, pull=hint))
    # the lease granted from n1's tier: its blocks follow one every BLOCK_DELAY_S, the time to kill n1 in
    await until(lambda: status(n1), "n1 to lend the prefix from its tier", holds=lambda s: s.tier.exports > exports)
    assert not request.done(), "the pull ended before the holder could be killed (raise the block delay)"
    n1.kill()
    result = await request
    assert result.served_by == "n2" and result.completion_tokens == 8
    assert result.pull is not None and result.pull["holder"] == "n1", result.pull
    assert result.pull["outcome"].startswith("failed") and result.pull["tokens"] < BLOCKS * BLOCK_SIZE, result.pull
    assert_same_greedy(computed.token_ids, margins, result.token_ids)  # what did not arrive was computed
    assert (await status(n2)).kv.pulls["failed"] >= 1  # counted
    said = [line for line in n2.log_path.read_text().splitlines() if "KV pull from n1" in line]  # type: ignore[union-attr]
    assert len(said) == 1, said
