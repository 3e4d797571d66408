"""The rate plan on real processes: four ``p2pnode serve`` nodes (simulated engines, real gossip and planner) under a
load with one key at half the traffic, the planner killed with ``kill -9`` and restarted
(scripts/bench_plan_mesh.py drives it and reports).

On the old code every request of the hot key went to one of its destinations (434 of 434), max/mean served was
2.36, and affinity went off for a plan period after the planner's death and ~38 s after its return.

The phases are shorter than the bench's defaults (75 s warm, 30 s steady, 15 s without the planner, 30 s after its
return: 150 s): affinity comes on ~30 s in (the gate's first verdict), nearly every key is warm by 55 s, a 20 s
window holds ~560 requests (~280 of the hot key), and 10 s without the planner is five plan periods. The hot key's
split leans on its destinations' served work by at most ``cacheroute.FILL_MAX_SHIFT`` (0.05) of a share, so it
stays within 0.1 of the plan's. Its split is judged under each set of destinations that carried at least
``MIN_SEGMENT`` (100) of its requests, and the largest; a plan still without the restarted n1 carries 30-40 in its
first seconds back, where each ingress's rounding alone reaches 0.1 (0.133 seen over 40). Failed in CI on the
uncapped leaning (up to half a piece): 0.102 after the planner's return, the restarted n1 (its cache cold) leaned
away from. Seen in trial runs since: max/mean served 1.05-1.14, the largest segment within 0.06 of its shares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_plan_mesh.py"
#: Seconds of each phase (module docstring): 105 s of load.
PHASES = ["--warm", "55", "--steady", "20", "--killed", "10", "--back", "20"]


def test_hot_key_split_balance_and_affinity_through_planner_restart(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *PHASES, "--json", "--logs", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)

    assert report["crashed"] == []
    assert report["planners_seen"] == ["n1", "n2"], "the planner role moved to n2 and back"
    assert report["affinity_first_on_s"] is not None, "the gate never turned affinity on (half the traffic reuses)"
    off = report["affinity_off_reads"]
    assert report["affinity_off"] == 0, f"a node's plan in force had affinity off after it was on: {off}"
    for window in report["windows"]:  # steady state before the kill, and after the planner's return
        name = window["name"]
        assert window["hot_kb"] >= 2, f"{name}: the hot key (half the traffic) has one destination"
        for destination in window["hot_destinations"]:
            assert window["hot_split"].get(destination, 0) > 0, f"{name}: destination {destination} got none"
        assert window["max_share_error"] <= 0.1, f"{name}: hot key's segments {window['hot_segments']}"
        assert window["max_over_mean"] <= 1.25, f"{name}: served per node {window['served']}"
        assert window["failed"] == 0, f"{name}: {report['errors']}"
