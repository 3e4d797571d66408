"""What a prompt's token ids cost through protobuf on a request's path, through protobuf's containers and through the
C wire pass (``p2pnode/token_wire.py``), per prompt length (a measurement, not a test).

Each row is one step a node takes per request:

- ``forward write``: the ingress writes a ForwardRequest with the prompt and serializes it (containers: the
  constructor fills ``prompt_token_ids`` from the list; C: ``serialize_with_tokens``);
- ``forward read``: the serving peer reads the prompt of the ForwardRequest it parsed, and its maximum for the
  vocabulary check (containers: ``[:]`` and ``max``; C: ``read_tokens`` from the payload);
- ``client read``: the ingress reads a client's GenerateRequest prompt, and its maximum (containers: ``list`` and
  ``max`` as before; C: ``read_tokens``, serializing the ``TokenIds`` sub-message first);
- ``parse``: protobuf's parse of the whole ForwardRequest (the same either way; for scale).

    python scripts/bench_token_wire.py [--json] [--tokens 1024,4096,16384]

Reported: the median of 7 repeats of a timed loop, in microseconds per call, on one core.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit
from collections.abc import Callable

from p2pnode import token_wire
from p2pnode.token_wire import read_tokens, serialize_with_tokens
from p2pnode.v1 import forward_pb2, node_pb2

VOCAB = 152_000  # a Qwen-sized vocabulary: most ids need a Python int of their own


def time_us(fn: Callable[[], object], seconds: float = 0.2) -> float:
    per = min(timeit.repeat(fn, number=1, repeat=3))
    number = max(1, int(seconds / max(per, 1e-7)))
    runs = sorted(timeit.repeat(fn, number=number, repeat=7))
    return runs[len(runs) // 2] / number * 1e6


def header() -> forward_pb2.ForwardRequest:
    return forward_pb2.ForwardRequest(
        request_id="req-0123456789", sampling=node_pb2.SamplingParams(max_tokens=64, temperature=0.7),
        origin="node-a", hop=1, routing_key="tenant/app", tenant="acme",
    )  # fmt: skip


def measure(tokens: int) -> list[dict[str, object]]:
    rng = random.Random(tokens)
    prompt = [rng.randrange(3, VOCAB) for _ in range(tokens)]
    full = header()
    full.prompt_token_ids.extend(prompt)
    data = full.SerializeToString()
    parsed = forward_pb2.ForwardRequest.FromString(data)
    client = node_pb2.GenerateRequest.FromString(
        node_pb2.GenerateRequest(token_ids=node_pb2.TokenIds(ids=prompt)).SerializeToString()
    )

    def container_write() -> bytes:
        message = header()
        message.prompt_token_ids.extend(prompt)
        return message.SerializeToString()

    def container_read(field: object) -> int:
        values = field[:]  # type: ignore[index]
        return max(values)

    rows = [
        ("forward write", container_write, lambda: serialize_with_tokens(header(), "prompt_token_ids", prompt)),
        ("forward read", lambda: container_read(parsed.prompt_token_ids),
         lambda: read_tokens(parsed, "prompt_token_ids", data)),
        ("client read", lambda: max(list(client.token_ids.ids)), lambda: read_tokens(client.token_ids, "ids")),
        ("parse", lambda: forward_pb2.ForwardRequest.FromString(data), None),
    ]  # fmt: skip
    out = []
    for step, old, new in rows:
        before = time_us(old)
        after = time_us(new) if new is not None else None
        out.append({
            "tokens": tokens, "step": step, "containers_us": round(before, 1),
            "c_us": None if after is None else round(after, 1),
        })  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", default="1024,4096,16384")
    args = parser.parse_args()
    if not token_wire.NATIVE:
        raise SystemExit("the C extension p2pnode._token_wire is not built (pip install -e .)")
    rows = [row for n in (int(x) for x in args.tokens.split(",") if x) for row in measure(n)]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'tokens':>7} {'step':<14} {'containers us':>14} {'C us':>8} {'saved us':>9}")
    for r in rows:
        c = r["c_us"]
        saved = "" if c is None else f"{r['containers_us'] - c:9.1f}"  # type: ignore[operator]
        print(f"{r['tokens']:>7} {r['step']:<14} {r['containers_us']:>14.1f} {'' if c is None else c:>8} {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
