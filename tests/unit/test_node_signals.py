"""SIGTERM and SIGINT on a node (``Node.serve_forever``), in-process on the simulated engine: a signal while the
node starts stops it without ever serving; a second signal while it drains stops it at once."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc

from p2pnode.client import build_request
from p2pnode.v1 import node_pb2_grpc
from tests.polling import until
from tests.unit.sim_nodes import make_node


def _forget_handlers() -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


async def test_a_signal_while_the_node_starts_stops_it_without_serving() -> None:
    """Before: the signal only set an event read after the start: an engine loading for minutes ignored Ctrl-C and
    SIGTERM, then said ready, joined the mesh, and only then drained."""
    node = make_node()
    started = asyncio.Event()
    real_start = node.start

    async def slow_start() -> None:  # an engine that takes a long time to load
        started.set()
        await asyncio.sleep(3600)
        await real_start()

    node.start = slow_start  # type: ignore[method-assign]
    try:
        serving = asyncio.ensure_future(node.serve_forever())
        await started.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 30)
        assert node._stopped.is_set() and node.server is None  # stopped, never served
    finally:
        _forget_handlers()


async def test_a_second_signal_while_draining_stops_the_node_at_once() -> None:
    node = make_node(token_delay_s=0.05)
    try:
        serving = asyncio.ensure_future(node.serve_forever())
        await until(lambda: node.server is not None and node.port, "the node to serve")
        async with grpc.aio.insecure_channel(node.address) as channel:
            long = node_pb2_grpc.NodeStub(channel).Generate(build_request("hi", max_tokens=2000))
            await long.read()  # a call in flight: the drain would wait up to drain_timeout_s (30 s) for it
            os.kill(os.getpid(), signal.SIGTERM)
            await until(lambda: node._draining, "the node to drain")
            assert not serving.done()
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(serving, 10)
            long.cancel()
        assert node._stopped.is_set()
    finally:
        _forget_handlers()
