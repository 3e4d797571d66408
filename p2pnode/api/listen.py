"""Listen addresses: ``HOST:PORT`` checked when the flags are read, and bound before the engine starts.

Why here and not in the servers: a node spends tens of seconds starting its engine, so an address it cannot bind
(in use, not this host's, a port above 65535 that gRPC would silently wrap) must fail in milliseconds with a line
naming the flag, not after the engine is up and with a traceback.
"""

from __future__ import annotations

import socket


class BadAddress(ValueError):
    """A ``HOST:PORT`` that is not one (the message says why)."""


def split_host_port(text: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[v6]:PORT`` too); raises BadAddress naming what is wrong. The host is
    required, and an IPv6 one bracketed: gRPC binds neither ``:PORT`` nor ``::1:PORT`` (it read the latter as
    another address), where a socket's bind took both."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text:
        raise BadAddress(f"{text!r} is not HOST:PORT")
    if not (port_text.isascii() and port_text.isdigit()):
        raise BadAddress(f"{text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise BadAddress(f"{text!r}: port {port} is above 65535")
    if host.startswith("[") != host.endswith("]"):
        raise BadAddress(f"{text!r}: unbalanced brackets around the host")
    bare = host.strip("[]")
    if not bare:
        raise BadAddress(f"{text!r}: no host (0.0.0.0 or [::] for every interface)")
    if ":" in bare and not host.startswith("[") and all(c in "0123456789abcdefABCDEF:." for c in bare):
        raise BadAddress(f"{text!r}: an IPv6 host is written in brackets, [{bare}]:{port}")  # (a gRPC target
        # such as dns:///host:port is not one)
    return bare, port


def bind_tcp(listen: str) -> socket.socket:
    """A bound (not yet listening) TCP socket for ``HOST:PORT`` (port 0: a free one; no host: every interface)."""
    host, port = split_host_port(listen)
    family, kind, proto, _, address = socket.getaddrinfo(
        host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def check_bindable(listen: str, flag: str) -> None:
    """Raise OSError naming ``flag`` when ``listen`` cannot be bound now (in use, not a local address...)."""
    try:
        bind_tcp(listen).close()
    except BadAddress as e:
        raise OSError(f"{flag} {e}") from None
    except OSError as e:
        raise OSError(f"cannot listen on {listen} ({e.strerror or e}): change {flag}") from None
