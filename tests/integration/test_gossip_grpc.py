"""Gossip over real gRPC on loopback: five agents in this process, each with its own grpc.aio server on 127.0.0.1:0
and a PrefixIndex fed by hand-made BlockStored events (no engine needed: the node core covers the real one).

Join through one seed and converge; a cache change on one node reaches the others' ClusterView; a killed node
(server stopped abruptly, no "left") is declared dead and its estimates stop being used; a restarted node rejoins
with a new generation; outsiders get the documented status codes; mTLS without a cluster secret works. Gossip runs
every 0.1 s so each test takes seconds; nothing asserts timings, conditions are polled with generous deadlines.
"""

from __future__ import annotations

import datetime
import ipaddress
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.events import BlockRemoved, BlockStored
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.gossip import GossipAgent, GossipConfig, MemberState, TlsConfig
from p2pnode.gossip.auth import Authenticator
from p2pnode.gossip.clock import AsyncioClock
from p2pnode.gossip.codec import Syn, encode
from p2pnode.gossip.grpc_transport import GOSSIP_METHOD, GrpcTransport, add_peer_service, server_credentials
from p2pnode.load import NodeLoad
from p2pnode.peering import Peering, peer
from p2pnode.routing.cluster_view import ClusterView
from tests.polling import until

SECRET = b"integration-test cluster secret!"
BS = 16
CONFIG = GossipConfig(
    cluster_secret=SECRET,
    interval_s=0.1,
    fd_initial_interval_s=0.2,
    fd_max_interval_s=1.0,
    rpc_timeout_s=1.0,
    leave_timeout_s=0.5,
)


@dataclass
class Node:
    agent: GossipAgent
    server: grpc.aio.Server
    index: PrefixIndex
    port: int
    peering: Peering

    @property
    def view(self) -> ClusterView:
        return self.peering.view

    @property
    def id(self) -> str:
        return self.agent.self_id

    @property
    def address(self) -> str:
        return self.agent.address

    async def kill(self) -> None:
        """Die abruptly: no 'left', the server gone mid-conversation."""
        await self.server.stop(None)
        await self.agent.stop(leave=False)


async def start_node(
    node_id: str, seeds: list[str], port: int = 0, config: GossipConfig = CONFIG, generation: int | None = None
) -> Node:
    server = grpc.aio.server()
    if config.tls is not None:
        port = server.add_secure_port(f"127.0.0.1:{port}", server_credentials(config.tls))
    else:
        port = server.add_insecure_port(f"127.0.0.1:{port}")
    assert port
    address = f"127.0.0.1:{port}"
    agent = GossipAgent(config, node_id, address, GrpcTransport(config), seeds=seeds, generation=generation)
    index = PrefixIndex(block_size=BS)
    peering = peer(agent, index)
    add_peer_service(server, agent)
    await server.start()
    await agent.start()
    return Node(agent, server, index, port, peering)


def converged(nodes: list[Node]) -> bool:
    for viewer in nodes:
        for owner in nodes:
            copy = viewer.agent.state.node(owner.id)
            own = owner.agent.state.self_node
            if copy is None or (copy.generation, copy.max_version) != (own.generation, own.max_version):
                return False
            if viewer.agent.membership.state(owner.id) is not MemberState.ALIVE:
                return False
    return True


@pytest.fixture
async def mesh() -> AsyncIterator[list[Node]]:
    seed = await start_node("n0", [])
    nodes = [seed] + [await start_node(f"n{i}", [seed.address]) for i in range(1, 5)]
    yield nodes
    for node in nodes:
        if node.agent.running:
            await node.agent.stop(leave=False)
        await node.server.stop(None)


def store(index: PrefixIndex, tokens: list[int], rng: random.Random) -> tuple[int, ...]:
    n = len(tokens) // BS
    engine = tuple(rng.getrandbits(63) for _ in range(n))
    index.apply(BlockStored(engine, None, tuple(tokens[: n * BS]), BS))
    return engine


async def test_five_nodes_join_through_one_seed_and_converge(mesh: list[Node]) -> None:
    for i, node in enumerate(mesh):
        node.peering.load.set(NodeLoad(running=i, kv_usage=0.25, in_flight=i))
    await until(lambda: converged(mesh), "the mesh to converge")
    await until(
        lambda: all(n.view.peer("n3").load is not None for n in mesh), "n3's load to reach everyone"
    )
    for node in mesh:
        members = node.agent.members()
        assert [m.node_id for m in members] == [f"n{i}" for i in range(5)]
        assert all(m.state is MemberState.ALIVE for m in members)
        assert {m.address for m in members} == {n.address for n in mesh}
        assert node.view.peer("n3").load.in_flight == 3
        assert node.agent.stats.internal_errors == 0 and not node.agent.stats.rejected


async def test_a_cache_change_on_one_node_reaches_the_others_cluster_view(mesh: list[Node]) -> None:
    await until(lambda: converged(mesh), "the mesh to converge")
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(BS * 33)]
    chain = block_hashes(tokens, BS)
    engine = store(mesh[2].index, tokens, rng)
    await until(
        lambda: all(n.view.estimate_match_blocks("n2", chain) == 32 for n in mesh),
        "n2's new prefix to reach every ClusterView",
    )
    assert mesh[0].view.estimate_all(chain) == {"n0": 0, "n1": 0, "n2": 32, "n3": 0, "n4": 0}
    mesh[2].index.apply(BlockRemoved(engine[16:]))  # keep the first 16 blocks
    await until(
        lambda: all(n.view.estimate_match_blocks("n2", chain) == 16 for n in mesh),
        "n2's eviction to reach every ClusterView",
    )


async def test_a_killed_node_is_declared_dead_and_its_estimates_are_no_longer_used(mesh: list[Node]) -> None:
    rng = random.Random(8)
    tokens = [rng.randrange(50_000) for _ in range(BS * 8)]
    chain = block_hashes(tokens, BS)
    store(mesh[4].index, tokens, rng)
    await until(
        lambda: all(n.view.estimate_match_blocks("n4", chain) == 8 for n in mesh[:4]),
        "n4's cache to be known",
    )
    await mesh[4].kill()
    survivors = mesh[:4]
    await until(
        lambda: all(n.agent.membership.state("n4") is MemberState.DEAD for n in survivors), "n4 to be declared dead"
    )
    for node in survivors:
        assert node.view.estimate_match_blocks("n4", chain) == 0
        assert "n4" not in node.view.estimate_all(chain)
        assert not node.view.peer("n4").usable
    # each survivor's detector that declared it wrote its verdict (the "down" key): they agree again once it spread
    await until(lambda: converged(survivors), "the survivors to converge")


async def test_a_restarted_node_rejoins_with_a_new_generation(mesh: list[Node]) -> None:
    await until(lambda: converged(mesh), "the mesh to converge")
    old = mesh[3]
    old_generation = old.agent.generation
    await old.kill()
    await until(
        lambda: all(n.agent.membership.state("n3") is MemberState.DEAD for n in mesh if n is not old), "n3 dead"
    )
    new = await start_node("n3", [mesh[0].address], port=old.port, generation=AsyncioClock().wall_ms())
    mesh[3] = new
    assert new.agent.generation > old_generation
    await until(lambda: converged(mesh), "the restarted node to rejoin")
    for node in mesh:
        assert node.view.peer("n3").generation == new.agent.generation


async def test_graceful_leave_is_seen_as_left(mesh: list[Node]) -> None:
    """A node that leaves is LEFT everywhere (not DEAD): its estimates are no longer used, and the
    others go on without it."""
    rng = random.Random(9)
    tokens = [rng.randrange(50_000) for _ in range(BS * 8)]
    chain = block_hashes(tokens, BS)
    store(mesh[1].index, tokens, rng)
    others = [n for n in mesh if n is not mesh[1]]
    await until(
        lambda: converged(mesh) and all(n.view.estimate_match_blocks("n1", chain) == 8 for n in others),
        "the mesh to converge and n1's cache to be known",
    )
    await mesh[1].agent.stop(leave=True)
    await until(lambda: all(n.agent.membership.state("n1") is MemberState.LEFT for n in others), "n1 left")
    for node in others:
        assert node.view.estimate_match_blocks("n1", chain) == 0
        assert "n1" not in node.view.estimate_all(chain)
        assert not node.view.peer("n1").usable
        assert [m.node_id for m in node.agent.members() if m.state is MemberState.ALIVE] == ["n0", "n2", "n3", "n4"]
    assert converged(others)  # the rest of the mesh still agrees


async def test_outsiders_get_the_documented_status_codes_and_are_counted(mesh: list[Node]) -> None:
    target = mesh[0]
    clock = AsyncioClock()

    def sealed(cluster: str, secret: bytes) -> bytes:
        auth = Authenticator(
            cluster_id=cluster, secret=secret, sender_id="outsider", sender_address="127.0.0.1:1",
            sender_generation=1, wall_ms=clock.wall_ms, replay_window_s=60, max_seen_nonces=10,
            max_receive_bytes=1 << 20,
        )  # fmt: skip
        return auth.seal(encode(Syn(())), target.id, target.agent.generation)

    cases = {
        sealed("other-cluster", SECRET): grpc.StatusCode.PERMISSION_DENIED,
        sealed(CONFIG.cluster_id, b"a wrong secret, also 32 bytes..."): grpc.StatusCode.UNAUTHENTICATED,
        b"\xffnot an envelope": grpc.StatusCode.INVALID_ARGUMENT,
        b"\x00" * (CONFIG.max_receive_bytes + 1): grpc.StatusCode.RESOURCE_EXHAUSTED,
    }  # fmt: skip
    replay = sealed(CONFIG.cluster_id, SECRET)
    async with grpc.aio.insecure_channel(target.address) as channel:
        call = channel.unary_unary(GOSSIP_METHOD)
        for data, code in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(data, timeout=5)
            assert info.value.code() == code
        assert await call(replay, timeout=5)  # a valid Syn gets a SynAck...
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(replay, timeout=5)  # ...once
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rejected = target.agent.stats.rejected
    assert dict(rejected) == {"wrong_cluster": 1, "bad_mac": 1, "malformed": 1, "oversized": 1, "replayed": 1}
    await until(lambda: converged(mesh), "the mesh to stay healthy")
    assert all("outsider" not in n.view for n in mesh)


# --- mTLS ----------------------------------------------------------------------------------------------------------


def make_pki(tmp: Path) -> tuple[Callable[[str], TlsConfig], TlsConfig]:
    """A CA and, for any node id, a certificate it signs naming that id (for 127.0.0.1); and a certificate from an
    unrelated CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA256())

    pem = serialization.Encoding.PEM

    def write(prefix: str, ca_name: str, ca_key, node_name: str) -> TlsConfig:
        node_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        node_cert = cert(node_name, node_key, ca_name, ca_key, ca=False)
        (tmp / f"{prefix}-ca.pem").write_bytes(ca_cert.public_bytes(pem))
        (tmp / f"{prefix}-cert.pem").write_bytes(node_cert.public_bytes(pem))
        (tmp / f"{prefix}-key.pem").write_bytes(
            node_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return TlsConfig(tmp / f"{prefix}-cert.pem", tmp / f"{prefix}-key.pem", tmp / f"{prefix}-ca.pem")

    mesh_ca_key = ec.generate_private_key(ec.SECP256R1())

    def node_tls(node_id: str) -> TlsConfig:
        return write(f"mesh-{node_id}", "mesh-ca", mesh_ca_key, node_id)

    return node_tls, write("rogue", "rogue-ca", ec.generate_private_key(ec.SECP256R1()), "rogue-node")


async def test_mtls_without_a_cluster_secret(tmp_path: Path) -> None:
    """Each node's certificate names its node id. A certificate from another CA cannot connect; one from the mesh's
    CA cannot speak as another node id (before, any certificate the CA signed could speak as any id)."""
    node_tls, rogue_tls = make_pki(tmp_path)

    def config(tls: TlsConfig) -> GossipConfig:
        return GossipConfig(
            cluster_secret=None, tls=tls, interval_s=0.1, fd_initial_interval_s=0.2, fd_max_interval_s=1.0
        )

    rogue_config = GossipConfig(cluster_secret=None, tls=rogue_tls, interval_s=0.1)
    nodes = [await start_node("t0", [], config=config(node_tls("t0")))]
    nodes += [await start_node(f"t{i}", [nodes[0].address], config=config(node_tls(f"t{i}"))) for i in (1, 2)]
    rogue = await start_node("rogue", [nodes[0].address], config=rogue_config)
    liar = await start_node("t9", [nodes[0].address], config=config(node_tls("t1")))  # t1's certificate
    try:
        await until(lambda: converged(nodes), "the mTLS mesh to converge")
        await until(lambda: nodes[0].agent.stats.rejected.get("cert_mismatch", 0) >= 3, "t9 to be refused")
        assert all("t9" not in n.view for n in nodes)
        assert [m.node_id for m in liar.agent.members()] == ["t9"]

        def rogue_failures() -> int:  # its calls to the mesh, refused at the TLS handshake
            return sum(v for k, v in rogue.agent.transport.stats.items() if k.startswith("failed:"))

        # Polled, not slept on: the rogue has tried (and failed) several times, so the mesh had every chance to let
        # it in.
        await until(lambda: rogue_failures() >= 5, "the rogue's calls to fail five times")
        assert all("rogue" not in n.view for n in nodes)
        assert [m.node_id for m in rogue.agent.members()] == ["rogue"]
        assert rogue.agent.transport.stats.get("replies", 0) == 0  # not one of its calls was answered
        with pytest.raises(ValueError, match="secret"):
            GossipAgent(GossipConfig(cluster_secret=None), "x", "127.0.0.1:1", GrpcTransport(GossipConfig()))
    finally:
        for node in [*nodes, rogue, liar]:
            await node.agent.stop(leave=False)
            await node.server.stop(None)


@dataclass
class _Dialler:
    """An mTLS node t0, and t1's transport dialling it (what its replies were signed as, in ``answered_as``)."""

    t0: Node
    client: GrpcTransport
    auth: Authenticator
    answered_as: list[frozenset[str] | None]

    async def close(self) -> None:
        await self.client.close(1.0)
        await self.t0.agent.stop(leave=False)
        await self.t0.server.stop(None)


async def _dialler(tmp_path: Path) -> _Dialler:
    node_tls, _ = make_pki(tmp_path)
    config = GossipConfig(cluster_secret=None, tls=node_tls("t1"), interval_s=0.1, rpc_timeout_s=2.0)
    t0 = await start_node("t0", [], config=GossipConfig(cluster_secret=None, tls=node_tls("t0"), interval_s=0.1))
    client = GrpcTransport(config)
    answered_as: list[frozenset[str] | None] = []
    client.bind(lambda data, reply_from, names=None: answered_as.append(names))
    auth = Authenticator(
        cluster_id=config.cluster_id, secret=None, sender_id="t1", sender_address="127.0.0.1:9", sender_generation=1,
        wall_ms=lambda: AsyncioClock().wall_ms(), replay_window_s=60.0, max_seen_nonces=16, max_receive_bytes=1 << 20,
    )  # fmt: skip
    return _Dialler(t0, client, auth, answered_as)


async def test_mtls_a_peer_channel_requires_the_dialled_nodes_certificate(tmp_path: Path) -> None:
    """With per-node certificates a message bound to node X goes only to a server whose certificate names X, and
    its reply counts only as X's. Before, a channel checked the host name alone: any certificate of the mesh's CA at
    X's address (X rescheduled, its address reused) was answered to as X."""
    d = await _dialler(tmp_path)
    try:
        d.client.send(d.t0.address, d.auth.seal(encode(Syn(())), "t0", d.t0.agent.generation))
        await until(lambda: d.client.stats["replies"] == 1, "t0 to answer a message bound to t0")
        assert d.answered_as == [frozenset({"t0"})]  # the reply must be signed as t0
        d.client.send(d.t0.address, d.auth.seal(encode(Syn(())), "t7", 1))  # t7 is not served there
        await until(lambda: d.client.stats["failed:UNAVAILABLE"] == 1, "the handshake with t0 as t7 to fail")
        assert d.client.stats["replies"] == 1 and d.t0.agent.stats.messages_received == 1
    finally:
        await d.close()


async def test_mtls_a_join_probe_counts_only_an_answer_the_asked_nodes_certificate_signs(tmp_path: Path) -> None:
    """A join probe asks an address whether a member deferred past its sender's vouching budget runs there. Sent on
    a channel that checked the host name alone, its answer could be signed as any id: any holder of a certificate of
    the mesh's CA confirmed made-up members, which then got in without spending a budget. The probe now goes on a
    channel that requires the asked node's certificate, and its answer must be signed as that node."""
    from p2pnode.gossip.codec import Hello

    d = await _dialler(tmp_path)
    try:
        d.client.send(d.t0.address, d.auth.seal(encode(Hello()), "", 0), peer_id="t0")  # does t0 run there?
        await until(lambda: d.client.stats["replies"] == 1, "t0 to answer the probe")
        assert d.answered_as == [frozenset({"t0"})]  # its answer counts only signed as t0
        d.client.send(d.t0.address, d.auth.seal(encode(Hello()), "", 0), peer_id="made-up")  # made-up, there?
        await until(lambda: d.client.stats["failed:UNAVAILABLE"] == 1, "the handshake asking for made-up to fail")
        assert d.client.stats["replies"] == 1
    finally:
        await d.close()
