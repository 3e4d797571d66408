"""What a run measured: per-request records folded into the summary the runner and report use.

Definitions (over requests that arrived after the warm-up, unless said otherwise):
- ``kv_hit``: token-weighted served KV hit rate, sum(cached prompt tokens) / sum(prompt tokens), the cached tokens
  being what the serving engine reused (vLLM's ``num_cached_tokens``);
- ``ttft_*``: client-side time to first token: arrival at the ingress to the first token back there (a forwarded
  request pays the hop both ways);
- ``load_imbalance``: max / mean of requests served per node; ``work_imbalance``: the same for engine busy time
  over the whole run;
- ``idle_nodes``: nodes that served no measured request while another node queued (its prefill backlog exceeded a
  step's token budget at some point): a node the routing never used although it was needed;
- ``forwarded_frac``: requests served by another node than their ingress;
- ``est_error_tokens``: mean |estimated match at the chosen node - cached tokens actually reused|, the quality of
  the routing information (stale gossip, speculative entries);
- ``gossip_bytes_per_node_s``: bytes the gossip model sent per node per simulated second (0 when not modelled);
- ``kv_running_frac``: the share of a node's KV cache held by running requests (pinned or reserved, not evictable),
  and ``waiting_frac`` the share of time a node had requests waiting, both sampled every second after the warm-up
  over every node (``cluster.KV_SAMPLE_PERIOD_S``): a mesh whose KV is short queues with its caches full of running
  requests, whatever the routing;
- KV pulls (``pulls.py``; all 0 when the run moves no KV): ``kv_hit`` counts every prompt token not recomputed,
  pulled ones too; ``pulled_frac`` is the pulled share of prompt tokens (so ``kv_hit_local`` = ``kv_hit`` -
  ``pulled_frac``); ``pulls_per_req``: requests whose pull went on a link, per request; ``pulls_failed_frac`` /
  ``pulls_partial_frac``: of those, the share that moved nothing / less than asked (the holder had evicted the
  blocks since the estimate); ``pull_bytes_per_req``: bytes moved per request (every request counted);
  ``pull_wait_p99_s``: the p99 of the pulls' wait for their holder's link; ``pull_s_mean``: a pull's mean time
  from reaching its target to joining its queue.
- KV tiers (``engine/simulated/tiers.py``; only in runs with tiers): ``kv_hit`` counts what a request loaded from its
  node's tiers; ``kv_hit_gpu`` / ``kv_hit_host`` / ``kv_hit_disk`` split it by where the tokens came from (with
  ``pulled_frac``, they sum to ``kv_hit``); ``tier_load_s_mean`` / ``tier_load_s_p99``: a loading request's wait for
  its blocks (queue on its node's host link included); ``tier_*_bytes_per_req``: bytes stored to and loaded from the
  tiers over the whole run (warm-up included), per request completed;
- segments (``engine/simulated/segments.py``; 0 without): ``kv_hit`` counts the tokens loaded from a segment store as
  cached (they were not prefilled); ``segment_loaded_frac`` is their share of prompt tokens, ``segment_phases`` the
  mean phases a request ran to reach them.
- flow control (``admission.py``; only in runs with it): ``by_tenant`` and ``by_priority``, each with the measured
  requests' TTFT p50 / p99, ``shed`` (requests arriving after the warm-up that were answered from their node's
  admission queue unserved) and its share, ``served_tokens_share`` (the group's share of the token work -- prompt +
  output -- of the requests that finished between the warm-up and the last arrival: while the mesh is loaded, not
  while it drains) and ``served_tokens_per_s`` over that window, and ``queue_wait_max_s`` (the longest wait in an
  admission queue, shed requests included: never above the queue limit); overall ``shed``, ``queue_wait_max_s``,
  ``queue_idle_frac`` (the share of samples in which a node's engine was idle while its admission queue held
  requests: 0 when the queue is work-conserving) and ``preemptions`` (requests a higher priority preempted).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from p2pnode.engine.simulated.batching import NodeEngine
from p2pnode.engine.simulated.request import PULL_FAILED, PULL_NONE, PULL_PARTIAL, PULL_UNNEEDED, SimRequest

__all__ = ["Recorder"]


def _array(values: array, dtype: type[np.generic]) -> np.ndarray:
    """A recorded column as an array (empty when nothing was recorded)."""
    return np.frombuffer(values, dtype=dtype) if values else np.zeros(0, dtype)


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else float("nan")


def _idle_nodes(engines: Sequence[NodeEngine], served: np.ndarray) -> int:
    idle = [j for j in range(len(engines)) if not served[j]]
    queued = [e.max_backlog_tokens > e.profile.max_num_batched_tokens for e in engines]
    return sum(1 for j in idle if any(q for k, q in enumerate(queued) if k != j))


class Recorder:
    """Per-request outcomes, stored compactly (a million requests fit in tens of MB)."""

    def __init__(
        self,
        n_nodes: int,
        block_size: int,
        warmup_s: float,
        forward_latency_s: float,
        tiers: bool = False,
        flow: bool = False,
    ) -> None:
        self.block_size = block_size
        #: Whether the run has flow control (admission queues, tenants, priorities): its figures only then.
        self.flow = flow
        self.tenants: dict[str, int] = {}
        self.m_tenant = array("i")  # per measured request (beside ``ttft``): tenant index, priority, queue wait
        self.m_priority = array("i")
        self.m_queue_wait = array("d")
        self.d_tenant = array("i")  # per served request, warm-up included: tenant, priority, token work, finish
        self.d_priority = array("i")
        self.d_work = array("d")
        self.d_done = array("d")
        self.s_tenant = array("i")  # per shed request arriving after the warm-up: tenant, priority, queue wait
        self.s_priority = array("i")
        self.s_queue_wait = array("d")
        self.queue_idle = 0
        #: Whether the run has KV tiers: their figures are recorded and reported only then.
        self.tiers = tiers
        self.tier_host = array("q")  # prompt tokens loaded from the host tier, per request
        self.tier_disk = array("q")
        self.tier_load_s = array("d")  # per request that loaded from a tier: its wait
        self.warmup_s = warmup_s
        self.forward_latency_s = forward_latency_s
        self.ttft = array("d")
        self.e2e = array("d")
        self.prompt = array("q")
        self.cached = array("q")
        self.est = array("q")
        self.node = array("i")
        self.forwarded = array("b")
        self.cls = array("i")
        self.rids = array("q")
        self.pulled = array("q")  # pulled prompt tokens per request
        self.loaded = 0  # prompt tokens loaded from segment stores, summed
        self.phases = 0
        self.pull_bytes = array("q")
        self.pull_outcome = array("b")
        self.pull_wait = array("d")  # per pull that went on a link: its wait for the link
        self.pull_s = array("d")  # ... and its time from reaching the target to joining the queue
        self.classes: dict[str, int] = {}
        self.completed = 0
        self.dropped = 0
        self.dropped_measured = 0  # of ``dropped``, those that arrived after the warm-up
        self.keep_rids = False
        self.kv_running = 0.0  # sums over samples x nodes (``sample``)
        self.waiting = 0
        self.samples = 0

    def record(self, r: SimRequest) -> None:
        self.completed += 1
        if self.keep_rids:
            self.rids.append(r.rid)
        if r.dropped:
            self.dropped += 1
            if r.arrival >= self.warmup_s:
                self.dropped_measured += 1
            return
        if self.flow:
            tenant = self.tenants.get(r.tenant)
            if tenant is None:
                tenant = self.tenants[r.tenant] = len(self.tenants)
            if r.shed:
                if r.arrival >= self.warmup_s:
                    self.s_tenant.append(tenant)
                    self.s_priority.append(r.priority)
                    self.s_queue_wait.append(r.queue_wait_s)
                return
            self.d_tenant.append(tenant)
            self.d_priority.append(r.priority)
            self.d_work.append(r.prompt_tokens + r.output_tokens)
            self.d_done.append(r.t_done)
            if r.arrival >= self.warmup_s:
                self.m_tenant.append(tenant)
                self.m_priority.append(r.priority)
                self.m_queue_wait.append(r.queue_wait_s)
        if r.arrival < self.warmup_s:
            return
        back = self.forward_latency_s if r.forwarded else 0.0
        self.ttft.append(r.t_first + back - r.arrival)
        self.e2e.append(r.t_done + back - r.arrival)
        self.prompt.append(r.prompt_tokens)
        self.cached.append(r.cached_tokens + r.loaded_tokens)
        if r.loaded_tokens or r.segments is not None:
            self.loaded += r.loaded_tokens
            self.phases += r.segments.phases if r.segments is not None else 0
        bs = self.block_size
        usable = (r.prompt_tokens - 1) // bs
        est = r.est_match_blocks
        self.est.append((est if est < usable else usable) * bs)
        self.node.append(r.target)
        self.forwarded.append(1 if r.forwarded else 0)
        c = self.classes.get(r.cls)
        if c is None:
            c = self.classes[r.cls] = len(self.classes)
        self.cls.append(c)
        self.pulled.append(r.pulled_tokens)
        self.pull_bytes.append(r.pull_bytes)
        outcome = r.pull_outcome
        self.pull_outcome.append(outcome)
        if outcome != PULL_NONE and outcome != PULL_UNNEEDED:
            self.pull_wait.append(r.pull_wait_s)
            self.pull_s.append(r.pull_s)
        if self.tiers:
            self.tier_host.append(r.tier_host_tokens)
            self.tier_disk.append(r.tier_disk_tokens)
            if r.tier_host_tokens or r.tier_disk_tokens:
                self.tier_load_s.append(r.tier_load_s)

    def sample(self, engines: Sequence[NodeEngine]) -> None:
        """Every node's KV held by running requests and whether it has a queue, now."""
        for e in engines:
            cache = e.cache
            self.kv_running += cache.used_blocks / cache.num_blocks
            self.waiting += 1 if e.waiting or e.queued else 0
            if e.queued and e.idle:
                self.queue_idle += 1
        self.samples += len(engines)

    def _pulls(self, prompt: np.ndarray, cached: np.ndarray, measured: int) -> dict[str, float]:
        """The KV pulls' figures (module docstring)."""
        pulled = _array(self.pulled, np.int64)
        moved = _array(self.pull_bytes, np.int64)
        outcome = _array(self.pull_outcome, np.int8)
        wait = _array(self.pull_wait, np.float64)
        took = _array(self.pull_s, np.float64)
        total = prompt.sum() if measured else 0
        on_link = int(wait.size)
        return {
            "kv_hit_local": float((cached.sum() - pulled.sum()) / total) if total else 0.0,
            "pulled_frac": float(pulled.sum() / total) if total else 0.0,
            "pulls_per_req": on_link / measured if measured else 0.0,
            "pulls_failed_frac": float((outcome == PULL_FAILED).sum() / on_link) if on_link else 0.0,
            "pulls_partial_frac": float((outcome == PULL_PARTIAL).sum() / on_link) if on_link else 0.0,
            "pull_bytes_per_req": float(moved.mean()) if measured else 0.0,
            "pull_wait_p99_s": _pct(wait, 99) if on_link else 0.0,
            "pull_s_mean": float(took.mean()) if on_link else 0.0,
        }

    def summary(
        self,
        engines: Sequence[NodeEngine],
        *,
        arrived: int,
        last_arrival: float,
        sim_time: float,
        gossip_bytes: int,
        events: int,
    ) -> dict[str, Any]:
        """The run's figures (module docstring); ``sim_time`` is when the last request finished."""
        n_nodes = len(engines)
        ttft = _array(self.ttft, np.float64)
        prompt = _array(self.prompt, np.int64)
        cached = _array(self.cached, np.int64)
        node = _array(self.node, np.int32)
        served = np.bincount(node, minlength=n_nodes) if node.size else np.zeros(n_nodes)
        busy = np.array([e.busy_s for e in engines])
        measured = int(ttft.size)
        out: dict[str, Any] = {
            "requests": arrived,
            "completed": self.completed,
            "dropped": self.dropped,
            # of the requests arriving after the warm-up, those dropped (larger than a node's whole KV cache: they
            # never get a first token, so they are above any TTFT percentile -- ``runner.MAX_DROPPED_FRAC``)
            "dropped_frac": self.dropped_measured / (measured + self.dropped_measured) if self.dropped_measured
            else 0.0,
            "measured": measured,
            "sim_time_s": sim_time,
            "offered_qps": measured / max(1e-9, last_arrival - self.warmup_s) if measured else 0.0,
            "kv_hit": float(cached.sum() / prompt.sum()) if measured and prompt.sum() else 0.0,
            **self._latencies(ttft),
            **self._placement(engines, served, busy, cached, measured),
            "gossip_bytes_per_node_s": gossip_bytes / max(1e-9, sim_time) / n_nodes,
            **self._pulls(prompt, cached, measured),
            "segment_loaded_frac": float(self.loaded / prompt.sum()) if measured and prompt.sum() else 0.0,
            "segment_phases": self.phases / measured if measured else 0.0,
            "kv_running_frac": self.kv_running / self.samples if self.samples else 0.0,
            "waiting_frac": self.waiting / self.samples if self.samples else 0.0,
            "events": events,
            "per_node": {
                "served": served.astype(int).tolist(),
                "busy_s": [round(float(b), 3) for b in busy],
                "evictions": [e.cache.evictions for e in engines],
            },
        }
        if self.tiers:
            out.update(self._tiers(engines, prompt, cached))
        if len(self.classes) > 1:
            out["by_class"] = self._by_class(ttft, prompt, cached)
        if self.flow:
            out.update(self._flow(engines, ttft, last_arrival))
        return out

    def _flow(self, engines: Sequence[NodeEngine], ttft: np.ndarray, last_arrival: float) -> dict[str, Any]:
        """Flow control's figures, per tenant and per priority (module docstring)."""
        m_tenant, m_prio = _array(self.m_tenant, np.int32), _array(self.m_priority, np.int32)
        d_tenant, d_prio = _array(self.d_tenant, np.int32), _array(self.d_priority, np.int32)
        s_tenant, s_prio = _array(self.s_tenant, np.int32), _array(self.s_priority, np.int32)
        m_wait, s_wait = _array(self.m_queue_wait, np.float64), _array(self.s_queue_wait, np.float64)
        work, done = _array(self.d_work, np.float64), _array(self.d_done, np.float64)
        in_window = (done >= self.warmup_s) & (done <= last_arrival)
        window_s = max(1e-9, last_arrival - self.warmup_s)
        total = float(work[in_window].sum())

        def group(m_sel: np.ndarray, d_sel: np.ndarray, s_sel: np.ndarray) -> dict[str, Any]:
            served = float(work[in_window & d_sel].sum())
            n_shed = int(s_sel.sum())
            waits = np.concatenate((m_wait[m_sel], s_wait[s_sel]))
            return {
                "measured": int(m_sel.sum()),
                "ttft_p50_s": _pct(ttft[m_sel], 50),
                "ttft_p99_s": _pct(ttft[m_sel], 99),
                "shed": n_shed,
                "shed_frac": n_shed / (n_shed + int(m_sel.sum())) if n_shed or m_sel.any() else 0.0,
                "served_tokens_share": served / total if total else 0.0,
                "served_tokens_per_s": served / window_s,
                "queue_wait_max_s": float(waits.max()) if waits.size else 0.0,
            }

        by_tenant = {
            name: group(m_tenant == i, d_tenant == i, s_tenant == i) for name, i in self.tenants.items()
        }
        priorities = sorted(set(m_prio.tolist()) | set(s_prio.tolist()))
        by_priority = {str(p): group(m_prio == p, d_prio == p, s_prio == p) for p in priorities}
        waits = np.concatenate((m_wait, s_wait))
        return {
            "shed": int(s_tenant.size),
            "queue_wait_max_s": float(waits.max()) if waits.size else 0.0,
            "queue_idle_frac": self.queue_idle / self.samples if self.samples else 0.0,
            "preemptions": sum(e.preemptions for e in engines),
            "served_tokens_per_s": total / window_s,
            "by_tenant": {name or "default": v for name, v in by_tenant.items()},
            "by_priority": by_priority,
        }

    def _tiers(self, engines: Sequence[NodeEngine], prompt: np.ndarray, cached: np.ndarray) -> dict[str, Any]:
        """The KV tiers' figures (module docstring)."""
        total = int(prompt.sum()) if prompt.size else 0
        host = int(_array(self.tier_host, np.int64).sum())
        disk = int(_array(self.tier_disk, np.int64).sum())
        pulled = int(_array(self.pulled, np.int64).sum())
        waits = _array(self.tier_load_s, np.float64)
        moved = {"host_store": 0, "host_load": 0, "disk_store": 0, "disk_load": 0}
        for e in engines:
            tiers = e.cache.tiers
            if tiers is not None:
                for k, v in tiers.bytes_moved().items():
                    moved[k] += v
        done = max(self.completed, 1)
        return {
            "kv_hit_gpu": (int(cached.sum()) - host - disk - pulled) / total if total else 0.0,
            "kv_hit_host": host / total if total else 0.0,
            "kv_hit_disk": disk / total if total else 0.0,
            "tier_load_s_mean": float(waits.mean()) if waits.size else 0.0,
            "tier_load_s_p99": _pct(waits, 99) if waits.size else 0.0,
            **{f"tier_{k}_bytes_per_req": v / done for k, v in moved.items()},
            "tier_bytes": moved,
        }

    def _latencies(self, ttft: np.ndarray) -> dict[str, float]:
        """TTFT's mean and percentiles, end to end's percentiles."""
        e2e = _array(self.e2e, np.float64)
        return {
            "ttft_mean_s": float(ttft.mean()) if ttft.size else float("nan"),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90),
            "ttft_p99_s": _pct(ttft, 99),
            "e2e_p50_s": _pct(e2e, 50),
            "e2e_p99_s": _pct(e2e, 99),
        }

    def _placement(
        self, engines: Sequence[NodeEngine], served: np.ndarray, busy: np.ndarray, cached: np.ndarray, measured: int
    ) -> dict[str, float]:
        """Where requests went: the spread of requests and work over the nodes, the forwarded share, and how far
        the routers' estimates of cached tokens were from what the engines found."""
        est = _array(self.est, np.int64)
        fwd = _array(self.forwarded, np.int8)
        return {
            "load_imbalance": float(served.max() / served.mean()) if measured else float("nan"),
            "work_imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else float("nan"),
            "idle_nodes": _idle_nodes(engines, served),
            "forwarded_frac": float(fwd.mean()) if measured else 0.0,
            "est_error_tokens": float(np.abs(est - cached).mean()) if measured else 0.0,
            "est_tokens_mean": float(est.mean()) if measured else 0.0,
        }

    def _by_class(self, ttft: np.ndarray, prompt: np.ndarray, cached: np.ndarray) -> dict[str, dict[str, Any]]:
        """Per request class (a workload's mix): how many were measured, their KV hit and p99 TTFT."""
        cls = _array(self.cls, np.int32)
        by_cls = {}
        for name, c in self.classes.items():
            sel = cls == c
            p = prompt[sel].sum()
            by_cls[name or "default"] = {
                "measured": int(sel.sum()),
                "kv_hit": float(cached[sel].sum() / p) if p else 0.0,
                "ttft_p99_s": _pct(ttft[sel], 99),
            }
        return by_cls
