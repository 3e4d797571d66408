"""The simulated engine: step timing by hand, and the multi-step decode runs against a step-by-step reference."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from p2pnode.cost import PROFILES, CostProfile, get_profile
from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.des import EventLoop
from p2pnode.sim.workloads.base import Stream

BS = 16
# Round numbers so that hand computations are easy; a tiny batch budget to exercise chunking.
PROFILE = CostProfile(
    name="test",
    description="",
    sources=(),
    kv_capacity_tokens=1 << 20,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    step_base_s=0.010,
    prefill_s_per_token=0.001,
    prefill_attn_s_per_token2=1e-6,
    decode_s_per_seq=0.002,
    kv_read_s_per_token=1e-5,
)


def _engine(profile: CostProfile = PROFILE) -> tuple[EventLoop, NodeEngine, list[SimRequest]]:
    loop = EventLoop()
    done: list[SimRequest] = []
    cache = PagedPrefixCache(profile.kv_blocks(BS), BS, "lru", BlockSpace(BS).block_tokens)
    eng = NodeEngine(0, loop, profile, cache, done.append)
    return loop, eng, done


def _unique(rid: int, t: float, prompt: int, output: int, space: BlockSpace) -> SimRequest:
    return Stream(space, rid + 1).request(rid, t, "k", prompt, output, "x")


def test_profiles_are_sane() -> None:
    for p in PROFILES.values():
        assert p.kv_capacity_tokens > 0 and p.step_base_s > 0 and p.prefill_s_per_token > 0
    p = get_profile("llama-3.1-8b-h100")
    assert 5e-3 < p.step_time(0, 0, 1, 1000) < 8e-3  # single-stream ITL ~6.5 ms
    assert 15_000 < 1 / p.prefill_s_per_token < 40_000
    with pytest.raises(ValueError, match="valid"):
        get_profile("nope")


def test_single_request_timing_by_hand() -> None:
    loop, eng, done = _engine()
    space = BlockSpace(BS)
    r = _unique(0, 0.0, 100, 3, space)
    loop.at(0.0, eng.submit, r)
    loop.run()
    # step 1: prefill 100 tokens: 0.010 + 0.1 + 1e-6 * 100 * 50 = 0.115
    assert r.t_first == pytest.approx(0.115)
    # steps 2 and 3 decode with 101 then 102 tokens of context: 0.010 + 0.002 + 1e-5 * ctx
    assert r.t_done == pytest.approx(0.115 + 0.012 + 0.00101 + 0.012 + 0.00102)
    assert done == [r] and eng.steps == 3


def test_chunked_prefill_spreads_a_long_prompt() -> None:
    loop, eng, _ = _engine()
    r = _unique(0, 0.0, 600, 1, BlockSpace(BS))
    loop.at(0.0, eng.submit, r)
    loop.run()
    assert eng.steps == 3  # 256 + 256 + 88 tokens
    attn = 256 * 128 + 256 * (256 + 128) + 88 * (512 + 44)
    assert r.t_first == pytest.approx(3 * 0.010 + 0.6 + 1e-6 * attn)
    assert r.t_done == r.t_first


def _reference(reqs: list[SimRequest], p: CostProfile) -> dict[int, tuple[float, float]]:
    """The same FCFS continuous batching, one step at a time (no cache hits: every prompt is unique)."""
    pending = sorted(reqs, key=lambda r: r.arrival)
    waiting: list[SimRequest] = []
    prefilling: list[list] = []  # [req, remaining]
    decoding: list[list] = []  # [req, context, tokens left]
    out: dict[int, tuple[float, float]] = {}
    first: dict[int, float] = {}
    t = 0.0
    while pending or waiting or prefilling or decoding:
        if not (waiting or prefilling or decoding):
            t = max(t, pending[0].arrival)
        while pending and pending[0].arrival <= t:
            waiting.append(pending.pop(0))
        budget = p.max_num_batched_tokens - len(decoding)
        chunks = []
        for item in prefilling:
            if budget <= 0:
                break
            take = min(item[1], budget)
            chunks.append((item, take))
            budget -= take
        while budget > 0 and waiting and len(prefilling) + len(decoding) < p.max_num_seqs:
            item = [waiting.pop(0), 0]
            item[1] = item[0].prompt_tokens
            prefilling.append(item)
            take = min(item[1], budget)
            chunks.append((item, take))
            budget -= take
        ptoks = sum(take for _, take in chunks)
        attn = sum(take * (it[0].prompt_tokens - it[1] + take / 2) for it, take in chunks)
        ctx = sum(d[1] + 1 for d in decoding)
        t += p.step_time(ptoks, attn, len(decoding), ctx)
        for d in decoding:
            d[1] += 1
            d[2] -= 1
        for d in [d for d in decoding if d[2] == 0]:
            decoding.remove(d)
            out[d[0].rid] = (first[d[0].rid], t)
        for it, take in chunks:
            it[1] -= take
            if it[1] == 0:
                prefilling.remove(it)
                r = it[0]
                first[r.rid] = t
                if r.output_tokens <= 1:
                    out[r.rid] = (t, t)
                else:
                    decoding.append([r, r.prompt_tokens, r.output_tokens - 1])
    return out


@pytest.mark.parametrize("threshold", [0, 128])
def test_a_long_prefill_threshold_lets_a_short_prompt_past_a_long_one(threshold: int) -> None:
    """vLLM's long_prefill_token_threshold: a 600-token prompt's chunks hold the whole 256-token budget without it, so
    a 20-token prompt sent just after gets its first token only in the long one's last step; with 128 a step, the
    short one is prefilled in the next step, beside the long one's chunk."""
    loop, eng, _ = _engine(replace(PROFILE, long_prefill_token_threshold=threshold))
    space = BlockSpace(BS)
    long, short = _unique(0, 0.0, 600, 1, space), _unique(1, 0.0, 20, 1, space)
    loop.at(0.0, eng.submit, long)
    loop.at(0.0, eng.submit, short)
    loop.run()
    if threshold:
        assert short.t_first < long.t_first
        assert eng.steps == 3  # 256 alone; 128 beside the short one's 20 (its one token); the last 216 alone again
    else:
        assert short.t_first == long.t_first  # both in the third step: 256, 256, 88 + 20
        assert eng.steps == 3


def test_a_long_prefill_threshold_does_not_cap_a_request_alone() -> None:
    """vLLM applies the cap only while another request is in the engine: alone, a long prompt takes the whole budget."""
    loop, eng, _ = _engine(replace(PROFILE, long_prefill_token_threshold=64))
    r = _unique(0, 0.0, 600, 1, BlockSpace(BS))
    loop.at(0.0, eng.submit, r)
    loop.run()
    assert eng.steps == 3  # 256 + 256 + 88, as without the threshold



@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_runs_match_the_step_by_step_reference(seed: int) -> None:
    rng = random.Random(seed)
    space = BlockSpace(BS)
    reqs = []
    t = 0.0
    for rid in range(60):
        t += rng.expovariate(4.0)
        reqs.append(_unique(rid, t, rng.randint(1, 400), rng.randint(1, 60), space))
    loop, eng, done = _engine()
    for r in reqs:
        loop.at(r.arrival, eng.submit, r)
    loop.run()
    ref = _reference(reqs, PROFILE)
    assert len(done) == len(reqs)
    for r in reqs:
        assert (r.t_first, r.t_done) == pytest.approx(ref[r.rid], rel=1e-9, abs=1e-9), r


def test_a_request_larger_than_the_cache_is_dropped_not_hung() -> None:
    small = replace(PROFILE, kv_capacity_tokens=4 * BS)
    loop, eng, done = _engine(small)
    space = BlockSpace(BS)
    big, ok = _unique(0, 0.0, 10 * BS, 2, space), _unique(1, 0.0, BS, 2, space)
    loop.at(0.0, eng.submit, big)
    loop.at(0.0, eng.submit, ok)
    loop.run()
    assert big.dropped and not ok.dropped and set(done) == {big, ok}
