"""Signed envelopes and hostile input: wrong cluster, bad MAC, replay, stale, oversized and malformed messages are
refused with the documented reason, counted by the agent, and never crash it or change its state."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.gossip import GossipAgent, GossipConfig, InMemoryNetwork, SimClock
from p2pnode.gossip.auth import Authenticator, NonceCache, Rejected, RejectReason, derive_key, tls_peer_names
from p2pnode.gossip.codec import PROTOCOL_VERSION, MalformedMessage, Syn, decode, encode
from p2pnode.gossip.digest import NodeDigest
from p2pnode.v1 import peer_pb2

SECRET = b"0123456789abcdef0123456789abcdef"


def make_auth(
    clock: SimClock,
    *,
    sender: str = "a",
    cluster: str = "c1",
    secret: bytes | None = SECRET,
    max_nonces: int = 1000,
    generation: int = 7,
) -> Authenticator:
    return Authenticator(
        cluster_id=cluster,
        secret=secret,
        sender_id=sender,
        sender_address=f"{sender}:1",
        sender_generation=generation,
        wall_ms=clock.wall_ms,
        replay_window_s=60.0,
        max_seen_nonces=max_nonces,
        max_receive_bytes=4096,
    )


def test_seal_then_open_returns_the_sender_and_payload() -> None:
    clock = SimClock()
    env = make_auth(clock, sender="b").open(make_auth(clock).seal(b"hello", "b", 7))
    assert (env.sender_id, env.sender_address, env.sender_generation, env.payload) == ("a", "a:1", 7, b"hello")


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda e: setattr(e, "payload", b"other"), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "sender_id", "mallory"), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "sender_address", "evil:1"), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "timestamp_ms", e.timestamp_ms + 1), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "nonce", b"x" * 16), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "mac", b""), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "receiver_id", "c"), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "receiver_generation", 8), RejectReason.BAD_MAC),
        (lambda e: setattr(e, "cluster_id", "c2"), RejectReason.WRONG_CLUSTER),
        (lambda e: setattr(e, "version", 1), RejectReason.MALFORMED),  # the first, unbound envelope format
        (lambda e: setattr(e, "version", 2), RejectReason.MALFORMED),  # bound to the receiver's id only
        (lambda e: setattr(e, "version", 4), RejectReason.MALFORMED),
    ],
)
def test_every_field_is_covered(tamper, reason: RejectReason) -> None:
    clock = SimClock()
    env = peer_pb2.GossipEnvelope.FromString(make_auth(clock).seal(b"payload", "b", 7))
    tamper(env)
    with pytest.raises(Rejected) as info:
        make_auth(clock, sender="b").open(env.SerializeToString())
    assert info.value.reason is reason


def test_an_envelope_is_accepted_by_its_receiver_only_and_once() -> None:
    """Unbound, a captured envelope from a to b was accepted once by every node (the MAC did not cover the
    receiver, nonce caches are per node). Now b takes it once, c and a refuse it, and nobody takes a's own id."""
    clock = SimClock()
    a, b, c = make_auth(clock, sender="a"), make_auth(clock, sender="b"), make_auth(clock, sender="c")
    data = a.seal(b"forward me", "b", 7)
    assert b.open(data).receiver_id == "b"
    reasons = []
    for node in (b, c, a):
        with pytest.raises(Rejected) as info:
            node.open(data)
        reasons.append(info.value.reason)
    assert reasons == [RejectReason.REPLAYED, RejectReason.WRONG_RECEIVER, RejectReason.WRONG_RECEIVER]
    with pytest.raises(Rejected) as info:  # signed by a secret holder as b, for b
        b.open(make_auth(clock, sender="b").seal(b"x", "b", 7))
    assert info.value.reason is RejectReason.OWN_SENDER
    unbound = a.seal(b"hello?", "", 0)
    with pytest.raises(Rejected) as info:
        c.open(unbound)
    assert info.value.reason is RejectReason.WRONG_RECEIVER
    assert c.open(unbound, allow_unbound=True).receiver_id == ""  # only the gossip Hello asks for this


def test_an_envelope_sealed_for_an_earlier_life_of_its_receiver_is_refused() -> None:
    """Before: a Forward captured on its way to b was served again by b restarted under the same id within the
    replay window (the nonce cache, in memory, started empty; the MAC did not name the receiver's life). Now the
    envelope names b's generation: the restarted b (generation 8) refuses it, whatever its nonce cache holds."""
    clock = SimClock()
    a, b = make_auth(clock, sender="a"), make_auth(clock, sender="b", generation=7)
    captured = a.seal(b"forward me", "b", 7)
    assert b.open(captured).receiver_generation == 7
    restarted = make_auth(clock, sender="b", generation=8)
    clock.advance(5.0)  # well inside the replay window
    with pytest.raises(Rejected) as info:
        restarted.open(captured)
    assert info.value.reason is RejectReason.WRONG_GENERATION
    assert info.value.code == "UNAUTHENTICATED"  # a forward refused so is retried on the next node
    assert "generation 7" in str(info.value) and "generation 8" in str(info.value)
    assert restarted.open(a.seal(b"forward me", "b", 8)).payload == b"forward me"  # sealed for this life: taken
    with pytest.raises(Rejected) as info:  # a Hello is unbound: no id, no generation; one with a generation is not
        restarted.open(a.seal(b"hello?", "", 7), allow_unbound=True)
    assert info.value.reason is RejectReason.WRONG_RECEIVER


def test_with_mtls_the_sender_id_must_be_named_by_the_callers_certificate() -> None:
    """Before: any certificate the CA signed could speak as any node id. The names come from gRPC's auth context."""
    clock = SimClock()
    receiver = make_auth(clock, sender="b", secret=None)
    sender = make_auth(clock, sender="a", secret=None)
    assert receiver.open(sender.seal(b"x", "b", 7), peer_names=frozenset({"a", "a.mesh.local"})).sender_id == "a"
    for names in (frozenset({"c"}), frozenset()):
        with pytest.raises(Rejected) as info:
            receiver.open(sender.seal(b"x", "b", 7), peer_names=names)
        assert info.value.reason is RejectReason.CERT_MISMATCH
    assert receiver.open(sender.seal(b"x", "b", 7), peer_names=None).sender_id == "a"  # binding off: not checked
    context = {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [b"a"],
        "x509_subject_alternative_name": [b"a.mesh.local", b"127.0.0.1"],
        "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----..."],
    }
    assert tls_peer_names(context) == frozenset({"a", "a.mesh.local", "127.0.0.1"})
    assert tls_peer_names({"transport_security_type": [b"insecure"]}) is None


def test_reasons_map_to_grpc_codes() -> None:
    assert RejectReason.WRONG_CLUSTER.grpc_code == "PERMISSION_DENIED"
    assert RejectReason.BAD_MAC.grpc_code == "UNAUTHENTICATED"
    assert RejectReason.REPLAYED.grpc_code == "UNAUTHENTICATED"
    assert RejectReason.MALFORMED.grpc_code == "INVALID_ARGUMENT"
    assert RejectReason.OVERSIZED.grpc_code == "RESOURCE_EXHAUSTED"
    assert RejectReason.WRONG_GENERATION.grpc_code == "UNAUTHENTICATED"
    assert RejectReason.CERT_MISMATCH.grpc_code == "UNAUTHENTICATED"
    assert RejectReason.IDENTITY_CONFLICT.grpc_code == "ALREADY_EXISTS"


def test_wrong_secret_and_other_cluster() -> None:
    clock = SimClock()
    receiver = make_auth(clock, sender="b")
    with pytest.raises(Rejected) as info:
        receiver.open(make_auth(clock, secret=b"another secret of 32 bytes......").seal(b"x", "b", 7))
    assert info.value.reason is RejectReason.BAD_MAC
    with pytest.raises(Rejected) as info:
        receiver.open(make_auth(clock, cluster="c2").seal(b"x", "b", 7))
    assert info.value.reason is RejectReason.WRONG_CLUSTER
    assert derive_key(SECRET, "c1") != derive_key(SECRET, "c2")


def test_replay_and_stale_timestamps_are_refused() -> None:
    clock = SimClock()
    sender, receiver = make_auth(clock), make_auth(clock, sender="b")
    data = sender.seal(b"x", "b", 7)
    receiver.open(data)
    with pytest.raises(Rejected) as info:
        receiver.open(data)
    assert info.value.reason is RejectReason.REPLAYED
    old = sender.seal(b"y", "b", 7)
    clock.advance(61.0)
    with pytest.raises(Rejected) as info:
        receiver.open(old)
    assert info.value.reason is RejectReason.STALE


def test_nonce_cache_is_bounded_without_opening_a_replay_hole() -> None:
    cache = NonceCache(max_entries=3, window_ms=60_000)
    for i in range(5):
        assert cache.check_and_add(bytes([i]) * 16, timestamp_ms=1000 + i, now_ms=1010)
    assert len(cache) == 3
    assert cache.floor_ms == 1001
    # nonce 0 and 1 were forgotten for lack of room: their envelopes (ts <= floor) are refused anyway
    assert not cache.check_and_add(bytes([0]) * 16, timestamp_ms=1000, now_ms=1010)
    assert not cache.check_and_add(bytes([9]) * 16, timestamp_ms=1001, now_ms=1010)
    assert cache.check_and_add(bytes([9]) * 16, timestamp_ms=1002, now_ms=1010)
    # entries older than the window expire (the timestamp check refuses their replays)
    cache.check_and_add(b"z" * 16, timestamp_ms=200_000, now_ms=200_000)
    assert len(cache) == 1


def test_one_envelope_dated_ahead_does_not_make_a_full_cache_refuse_honest_ones() -> None:
    """Forgotten by arrival, an envelope dated near the window's future edge set the floor there when the cache
    filled: the node refused every honest envelope (gossip and forwards) for about a minute."""
    now = 1_700_000_000_000
    cache = NonceCache(max_entries=1000, window_ms=60_000)
    assert cache.check_and_add(b"ahead".ljust(16, b"."), now + 59_000, now)  # inside the window: accepted
    for i in range(1000):  # the cache fills with current envelopes
        assert cache.check_and_add(i.to_bytes(16, "big"), now + i, now + i)
    for dt in (1_000, 30_000, 58_000):
        assert cache.check_and_add(f"honest{dt}".encode().ljust(16, b"."), now + dt, now + dt)
    assert len(cache) <= 1000


def test_a_replay_is_refused_after_the_receivers_clock_steps_back() -> None:
    """A nonce that left the window used to leave no trace: once the receiver's wall clock stepped back, the
    captured envelope's timestamp was inside the window again and its nonce unknown: accepted a second time."""
    clock = SimClock()
    sender, receiver = make_auth(clock), make_auth(clock, sender="b")
    step_ms = 0
    receiver._wall_ms = lambda: clock.wall_ms() + step_ms  # the receiver's own wall clock
    captured = sender.seal(b"forward me", "b", 7)
    assert receiver.open(captured).payload == b"forward me"
    clock.advance(61.0)
    receiver.open(sender.seal(b"later", "b", 7))  # the captured nonce leaves the cache
    step_ms = -30_000  # NTP steps the receiver's clock back
    with pytest.raises(Rejected) as info:
        receiver.open(captured)
    assert info.value.reason is RejectReason.REPLAYED


def test_oversized_and_garbage_envelopes() -> None:
    clock = SimClock()
    receiver = make_auth(clock, sender="b")
    with pytest.raises(Rejected) as info:
        receiver.open(make_auth(clock).seal(b"x" * 5000, "b", 7))
    assert info.value.reason is RejectReason.OVERSIZED
    big = make_auth(clock).seal(b"x" * 5000, "b", 7)
    assert receiver.open(big, max_bytes=8192).payload == b"x" * 5000  # e.g. a forwarded prompt
    for garbage in (b"\xff" * 10, b"\x0a\x05abc", b""):
        with pytest.raises(Rejected) as info:
            receiver.open(garbage)
        assert info.value.reason is RejectReason.MALFORMED


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_open_never_raises_anything_but_rejected(data: bytes) -> None:
    with pytest.raises(Rejected):
        make_auth(SimClock(), sender="b").open(data)


def _packs() -> st.SearchStrategy:
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.binary(max_size=8),
        st.text(max_size=8),
        st.floats(allow_nan=False),
    )
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=9), max_leaves=40)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        _packs().map(lambda o: msgpack.packb([PROTOCOL_VERSION, *o] if isinstance(o, list) else o)),
    )
)
def test_decode_never_raises_anything_but_malformed(data: bytes) -> None:
    with contextlib.suppress(MalformedMessage):
        decode(data, 4096)


def test_decode_validates_structure() -> None:
    good = encode(Syn((NodeDigest("a", 1, 2, 3, 0),)))
    assert decode(good, 4096) == Syn((NodeDigest("a", 1, 2, 3, 0),))
    bad = [
        msgpack.packb([2, 0, 0, ["a", 1, -1, 3, 0]]),  # negative
        msgpack.packb([2, 0, 5, ["a", -6, 2, 3, 0]]),  # a generation below 0 once its offset is added
        msgpack.packb([2, 0, 5, ["a", (1 << 64) - 5, 2, 3, 0]]),  # ... or past 64 bits
        msgpack.packb([2, 0, 1 << 63, ["a", 1, 2, 3, 0]]),  # a base past 2**63
        msgpack.packb([2, 0, 0, ["a", 1.0, 2, 3, 0]]),  # an offset not an integer
        msgpack.packb([2, 0, -1, []]),  # a negative base
        msgpack.packb([2, 0, 0, ["a", 1, 2, 3]]),  # a digest entry short
        msgpack.packb([2, 0, 0, [["a", 1, 2, 3, 0]]]),  # version 1's nested entries in version 2
        msgpack.packb([1, 0, ["a", 1, 2, 3, 0]]),  # and version 2's flat ones in version 1
        msgpack.packb([1, 0, [["a", -1, 2, 3, 0]]]),  # version 1, a negative generation
        msgpack.packb([1, 0, 0, [["a", 1, 2, 3, 0]]]),  # version 1 has no base
        msgpack.packb([2, 0, 0, ["", 1, 2, 3, 0]]),  # empty id
        msgpack.packb([2, 2, 0, [["a", 1, 0, 0, 5, 0, False, ["k", 0, b""]]]]),  # version step 0
        msgpack.packb([2, 2, 0, [["a", 1, 0, 0, 1, 0, False, ["k", 2, b""]]]]),  # beyond to_version
        msgpack.packb([2, 2, 0, [["a", 1, 0, 3, 5, 0, True, []]]]),  # reset not from 0
        msgpack.packb([2, 2, 0, [["a", 1, 0, 0, 1, 0, False, ["k", 1, 5]]]]),  # value not bytes
        msgpack.packb([2, 2, 9, [["a", -10, 0, 0, 1, 0, False, ["k", 1, b""]]]]),  # a generation below 0
        msgpack.packb([2, 2, [["a", 1, 0, 0, 1, 0, False, []]]]),  # no base
        msgpack.packb([3, 0, 0, []]),  # other version
        msgpack.packb([2, 9, 0, []]),  # unknown kind
        msgpack.packb({"a": 1}),
    ]
    for data in bad:
        with pytest.raises(MalformedMessage):
            decode(data, 4096)
    with pytest.raises(MalformedMessage):
        decode(good, 4)
    with pytest.raises(MalformedMessage, match=r"version 3, this node reads \(1, 2\)"):  # another release says so
        decode(msgpack.packb([3, 0, 0, []]), 4096)


# --- the agent: counted, survived, nothing applied -----------------------------------------------------------------


async def test_agent_counts_every_rejection_and_its_state_is_untouched() -> None:
    clock = SimClock()
    net = InMemoryNetwork(clock)
    cfg = GossipConfig(cluster_id="c1", cluster_secret=SECRET, max_receive_bytes=64 * 1024)
    agent = GossipAgent(cfg, "victim", "victim:1", net.transport("victim:1"), clock)
    await agent.start()
    before = {n: (s.generation, s.max_version) for n, s in agent.state.nodes.items()}

    intruder = make_auth(clock, sender="intruder")
    syn = encode(Syn((NodeDigest("intruder", 1, 5, 9, 0),)))
    life = agent.generation
    wrong_cluster = make_auth(clock, sender="intruder", cluster="c2").seal(syn, "victim", life)
    bad_mac = make_auth(clock, sender="intruder", secret=b"not the cluster secret.........").seal(syn, "victim", life)
    good = intruder.seal(syn, "victim", life)
    replayed = good
    oversized = intruder.seal(b"\x00" * (70 * 1024), "victim", life)
    malformed_payload = intruder.seal(b"\xc1 definitely not msgpack", "victim", life)
    garbage = b"\x00\x01\x02 not an envelope"

    expected = {
        wrong_cluster: "wrong_cluster",
        bad_mac: "bad_mac",
        oversized: "oversized",
        malformed_payload: "malformed",
        garbage: "malformed",
    }
    for data, reason in expected.items():
        with pytest.raises(Rejected) as info:
            agent.handle(data)
        assert info.value.reason.value == reason
    assert agent.handle(good) is not None  # a proper Syn gets a SynAck
    with pytest.raises(Rejected):
        agent.handle(replayed)
    assert dict(agent.stats.rejected) == {
        "wrong_cluster": 1,
        "bad_mac": 1,
        "oversized": 1,
        "malformed": 2,
        "replayed": 1,
    }
    after = {n: (s.generation, s.max_version) for n, s in agent.state.nodes.items()}
    assert after == before and "intruder" not in agent.state.nodes  # a Syn alone adds no member
    clock.advance(5.0)
    assert agent.stats.internal_errors == 0 and agent.running
