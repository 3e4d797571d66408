"""Connection bounds uvicorn lacks: a header timeout, a body timeout and a per-client connection cap.

Why: uvicorn closes idle keep-alive connections but waits for ever on one that sends its header or body slowly
(slowloris); 500 such connections stayed open for as long as their client wished, and since uvicorn's
``limit_concurrency`` counts connections, enough of them turn every real call into 503. Here a connection must
deliver a request's whole header within ``header_timeout_s`` (from its first byte, or from the connection's
opening) and its whole body within ``body_timeout_s`` after the header; one that does not gets 408 and is closed
(its call, if it started, sees the client gone: one DEBUG line). One client address holds at most
``max_per_client`` connections; a connection beyond gets 429 and is closed at once.

The bounds live in a subclass of uvicorn's httptools protocol (the parser ``vllm serve`` runs too), made per
server by ``ConnectionGuard.protocol_class``; what they cut and refuse is counted (``/metrics``:
``p2pnode:http_connections_cut_total{phase}``, ``p2pnode:http_connections_refused_total``) and logged a few lines a
minute.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from p2pnode.api.http.errors import error_body
from p2pnode.log_limit import LogLimiter

log = logging.getLogger("p2pnode.http")

#: The phases a connection can be cut in (the ``phase`` label of the cut counter).
PHASES = ("header", "body")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error JSON that closes the connection."""
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class ConnectionGuard:
    """The bounds of one HTTP server, and what they did (``cut`` by phase, ``refused``)."""

    def __init__(self, header_timeout_s: float, body_timeout_s: float, max_per_client: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_per_client = max_per_client
        #: Open connections by client address (addresses with none are dropped: the map is bounded by the
        #: server's connection limit).
        self.open: Counter[str] = Counter()
        self.cut: Counter[str] = Counter({phase: 0 for phase in PHASES})
        self.refused = 0
        self._log = LogLimiter(log)

    def admit(self, host: str) -> bool:
        """Count a new connection from ``host``; False (not counted) when it already holds ``max_per_client``."""
        if self.max_per_client and self.open[host] >= self.max_per_client:
            self.refused += 1
            self._log.warning(
                f"cap:{host}", "refused a connection from %s: it holds %d (at most %d per client address)", host,
                self.open[host], self.max_per_client,
            )
            return False
        self.open[host] += 1
        return True

    def release(self, host: str) -> None:
        self.open[host] -= 1
        if self.open[host] <= 0:
            del self.open[host]

    def timed_out(self, host: str, phase: str, seconds: float) -> None:
        self.cut[phase] += 1
        self._log.warning(
            f"cut:{phase}", "closed a connection from %s: its request %s did not arrive within %g s", host, phase,
            seconds,
        )

    def protocol_class(self) -> type[asyncio.Protocol]:
        """uvicorn's httptools protocol, bounded by this guard (``uvicorn.Config(http=...)``)."""
        return type("GuardedHttpToolsProtocol", (_GuardedProtocol,), {"guard": self})


class GuardCollector(Collector):
    """The guard's counters as ``p2pnode:*`` families (registered on the node's registry by the HTTP front)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        cut = CounterMetricFamily(
            "p2pnode:http_connections_cut",
            "HTTP connections closed because a request's header or body did not arrive in time, by phase.",
            labels=["phase"],
        )
        for phase in PHASES:
            cut.add_metric([phase], self.guard.cut[phase])
        yield cut
        yield CounterMetricFamily(
            "p2pnode:http_connections_refused",
            "HTTP connections refused at once: their client address already held the most allowed.",
            value=self.guard.refused,
        )


class _GuardedProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the guard's timers and cap (see the module docstring). One timer at a time: the
    header's from the connection's opening (or a new request's first byte) to its header's end, then the body's
    to the request's end."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else ""
        self._admitted = self.guard.admit(self._host)
        if not self._admitted:
            cap = self.guard.max_per_client
            transport.write(_raw_response(429, "Too Many Requests", f"at most {cap} connections per client"))
            transport.close()
            return
        self._arm("header", self.guard.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_admitted", False):
            self._admitted = False
            self.guard.release(self._host)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return  # refused: whatever it sends is dropped with the connection
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # a keep-alive connection's next request: its header's clock starts now
            self._arm("header", self.guard.header_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm("body", self.guard.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        if seconds > 0:
            self._timer = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        timer: Any = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _expired(self, phase: str, seconds: float) -> None:
        """Answer 408 (unless the response began) and close; a running call sees its client gone."""
        self._timer = None
        if self.transport.is_closing():
            return
        self.guard.timed_out(self._host, phase, seconds)
        cycle = self.cycle  # the header's request has none yet: this is the previous request's, if any
        answer = (cycle is None or cycle.response_complete) if phase == "header" else not cycle.response_started
        if answer:
            message = f"request {phase} not received within {seconds:g} s"
            self.transport.write(_raw_response(408, "Request Timeout", message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's sends are dropped from now on; its receive() sees the disconnect
            cycle.message_event.set()
        self.transport.close()
