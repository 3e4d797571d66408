"""The end of the shared mesh (conftest.py), after every other test that uses it (``stops_shared_mesh``):

- a serving node (n2, real vLLM) killed during a stream of requests: every request completes or fails with a clear
  status, none is lost or duplicated, and once gossip declares the node dead routing stops choosing it;
- SIGTERM to a node (n1, real vLLM) holding a gRPC and an HTTP stream: both finish whole, new calls on either API
  are refused while ``/ready`` says 503 "draining", and the node exits 0.

In this order: the kill needs n1 as an ingress, and the drain ends n1.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import threading

import grpc
import httpx
import openai
import pytest

from p2pnode.client import GenerateResult, build_request, collect, collect_call
from p2pnode.launcher import NodeProcess
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import (
    API_KEY,
    BLOCK_SIZE,
    channel,
    stored_blocks,
    wait_idle,
    wait_summary_reaches,
    wait_until_status,
)
from tests.integration.test_mesh_routing import generate, member
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.stops_shared_mesh]

VOCAB = 512
MODEL = "tiny"


def prompt(seed: int, blocks: int, tail: int = 7) -> list[int]:
    rng = random.Random(f"test_shutdown-{seed}")  # apart from the other modules' prompts on the shared mesh
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK_SIZE + tail)]


async def test_killing_a_target_mid_stream_loses_and_duplicates_nothing(shared_mesh: dict[str, NodeProcess]) -> None:
    mesh = shared_mesh
    target = mesh["n2"]
    shared = prompt(2, blocks=8, tail=0)
    await wait_idle(target)
    stored = await stored_blocks(target)
    seeded = await generate(target.address or "", [*shared, 5], max_tokens=2)
    assert seeded.served_by == "n2"
    # (the ingresses' channels to n2 are up: conftest's warm-up)
    await wait_summary_reaches(target, [mesh["n1"], mesh["n3"]], stored, 8)

    ingresses = [mesh["n1"].address or "", mesh["n3"].address or ""]
    outcomes: dict[str, GenerateResult | grpc.aio.AioRpcError] = {}
    killed = asyncio.Event()

    async def one(i: int) -> None:
        rid = f"kill-{i}"
        try:
            outcomes[rid] = await generate(
                ingresses[i % 2], [*shared, 100 + i], max_tokens=48, ignore_eos=True, request_id=rid
            )
        except grpc.aio.AioRpcError as e:
            outcomes[rid] = e
        if i == 5:
            target.kill()  # SIGKILL the whole node (engine core included) while others stream from it
            killed.set()

    sent = 24
    await asyncio.gather(*(one(i) for i in range(sent)))
    assert killed.is_set()
    assert len(outcomes) == sent  # every request has exactly one outcome: nothing lost
    completed = {rid: r for rid, r in outcomes.items() if isinstance(r, GenerateResult)}
    failed = {rid: e for rid, e in outcomes.items() if isinstance(e, grpc.aio.AioRpcError)}
    for rid, r in completed.items():
        assert r.request_id == rid
        assert r.completion_tokens == 48 == len(r.token_ids), f"{rid}: output duplicated or cut: {r}"
    for rid, e in failed.items():
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), (rid, e)
        assert e.details(), rid
    assert any(r.served_by == "n2" for r in completed.values())  # the target did serve before it died

    # Once gossip declares n2 dead, routing no longer tries it: no retries, never served by n2.
    for ingress in ingresses:
        await wait_until_status(ingress, lambda s: (m := member(s, "n2")) is not None and m.state == "dead", "n2 dead")
    after = [await generate(ingresses[i % 2], [*shared, 200 + i], max_tokens=4) for i in range(6)]
    assert all(r.served_by != "n2" and r.attempts == 1 for r in after), after


class HeldStream:
    """A streamed completion whose client reads nothing until asked: with a tiny receive window, flow control
    holds the node's side of the stream open however fast the engine is (a raw HTTP/1.1 socket, since a client
    library would read ahead into its own buffers)."""

    def __init__(self, node: NodeProcess, body: dict[str, object]) -> None:
        host, port = (node.http_address or "").rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: it sets the window
        # A small advertised segment size keeps the node's send buffer small too: Linux sizes it from the segment
        # size (on loopback ~64 kB a segment, which lets it take ~1 MB, the whole answer, and finish unread).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        self.sock.connect((host, int(port)))
        payload = json.dumps(body).encode()
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )

    def read_events(self) -> list[str]:
        data = bytearray()
        while chunk := self.sock.recv(65536):
            data += chunk
        self.sock.close()
        return [line[6:].strip() for line in data.decode().split("\r\n") if line.startswith("data: ")]


#: A client that does not read a gRPC stream holds the node's side of it open: HTTP/2 flow control stops the node's
#: writes once this much is unread (no BDP probing to grow the window).
UNREAD_WINDOW_BYTES = 1024


async def test_sigterm_drains_grpc_and_http_calls_refuses_new_ones_and_exits_zero(
    shared_mesh: dict[str, NodeProcess],
) -> None:
    node = shared_mesh["n1"]
    ready_url = f"http://{node.http_address}/ready"
    unread_options = [("grpc.http2.lookahead_bytes", UNREAD_WINDOW_BYTES), ("grpc.http2.bdp_probe", 0)]
    async with (
        httpx.AsyncClient(timeout=10) as http,
        channel(node.address or "") as ch,
        channel(node.address or "", options=unread_options) as unread_ch,
    ):
        stub, unread = node_pb2_grpc.NodeStub(ch), node_pb2_grpc.NodeStub(unread_ch)

        async def status() -> node_pb2.NodeStatus:
            return await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=5)

        async def ready_code(code: int) -> httpx.Response | None:
            response = await http.get(ready_url)
            return response if response.status_code == code else None

        await until(lambda: ready_code(200), "n1 to be ready (the previous tests' calls may still be ending)")
        # Both held requests continue a prefix n1 holds, so n1 serves them itself even with the other in flight.
        held_prefix = prompt(3, blocks=2, tail=0)
        await wait_idle(node)
        assert (await collect(stub, build_request([*held_prefix, 5], max_tokens=1))).served_by == "n1"
        # Far more output than flow control lets the node write unread, in as few engine steps as can carry it: the
        # answers' bytes hold the calls open, their tokens only cost time (2,000 tokens at 5 logprobs took ~13 s).
        grpc_tokens = http_tokens = 600
        held_request = build_request([*held_prefix, 6], max_tokens=grpc_tokens, ignore_eos=True)
        # 20 logprobs (vLLM's most) make each message ~0.36 kB (21 entries of ~17 B), the whole answer ~215 kB: far
        # beyond the window plus what the node's gRPC transport buffers per stream (~64 kB), so the call stays open
        # however fast the engine is.
        held_request.sampling.logprobs = 20
        grpc_call = unread.Generate(held_request)
        await until(status, "the held gRPC call to start", holds=lambda s: s.load.in_flight == 1)
        # 20 logprobs make each event ~0.7 kB, so the unread HTTP stream (~400 kB) far exceeds what the socket
        # buffers hold.
        held = await asyncio.to_thread(HeldStream, node, {
            "model": MODEL, "prompt": [*held_prefix, 7], "max_tokens": http_tokens, "logprobs": 20, "stream": True,
            "ignore_eos": True,
        })  # fmt: skip
        await until(status, "the held HTTP call to start", holds=lambda s: s.load.in_flight == 2)

        node.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        # Wait for the node to see the signal (GetStatus is still served while draining) rather than racing "late"
        # calls against it: one sent while the server is already stopping would be cut off (CANCELLED) instead.
        seen = await until(status, "n1 to start draining", holds=lambda s: s.draining)
        assert seen.load.in_flight == 2
        ready = await until(lambda: ready_code(503), "/ready to turn 503")
        assert ready.json()["reason"] == "draining"

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, build_request("late", max_tokens=1))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        late = openai.AsyncOpenAI(base_url=node.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as http_err:  # the SDK's class for 5xx
            await late.completions.create(model=MODEL, prompt="late", max_tokens=1)
        assert http_err.value.status_code == 503 and http_err.value.body["type"] == "ServiceUnavailableError"
        assert (await status()).load.in_flight == 2  # both still held open

        reader_done = threading.Event()
        events: list[str] = []

        def read() -> None:
            events.extend(held.read_events())
            reader_done.set()

        threading.Thread(target=read, daemon=True).start()
        result = await collect_call(grpc_call)
        assert result.served_by == "n1"
        assert result.completion_tokens == grpc_tokens == len(result.token_ids) and result.finish_reason == "length"
        assert await asyncio.to_thread(reader_done.wait, 120)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == http_tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert await asyncio.to_thread(node.terminate) == 0
