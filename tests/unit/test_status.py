"""``p2pnode status``: ``--json`` in the shape ``generate --json`` uses (snake_case, 64-bit integers as numbers), and
each member's engine prefix-cache hit rate, KV holding cached prefixes, versions and served names (before: camelCase,
integers as strings, none of those, and a KV column of 0% whenever the node was idle)."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from p2pnode.client import status_command
from p2pnode.node import Node
from p2pnode.node_info import engine_version, package_version
from tests.polling import until
from tests.unit.sim_nodes import BLOCK, make_node


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Node, Node]]:
    b = make_node("B", mesh=True, served_model_names=("tiny", "alias"))
    await b.start()
    a = make_node("A", mesh=True, seeds=(b.address,), served_model_names=("tiny", "alias"))
    await a.start()
    yield a, b
    for n in (a, b):
        await n.stop(leave=False)


async def status_json(node: Node, capsys: pytest.CaptureFixture[str]) -> dict:
    args = argparse.Namespace(target=node.address, timeout=10.0, json=True, api_key=None, tls_cert=None,
                              tls_key=None, tls_ca=None, tls_server_name=None)
    assert await status_command(args) == 0
    return json.loads(capsys.readouterr().out)


async def test_status_json_is_snake_case_with_numbers_and_shows_every_members_engine(
    pair: tuple[Node, Node], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pair
    async with httpx.AsyncClient(base_url=f"http://{b.http.address}", timeout=30) as http:
        reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * (4 * BLOCK), "max_tokens": 1})
        assert reply.status_code == 200

    async def b_seen_from_a() -> tuple[dict, dict] | None:
        status = await status_json(a, capsys)
        member = next((m for m in status["members"] if m["node_id"] == "B" and m["kv_cached"] > 0), None)
        return (status, member) if member is not None else None

    status, member = await until(b_seen_from_a, "B's next load report (once a second) to reach A")
    assert "requests_total" in status and "requestsTotal" not in status
    assert isinstance(status["requests_total"], int) and isinstance(member["generation"], int)
    assert status["served_model_names"] == ["tiny", "alias"] and status["version"] == package_version("p2pnode")
    assert status["engine_version"] == engine_version() and "prefix_cache_hit_rate" in status["load"]
    assert member["served_model_names"] == ["tiny", "alias"] and member["version"] == package_version("p2pnode")
    assert 0 < member["kv_cached"] <= 1 and member["kv_usage"] == 0  # idle: nothing running, its cache still full


def test_the_host_tier_line_says_what_it_holds_and_moved(capsys: pytest.CaptureFixture[str]) -> None:
    from p2pnode.client import _print_tier
    from p2pnode.v1 import node_pb2

    _print_tier(node_pb2.TierStatus())  # no tier: no line
    assert capsys.readouterr().out == ""
    _print_tier(node_pb2.TierStatus(
        host_bytes=16 << 20, host_blocks=40, host_used_bytes=40 << 15, host_indexed_blocks=38, stored_blocks=90,
        evicted_blocks=50, loads=3, loaded_tokens=768, load_bytes=786432, load_seconds=0.012, store_threshold=1,
        store_outputs=True, eviction="lru", exports=1,
    ))
    line = capsys.readouterr().out
    assert "host kv tier: 1.2 of 16 MiB (40 blocks, 38 indexed" in line
    assert "loads 3 (768 tokens" in line and "exports 1" in line and "disk kv tier" not in line
    _print_tier(node_pb2.TierStatus(
        host_bytes=16 << 20, disk_bytes=16 << 30, disk_blocks=12, disk_load_bytes=2_000_000, disk_failures=1,
    ))
    assert "disk kv tier: bound 16.0 GiB (12 blocks indexed)  read 2.0 MB" in capsys.readouterr().out
