"""Turning runs into results: results.json, a markdown table, and PNG plots.

Aggregation, per (workload, policy, eviction, segment reuse mode), labelled ``POLICY[/EVICTION][/segments=MODE]``
(the eviction when not the default; the mode when some run reused segments: ``p2p/segments=exact``):
- per QPS rung: the mean over seeds of each metric (rungs a series skipped are left out of the means);
- SLO capacity per seed: the last rung before the first miss (a rung whose p99 TTFT is above the SLO, or skipped),
  so a lucky rung above a miss does not count; 0 when the lowest rung misses (``infeasible``: the SLO cannot be met
  even at the lowest load tried), and a lower bound when no rung misses (``censored``: the capacity is at least the
  top rung). Its mean with a 95% confidence interval over seeds (Student's t; no interval with one seed). A ladder
  of one rung (a trace at its own rate) has no capacity (None);
- "at capacity": the metrics at the rung equal to the mean capacity's nearest run rung (the lowest rung if the
  capacity is 0), which is what the table shows beside the capacity.

Plots (matplotlib, optional: without it the report skips them and says so): p99 TTFT vs QPS per policy (log scale,
the SLO as a line), KV hit rate vs QPS per policy, and SLO capacity per policy with its confidence interval.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from p2pnode.config import DEFAULT_SIM_EVICTION, DEFAULT_SIM_SEGMENTS

__all__ = [
    "aggregate", "capacity_text", "infeasible_warnings", "markdown", "seed_capacity", "t_interval", "write_report"
]

# Two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond 30, the normal 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_METRICS = (
    "kv_hit", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "load_imbalance", "work_imbalance", "forwarded_frac",
    "est_error_tokens", "gossip_bytes_per_node_s", "idle_nodes",
)
#: The KV pulls' figures and the KV held by running requests (``metrics.py``): 0 in runs saved before they were
#: measured.
_PULL_METRICS = (
    "kv_hit_local", "pulled_frac", "pulls_per_req", "pulls_failed_frac", "pulls_partial_frac", "pull_bytes_per_req",
    "pull_wait_p99_s", "pull_s_mean", "kv_running_frac", "waiting_frac", "segment_loaded_frac", "segment_phases",
    "dropped_frac",
)


#: The KV tiers' figures (``metrics.py``): in runs with tiers only, so aggregated only where the runs have them.
_TIER_METRICS = (
    "kv_hit_gpu", "kv_hit_host", "kv_hit_disk", "tier_load_s_mean", "tier_load_s_p99", "tier_host_store_bytes_per_req",
    "tier_host_load_bytes_per_req", "tier_disk_store_bytes_per_req", "tier_disk_load_bytes_per_req",
)
#: Flow control's whole-run figures, in runs with it (``metrics.py``); per tenant and priority beside them.
_FLOW_METRICS = ("shed", "queue_idle_frac", "preemptions", "served_tokens_per_s")


def t_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% CI); half-width 0 for fewer than two values."""
    n = len(values)
    if n == 0:
        return float("nan"), 0.0
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return mean, t * math.sqrt(var / n)


def _series_key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    return r["workload"], r["policy"], r["eviction"], r.get("segments", DEFAULT_SIM_SEGMENTS)


def aggregate(runs: Iterable[dict[str, Any]], slo_s: float, order: Sequence[str] = ()) -> dict[str, Any]:
    """Per workload, per policy/eviction: ladder means, capacities per seed and their CI.

    Policies come out in ``order`` (the experiment's), unknown ones after, alphabetically.
    """
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[_series_key(r)].append(r)
    rank = {p: i for i, p in enumerate(order)}
    modes = {key[3] for key in groups}
    by_mode = modes != {DEFAULT_SIM_SEGMENTS}
    out: dict[str, Any] = {}
    mode_rank = {"none": 0, "exact": 1, "approximate": 2}
    for (wl, pol, ev, seg), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], rank.get(kv[0][1], len(rank)), kv[0][:3], mode_rank.get(kv[0][3], 3))
    ):
        ladder = sorted({r["qps"] for r in rs})
        seeds = sorted({r["seed"] for r in rs})
        per_qps = {}
        for q in ladder:
            done = [r for r in rs if r["qps"] == q and not r.get("skipped")]
            if not done:
                continue
            per_qps[q] = {m: sum(r[m] for r in done) / len(done) for m in _METRICS}
            for m in _PULL_METRICS:
                per_qps[q][m] = sum(r.get(m, r["kv_hit"] if m == "kv_hit_local" else 0.0) for r in done) / len(done)
            if all("kv_hit_host" in r for r in done):
                for m in _TIER_METRICS:
                    per_qps[q][m] = sum(r[m] for r in done) / len(done)
            if all("by_tenant" in r for r in done):
                per_qps[q].update(_flow_means(done))
            per_qps[q]["seeds"] = len(done)
        caps: list[float] = []
        censored = infeasible = 0
        for s in seeds:
            cap, reached_top = seed_capacity(sorted((r for r in rs if r["seed"] == s), key=lambda r: r["qps"] or 0.0))
            caps.append(cap)
            censored += reached_top
            infeasible += cap == 0.0
        run_rungs = sorted(per_qps)
        has_ladder = len(ladder) > 1 and None not in ladder
        cap_mean, cap_ci = t_interval(caps) if has_ladder else (None, 0.0)
        at = None
        if run_rungs:
            at = min(run_rungs, key=lambda q: (abs(q - cap_mean), q)) if cap_mean else run_rungs[0]
        label = pol if ev == DEFAULT_SIM_EVICTION else f"{pol}/{ev}"
        if by_mode:
            label += f"/segments={seg}"
        out.setdefault(wl, {})[label] = {
            "policy": pol,
            "eviction": ev,
            "segments": seg,
            "ladder": per_qps,
            "capacity_per_seed": caps if has_ladder else [],
            "capacity_mean": cap_mean,
            "capacity_ci95": cap_ci,
            #: Some seed met the SLO at the top rung: the capacity is at least what is shown.
            "capacity_censored": has_ladder and censored > 0,
            #: Every seed missed the SLO at the lowest rung.
            "infeasible": has_ladder and infeasible == len(seeds),
            "at_capacity_qps": at,
            "at_capacity": per_qps.get(at, {}) if at is not None else {},
        }
    return out


def _flow_means(done: list[dict[str, Any]]) -> dict[str, Any]:
    """Flow control's figures over seeds: means, the longest queue wait (a limit's check) as the maximum."""
    out: dict[str, Any] = {m: sum(r[m] for r in done) / len(done) for m in _FLOW_METRICS}
    out["queue_wait_max_s"] = max(r["queue_wait_max_s"] for r in done)
    for by in ("by_tenant", "by_priority"):
        groups = {g for r in done for g in r[by]}
        out[by] = {}
        for g in sorted(groups):
            rows = [r[by][g] for r in done if g in r[by]]
            out[by][g] = {k: sum(x[k] for x in rows) / len(rows) for k in rows[0] if k != "queue_wait_max_s"}
            out[by][g]["queue_wait_max_s"] = max(x["queue_wait_max_s"] for x in rows)
    return out


def seed_capacity(runs: list[dict[str, Any]]) -> tuple[float, bool]:
    """(the last rung met before the first miss, whether no rung missed) for one seed's runs, lowest rung first."""
    cap = 0.0
    for r in runs:
        if not r.get("slo_met") or r.get("skipped"):
            return cap, False
        cap = float(r["qps"])
    return cap, True


def capacity_text(a: dict[str, Any]) -> str:
    """A capacity as a reader should take it: '>= 16' when censored, 'infeasible' at the lowest rung, 'n/a'."""
    if a["capacity_mean"] is None:
        return "n/a (no ladder)"
    if a["infeasible"]:
        return "0 (infeasible)"
    ci = f" ± {a['capacity_ci95']:.0f}" if a["capacity_ci95"] else ""
    return f"{'>= ' if a['capacity_censored'] else ''}{a['capacity_mean']:.0f}{ci}"


def infeasible_warnings(agg: dict[str, Any], slo_s: float) -> list[str]:
    """One line per workload where some policy cannot meet the SLO even at the lowest rung, and one per policy that
    dropped requests (larger than a node's whole KV cache: never served, counted above the SLO)."""
    out = []
    for wl, pols in agg.items():
        bad = [label for label, a in pols.items() if a["infeasible"]]
        if bad:
            out.append(
                f"{wl}: p99 TTFT <= {slo_s} s is not met at the lowest rung by {', '.join(bad)}: their capacity 0 "
                "only says the SLO is infeasible there -- lower the ladder or raise --slo-p99-ttft"
            )
        for label, a in pols.items():
            dropped = {q: m["dropped_frac"] for q, m in a["ladder"].items() if m.get("dropped_frac")}
            if dropped:
                worst = max(dropped, key=lambda q: dropped[q])
                out.append(
                    f"{wl}: {label} dropped requests larger than a node's whole KV cache at {len(dropped)} rung(s) "
                    f"(up to {dropped[worst]:.1%}, at {_fmt(worst, 1)} QPS): they are never served, and a rung "
                    "dropping more than 1% misses the SLO -- raise --kv-capacity-tokens or shorten the prompts"
                )
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _by_qps_table(
    title: str, pols: dict[str, Any], rungs: list[float], cell: Callable[[dict[str, Any]], str]
) -> list[str]:
    """One row per policy, one column per rung of the ladder: ``cell`` of that rung's metrics ("skipped" if none)."""
    header = "| policy | " + " | ".join(_fmt(q, 0) for q in rungs) + " |"
    lines = ["", title, "", header, "|---|" + "---:|" * len(rungs)]
    for label, a in pols.items():
        cells = ["skipped" if (m := a["ladder"].get(q)) is None else cell(m) for q in rungs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _settings(sim: dict[str, Any], prefix: str = "") -> list[str]:
    """``name=value`` for each of a run's echoed settings, nested ones (its ``routing``) as ``routing.name``; not the
    policy or the seed, which vary by run."""
    out = []
    for k, v in sim.items():
        if k in ("policy", "seed"):
            continue
        out += _settings(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={v}"]
    return out


def markdown(agg: dict[str, Any], slo_s: float, config: dict[str, Any]) -> str:
    lines = ["# Simulation results", ""]
    shown = (
        "workloads", "policies", "evictions", "qps_ladder", "seeds", "limit", "warmup_frac", "block_size", "wall_s"
    )
    lines.append("Config: " + ", ".join(f"{k}={config[k]}" for k in shown if k in config))
    sim = config.get("sim", {})
    if sim:
        lines.append("")
        lines.append("Simulator: " + ", ".join(_settings(sim)))
    lines.append("")
    for line in infeasible_warnings(agg, slo_s):
        lines += [f"**Warning**: {line}", ""]
    for wl, pols in agg.items():
        lines += [
            f"## {wl}", "",
            f"SLO: p99 TTFT <= {slo_s} s. Capacity: the last rung before the first miss ('>=': no rung missed). "
            "Metrics at each policy's capacity rung; idle: nodes that served nothing while another queued.", "",
        ]
        lines.append(
            "| policy | SLO capacity (QPS) | at QPS | KV hit | TTFT p50 (s) | TTFT p99 (s) | load max/mean "
            "| work max/mean | idle nodes | forwarded | gossip KB/s/node |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, a in pols.items():
            m = a["at_capacity"]
            lines.append(
                f"| {label} | {capacity_text(a)} | {_fmt(a['at_capacity_qps'], 0)} "
                f"| {_fmt(m.get('kv_hit'))} | {_fmt(m.get('ttft_p50_s'))} | {_fmt(m.get('ttft_p99_s'))} "
                f"| {_fmt(m.get('load_imbalance'), 2)} | {_fmt(m.get('work_imbalance'), 2)} "
                f"| {_fmt(m.get('idle_nodes'), 1)} | {_fmt(m.get('forwarded_frac'), 2)} "
                f"| {_fmt((m.get('gossip_bytes_per_node_s') or 0) / 1000, 1)} |"
            )
        pulling = {label: a["at_capacity"] for label, a in pols.items() if a["at_capacity"].get("pulls_per_req")}
        if pulling:
            lines += [
                "", "KV pulls at the capacity rung (KV hit = local + pulled; failed: moved nothing, the holder had "
                "evicted the blocks; wait: for the holder's link):", "",
                "| policy | KV hit local | pulled | pulls / request | failed | partial | MB / request | wait p99 (s) "
                "| pull mean (s) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for label, m in pulling.items():
                lines.append(
                    f"| {label} | {_fmt(m['kv_hit_local'])} | {_fmt(m['pulled_frac'])} | {_fmt(m['pulls_per_req'])} "
                    f"| {_fmt(m['pulls_failed_frac'], 2)} | {_fmt(m['pulls_partial_frac'], 2)} "
                    f"| {_fmt(m['pull_bytes_per_req'] / 1e6, 1)} | {_fmt(m['pull_wait_p99_s'], 2)} "
                    f"| {_fmt(m['pull_s_mean'], 3)} |"
                )
        tiered = {label: a["at_capacity"] for label, a in pols.items() if "kv_hit_host" in a["at_capacity"]}
        if tiered:
            lines += [
                "", "KV tiers at the capacity rung (KV hit split by where the tokens came from; bytes moved per "
                "request, warm-up included; load: a loading request's wait for its blocks):", "",
                "| policy | KV hit | gpu | host | disk | pulled | MB stored / request (host, disk) "
                "| MB loaded / request (host, disk) | load mean / p99 (ms) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for label, m in tiered.items():
                lines.append(
                    f"| {label} | {_fmt(m['kv_hit'])} | {_fmt(m['kv_hit_gpu'])} | {_fmt(m['kv_hit_host'])} "
                    f"| {_fmt(m['kv_hit_disk'])} | {_fmt(m['pulled_frac'])} "
                    f"| {_fmt(m['tier_host_store_bytes_per_req'] / 1e6, 1)}, "
                    f"{_fmt(m['tier_disk_store_bytes_per_req'] / 1e6, 1)} "
                    f"| {_fmt(m['tier_host_load_bytes_per_req'] / 1e6, 1)}, "
                    f"{_fmt(m['tier_disk_load_bytes_per_req'] / 1e6, 1)} "
                    f"| {_fmt(m['tier_load_s_mean'] * 1e3, 1)} / {_fmt(m['tier_load_s_p99'] * 1e3, 1)} |"
                )
        lines += _flow_table(pols)
        rungs = sorted({q for a in pols.values() for q in a["ladder"]})
        if len(rungs) > 1:
            lines += _by_qps_table(
                "KV hit / p99 TTFT (s) by QPS:", pols, rungs, lambda m: f"{m['kv_hit']:.2f} / {m['ttft_p99_s']:.2f}"
            )
            lines += _by_qps_table(
                "KV held by running requests / share of time a node queued, by QPS (sampled every second on every "
                "node):", pols, rungs, lambda m: f"{m['kv_running_frac']:.2f} / {m['waiting_frac']:.2f}",
            )
        lines.append("")
    return "\n".join(lines)


def _flow_table(pols: dict[str, Any]) -> list[str]:
    """Per tenant and per priority at the capacity rung, in runs with flow control (none without)."""
    flowing = {label: a["at_capacity"] for label, a in pols.items() if "by_tenant" in a["at_capacity"]}
    if not flowing:
        return []
    lines = [
        "", "Tenants and priorities at the capacity rung (served share: of the token work finished while arrivals "
        "came; shed: answered unserved from an admission queue; wait: the longest in one):", "",
        "| policy | group | measured | TTFT p50 (s) | TTFT p99 (s) | served share | shed | wait max (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, m in flowing.items():
        groups = [(f"tenant {t}", g) for t, g in m["by_tenant"].items()]
        groups += [(f"priority {p}", g) for p, g in m["by_priority"].items()]
        for name, g in groups:
            lines.append(
                f"| {label} | {name} | {_fmt(g['measured'], 0)} | {_fmt(g['ttft_p50_s'], 2)} "
                f"| {_fmt(g['ttft_p99_s'], 2)} | {_fmt(g['served_tokens_share'])} | {_fmt(g['shed'], 0)} "
                f"| {_fmt(g['queue_wait_max_s'], 1)} |"
            )
    return lines


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


_MARKERS = "osD^v<>ph*"


def _style(i: int) -> dict[str, Any]:
    """The ``i``-th policy's line: the darker shades of tab20 first, then the lighter ones, and a marker."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20").colors
    return {"color": colors[(2 * i) % 20 + (2 * i) // 20 % 2], "marker": _MARKERS[i % len(_MARKERS)], "ms": 3}


def plot(agg: dict[str, Any], slo_s: float, out: Path) -> list[Path]:
    """Write the PNGs; returns their paths (empty when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[Path] = []
    for wl, pols in agg.items():
        stem = _safe(wl)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _per_rung(ax, pols, "ttft_p99_s")
        ax.axhline(slo_s, color="k", ls="--", lw=1, label=f"SLO {slo_s}s")
        ax.set_yscale("log")
        ax.set_ylabel("p99 TTFT (s)")
        ax.set_title(f"{wl}: p99 TTFT vs load")
        written.append(_save(plt, fig, ax, out / f"p99_ttft_{stem}.png"))

        fig, ax = plt.subplots(figsize=(7, 4.5))
        _per_rung(ax, pols, "kv_hit")
        ax.set_ylim(0, 1)
        ax.set_ylabel("KV hit rate (token-weighted)")
        ax.set_title(f"{wl}: served KV hit rate")
        written.append(_save(plt, fig, ax, out / f"kv_hit_{stem}.png"))

        fig, ax = plt.subplots(figsize=(7, 4.5))
        _capacities(ax, pols, slo_s)
        ax.set_title(f"{wl}: SLO capacity (95% CI over seeds)")
        written.append(_save(plt, fig, None, out / f"capacity_{stem}.png"))
    return written


def _per_rung(ax: Any, pols: dict[str, Any], metric: str) -> None:
    """One line per policy: ``metric`` at each rung of its ladder."""
    for i, (label, a) in enumerate(pols.items()):
        qs = sorted(a["ladder"])
        ax.plot(qs, [a["ladder"][q][metric] for q in qs], label=label, **_style(i))
    ax.set_xlabel("offered load (QPS)")


def _capacities(ax: Any, pols: dict[str, Any], slo_s: float) -> None:
    """One bar per policy: its mean SLO capacity with its interval, and each seed's as a dot."""
    labels = list(pols)
    means = [pols[k]["capacity_mean"] or 0.0 for k in labels]
    cis = [pols[k]["capacity_ci95"] for k in labels]
    low = [min(c, m) for c, m in zip(cis, means, strict=True)]  # a capacity is never negative
    bar_colors = [_style(i)["color"] for i in range(len(labels))]
    ax.bar(range(len(labels)), means, yerr=[low, cis], capsize=4, color=bar_colors)
    for i, k in enumerate(labels):
        seeds = pols[k]["capacity_per_seed"]
        ax.plot([i] * len(seeds), seeds, "k.", ms=4)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"SLO capacity (QPS at p99 TTFT <= {slo_s}s)")


def _save(plt: Any, fig: Any, legend_ax: Any, path: Path) -> Path:
    """``fig`` written to ``path`` (with ``legend_ax``'s legend, when given) and closed."""
    if legend_ax is not None:
        legend_ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(runs: list[dict[str, Any]], slo_s: float, config: dict[str, Any], out: Path) -> dict[str, Any]:
    """results.json, results.md and the plots under ``out``; returns the aggregate."""
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(runs, slo_s, config.get("policies", ()))
    (out / "results.json").write_text(
        json.dumps({"config": config, "summary": agg, "runs": runs}, indent=1, default=str, allow_nan=True)
    )
    md = markdown(agg, slo_s, config)
    pngs = plot(agg, slo_s, out)
    if not pngs:
        md += "\n(matplotlib is not installed: no plots)\n"
    (out / "results.md").write_text(md)
    return agg
