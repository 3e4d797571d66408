"""Flag values checked when the flags are read: listen addresses gRPC can bind, and tenants' errors that keep keys
out of the message."""

from __future__ import annotations

import pytest


def test_a_listen_address_grpc_cannot_bind_is_refused_when_the_flags_are_read() -> None:
    """``:50051`` and ``::1:50051`` passed (a socket's bind takes them) and the node failed at its gRPC bind without
    saying why; a non-ASCII digit as the port was a bare ValueError."""
    from p2pnode.api.listen import BadAddress, split_host_port

    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    assert split_host_port("0.0.0.0:8000") == ("0.0.0.0", 8000)
    assert split_host_port("dns:///peer.example:50051") == ("dns:///peer.example", 50051)  # a gRPC target
    for bad, said in ((":50051", "no host"), ("[]:50051", "no host"), ("::1:50051", "in brackets"),
                      (":::8443", "in brackets"), ("host:\u00b2", "not a number")):
        with pytest.raises(BadAddress, match=said):
            split_host_port(bad)


def test_a_tenant_flags_error_never_quotes_what_may_be_part_of_its_key() -> None:
    from p2pnode.serving.tenants import parse_tenant

    with pytest.raises(ValueError) as info:
        parse_tenant("acme=sk-live-AAAA,BBBBsecretTail")
    assert "secretTail" not in str(info.value)
