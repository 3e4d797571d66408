"""Tenants and priorities in the simulator: the engine's priority scheduling and preemption, the node admission
queue's shedding and work conservation, the per-tenant and per-priority figures, and equal priorities changing
nothing."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from p2pnode.cost import CostProfile
from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.admission import NodeQueue
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.cluster import Cluster, SimConfig
from p2pnode.sim.des import EventLoop
from p2pnode.sim.workloads import Limit, get_workloads
from p2pnode.sim.workloads.base import Stream
from p2pnode.sim.workloads.tenants import HIGH_PRIORITY, Tenant, TenantMix, parse_tenants
from tests.unit.test_sim_engine import BS
from tests.unit.test_sim_engine import PROFILE as ENGINE_PROFILE

#: test_sim_engine's round-number profile, one sequence at a time: priorities decide who runs.
PROFILE = replace(ENGINE_PROFILE, max_num_seqs=1)


def _engine(profile: CostProfile = PROFILE, priority: bool = True) -> tuple[EventLoop, NodeEngine, list[SimRequest]]:
    loop = EventLoop()
    done: list[SimRequest] = []
    cache = PagedPrefixCache(profile.kv_blocks(BS), BS, "lru", BlockSpace(BS).block_tokens)
    return loop, NodeEngine(0, loop, profile, cache, done.append, priority_policy=priority), done


def _req(rid: int, t: float, prompt: int, output: int, space: BlockSpace, priority: int = 0) -> SimRequest:
    r = Stream(space, rid + 1).request(rid, t, "", prompt, output, "x")
    r.priority = priority
    return r


@pytest.mark.parametrize("priority", [True, False])
def test_waiting_requests_are_admitted_by_priority_then_arrival(priority: bool) -> None:
    loop, eng, done = _engine(priority=priority)
    space = BlockSpace(BS)
    first = _req(0, 0.0, 64, 20, space)
    late, urgent, later = _req(1, 0.001, 64, 2, space), _req(2, 0.002, 64, 2, space, -1), _req(3, 0.003, 64, 2, space)
    for r in (first, late, urgent, later):
        loop.at(r.arrival, eng.submit, r)
    loop.run()
    order = [r.rid for r in sorted(done, key=lambda r: r.t_first)]
    # one sequence at a time: FCFS serves in arrival order, the priority policy the urgent request next
    assert order == ([0, 2, 1, 3] if priority else [0, 1, 2, 3])
    assert eng.preemptions == 0  # the KV never ran short


def test_a_blocked_higher_priority_request_preempts_the_lowest_running_one() -> None:
    # KV for one request at a time: the urgent one cannot be admitted beside the running ones
    small = replace(PROFILE, kv_capacity_tokens=12 * BS, max_num_seqs=4)
    loop, eng, done = _engine(small)
    space = BlockSpace(BS)
    low = _req(0, 0.0, 64, 100, space, priority=1)
    urgent = _req(1, 0.5, 64, 4, space, priority=-1)
    for r in (low, urgent):
        loop.at(r.arrival, eng.submit, r)
    loop.run()
    assert eng.preemptions == 1
    assert [r.rid for r in done] == [1, 0]  # the urgent one finished first
    assert low.t_first < urgent.arrival  # its first token came before it was preempted, and is kept
    assert (low.prompt_tokens, low.output_tokens, low.preempted_tokens > 0) == (64, 100, True)  # as it was sent
    assert urgent.t_first < 0.5 + 0.2  # admitted at the next step boundary, not after the long decode
    assert eng.cache.used_blocks == 0 and eng.prefill_backlog_tokens == 0 and not eng.waiting
    # it reports what its first admission reused (nothing), as vLLM sets num_cached_tokens once: the resumption's,
    # over its own blocks, was taken (a 64-token prompt "cached 208", a per-request KV hit of 3.25)
    assert low.cached_tokens == 0


def test_a_trace_request_preempted_while_decoding_resumes_within_its_chain() -> None:
    """A trace's chain holds its prompt's blocks only: a preempted request's grown prompt (its tokens so far) read
    past it (IndexError: chain index out of range) on any trace with priorities and a short KV."""
    small = replace(PROFILE, kv_capacity_tokens=12 * BS, max_num_seqs=4)
    loop, eng, done = _engine(small)

    def trace_request(rid: int, t: float, first_hash: int, prompt: int, output: int, priority: int) -> SimRequest:
        chain = list(range(first_hash, first_hash + prompt // BS))
        r = SimRequest(rid, t, "", prompt, output, chain, list(chain), BS, "trace")
        r.n_blocks = r.n_prompt_blocks  # as TraceWorkload.requests sets it
        r.priority = priority
        return r

    low = trace_request(0, 0.0, 1000, 64, 100, 1)
    urgent = trace_request(1, 0.5, 2000, 64, 4, -1)
    for r in (low, urgent):
        loop.at(r.arrival, eng.submit, r)
    loop.run()
    assert eng.preemptions == 1 and [r.rid for r in done] == [1, 0]
    assert (low.prompt_tokens, low.output_tokens) == (64, 100) and low.n_prompt_blocks == 4
    cache = eng.cache
    assert cache.used_blocks == 0 and cache.free + len(cache.refs) == cache.num_blocks


def test_no_preemption_for_an_equal_or_lower_priority() -> None:
    small = replace(PROFILE, kv_capacity_tokens=12 * BS, max_num_seqs=4)
    loop, eng, done = _engine(small)
    space = BlockSpace(BS)
    running = _req(0, 0.0, 64, 50, space, priority=0)
    same = _req(1, 0.2, 64, 4, space, priority=0)
    loop.at(0.0, eng.submit, running)
    loop.at(0.2, eng.submit, same)
    loop.run()
    assert eng.preemptions == 0 and [r.rid for r in done] == [0, 1]


def _random_stream(seed: int, n: int = 60) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(20.0)
        out.append((t, rng.randint(20, 600), rng.randint(1, 60)))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_priorities_schedule_exactly_as_fcfs(seed: int) -> None:
    tight = replace(PROFILE, kv_capacity_tokens=80 * BS, max_num_seqs=4)  # KV-blocked at times
    times = []
    for priority in (False, True):
        loop, eng, done = _engine(tight, priority)
        space = BlockSpace(BS)
        for i, (t, p, o) in enumerate(_random_stream(seed)):
            loop.at(t, eng.submit, _req(i, t, p, o, space))
        loop.run()
        times.append([(r.rid, r.t_first, r.t_done) for r in sorted(done, key=lambda r: r.rid)])
        assert eng.preemptions == 0
    assert times[0] == times[1]


def _queued_node(max_queue_s: float) -> tuple[EventLoop, NodeEngine, NodeQueue, list[SimRequest]]:
    loop, eng, done = _engine()
    queue = NodeQueue(eng, loop, done.append, max_queue_s, 100, lambda tenant: 1.0)
    return loop, eng, queue, done


def test_the_admission_queue_sheds_at_its_limit_and_never_idles_the_engine() -> None:
    loop, eng, queue, done = _queued_node(max_queue_s=1.0)
    space = BlockSpace(BS)
    reqs = [_req(i, i * 0.01, 128, 40, space) for i in range(30)]  # ~0.6 s each, one at a time: a backlog
    idle_with_queue = []

    def arrive(r: SimRequest) -> None:
        queue.arrive(r)
        idle_with_queue.append(eng.idle and len(queue) > 0)

    for r in reqs:
        loop.at(r.arrival, arrive, r)
    loop.run()
    shed = [r for r in reqs if r.shed]
    served = [r for r in reqs if not r.shed]
    assert shed and served and len(done) == len(reqs)
    assert all(r.t_done == pytest.approx(r.queued_at + 1.0) and r.t_first < 0 for r in shed)
    assert all(r.queue_wait_s <= 1.0 + 1e-9 for r in reqs)
    assert queue.shed == len(shed) and len(queue) == 0 and eng.queued == 0 and eng.prefill_backlog_tokens == 0
    assert not any(idle_with_queue)
    # served in arrival order (one tenant, one priority: FIFO), each starting as soon as the one before finished
    served.sort(key=lambda r: r.t_first)
    assert [r.rid for r in served] == sorted(r.rid for r in served)


def test_the_queue_counts_in_the_nodes_load() -> None:
    loop, eng, queue, done = _queued_node(max_queue_s=10.0)
    space = BlockSpace(BS)
    for i in range(4):
        queue.arrive(_req(i, 0.0, 128, 40, space))
    urgent = _req(4, 0.0, 64, 4, space, priority=HIGH_PRIORITY)
    queue.arrive(urgent)
    # one in the batch (one sequence at a time); the others wait in the admission queue, not at the engine's
    load = eng.load()
    assert (load.running, load.waiting, eng.queued, len(eng.waiting)) == (1, 4, 4, 0)
    assert load.prefill_backlog_tokens == 4 * 128 + 64
    # an urgent request waits behind the urgent part of the queue only (what routing reads for one)
    assert (load.urgent().waiting, load.urgent().prefill_backlog_tokens) == (1, 64)
    loop.run()
    assert urgent.t_first < min(r.t_first for r in done if r is not urgent and r.rid != 0)
    final = eng.load()
    assert (final.waiting, final.prefill_backlog_tokens, final.urgent_waiting, final.urgent_backlog_tokens) == (0,) * 4


def test_tenants_are_drawn_per_session_and_one_alone_sends_the_same_requests() -> None:
    wl = get_workloads("platform-chat")[0]
    tenants = parse_tenants("polite:1,greedy:4:2")
    assert tenants == (Tenant("polite", 1.0), Tenant("greedy", 4.0, 2.0))
    space = BlockSpace(wl.block_size)
    mix = TenantMix(wl, tenants, high_priority_frac=0.1)
    reqs = list(mix.requests(20.0, 0, space, Limit(duration_s=200)))
    polite = [r for r in reqs if r.tenant == "polite"]
    assert 0.1 < len(polite) / len(reqs) < 0.3
    high = sum(r.priority == HIGH_PRIORITY for r in reqs) / len(reqs)
    assert 0.05 < high < 0.15
    by_chain: dict[int, set[str]] = {}
    for r in reqs:
        by_chain.setdefault(id(r.chain), set()).add(r.tenant)
    assert all(len(names) == 1 for names in by_chain.values())  # a conversation's turns: one tenant
    alone = list(TenantMix(wl, tenants, 0.1, only="polite").requests(20.0, 0, BlockSpace(wl.block_size),
                                                                        Limit(duration_s=200)))
    assert [(r.rid, r.arrival, r.prompt_tokens, r.priority) for r in alone] == [
        (r.rid, r.arrival, r.prompt_tokens, r.priority) for r in polite
    ]


def test_a_run_with_tenants_reports_them_and_sheds_nothing_past_its_limit() -> None:
    wl = get_workloads("tool-agent")[0]
    mix = TenantMix(wl, parse_tenants("a:1:2,b:1"), high_priority_frac=0.2)
    cfg = SimConfig(nodes=2, block_size=wl.block_size, warmup_s=5.0, admission_queue=True, max_queue_s=2.0,
                    tenant_weights=mix.tenant_weights)
    c = Cluster(cfg)
    s = c.run(mix.requests(60.0, 0, c.space, Limit(duration_s=30)))
    assert set(s["by_tenant"]) == {"a", "b"} and set(s["by_priority"]) == {str(HIGH_PRIORITY), "0"}
    for groups in (s["by_tenant"], s["by_priority"]):
        assert sum(g["measured"] for g in groups.values()) == s["measured"]
        assert sum(g["shed"] for g in groups.values()) == s["shed"]
        assert sum(g["served_tokens_share"] for g in groups.values()) == pytest.approx(1.0)
    assert s["queue_wait_max_s"] <= 2.0 + 1e-9
    assert s["queue_idle_frac"] == 0.0
    assert s["completed"] == s["requests"]


def test_without_flow_control_a_run_reports_no_flow_figures() -> None:
    wl = get_workloads("tool-agent")[0]
    c = Cluster(SimConfig(nodes=2, block_size=wl.block_size))
    s = c.run(wl.requests(20.0, 0, c.space, Limit(duration_s=10)))
    assert "by_tenant" not in s and "shed" not in s and c.queues is None
    assert c.engines[0].load().urgent_backlog_tokens is None  # not reported: the load is as before


def test_a_trace_may_name_tenants_and_priorities(tmp_path) -> None:
    from p2pnode.sim.workloads.trace import TraceFormatError, TraceWorkload

    path = tmp_path / "t.jsonl"
    lines = [
        '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "tenant": "a"}',
        '{"timestamp": 5, "input_length": 1024, "output_length": 8, "hash_ids": [1, 3], "priority": -1}',
    ]
    path.write_text("\n".join(lines) + "\n")
    wl = TraceWorkload(path, 512)
    assert wl.has_flow
    reqs = list(wl.requests(None, 0, BlockSpace(512), Limit(max_requests=2)))
    assert [(r.tenant, r.priority) for r in reqs] == [("a", 0), ("", -1)]
    # tagged again by a mix with no tenants of its own: the trace's tenants stay
    assert [r.tenant for r in TenantMix(wl).requests(None, 0, BlockSpace(512), Limit(max_requests=2))] == ["a", ""]
    path.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "priority": "x"}\n')
    with pytest.raises(TraceFormatError, match="priority"):
        TraceWorkload(path, 512)


def test_with_tenants_the_simulator_shares_over_the_mesh_as_a_node_does_unless_told_not_to() -> None:
    """A node charges its queue with what peers served each tenant (``flow/served``) by default: so does the
    simulated mesh, and ``--no-mesh-shares`` leaves each node's queue to its own engine."""
    from p2pnode.cli import build_parser
    from p2pnode.cost import get_profile
    from p2pnode.sim.cli import _base_config, _with_tenants, _workloads

    parser = build_parser()
    profile = get_profile("llama-3.1-8b-h100")
    for flags, shared in (((), True), (("--no-mesh-shares",), False)):
        args = parser.parse_args(["sim", "--workload", "platform-chat", "--tenants", "a:0.8,b:0.2", *flags])
        config = _base_config(args, profile, _with_tenants(args, _workloads(args)))
        assert config.admission_queue and config.mesh_shares is shared


def test_tenants_over_a_trace_keep_its_rate_length_and_segments() -> None:
    """A mix hid its trace's records, native rate and segments: ``--tenants`` with ``--trace`` crashed without
    ``--requests``, with it warmed up at a rate of 1.0 (measuring 24 of 28 requests, QPS reported 0.0), and refused
    ``--segments exact`` on a segmented trace."""
    import pickle
    from pathlib import Path

    from p2pnode.sim.workloads.segmented_trace import SegmentedTraceWorkload

    trace = SegmentedTraceWorkload(Path(__file__).resolve().parent / "fixtures" / "segmented_trace.jsonl")
    mix = TenantMix(trace, parse_tenants("a:1,b:1"), 0.2)
    assert (mix.records, mix.native_qps, mix.has_segments) == (trace.records, trace.native_qps, True)
    again = pickle.loads(pickle.dumps(mix))  # what --jobs sends its workers
    assert again.native_qps == trace.native_qps and len(again.records) == len(trace.records)
    with pytest.raises(AttributeError):
        _ = mix.no_such_thing
