"""The host KV tier under real engines: a prefix the engine evicted comes back from host memory, a peer pulls a prefix
that sits only in its holder's tier, p2pnode's own eviction order of the engine's cache keeps working beside it, and
(last: it kills n1) a holder killed while it lends from its tier costs the puller a recompute, not the request.

In the slow suite: the tier needs engines of its own (the shared mesh's have none, and a tier under them would change
what the other modules see cached). Two ``p2pnode serve`` nodes on the tiny model, each with a 64-block KV cache and
a 16 MiB host tier (512 blocks) under it (``--host-kv-bytes``), moving KV between them (``--kv-link-gbps``): n1 evicts
in vLLM's own order (``lru``) and lends each block late (``--chaos-kv-block-delay``: an 8-block pull lasts ~1.6 s,
long enough to kill n1 in the middle of one), n2 evicts in S3-FIFO's and pulls whatever it is told to
(``--kv-pull-force``). Every request
reaches the node that must serve it as a signed Forward (what an ingress sends once its routing chose), so no
assertion depends on routing or gossip timing.

Greedy tokens: a prompt served from the engine's own cache right after it was computed splits the same way as one
served from the tier (the prefix cached, the tail computed) over the same bytes -- the tier copies the engine's own
back -- so their tokens are identical; against the prompt computed from scratch they are compared as far as each step
was decided (tests/greedy.py: how a prompt is split between cache and computation moves its logits by roundings).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.client import GenerateResult, collect_call
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc
from tests.conftest import built_tiny_model
from tests.greedy import MIN_DECIDED_STEPS, assert_same_greedy, decided_steps, tap_margins
from tests.integration.conftest import (
    BLOCK_SIZE,
    MULTI_ENGINE_ENV,
    forwarded,
    free_port,
    kill_all,
    make_vllm_node,
    start_in_turn,
)
from tests.polling import until

pytestmark = pytest.mark.integration

SECRET = b"kv-tier-integration-cluster-secret"
TIER = ["--host-kv-bytes", "16MiB", "--kv-link-gbps", "10", "--gossip-profile", "local", "--cost-profile", "tiny-cpu"]
VOCAB = 512
#: Prompts of this many full blocks; ten of them (80 blocks) push any one out of a 63-block engine cache.
BLOCKS = 8
SCAN = 10
#: n1 lends each block this late (module docstring).
BLOCK_DELAY_S = 0.2


def prompt(seed: int | str, blocks: int = BLOCKS, tail: int = 9) -> list[int]:
    rng = random.Random(f"kv-tier-{seed}")
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


def start_tier_mesh(tmp: Path) -> dict[str, NodeProcess]:
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    common = ["--cluster-secret-file", str(secret), *TIER, "--http-listen", "127.0.0.1:0"]
    first = f"127.0.0.1:{free_port()}"  # chosen first: n1 is n2's seed
    model = built_tiny_model()
    n1 = make_vllm_node(
        model, "n1", tmp, *common, "--eviction-policy", "lru", "--chaos-kv-block-delay", str(BLOCK_DELAY_S),
        "--listen", first, env=MULTI_ENGINE_ENV,
    )  # fmt: skip
    n2 = make_vllm_node(
        model, "n2", tmp, *common, "--eviction-policy", "s3fifo", "--kv-pull-force", "--seeds", first,
        env=MULTI_ENGINE_ENV,
    )  # fmt: skip
    nodes = {"n1": n1, "n2": n2}
    try:
        start_in_turn(nodes.values())
    except BaseException:
        kill_all(nodes.values())
        raise
    return nodes


@pytest.fixture(scope="module")
def tier_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    nodes = start_tier_mesh(tmp_path_factory.mktemp("tier_mesh"))
    try:
        yield nodes
    finally:
        kill_all(nodes.values())


async def status(node: NodeProcess) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(node.address or "") as channel:
        return await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=10)


async def forward(
    target: NodeProcess,
    target_id: str,
    tokens: list[int],
    *,
    max_tokens: int = 8,
    cache_salt: str = "",
    pull: forward_pb2.KvPullHint | None = None,
    margins: list[float] | None = None,
) -> GenerateResult:
    """Serve ``tokens`` greedily at ``target``: a Forward signed with the cluster secret, bound to it; ``margins``:
    filled with each step's (tests/greedy.py)."""
    request = forward_pb2.ForwardRequest(
        request_id=f"t-{random.getrandbits(32)}",
        prompt_token_ids=tokens,
        origin="test-ingress",
        hop=1,
        cache_salt=cache_salt,
        pull=pull,
    )
    request.sampling.max_tokens = max_tokens
    request.sampling.temperature = 0.0
    if margins is not None:
        request.sampling.logprobs = 2
    messages = forwarded(target, target_id, request, SECRET)
    result = await collect_call(messages if margins is None else tap_margins(messages, margins))
    assert result.served_by == target_id, result
    return result


async def evict(target: NodeProcess, target_id: str, seed: int) -> None:
    """Push every earlier prefix out of ``target``'s engine cache (the tier keeps them)."""
    for k in range(SCAN):
        await forward(target, target_id, prompt(f"scan-{seed}-{k}"), max_tokens=1)


async def metrics(node: NodeProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(base_url=f"http://{node.http_address}") as http:
        text = (await http.get("/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def computed_then_cached(
    node: NodeProcess, node_id: str, seed: int, **kw: str
) -> tuple[list[int], GenerateResult, list[float], GenerateResult]:
    """A prompt computed from scratch at ``node`` whose first greedy steps are decided (tests/greedy.py: the tiny
    model's random weights leave a quarter of its steps at near-ties; the first of the seed's candidates that decides
    ``MIN_DECIDED_STEPS``), then served from its engine's own cache: the prompt, both answers, the first's margins."""
    for candidate in range(20):
        tokens = prompt(seed * 100 + candidate)
        margins: list[float] = []
        computed = await forward(node, node_id, tokens, margins=margins, **kw)
        assert computed.cached_tokens == 0 and computed.tier_hits["host"] == 0
        if decided_steps(margins) >= MIN_DECIDED_STEPS:
            break
    else:
        raise AssertionError(f"none of seed {seed}'s prompts decides its first {MIN_DECIDED_STEPS} greedy steps")
    cached = await forward(node, node_id, tokens, **kw)
    assert cached.cached_tokens == BLOCKS * BLOCK_SIZE and cached.tier_hits["gpu"] == cached.cached_tokens
    return tokens, computed, margins, cached


async def test_a_prefix_the_engine_evicted_is_loaded_back_from_the_host_tier(
    tier_mesh: dict[str, NodeProcess],
) -> None:
    n1 = tier_mesh["n1"]
    tokens, computed, margins, cached = await computed_then_cached(n1, "n1", seed=1)  # the tier stores its blocks
    await evict(n1, "n1", seed=1)
    loaded = await forward(n1, "n1", tokens)
    assert loaded.cached_tokens == BLOCKS * BLOCK_SIZE  # the engine reports the whole prefix cached...
    assert loaded.tier_hits["host"] > 0, loaded.tier_hits  # ...most (all, in LRU's order) of it from the tier
    assert loaded.tier_hits["gpu"] + loaded.tier_hits["host"] == loaded.cached_tokens
    assert loaded.token_ids == cached.token_ids  # the bytes it computed, split as the engine's own hit splits them
    assert_same_greedy(computed.token_ids, margins, loaded.token_ids)
    tier = (await status(n1)).tier
    assert tier.host_bytes == 16 << 20 and tier.store_outputs and tier.eviction == "lru"
    assert tier.loads >= 1 and tier.loaded_tokens >= loaded.tier_hits["host"]
    assert tier.load_bytes > 0 and tier.store_bytes > 0 and tier.stored_blocks > 0
    assert 0 < tier.host_indexed_blocks <= tier.host_blocks and tier.host_used_bytes > 0
    seen = await metrics(n1)
    assert seen[("p2pnode:kv_tier_loads_total", (("medium", "host"),))] >= 1
    assert seen[("p2pnode:kv_tier_loaded_tokens_total", (("medium", "host"),))] >= loaded.tier_hits["host"]
    by_source = {labels: v for (name, labels), v in seen.items() if name == "vllm:prompt_tokens_cached_by_source_total"}
    assert sum(v for labels, v in by_source.items() if ("source", "host") in labels) >= loaded.tier_hits["host"]


async def test_a_salted_prefix_in_the_tier_is_never_a_hit_for_another_salt(tier_mesh: dict[str, NodeProcess]) -> None:
    n1 = tier_mesh["n1"]
    tokens, computed, margins, cached = await computed_then_cached(n1, "n1", seed=2, cache_salt="tenant-a")
    await evict(n1, "n1", seed=2)
    other = await forward(n1, "n1", tokens, cache_salt="tenant-b")
    assert other.cached_tokens == 0 and other.tier_hits["host"] == 0
    assert other.token_ids == computed.token_ids  # computed from scratch, as the first was
    own = await forward(n1, "n1", tokens, cache_salt="tenant-a")
    assert own.tier_hits["host"] > 0 and own.cached_tokens == BLOCKS * BLOCK_SIZE
    assert own.token_ids == cached.token_ids
    assert_same_greedy(computed.token_ids, margins, own.token_ids)


async def test_a_node_pulls_a_prefix_that_sits_only_in_its_holders_host_tier(
    tier_mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = tier_mesh["n1"], tier_mesh["n2"]
    tokens, computed, margins, cached = await computed_then_cached(n1, "n1", seed=3)
    await evict(n1, "n1", seed=3)  # gone from n1's engine, still in n1's host tier
    exports = (await status(n1)).tier.exports
    hint = forward_pb2.KvPullHint(holder="n1", holder_address=n1.address, blocks=BLOCKS)
    pulled = await forward(n2, "n2", tokens, pull=hint)
    assert pulled.pull is not None and pulled.pull["outcome"] == "ok", pulled.pull
    assert pulled.pull["tokens"] == BLOCKS * BLOCK_SIZE and pulled.pull["bytes"] > 0
    assert pulled.cached_tokens == BLOCKS * BLOCK_SIZE and pulled.tier_hits["pulled"] == BLOCKS * BLOCK_SIZE
    assert pulled.token_ids == cached.token_ids  # n1's bytes, split as n1's own hit splits them, on this host
    assert_same_greedy(computed.token_ids, margins, pulled.token_ids)
    tier = (await status(n1)).tier
    assert tier.exports == exports + 1 and tier.export_blocks > 0  # n1's engine loaded it from its tier to lend it


async def test_the_projects_eviction_order_keeps_working_beside_the_tier(tier_mesh: dict[str, NodeProcess]) -> None:
    """S3-FIFO (n2) keeps a prefix read three times in the engine through a one-time scan larger than the cache, with
    the tier storing beside it; vLLM's LRU order (n1) evicts it, and the tier brings it back."""
    for seed, (node_id, policy) in enumerate((("n2", "s3fifo"), ("n1", "lru")), start=4):
        node = tier_mesh[node_id]
        hot = prompt(f"hot-{seed}")
        for _ in range(3):
            await forward(node, node_id, hot, max_tokens=1)
        await evict(node, node_id, seed=seed)
        again = await forward(node, node_id, hot, max_tokens=1)
        assert again.cached_tokens == BLOCKS * BLOCK_SIZE, (policy, again)
        if policy == "s3fifo":
            assert again.tier_hits == {"gpu": BLOCKS * BLOCK_SIZE, "host": 0, "disk": 0, "pulled": 0}
        else:
            assert again.tier_hits["host"] > 0, again.tier_hits
        state = await status(node)
        assert state.eviction.policy == policy and state.eviction.active == policy
        assert state.tier.stored_blocks > 0


async def test_a_holder_killed_while_lending_from_its_tier_costs_a_recompute_not_the_request(
    tier_mesh: dict[str, NodeProcess],
) -> None:
    """Last in the module: it kills n1. The request ends in the computed answer at n2, the pull counted as failed,
    and one line at n2 says so."""
    n1, n2 = tier_mesh["n1"], tier_mesh["n2"]
    tokens, computed, margins, _ = await computed_then_cached(n1, "n1", seed=7)
    await evict(n1, "n1", seed=7)  # gone from n1's engine, still in n1's host tier
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
    assert n2.log_path is not None
    log_path = n2.log_path

    def said() -> list[str]:
        return [line for line in log_path.read_text().splitlines() if "KV pull from n1" in line]

    # n2 wrote the line before its answer, but this process copies n2's output into the log on its own thread
    lines = await until(said, "n2's log to say the pull from n1 failed")
    assert len(lines) == 1, lines
