"""The HTTP front on a node without a vLLM engine: it starts and serves its operators' endpoints without importing
vLLM (~7 s of CPU here, which every simulated node of a mesh paid before it was ready), and the first call that reads
a body loads vLLM's types off the node's event loop: the node answers meanwhile, and the call is then served."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator

import httpx
import pytest

from p2pnode.api.http import server
from p2pnode.node import Node
from tests.unit.sim_nodes import make_node

_STARTS_WITHOUT_VLLM = """
import asyncio, sys
import httpx
from tests.unit.sim_nodes import make_node

async def main():
    node = make_node()
    await node.start()
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=60) as http:
        codes = [(await http.get(path)).status_code for path in ("/health", "/ready", "/metrics", "/load", "/ping")]
        bad = (await http.post("/v1/completions", content=b"{not json")).status_code
        version = (await http.get("/version")).json()["version"]
    await node.stop()
    print(codes, bad, sorted(m for m in ("vllm", "torch") if m in sys.modules))
    print(version)

asyncio.run(main())
"""


def test_a_simulated_nodes_front_serves_without_importing_vllm() -> None:
    """A node on the simulated engine starts its HTTP front and answers health, readiness, metrics, load, ping and a
    malformed body (refused before any type is needed) and its vLLM version with neither vLLM nor torch imported."""
    out = subprocess.run([sys.executable, "-c", _STARTS_WITHOUT_VLLM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    served, version = out.stdout.strip().splitlines()[-2:]
    assert served == "[200, 200, 200, 200, 200] 400 []"
    from vllm.version import __version__  # (this process may import it)

    assert version == __version__  # /version from the package's metadata, as vLLM itself says it


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    node = make_node()
    await node.start()
    yield node
    await node.stop()


async def test_the_node_answers_while_a_first_call_loads_vllms_types(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the first call's import of vLLM's types runs (held here until the node has answered another call), the
    node's loop serves: the health check answers; then the held call is served in full."""
    loaded = await server.vllm_protocol()  # the real types (loaded now if no test has yet)
    monkeypatch.delitem(sys.modules, server._PROTOCOL)  # as on a node that has not loaded them (put back after)
    started, release = threading.Event(), threading.Event()

    def slow_import(name: str) -> object:
        assert name == server._PROTOCOL
        started.set()
        assert release.wait(30)
        sys.modules[name] = loaded
        return loaded

    monkeypatch.setattr(server.importlib, "import_module", slow_import)
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
        first = asyncio.create_task(
            http.post("/v1/completions", json={"model": "sim", "prompt": "hello", "max_tokens": 3})
        )
        assert await asyncio.to_thread(started.wait, 30)
        assert (await http.get("/health")).status_code == 200  # the loop is not held by the import
        assert not first.done()
        release.set()
        reply = await first
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["text"]) == 3
