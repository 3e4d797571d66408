"""A forwarded call to a peer whose packets vanish (a frozen process, a partition) fails in seconds.

Peer channels had no keepalive, so a call that had started streaming waited for as long as TCP retransmits
(~15 minutes) when the peer went silent. Here a proxy in front of a slowly streaming server starts dropping every
byte mid-stream; the call on a peer channel (``PeerChannels``) must fail UNAVAILABLE well before the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from p2pnode.config import ForwardingConfig
from p2pnode.serving.forward import PeerChannels, peer_server_keepalive_options

CONFIG = ForwardingConfig(keepalive_s=1.0, keepalive_timeout_s=2.0)


class Blackhole:
    """A TCP proxy that, once ``drop`` is set, reads and discards every byte in both directions."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drop = False
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if not self.drop:
                    writer.write(data)
                    await writer.drain()
        writer.close()


async def slow_stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    for _ in range(600):
        yield b"token"
        await asyncio.sleep(0.1)


async def test_a_call_to_a_peer_that_went_silent_fails_within_seconds() -> None:
    server = grpc.aio.server(options=peer_server_keepalive_options(CONFIG))
    handler = grpc.unary_stream_rpc_method_handler(slow_stream)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Slow", {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = Blackhole(port)
    proxy_port = await proxy.start()
    channels = PeerChannels([], forwarding=CONFIG)
    try:
        call = channels.get(f"127.0.0.1:{proxy_port}").unary_stream("/t.Slow/Stream")(b"")
        received = 0
        dropped_at = 0.0
        code = None
        try:
            async for _ in call:
                received += 1
                if received == 5:
                    proxy.drop = True
                    dropped_at = time.monotonic()
        except grpc.aio.AioRpcError as e:
            code = e.code()
        took = time.monotonic() - dropped_at
        assert code == grpc.StatusCode.UNAVAILABLE
        assert took < 30.0  # keepalive 1 s + 2 s without an answer; the stream would last 60 s
    finally:
        await channels.close()
        await server.stop(None)
        assert proxy.server is not None
        proxy.server.close()
