#!/usr/bin/env python3
"""A request's trip through the code, traced: the p2pnode modules a request is handed through, and how.

Two in-process nodes on simulated engines over real loopback gRPC (B seeded with a prefix, A routing to it): a gRPC
``Generate`` sent to A and forwarded to B, and an OpenAI chat completion sent to A's HTTP front and forwarded the
same way. A profile hook watches the p2pnode calls that run in the tasks serving the request (A's handler, B's
Forward handler) -- not what runs meanwhile for other reasons (gossip rounds, load reports), generated protobuf code,
or the simulated engine's own modules (a real node runs vLLM there) -- and keeps the hand-offs: a call from one
module into another that passes the request in any of its forms (the client's or a peer's message, an OpenAI body,
an admitted call, the request object, its sampling, segments, namespace or pull, its prompt's token ids) as an
argument. Calls inside a module, and a request's own methods, are not hand-offs. ``loose`` counts the request's parts
passed beside its first form: the fields a signature threads instead of taking the request whole.

    python scripts/trace_trip.py            # both trips, a table
    python scripts/trace_trip.py --json     # one JSON object: {"grpc": {...}, "http": {...}}

docs/architecture.md lists these trips; tests/unit/test_architecture_doc.py holds the two to each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGE = ROOT / "p2pnode"
#: Modules a trip does not list: generated code, and the simulated engine standing in for vLLM.
NOT_LISTED = ("v1/", "engine/simulated/")
#: Functions whose task serves a request at each end (the trip starts there).
ENTRIES = {
    "api/grpc/node_service.py": "ingress",
    "api/http/server.py:HttpFront.chat_completions": "ingress",
    "serving/forward.py:ForwarderService.forward": "server",
    "serving/peer_link.py:LinkSession._serve_one": "server",
}
BLOCK = 32
SECRET = b"trace-trip-cluster-secret"
#: The forms a request takes on its way, and its parts (type names, so that any tree's are recognized).
CARRIERS = frozenset({
    "GenerateRequest", "ForwardRequest", "ChatCompletionRequest", "CompletionRequest", "Call", "Request", "Sequence",
    "SamplingOptions", "SamplingParams", "SegmentSpans", "CacheNamespace", "KvPullHint", "KvSource",
})
#: A token list longer than this is the traced prompt itself.
PROMPT_TOKENS = 8 * BLOCK
#: The prompts' bytes the requests seen so far keep (``Request.packed_tokens``), by id: a form of the prompt too.
_PROMPT_BYTES: dict[int, bytes] = {}


@dataclass
class Trip:
    """One end of a request's trip: the modules it was handed into (in order), the functions it was handed to in
    each, and the request's parts those calls passed beside its first form."""

    modules: dict[str, list[str]] = field(default_factory=dict)
    loose: int = 0

    def add(self, module: str, function: str, parts: int) -> None:
        functions = self.modules.setdefault(module, [])
        if function not in functions:
            functions.append(function)
            self.loose += max(parts - 1, 0)

    @property
    def handoffs(self) -> int:
        return sum(len(f) for f in self.modules.values())


def _module_of(path: str) -> str | None:
    """The module's path inside the package, or None outside it."""
    root = str(PACKAGE) + "/"
    return path[len(root) :] if path.startswith(root) else None


def _parts(frame: Any) -> int:
    """How many of the call's arguments are the request in one of its forms (its own methods' ``self`` is not)."""
    code = frame.f_code
    local = frame.f_locals
    names = [n for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] if n != "self"]
    return sum(_is_request_part(local.get(name)) for name in names)


def _is_carrier(value: Any) -> bool:
    kind = type(value)
    return kind.__name__ in CARRIERS and kind.__module__.startswith(("p2pnode", "vllm"))


def _is_request_part(value: Any) -> bool:
    """One of the request's forms, a list of them (a call's requests), or its prompt's token ids (a list, or the
    bytes a ``Request`` seen before keeps of a client's: ``packed_tokens``)."""
    if _is_carrier(value):
        packed = getattr(value, "packed_tokens", None)
        if type(value).__name__ == "Request" and packed is not None:
            _PROMPT_BYTES[id(packed)] = packed  # kept, so that the id names these bytes while traced
        return True
    if isinstance(value, bytes):
        return id(value) in _PROMPT_BYTES
    if not isinstance(value, list | tuple) or not value:
        return False
    return _is_carrier(value[0]) or (len(value) > PROMPT_TOKENS and isinstance(value[0], int))


class Tracer:
    """A profile hook that files each hand-off under the task it ran in."""

    def __init__(self) -> None:
        self.by_task: dict[int, Trip] = {}
        self.roles: dict[int, str] = {}
        #: Task -> the task that created it: a task a request's handler starts works for the request too.
        self.parents: dict[int, int] = {}
        self._tasks: list[asyncio.Task[Any]] = []  # kept alive while traced, so ids stay unique

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        parent = asyncio.current_task(loop)
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self._tasks.append(task)
        if parent is not None:
            self.parents[id(task)] = id(parent)
        return task

    def role_of(self, task: int) -> str | None:
        while task not in self.roles and task in self.parents:
            task = self.parents[task]
        return self.roles.get(task)

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module_of(frame.f_code.co_filename)
        if module is None:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if task is None:
            return
        name = frame.f_code.co_qualname
        entry = self._note_role(id(task), module, name)
        caller = frame.f_back
        if module.startswith(NOT_LISTED) or (caller is not None and _module_of(caller.f_code.co_filename) == module):
            return
        parts = _parts(frame)
        if parts or entry:  # where the request arrives (as bytes) is its first hand-off
            self.by_task.setdefault(id(task), Trip()).add(module, name, parts)

    def _note_role(self, task: int, module: str, name: str) -> bool:
        """Mark a task that entered a request's handler with its role; whether this call is that entry."""
        if task in self.roles:
            return False
        for entry, role in ENTRIES.items():
            where, _, function = entry.partition(":")
            if module == where and (not function or name == function):
                self.roles[task] = role
                return True
        return False

    def trips(self) -> dict[str, Trip]:
        """The ingress's and the serving node's trips (each task of a role merged, in the order they ran)."""
        out: dict[str, Trip] = {}
        for task in self.by_task:
            role = self.role_of(task)
            if role is None:
                continue
            trip = out.setdefault(role, Trip())
            mine = self.by_task.get(task, Trip())
            trip.loose += mine.loose
            for module, functions in mine.modules.items():
                for function in functions:
                    trip.add(module, function, 0)
        return out


async def _pair() -> tuple[Any, Any]:
    from p2pnode.config import ClientApiConfig, EngineConfig, NodeConfig, ServerConfig
    from p2pnode.engine.simulated.realtime import SimEngine
    from p2pnode.gossip.config import GossipConfig
    from p2pnode.node import Node

    def node(node_id: str, seeds: tuple[str, ...] = ()) -> Node:
        config = NodeConfig(
            node_id=node_id,
            engine=EngineConfig(model=Path("sim"), block_size=BLOCK),
            server=ServerConfig(listen="127.0.0.1:0"),
            gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05),
            seeds=seeds,
            api=ClientApiConfig(http_listen="127.0.0.1:0", stats_interval_s=0),
        )
        return Node(config, SimEngine(block_size=BLOCK, num_blocks=8192, max_model_len=8192, name=node_id))

    b = node("B")
    await b.start()
    a = node("A", seeds=(b.address,))
    await a.start()
    return a, b


async def _until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


def _knows(a: Any, peer: str) -> bool:
    p = a.peering.view.peer(peer)
    return p is not None and p.usable and p.load is not None and len(p.hashes) > 0 and not p.load.running


async def _grpc_generate(node: Any, prompt: list[int]) -> Any:
    import grpc

    from p2pnode.client import build_request, collect
    from p2pnode.v1 import node_pb2_grpc

    async with grpc.aio.insecure_channel(node.address) as channel:
        return await collect(node_pb2_grpc.NodeStub(channel), build_request(prompt, max_tokens=2), timeout=30)


async def _http_chat(node: Any, text: str) -> dict[str, Any]:
    import httpx

    body = {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as client:
        reply = await client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    return reply.json()


async def _traced(call: Callable[[], Any]) -> tuple[dict[str, Trip], Any]:
    tracer = Tracer()
    loop = asyncio.get_running_loop()
    loop.set_task_factory(tracer.task_factory)  # type: ignore[arg-type]
    sys.setprofile(tracer.hook)
    try:
        result = await call()
    finally:
        sys.setprofile(None)
        loop.set_task_factory(None)
    return tracer.trips(), result


async def trace() -> dict[str, dict[str, Trip]]:
    """Both trips: {"grpc" | "http": {"ingress" | "server": Trip}}."""
    a, b = await _pair()
    try:
        prefix = list(range(10, 10 + 8 * BLOCK))
        await _grpc_generate(b, [*prefix, 1])
        await _until(lambda: _knows(a, "B"), "A to learn B's cache summary")
        grpc_trips, result = await _traced(lambda: _grpc_generate(a, [*prefix, 2]))
        if result.served_by != "B":
            raise RuntimeError(f"the traced gRPC request was served by {result.served_by}, not forwarded to B")
        text = "tell me about the mesh " * 40
        known = len(a.peering.view.peer("B").hashes)
        await _http_chat(b, text)
        await _until(lambda: _knows(a, "B") and len(a.peering.view.peer("B").hashes) > known, "B's chat prefix")
        http_trips, reply = await _traced(lambda: _http_chat(a, text + "again"))
        served = reply["choices"][0]["p2pnode"]["served_by"]
        if served != "B":
            raise RuntimeError(f"the traced chat was served by {served}, not forwarded to B")
        return {"grpc": grpc_trips, "http": http_trips}
    finally:
        for node in (a, b):
            await node.stop(leave=False)


def table(trips: dict[str, dict[str, Trip]]) -> str:
    lines = []
    for name, ends in trips.items():
        modules = sum(len(t.modules) for t in ends.values())
        handoffs = sum(t.handoffs for t in ends.values())
        loose = sum(t.loose for t in ends.values())
        lines.append(f"{name}: {modules} modules, {handoffs} hand-offs, {loose} loose parts")
        for role in ("ingress", "server"):
            for module, functions in ends.get(role, Trip()).modules.items():
                lines.append(f"  {role[0].upper()}  {module:32} {', '.join(functions)}")
    return "\n".join(lines)


def as_json(trips: dict[str, dict[str, Trip]]) -> dict[str, Any]:
    return {
        name: {
            role: {"modules": trip.modules, "handoffs": trip.handoffs, "loose": trip.loose}
            for role, trip in ends.items()
        }
        for name, ends in trips.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    trips = asyncio.run(trace())
    print(json.dumps(as_json(trips), indent=1) if args.json else table(trips))
    return 0


if __name__ == "__main__":
    sys.exit(main())
