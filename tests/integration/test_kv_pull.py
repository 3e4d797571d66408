"""KV pulls between real engines: a node serving a request loads its prefix's KV from the peer that holds it.

Three ``p2pnode serve`` nodes on the tiny model, every one moving KV (``--kv-link-gbps``): n1 holds prefixes (and lends
them slowly: ``--chaos-kv-block-delay``, so that a pull lasts long enough to kill n1 during it), n2 serves what it is
asked with the prefix pulled (``--kv-pull-force``: on this machine recomputing a tiny-model prefix always costs less
than moving it, so the price alone would never pull), n3 runs another block size (its blocks are not n2's).

- A greedy generation whose prefix was pulled gives the tokens of the same prompt computed from scratch (as far as
  each step was decided: the two are summed in other steps, tests/greedy.py), and the serving engine reports the
  pulled tokens as cached; they stay in its cache after.
- Blocks evicted on the holder, a holder of another block size, and a holder killed -9 during the pull: each request
  still ends in a complete, correct answer, and the final message counts the pull as refused or failed.
- Stored segments (approximate reuse) move too: a document n1 stored is pulled by n2 for an approximate request and
  loaded there like one n2 stored itself (the tokens n1 gives holding it); killed during such a pull, n1 costs n2 a
  recompute of the document, not the request.

- Priority on an engine that pulls: n2 runs one sequence at a time (``--max-num-seqs 1``); a forwarded high-priority
  request behind two queued low-priority forwards runs first when the slot frees (the engine with p2pnode's KV
  connector schedules by priority; tests/slow/test_vllm_node.py shows the same on an engine without it).

The failure cases reach n2 as a forwarded request naming the holder to pull from (what an ingress sends when its
routing decided a pull; the test signs it with the cluster secret as an ingress would), so that they do not depend on
when gossip reports what n1 holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import GenerateResult, build_request, collect, collect_call
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc
from tests.conftest import built_tiny_model
from tests.greedy import assert_same_greedy, tap_margins
from tests.integration.conftest import (
    BLOCK_SIZE,
    EARLY,
    LONG_ENGINE,
    MULTI_ENGINE_ENV,
    forwarded,
    free_port,
    kill_all,
    make_vllm_node,
    start_in_turn,
    stored_blocks,
    wait_idle,
    wait_summary_reaches,
)
from tests.polling import until

pytestmark = pytest.mark.integration

SECRET = b"kv-pull-integration-cluster-secret"
KV = ["--kv-link-gbps", "10", "--gossip-profile", "local", "--cost-profile", "tiny-cpu", "--http-listen", "off"]
#: n1 lends each block this late: a 12-block pull lasts ~2.4 s, long enough to kill n1 in the middle.
BLOCK_DELAY_S = 0.2
VOCAB = 512
#: Lower runs first, as vLLM orders priorities.
HIGH, LOW = -1, 0


def prompt(seed: int, blocks: int, tail: int = 9) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


def start_kv_mesh(tmp: Path) -> dict[str, NodeProcess]:
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    common = ["--cluster-secret-file", str(secret), *KV]
    first = f"127.0.0.1:{free_port()}"  # chosen first: n1 the others' seed
    seeds = ["--seeds", first]
    model = built_tiny_model()
    n1 = make_vllm_node(
        model, "n1", tmp, *common, "--chaos-kv-block-delay", str(BLOCK_DELAY_S), "--listen", first,
        env=MULTI_ENGINE_ENV, base_env=EARLY.environ,
    )
    env = {"env": MULTI_ENGINE_ENV, "base_env": EARLY.environ}
    # one sequence at a time, and the long engine: a request of 3,000 tokens holds the slot for seconds
    n2 = make_vllm_node(
        model, "n2", tmp, *common, *seeds, "--kv-pull-force", *LONG_ENGINE, "--max-num-seqs", "1", **env
    )
    n3 = make_vllm_node(model, "n3", tmp, *common, *seeds, "--block-size", "64", **env)
    nodes = {"n1": n1, "n2": n2, "n3": n3}
    try:
        start_in_turn(nodes.values())
    except BaseException:
        kill_all(nodes.values())
        raise
    return nodes


EARLY.register("kv_mesh", start_kv_mesh)  # started in the background once collection shows it is used


@pytest.fixture(scope="module")
def kv_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    nodes = EARLY.take("kv_mesh", tmp_path_factory)
    try:
        yield nodes
    finally:
        kill_all(nodes.values())


async def generate(
    address: str, tokens: list[int], max_tokens: int = 8, margins: list[float] | None = None, cache_salt: str = ""
) -> GenerateResult:
    """Greedy tokens of ``tokens`` served at ``address``; ``margins``: filled with each step's (tests/greedy.py)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        request = build_request(tokens, max_tokens=max_tokens, temperature=0.0, cache_salt=cache_salt)
        if margins is None:
            return await collect(stub, request, timeout=120)
        request.sampling.logprobs = 2
        return await collect_call(tap_margins(stub.Generate(request, timeout=120), margins))


async def status(address: str) -> node_pb2.NodeStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        return await node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=10)


async def wait_until_known(viewer: str, holder: str, at_least: int, field: str = "summary_hashes") -> None:
    """Until ``viewer``'s gossip shows ``holder`` publishing at least that many cache-summary hashes (``field``
    ``summary_segments``: segment keys)."""
    await until(
        lambda: status(viewer), f"{viewer} to hear of {at_least} of {holder}'s {field}",
        holds=lambda s: any(m.node_id == holder and getattr(m, field) >= at_least for m in s.members),
    )


async def forward_with_pull(
    target: NodeProcess, target_id: str, holder: str, holder_address: str, tokens: list[int], blocks: int
) -> GenerateResult:
    """What an ingress sends when its routing decided ``target`` serves ``tokens`` with the prefix pulled from
    ``holder``: a Forward signed with the cluster secret, bound to ``target``."""
    pull = forward_pb2.KvPullHint(holder=holder, holder_address=holder_address, blocks=blocks)
    return await forward(target, target_id, tokens, pull=pull)


async def forward(
    target: NodeProcess,
    target_id: str,
    tokens: list[int],
    *,
    pull: forward_pb2.KvPullHint | None = None,
    segment: tuple[int, int] | None = None,
    logprobs: list[float] | None = None,
    max_tokens: int = 8,
    priority: int = 0,
    ignore_eos: bool = False,
) -> GenerateResult:
    """A Forward signed with the cluster secret, bound to ``target`` (which must serve it): with a prefix to pull,
    or with one approximate-mode segment (whose pull ``target`` decides itself). ``logprobs``: filled with the
    sampled tokens' log-probabilities. ``priority``: vLLM's (lower runs first)."""
    request = forward_pb2.ForwardRequest(
        request_id=f"t-{random.getrandbits(32)}", prompt_token_ids=tokens, origin="test-ingress", hop=1, pull=pull,
    )
    if segment is not None:
        request.segment_reuse = node_pb2.SEGMENT_REUSE_APPROXIMATE
        request.segment_spans.add(start=segment[0], end=segment[1])
    request.sampling.max_tokens = max_tokens
    request.sampling.temperature = 0.0
    request.sampling.priority = priority
    request.sampling.ignore_eos = ignore_eos
    if logprobs is not None:
        request.sampling.logprobs = 1

    async def tapped() -> AsyncIterator[node_pb2.GenerateResponse]:
        async for message in forwarded(target, target_id, request, SECRET):
            if logprobs is not None:
                logprobs.extend(p.sampled.logprob for p in message.logprobs)
            yield message

    return await collect_call(tapped())


async def test_a_pulled_prefix_gives_the_tokens_of_computing_it_and_counts_as_cached(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = kv_mesh["n1"], kv_mesh["n2"]
    tokens = prompt(1, blocks=12)
    margins: list[float] = []
    computed = await generate(n1.address, tokens, margins=margins)  # from scratch on n1, which now holds the prefix
    assert computed.served_by == "n1" and computed.cached_tokens == 0 and computed.pull is None
    await wait_until_known(n2.address or "", "n1", 3)
    pulled = await generate(n2.address, tokens)
    assert pulled.served_by == "n2", pulled
    assert pulled.pull is not None and pulled.pull["holder"] == "n1" and pulled.pull["outcome"] == "ok", pulled.pull
    assert pulled.pull["tokens"] >= 8 * BLOCK_SIZE and pulled.pull["bytes"] > 0
    assert pulled.cached_tokens >= pulled.pull["tokens"]  # the engine counts the pulled tokens as cached
    # computed in other steps than from scratch: the same greedy tokens as far as they were decided
    assert_same_greedy(computed.token_ids, margins, pulled.token_ids)
    again = await generate(n2.address, tokens)  # the pulled blocks joined n2's own prefix cache
    assert again.served_by == "n2" and again.cached_tokens >= pulled.pull["tokens"]
    assert_same_greedy(computed.token_ids, margins, again.token_ids)
    kv = (await status(n2.address)).kv
    assert kv.pulls["ok"] >= 1 and kv.pulled_tokens >= pulled.pull["tokens"]


async def test_blocks_evicted_on_the_holder_are_computed_and_the_pull_is_refused(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = kv_mesh["n1"], kv_mesh["n2"]
    tokens = prompt(2, blocks=10)
    reference = await generate(n1.address, tokens)
    for seed in range(100, 108):  # ~88 blocks of other prompts through n1's 64-block cache: the first is evicted
        await generate(n1.address, prompt(seed, blocks=10), max_tokens=1)
    result = await forward_with_pull(n2, "n2", "n1", n1.address or "", tokens, blocks=10)
    assert result.pull is not None and result.pull["outcome"].startswith("refused"), result.pull
    assert "evicted" in result.pull["outcome"] and result.pull["tokens"] == 0
    # both computed from scratch, in the same steps, by engines of the same settings: the very same numbers
    assert result.completion_tokens == 8 and result.token_ids == reference.token_ids
    assert (await status(n1.address)).kv.exports["evicted"] >= 1


async def test_a_holder_of_another_block_size_lends_nothing_and_the_prefix_is_computed(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    n2, n3 = kv_mesh["n2"], kv_mesh["n3"]
    tokens = prompt(280, blocks=10)  # its first steps decided by far (tests/greedy.py): seed 3's were not
    margins: list[float] = []
    reference = await generate(n3.address, tokens, margins=margins)  # n3 (64-token blocks) holds the prefix now
    result = await forward_with_pull(n2, "n2", "n3", n3.address or "", tokens, blocks=9)
    assert result.pull is not None and result.pull["outcome"].startswith("refused"), result.pull
    assert "kv_layout" in result.pull["outcome"] and result.pull["tokens"] == 0
    assert result.served_by == "n2"
    assert_same_greedy(reference.token_ids, margins, result.token_ids)  # attention over other blocks: other sums


async def segments_known(viewer: str, holder: str) -> int:
    return next((m.summary_segments for m in (await status(viewer)).members if m.node_id == holder), 0)


def with_document(seed: int, document: list[int], context: int = 40) -> tuple[list[int], tuple[int, int]]:
    """``[context][document][question]`` and the document's span."""
    rng = random.Random(f"kv-pull-segment-{seed}")
    head = [rng.randrange(3, VOCAB) for _ in range(context)]
    return [*head, *document, *(rng.randrange(3, VOCAB) for _ in range(10))], (context, context + len(document))


async def test_a_segment_stored_on_a_peer_is_pulled_and_loaded_like_one_stored_there(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    n1, n2 = kv_mesh["n1"], kv_mesh["n2"]
    document = prompt(30, blocks=3, tail=8)  # 104 tokens: 4 chunks, n1 lending one every 0.2 s
    first, span = with_document(1, document)
    before = await segments_known(n2.address or "", "n1")
    stored = await forward(n1, "n1", first, segment=span)  # n1 computes the document after its context, stores it
    assert stored.served_by == "n1" and stored.segments is not None
    await wait_until_known(n2.address or "", "n1", before + 1, "summary_segments")
    second, span2 = with_document(2, document)  # the document after another context, at the same place
    pulled_logprobs: list[float] = []
    pulled = await forward(n2, "n2", second, segment=span2, logprobs=pulled_logprobs)
    assert pulled.served_by == "n2", pulled
    assert pulled.pull is None  # no prefix pull: the segment's, one entry for its one holder
    [segment_pull] = pulled.segment_pulls
    assert segment_pull["holder"] == "n1" and segment_pull["outcome"] == "ok", segment_pull
    assert segment_pull["tokens"] == len(document) and segment_pull["bytes"] > 0
    assert pulled.segments is not None and pulled.segments["reused_segments"] == 1, pulled.segments
    assert pulled.segments["reused_tokens"] >= len(document)
    holder_logprobs: list[float] = []
    at_holder = await forward(n1, "n1", second, segment=span2, logprobs=holder_logprobs)  # from n1's own store
    assert at_holder.segments is not None and at_holder.segments["reused_segments"] == 1
    assert pulled.token_ids == at_holder.token_ids
    # the same K/V bytes give the same numbers (a key rotated one position off moves them; test_segments_engine.py)
    assert len(pulled_logprobs) == 8 and pulled_logprobs == holder_logprobs
    again_logprobs: list[float] = []
    again = await forward(n2, "n2", second, segment=span2, logprobs=again_logprobs)  # now held at n2: no pull
    assert again.pull is None and again.segment_pulls == []
    assert again.segments is not None and again.segments["reused_segments"] == 1
    assert again.token_ids == at_holder.token_ids and again_logprobs == holder_logprobs
    kv = (await status(n2.address)).kv
    assert kv.pulls["ok"] >= 1 and kv.pulled_tokens >= len(document)


async def test_a_salted_prompt_is_never_pulled_and_its_repeat_goes_to_its_holder(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    """A pull leases the holder's blocks by tokens alone, so a salted prompt's KV (or an adapter's) never moves: n2,
    which pulls whatever it can (``--kv-pull-force``), sends the salted repeat to n1, whose engine reuses it all.
    (Before, n2 planned the pull, n1 had no such default-namespace blocks, and n2 computed the prompt: 0 cached.)"""
    n1, n2 = kv_mesh["n1"], kv_mesh["n2"]
    tokens = prompt(9, blocks=8)
    stored = await stored_blocks(n1)
    first = await generate(n1.address, tokens, cache_salt="tenant-1")
    assert first.served_by == "n1" and first.cached_tokens == 0
    await wait_summary_reaches(n1, [n2], stored, 8)
    repeat = await generate(n2.address, tokens, cache_salt="tenant-1")
    assert repeat.pull is None, repeat.pull
    assert repeat.served_by == "n1" and repeat.cached_tokens == 8 * BLOCK_SIZE
    # computed in other steps than from scratch: the greedy tokens of the prompt from scratch (the unsalted one, at
    # n1: a salt changes no number), as far as they were decided
    margins: list[float] = []
    scratch = await generate(n1.address, tokens, margins=margins)
    assert scratch.served_by == "n1" and scratch.cached_tokens == 0
    assert_same_greedy(scratch.token_ids, margins, repeat.token_ids)


async def test_a_holder_killed_during_the_pull_costs_a_recompute_not_the_request(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    """n1 lends one block every 0.2 s (and one block's worth of a segment's tokens); it is killed -9 once it has
    lent a prefix and a segment, seconds before they would have arrived. n2 computes what did not arrive."""
    n1, n2 = kv_mesh["n1"], kv_mesh["n2"]
    tokens = prompt(4, blocks=16)
    reference_margins: list[float] = []
    reference = await generate(n1.address, tokens, margins=reference_margins)
    document = prompt(31, blocks=12, tail=8)  # 392 tokens: 13 chunks, 2.6 s at n1's delay
    first, span = with_document(3, document)
    before = await segments_known(n2.address or "", "n1")
    await forward(n1, "n1", first, segment=span)
    await wait_until_known(n2.address or "", "n1", before + 1, "summary_segments")
    second, span2 = with_document(13, document)  # a context whose first steps are decided by far
    margins: list[float] = []
    computed = await generate(n1.address, second, margins=margins)  # what n2 gives without the document
    lent = (await status(n1.address)).kv.exports.get("ok", 0)
    request = asyncio.create_task(forward_with_pull(n2, "n2", "n1", n1.address or "", tokens, blocks=16))
    segment_request = asyncio.create_task(forward(n2, "n2", second, segment=span2))
    # both leases granted: the blocks follow one every BLOCK_DELAY_S, seconds of pulling left to kill n1 in
    await until(lambda: status(n1.address), "n1 to lend the prefix and the segment",
                holds=lambda s: s.kv.exports.get("ok", 0) >= lent + 2)
    assert not request.done(), "the pull ended before the holder could be killed (raise the block delay)"
    assert not segment_request.done(), "the segment pull ended before the holder could be killed"
    n1.kill()
    segment_result = await segment_request
    assert segment_result.served_by == "n2" and segment_result.completion_tokens == 8
    [segment_pull] = segment_result.segment_pulls
    assert segment_pull["holder"] == "n1" and segment_pull["outcome"].startswith("failed"), segment_result
    assert segment_result.segments is not None and segment_result.segments["reused_segments"] == 0
    assert_same_greedy(computed.token_ids, margins, segment_result.token_ids)
    result = await request
    assert result.served_by == "n2" and result.completion_tokens == 8
    assert result.pull is not None and result.pull["holder"] == "n1", result
    assert result.pull["outcome"].startswith("failed"), result.pull
    assert result.pull["tokens"] < 16 * BLOCK_SIZE
    assert result.cached_tokens <= result.pull["tokens"]  # what did not arrive was computed, not counted as cached
    assert_same_greedy(reference.token_ids, reference_margins, result.token_ids)  # from what arrived, if any
    assert (await status(n2.address)).kv.pulls["failed"] >= 2


#: Tokens the request holding n2's one slot asks for (its prompt is 41): ~8 s of decoding on the long engine.
HOLD_TOKENS = 4000
#: Tries at setting the scene (the slot held while three requests queue behind it): on a host starved of CPU the
#: holder can end, or a request arrive late, before it is set. A try that misses is named in the failure.
SCENE_TRIES = 3


def outcome(task: asyncio.Task[GenerateResult]) -> str:
    """How a request's task ended, for a failure message."""
    if not task.done():
        return "still running"
    if task.cancelled():
        return "cancelled"
    if (error := task.exception()) is not None:
        return f"failed: {error!r}"
    result = task.result()
    return f"{result.completion_tokens} tokens ({result.finish_reason}) from {result.served_by}"


async def test_a_high_priority_request_overtakes_queued_low_priority_ones_on_an_engine_that_pulls(
    kv_mesh: dict[str, NodeProcess],
) -> None:
    """n2's engine runs p2pnode's KV connector (it pulls) with one sequence at a time: a forwarded high-priority
    request behind two queued low-priority forwards runs first when the slot frees. (One whose prefix is still being
    pulled waits outside the batch, in vLLM's WAITING_FOR_REMOTE_KVS, while ready ones of lower priority run: the
    engine never idles for it.)"""
    missed = []
    for _ in range(SCENE_TRIES):
        miss = await overtaking_scene(kv_mesh["n2"])
        if miss is None:
            return
        missed.append(miss)
        await wait_idle(kv_mesh["n2"])
    raise AssertionError(f"the scene was never set in {SCENE_TRIES} tries: " + "; ".join(missed))


async def overtaking_scene(n2: NodeProcess) -> str | None:
    """One try: a long request holds n2's slot while two low-priority requests, then a high-priority one, queue
    behind it; the slot is freed and the high one must finish first (asserted). None once asserted; what ended too
    early when the scene could not be set."""
    finished: list[str] = []
    names = ("holder", "low-0", "low-1", "high")

    async def served(name: str, call: Awaitable[GenerateResult]) -> GenerateResult:
        result = await call
        finished.append(name)
        return result

    holder = asyncio.create_task(forward(n2, "n2", prompt(7, blocks=1), max_tokens=HOLD_TOKENS, ignore_eos=True))
    tasks: list[asyncio.Task[GenerateResult]] = [holder]

    async def queued_behind_holder(waiting: int) -> bool:
        """Until ``waiting`` requests queue behind the holder: False when the holder or one of them ended first."""
        await until(lambda: status(n2.address), f"{waiting} requests to queue behind the long one",
                    holds=lambda s: (s.load.running == 1 and s.load.waiting == waiting)
                    or any(t.done() for t in tasks))
        return not any(t.done() for t in tasks)

    set_ = await queued_behind_holder(0)
    if set_:
        tasks += [asyncio.create_task(served(f"low-{i}", forward(n2, "n2", prompt(20 + i, blocks=1), priority=LOW)))
                  for i in range(2)]
        set_ = await queued_behind_holder(2)
    if set_:
        tasks.append(asyncio.create_task(served("high", forward(n2, "n2", prompt(22, blocks=1), priority=HIGH))))
        set_ = await queued_behind_holder(3)
    ended = "" if set_ else ", ".join(f"{name} {outcome(t)}" for name, t in zip(names, tasks, strict=False))
    holder.cancel()  # the slot frees at once
    with contextlib.suppress(asyncio.CancelledError):
        await holder
    if set_:
        results = await asyncio.gather(*tasks[1:])
        assert all(r.completion_tokens == 8 and r.served_by == "n2" for r in results)
        assert finished[0] == "high" and sorted(finished[1:]) == ["low-0", "low-1"], finished
        return None
    for task in tasks[1:]:
        task.cancel()
    await asyncio.gather(*tasks[1:], return_exceptions=True)
    return ended
