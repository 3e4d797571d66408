"""The platform-prompt scene on real processes: three ``p2pnode serve`` nodes (simulated engines, real gossip, routing
and forwarding), 16 conversations x 3 turns behind one 473-token platform prompt, each turn to a random ingress
(scripts/bench_platform_mesh.py drives it and reports).

On the old code the default ``p2p`` served 0 / 38 / 10 requests per node: every node that had served held the
platform prompt, so they all "matched", and a node that had not served yet never did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_platform_mesh.py"


def test_every_node_serves_and_conversations_stay_with_their_history(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--policies", "p2p,flat", "--json", "--logs", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    runs = {r["policy"]: r for r in json.loads(run.stdout)["runs"]}
    p2p, flat = runs["p2p"], runs["flat"]

    for r in (p2p, flat):
        assert r["failed"] == 0, r["errors"]
        assert sum(r["served"].values()) == r["requests"] == 48
    assert p2p["idle_nodes"] == 0, f"a node never served: {p2p['served']}"
    # A later turn goes where its history is (cache-blind balancing scatters about two in three)...
    assert p2p["stayed"] >= 0.75 and p2p["stayed"] > flat["stayed"], (p2p, flat)
    # ...so the engines reuse more of each prompt than under cache-blind balancing.
    assert p2p["kv_hit"] > flat["kv_hit"], (p2p, flat)
