"""The experiment runner, the report and the ``p2pnode sim`` command, on tiny configurations."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from p2pnode.sim.cli import add_sim_parser, parse_ladder, run_sim
from p2pnode.sim.cluster import SimConfig
from p2pnode.sim.report import aggregate, capacity_text, infeasible_warnings, t_interval
from p2pnode.sim.runner import MAX_DROPPED_FRAC, Experiment, run_experiment
from p2pnode.sim.workloads import Limit, get_workloads


def test_ladder_parsing() -> None:
    assert parse_ladder("20:100:20") == [20, 40, 60, 80, 100]
    assert parse_ladder("0.5:1.5:0.5") == [0.5, 1.0, 1.5]
    assert parse_ladder("30,10") == [10, 30]
    for bad in ("10:5:1", "1:2:0", "x", "0:10:5", "nan", "inf", "1:inf:1", "5,nan"):  # NaN and inf hung a run
        with pytest.raises(argparse.ArgumentTypeError):
            parse_ladder(bad)


def test_capacity_and_confidence_interval() -> None:
    def run(q: float, seed: int, p99: float, skipped: bool = False) -> dict:
        r = {"workload": "w", "policy": "p", "eviction": "lru", "qps": q, "seed": seed, "slo_met": p99 <= 1.0}
        if skipped:
            return {**r, "skipped": True, "slo_met": False}
        return {**r, "ttft_p99_s": p99, **{m: 0.5 for m in ("kv_hit", "ttft_p50_s", "e2e_p99_s", "load_imbalance",
                "work_imbalance", "forwarded_frac", "est_error_tokens", "gossip_bytes_per_node_s", "idle_nodes")}}

    # Seed 1 meets the SLO again at 30 after missing at 20: the capacity is the last rung before the first miss.
    runs = [run(10, 0, 0.2), run(20, 0, 0.9), run(30, 0, 3.0), run(40, 0, 0, skipped=True),
            run(10, 1, 0.3), run(20, 1, 1.5), run(30, 1, 0.8), run(40, 1, 0, skipped=True)]
    a = aggregate(runs, 1.0)["w"]["p"]
    assert a["capacity_per_seed"] == [20, 10]
    _mean, ci = t_interval([20, 10])
    assert (a["capacity_mean"], a["capacity_ci95"]) == (15, ci) and ci == pytest.approx(12.706 * 5)
    assert 40 not in a["ladder"] and a["ladder"][10]["ttft_p99_s"] == pytest.approx(0.25)
    assert not a["capacity_censored"] and not a["infeasible"]
    assert capacity_text(a) == "15 ± 64"


def test_capacity_at_the_top_of_the_ladder_is_a_lower_bound_and_a_miss_at_the_bottom_is_flagged() -> None:
    def run(q: float, p99: float) -> dict:
        metrics = ("kv_hit", "ttft_p50_s", "e2e_p99_s", "load_imbalance", "work_imbalance", "forwarded_frac",
                   "est_error_tokens", "gossip_bytes_per_node_s", "idle_nodes")
        return {"workload": "w", "policy": "p", "eviction": "lru", "qps": q, "seed": 0, "slo_met": p99 <= 1.0,
                "ttft_p99_s": p99, **{m: 0.5 for m in metrics}}

    top = aggregate([run(10, 0.2), run(20, 0.9)], 1.0)["w"]["p"]
    assert top["capacity_censored"] and capacity_text(top) == ">= 20"
    bottom = aggregate([run(10, 2.0), run(20, 5.0)], 1.0)
    assert bottom["w"]["p"]["infeasible"] and capacity_text(bottom["w"]["p"]) == "0 (infeasible)"
    assert infeasible_warnings(bottom, 1.0) and "infeasible" in infeasible_warnings(bottom, 1.0)[0]
    single = aggregate([run(10, 0.2)], 1.0)["w"]["p"]
    assert single["capacity_mean"] is None and capacity_text(single) == "n/a (no ladder)"


@pytest.mark.parametrize("jobs", [1, 3])
def test_runner_stops_a_series_past_its_knee(jobs: int) -> None:
    """With more jobs than series a series runs several rungs at once; those past where patience stops it are
    reported skipped, as in order (they were reported run, changing the rungs' tables and means)."""
    exp = Experiment(
        workloads=get_workloads("mmlu"),
        policies=["flat"],
        evictions=["lru"],
        qps_ladder=[5.0, 10.0, 20.0],
        seeds=[0],
        base=SimConfig(nodes=2, block_size=32).with_routing(cost_profile="tiny-cpu"),
        limit=Limit(duration_s=10.0),
        slo_p99_ttft_s=1e-6,  # nothing meets it
        patience=2,
        jobs=jobs,
    )
    ticks: list[int] = []
    runs = run_experiment(exp, progress=ticks.append)
    assert sum(ticks) == 3
    assert [r.get("skipped", False) for r in sorted(runs, key=lambda r: r["qps"])] == [False, False, True]


def test_a_rung_that_drops_requests_misses_the_slo_and_says_so() -> None:
    """Requests larger than a node's whole KV cache are dropped, never served: they were left out of every figure,
    and a rung dropping 10% of its requests met the SLO ("capacity >= 1" on whales at 4,864 tokens of KV)."""
    exp = Experiment(
        workloads=get_workloads("whales"),
        policies=["p2p"],
        evictions=["lru"],
        qps_ladder=[0.5],
        seeds=[0],
        base=SimConfig(nodes=4, kv_capacity_tokens=4864),
        limit=Limit(duration_s=60.0),
        slo_p99_ttft_s=3.5,
        jobs=1,
    )
    (run,) = run_experiment(exp)
    assert run["dropped_frac"] > MAX_DROPPED_FRAC and run["ttft_p99_s"] <= 3.5  # the served ones alone met it
    assert not run["slo_met"]
    agg = aggregate([run], 3.5)
    assert any("dropped requests larger than a node's whole KV cache" in w for w in infeasible_warnings(agg, 3.5))


def test_cli_end_to_end(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "res"
    args = parser.parse_args(
        ["sim", "--workload", "whales", "--nodes", "3", "--policies", "flat,p2p,cacheroute,upper-bound",
         "--qps-ladder", "10:20:10", "--duration", "20", "--seeds", "2", "--out", str(out), "--jobs", "2", "--quiet"]
    )
    assert run_sim(args) == 0
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4 * 2 * 2
    assert set(data["summary"]["whales"]) == {"flat", "p2p", "cacheroute", "upper-bound"}
    md = (out / "results.md").read_text()
    assert "| p2p |" in md and "SLO capacity" in md
    for stem in ("p99_ttft_whales", "kv_hit_whales", "capacity_whales"):
        assert (out / f"{stem}.png").stat().st_size > 1000


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers(dest="command"))
    bad_trace = tmp_path / "t.jsonl"
    bad_trace.write_text('{"timestamp": 0}\n')
    assert run_sim(parser.parse_args(["sim", "--trace", str(bad_trace), "--out", str(tmp_path)])) == 2
    assert "t.jsonl:1: missing field 'input_length'" in capsys.readouterr().err
    assert run_sim(parser.parse_args(["sim", "--policies", "nope", "--qps-ladder", "1:2:1"])) == 2
    assert "unknown routing policy 'nope'" in capsys.readouterr().err
    assert run_sim(parser.parse_args(["sim", "--workload", "whales"])) == 2
    assert "--qps-ladder is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--duration", "inf"],  # hung
        ["--arrival", "gamma", "--arrival-cv", "inf"],  # ZeroDivisionError
        ["--patience", "-1"],  # skipped every rung after the first
        ["--forward-latency", "-1"],  # negative TTFTs
        ["--gossip-delay", "-5"],  # a traceback from inside the run
        ["--speculative-ttl", "nan"],
    ],
)
def test_cli_refuses_values_that_hung_or_skewed_a_run(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["sim", "--workload", "whales", "--qps-ladder", "1", *flags])
    assert flags[-2] in capsys.readouterr().err


def test_cli_checks_the_configuration_before_its_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A configuration a run would refuse (a disk tier without a host tier) is one line before any run starts, not
    a traceback from each worker."""
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sim", "--workload", "whales", "--qps-ladder", "1", "--disk-kv-tokens", "100000"])
    assert run_sim(args) == 2
    assert "a disk tier needs a host tier" in capsys.readouterr().err
    for flags, said in (
        (["--eviction", ""], "--eviction names no policy"),  # 0 runs, exit 0
        (["--segments", ","], "--segments names no mode"),
        (["--gossip", "agent", "--gossip-delay", "2"], "--gossip-delay applies to --gossip model only"),  # ignored
    ):
        assert run_sim(parser.parse_args(["sim", "--workload", "whales", "--qps-ladder", "1", *flags])) == 2
        assert said in capsys.readouterr().err


def test_arrival_flags_are_refused_where_a_workload_brings_its_own_arrivals() -> None:
    """``--arrival gamma --arrival-cv 4`` gave wakman-mixes and revisit results identical to the digit: ignored."""
    for name in ("revisit", "wakman-mixes", "wakman-mixes/s20-c40-a40"):
        with pytest.raises(ValueError, match="brings its own arrivals"):
            get_workloads(name, arrival="gamma")
        with pytest.raises(ValueError, match="brings its own arrivals"):
            get_workloads(name, cv=4.0)
        assert get_workloads(name, arrival="poisson")  # its own, said aloud
    assert get_workloads("whales", arrival="gamma", cv=4.0)
