"""`p2pnode generate` and `p2pnode status` reach a node that serves mTLS (they could only dial plaintext,
and such a node requires a client certificate on every service)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from p2pnode.config import EngineConfig, NodeConfig, ServerConfig
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node
from tests.integration.test_gossip_grpc import make_pki


async def cli(*argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "p2pnode", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_generate_and_status_reach_an_mtls_node(tmp_path: Path) -> None:
    node_tls, rogue = make_pki(tmp_path)
    tls = node_tls("secure")
    config = NodeConfig(
        node_id="secure",
        engine=EngineConfig(model=Path("sim"), block_size=32),
        server=ServerConfig(listen="127.0.0.1:0"),
        gossip=GossipConfig(cluster_secret=None, tls=tls),
    )
    node = Node(config, SimEngine(block_size=32, num_blocks=64, max_model_len=1024))
    await node.start()
    try:
        flags = ["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file), "--tls-ca", str(tls.ca_file)]
        code, out, err = await cli("status", "--target", node.address, "--json", *flags)
        assert code == 0, err
        assert json.loads(out)["node_id"] == "secure"
        code, out, err = await cli("generate", "--target", node.address, "--json", "--max-tokens", "3", "hi", *flags)
        assert code == 0, err
        assert json.loads(out)["completion_tokens"] == 3
        # without a certificate, or with one the node's CA did not sign: a one-line error, no traceback
        for bad in ([], ["--tls-cert", str(rogue.cert_file), "--tls-key", str(rogue.key_file),
                         "--tls-ca", str(tls.ca_file)]):
            code, _, err = await cli("status", "--target", node.address, "--timeout", "5", *bad)
            assert code == 1 and "Traceback" not in err and err.startswith("error: UNAVAILABLE"), err
    finally:
        await node.stop()
