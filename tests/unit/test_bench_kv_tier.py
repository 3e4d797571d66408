"""scripts/bench_kv_tier.py: the checks under its tables say what the runs say."""

from __future__ import annotations

from typing import Any

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kv_tier")


def _row(policy: str, capacity: float, hits: dict[str, float] | None = None, lowest: float = 0.3) -> dict[str, Any]:
    return {
        "policy": policy, "capacity_mean": capacity, "capacity_ci95": 0.0, "capacity": f"{capacity:g}",
        "censored": False, "infeasible": False, "kv_hit_lowest": lowest,
        "by_qps": {q: {"kv_hit": h} for q, h in (hits or {}).items()},
    }  # fmt: skip


def _result(workload: str, tiered: float, plain: float, oracle: float, hit: float, oracle_hit: float,
            baseline: float, full: tuple[float, float] = (20.0, 20.0)) -> dict[str, Any]:  # fmt: skip
    return {
        "workload": workload, "reference_qps": 14.0, "ladder": [10.0, 11.0, 12.0], "full_ladder": [10.0, 12.0],
        "no_tier": {"rows": [_row("p2p", plain)]},
        "tier": {"rows": [_row("p2p", tiered, {"14": hit}), _row("dualmap", baseline)]},
        "oracle": {"capacity_mean": oracle, "capacity_ci95": 0.0, "by_qps": {"14": {"kv_hit": oracle_hit}}},
        "full_no_tier": {"rows": [_row("p2p", full[0], lowest=0.35)]},
        "full_tier": {"rows": [_row("p2p", full[1], lowest=0.345)]},
    }  # fmt: skip


def test_every_target_is_checked_and_can_fail(bench) -> None:
    good = bench.checks(_result("platform-chat", 16, 14, 16.5, 0.30, 0.32, 15))
    assert len(good) == 5 and all(c["met"] for c in good)
    bad = bench.checks(_result("platform-chat", 15, 14, 16.5, 0.28, 0.32, 15.5, full=(20, 17)))
    assert not any(c["met"] for c in bad if "within 1 point" not in c["check"])
    assert [c["met"] for c in bad if "within 1 point" in c["check"]] == [True]  # 0.345 against 0.35


def test_tool_agent_is_judged_against_itself_without_a_tier(bench) -> None:
    checks = bench.checks(_result("tool-agent", 65, 50, 80, 0.84, 0.85, 60))
    gain = next(c for c in checks if "its own without a tier" in c["check"])
    assert gain["met"] and "1.30x" in gain["figure"]
    assert not any("oracle's minus one rung" in c["check"] for c in checks)
    short = bench.checks(_result("tool-agent", 64, 50, 80, 0.84, 0.85, 60))
    assert not next(c for c in short if "its own without a tier" in c["check"])["met"]


def test_a_ladder_of_its_own_per_workload(bench) -> None:
    ladders = bench.parse_ladders(["platform-chat=12:14:1", "tool-agent=40:60:10"], "--ladder")
    assert ladders == {"platform-chat": (12.0, 13.0, 14.0), "tool-agent": (40.0, 50.0, 60.0)}
    case = bench.quarter_case("platform-chat", False, ladders["platform-chat"])
    default = bench.quarter_case("platform-chat", False)
    assert case.ladder == (12.0, 13.0, 14.0) and case.duration_s == default.duration_s != 0
    for bad in ("platform-chat", "mmlu=1:2:1", "tool-agent=40:60"):
        with pytest.raises(SystemExit):
            bench.parse_ladders([bad], "--ladder")
