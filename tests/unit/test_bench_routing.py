"""scripts/bench_routing.py: the table a reader of docs/results.md relies on says what the runs say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_routing.py"


def _module():
    return load_script("bench_routing")


def _row(policy: str, mean: float | None, ci: float = 0.0) -> dict[str, object]:
    return {"policy": policy, "capacity_mean": mean, "capacity_ci95": ci, "capacity": f"{mean} ± {ci}"}


def test_verdict_compares_the_default_with_the_best_baseline_not_the_reference_or_what_ifs() -> None:
    verdict = _module().verdict
    rows = [_row("p2p", 20), _row("dualmap", 18), _row("flat", 10), _row("upper-bound", 30), _row("p2p@w1", 25)]
    assert "beats the best baseline, dualmap" in verdict(rows)
    assert "LOSES to the best baseline, dualmap" in verdict([_row("p2p", 12), _row("dualmap", 18)])
    assert "within the interval of" in verdict([_row("p2p", 17, 1.0), _row("dualmap", 18, 1.0)])
    assert "ties" in verdict([_row("p2p", 18), _row("dualmap", 18)])


def test_quick_run_prints_every_policy_with_its_capacity_as_json() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--only", "whales", "--policies", "p2p,flat", "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    (result,) = json.loads(run.stdout)["workloads"]
    assert result["workload"] == "whales" and result["slo_p99_ttft_s"] == 3.5
    assert [r["policy"] for r in result["rows"]] == ["p2p", "flat"]
    for row in result["rows"]:
        assert row["capacity_mean"] is not None and 0 < row["kv_hit"] <= 1
    assert result["verdict"].startswith("p2p ")


def test_unknown_workload_is_refused_naming_the_valid_ones() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown workload(s) nope" in run.stderr and "platform-chat" in run.stderr
