"""KV pulls between real engines: a node serving a request loads its prefix's KV from the peer that holds it.

Three ``p2pnode serve`` nodes on the tiny model, every one moving KV (``--kv-link-gbps``): n1 holds prefixes (and lends
them slowly: ``--chaos-kv-block-delay``, so that a pull lasts long enough to kill n1 during it), n2 serves what it is
asked with the prefix pulled (``--kv-pull-force``: on this machine recomputing a tiny-model prefix always costs less
than moving it, so the price alone would never pull), n3 runs another block size (its blocks are not n2's).

- A greedy generation whose prefix was pulled gives the tokens (and the log-probabilities) of the same prompt computed
  from scratch, and the serving engine reports the pulled tokens as cached; they stay in its cache after.
- Blocks evicted on the holder, a holder of another block size, and a holder killed -9 during the pull: each request
  still ends in a complete, correct answer, and the final message counts the pull as refused or failed.

The failure cases reach n2 as a forwarded request naming the holder to pull from (what an ingress sends when its
routing decided a pull; the test signs it with the cluster secret as an ingress would), so that they do not depend on
when gossip reports what n1 holds.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import GenerateResult, build_request, collect, collect_call
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.config import DEFAULT_CLUSTER_ID, DEFAULT_MAX_RECEIVE_BYTES, DEFAULT_REPLAY_WINDOW_S
from p2pnode.launcher import NodeProcess
from p2pnode.serving.forward import FORWARD_METHOD
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc
from tests.integration.conftest import BLOCK_SIZE, MULTI_ENGINE_ENV, make_vllm_node

pytestmark = pytest.mark.integration

SECRET = b"kv-pull-integration-cluster-secret"
KV = ["--kv-link-gbps", "10", "--gossip-profile", "local", "--cost-profile", "tiny-cpu", "--http-listen", "off"]
#: n1 lends each block this late: a 12-block pull lasts ~2.4 s, long enough to kill n1 in the middle.
BLOCK_DELAY_S = 0.2
VOCAB = 512


def prompt(seed: int, blocks: int, tail: int = 9) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    tmp = tmp_path_factory.mktemp("kv-mesh")
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    common = ["--cluster-secret-file", str(secret), *KV]
    n1 = make_vllm_node(
        tiny_model, "n1", tmp, *common, "--chaos-kv-block-delay", str(BLOCK_DELAY_S), env=MULTI_ENGINE_ENV
    ).start()
    seeds = ["--seeds", n1.address or ""]
    n2 = make_vllm_node(tiny_model, "n2", tmp, *common, *seeds, "--kv-pull-force", env=MULTI_ENGINE_ENV)
    n3 = make_vllm_node(tiny_model, "n3", tmp, *common, *seeds, "--block-size", "64", env=MULTI_ENGINE_ENV)
    starters = [threading.Thread(target=n.start) for n in (n2, n3)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    nodes = {"n1": n1, "n2": n2, "n3": n3}
    try:
        yield nodes
    finally:
        for node in nodes.values():
            node.kill()


async def generate(address: str, tokens: list[int], max_tokens: int = 8) -> GenerateResult:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        request = build_request(tokens, max_tokens=max_tokens, temperature=0.0)
        return await collect(stub, request, timeout=120)


async def status(address: str) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        return await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=10)


async def wait_until_known(viewer: str, holder: str, hashes_at_least: int) -> None:
    """Until ``viewer``'s gossip shows ``holder`` publishing a cache summary of at least that many hashes."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = await status(viewer)
        if any(m.node_id == holder and m.summary_hashes >= hashes_at_least for m in s.members):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{viewer} never heard {holder}'s summary")


async def forward_with_pull(
    target: NodeProcess, target_id: str, holder: str, holder_address: str, tokens: list[int], blocks: int
) -> GenerateResult:
    """What an ingress sends when its routing decided ``target`` serves ``tokens`` with the prefix pulled from
    ``holder``: a Forward signed with the cluster secret, bound to ``target``."""
    auth = Authenticator(
        cluster_id=DEFAULT_CLUSTER_ID, secret=SECRET, sender_id="test-ingress", sender_address="127.0.0.1:1",
        sender_generation=1, wall_ms=lambda: int(time.time() * 1000), replay_window_s=DEFAULT_REPLAY_WINDOW_S,
        max_seen_nonces=16, max_receive_bytes=DEFAULT_MAX_RECEIVE_BYTES,
    )
    request = forward_pb2.ForwardRequest(
        request_id=f"t-{random.getrandbits(32)}", prompt_token_ids=tokens, origin="test-ingress", hop=1,
        pull=forward_pb2.KvPullHint(holder=holder, holder_address=holder_address, blocks=blocks),
    )
    request.sampling.max_tokens = 8
    request.sampling.temperature = 0.0
    life = next(m.generation for m in (await status(target.address)).members if m.is_self)
    envelope = auth.seal(request.SerializeToString(), target_id, life)
    async with grpc.aio.insecure_channel(target.address) as channel:
        call = channel.unary_stream(FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString)
        return await collect_call(call(envelope, timeout=120))


async def test_a_pulled_prefix_gives_the_tokens_of_computing_it_and_counts_as_cached(
    mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = mesh["n1"], mesh["n2"]
    tokens = prompt(1, blocks=12)
    computed = await generate(n1.address, tokens)  # computed from scratch on n1, which now holds the prefix
    assert computed.served_by == "n1" and computed.cached_tokens == 0 and computed.pull is None
    await wait_until_known(n2.address or "", "n1", hashes_at_least=3)
    pulled = await generate(n2.address, tokens)
    assert pulled.served_by == "n2", pulled
    assert pulled.pull is not None and pulled.pull["holder"] == "n1" and pulled.pull["outcome"] == "ok", pulled.pull
    assert pulled.pull["tokens"] >= 8 * BLOCK_SIZE and pulled.pull["bytes"] > 0
    assert pulled.cached_tokens >= pulled.pull["tokens"]  # the engine counts the pulled tokens as cached
    assert pulled.token_ids == computed.token_ids
    again = await generate(n2.address, tokens)  # the pulled blocks joined n2's own prefix cache
    assert again.served_by == "n2" and again.cached_tokens >= pulled.pull["tokens"]
    assert again.token_ids == computed.token_ids
    kv = (await status(n2.address)).kv
    assert kv.pulls["ok"] >= 1 and kv.pulled_tokens >= pulled.pull["tokens"]


async def test_blocks_evicted_on_the_holder_are_computed_and_the_pull_is_refused(
    mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = mesh["n1"], mesh["n2"]
    tokens = prompt(2, blocks=10)
    reference = await generate(n1.address, tokens)
    for seed in range(100, 108):  # ~88 blocks of other prompts through n1's 64-block cache: the first is evicted
        await generate(n1.address, prompt(seed, blocks=10), max_tokens=1)
    result = await forward_with_pull(n2, "n2", "n1", n1.address or "", tokens, blocks=10)
    assert result.pull is not None and result.pull["outcome"].startswith("refused"), result.pull
    assert "evicted" in result.pull["outcome"] and result.pull["tokens"] == 0
    assert result.completion_tokens == 8 and result.token_ids == reference.token_ids
    assert (await status(n1.address)).kv.exports["evicted"] >= 1


async def test_a_holder_of_another_block_size_lends_nothing_and_the_prefix_is_computed(
    mesh: dict[str, NodeProcess],
) -> None:
    n2, n3 = mesh["n2"], mesh["n3"]
    tokens = prompt(3, blocks=10)
    reference = await generate(n3.address, tokens)  # n3 (64-token blocks) holds the prefix now
    result = await forward_with_pull(n2, "n2", "n3", n3.address or "", tokens, blocks=9)
    assert result.pull is not None and result.pull["outcome"].startswith("refused"), result.pull
    assert "kv_layout" in result.pull["outcome"] and result.pull["tokens"] == 0
    assert result.served_by == "n2" and result.token_ids == reference.token_ids


async def test_a_holder_killed_during_the_pull_costs_a_recompute_not_the_request(
    mesh: dict[str, NodeProcess],
) -> None:
    """n1 lends one block every 0.2 s; it is killed -9 a second into the pull. n2 computes what did not arrive."""
    n1, n2 = mesh["n1"], mesh["n2"]
    tokens = prompt(4, blocks=16)
    reference = await generate(n1.address, tokens)
    request = asyncio.create_task(forward_with_pull(n2, "n2", "n1", n1.address or "", tokens, blocks=16))
    await asyncio.sleep(1.0)
    assert not request.done(), "the pull ended before the holder could be killed (raise the block delay)"
    n1.kill()
    result = await request
    assert result.served_by == "n2" and result.completion_tokens == 8
    assert result.pull is not None and result.pull["holder"] == "n1", result
    assert result.pull["outcome"].startswith("failed"), result.pull
    assert result.pull["tokens"] < 16 * BLOCK_SIZE
    assert result.cached_tokens <= result.pull["tokens"]  # what did not arrive was computed, not counted as cached
    assert result.token_ids == reference.token_ids
    assert (await status(n2.address)).kv.pulls["failed"] >= 1
