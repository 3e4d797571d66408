"""A request body as JSON, within bounds: its size (413 beyond), its nesting depth (400 beyond), and the client's
patience (a client gone mid-body is ``ClientGone``, one DEBUG line, never a traceback).

Why a depth bound: Python's JSON parser recurses once per level of nesting and raises RecursionError near 1,000
levels; unbounded, ``[[[[...]]]]`` answered 500 with two ERROR tracebacks, and a body just under that depth would
reach pydantic and vLLM's renderer, which recurse too. The depth is measured before parsing without recursion:
strings are cut out (a bracket inside a string does not nest), the brackets left are summed as +1/-1 (numpy), and
the running sum's maximum is the depth, chunk by chunk (a deep body is refused at its first chunk). Bodies with
fewer opening brackets than the bound (nearly all) skip it.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request

log = logging.getLogger("p2pnode.http")

#: A JSON string (the unrolled form of ``"(?:[^"\\]|\\.)*"``: linear, no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: Every byte but the four brackets (bytes.translate deletes them).
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class ClientGone(Exception):
    """The HTTP client disconnected before the response began (while sending its body, or while it waited)."""


class BodyError(Exception):
    """A body that is not a request: ``status`` (400 or 413) and a message naming the problem (``param``: "body")."""

    def __init__(self, status: int, message: str, param: str | None = "body") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


#: Brackets summed per numpy step: a deeply nested body is refused after its first chunk.
_CHUNK = 1 << 16


def nested_deeper_than(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``body`` nest more than ``limit`` levels, computed without recursion."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    codes = np.frombuffer(brackets, dtype=np.uint8)
    depth = 0
    for start in range(0, len(codes), _CHUNK):
        part = codes[start : start + _CHUNK]
        steps = np.where((part == ord("[")) | (part == ord("{")), 1, -1).astype(np.int32)
        running = np.cumsum(steps, dtype=np.int32) + depth
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


def parse_json(body: bytes, max_depth: int) -> Any:
    """``body`` parsed, or BodyError: not JSON, or nested deeper than ``max_depth``."""
    if body.count(b"[") + body.count(b"{") > max_depth and nested_deeper_than(body, max_depth):
        raise BodyError(400, f"body: JSON nested more than {max_depth} levels deep; at most {max_depth} are accepted")
    try:
        return json.loads(body)
    except RecursionError:  # unreachable below the bound; kept so that no body can ever answer 500
        raise BodyError(400, f"body: JSON nested too deep; at most {max_depth} levels are accepted") from None
    except ValueError as e:
        raise BodyError(400, f"body: not valid JSON ({e})") from None


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    """The request's body as JSON, read up to ``max_bytes``: BodyError when it is too large or not a bounded JSON
    document, ClientGone when the client goes away before sending all of it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyError(413, f"request body is {length} bytes; at most {max_bytes} are accepted")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise BodyError(413, f"request body exceeds {max_bytes} bytes")
    except ClientDisconnect:
        client = request.client.host if request.client else "-"
        log.debug("%s %s: client %s went away after %d of %s body bytes", request.method, request.url.path,
                  client, len(body), length or "?")
        raise ClientGone from None
    return parse_json(bytes(body), max_depth)
