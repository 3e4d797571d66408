"""A stream that survives its node, on real processes through the chaos driver (scripts/chaos.py): a mesh of three
simulated nodes of its own (no vLLM engine), one greedy stream per case whose serving node (the peer the driver finds
serving it) is SIGSTOPped or killed -9 after 1 and 20 tokens (the first token and deep into the stream; the
driver's default adds 6). Before: each ended ``UNAVAILABLE ... failed after
streaming N tokens`` and the client lost the request."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

MAX_TOKENS = 64


async def test_a_greedy_stream_whose_node_is_frozen_or_killed_continues_elsewhere_each_token_once(
    chaos: ModuleType, hub: object, tmp_path: Path
) -> None:
    report = await chaos.fault_stream_migration(tmp_path, hub, after=(1, 20), max_tokens=MAX_TOKENS)
    cases = report.extra["cases"]
    assert [(c["signal"], c["after"]) for c in cases] == [(s, n) for s in ("SIGSTOP", "SIGKILL") for n in (1, 20)]
    for case in cases:
        assert case["code"] == "OK", case
        assert case["victim"] and case["migrations"] == 1 and case["served_by"] != case["victim"], case
        # the tokens the victim streamed (at least N) once, then what a fresh greedy request of prompt + those produces
        assert case["seam"] is not None and case["after"] <= case["seam"] < MAX_TOKENS, case
        assert case["tokens"] == MAX_TOKENS and case["completion_tokens"] == MAX_TOKENS, case
        assert case["text_matches"] and case["prompt_tokens_match"], case
    assert report.resumed == len(cases) and report.duplicated == 0
    assert report.extra["ingress_migrations"] == len(cases)
    assert report.crashed == []
