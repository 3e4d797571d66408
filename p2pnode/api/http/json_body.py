"""A request body as JSON, within bounds: its size (413 beyond), its media type (``application/json``, as ``vllm
serve``), its nesting depth and its text (400 beyond), and the client's patience (a client gone mid-body is
``ClientGone``, one DEBUG line, never a traceback).

Why a media type: ``vllm serve`` answers any other ``Content-Type`` (none, ``text/plain``, form-encoded) with 400
"Unsupported Media Type: Only 'application/json' is allowed" before reading the body (its ``validate_json_request``
on every JSON route: completions, chat, responses, messages, tokenize, detokenize, LoRA loading); a node accepted
them all. Its check is ours: the media type before any parameter (``; charset=...`` allowed), case-insensitive.

Why a depth bound: Python's JSON parser recurses once per level of nesting and raises RecursionError near 1,000
levels; unbounded, ``[[[[...]]]]`` answered 500 with two ERROR tracebacks, and a body just under that depth would
reach pydantic and vLLM's renderer, which recurse too. The depth is measured before parsing without recursion:
strings are cut out (a bracket inside a string does not nest), the brackets left are summed as +1/-1 (numpy), and
the running sum's maximum is the depth, chunk by chunk (a deep body is refused at its first chunk). Bodies with
fewer opening brackets than the bound (nearly all) skip it.

Why a Unicode check: JSON's ``\\uD800`` escapes decode to lone surrogates, which Python keeps in a ``str`` but no
encoder takes; unchecked, ``{"prompt": "\\ud800"}`` reached the protobuf setter (500 ``UnicodeEncodeError``, two
tracebacks). Every string of the body, keys included, is checked once after parsing, before any field is used, and
refused with 400 naming where it is (``messages[0].content``). A lone surrogate comes from such an escape or from its
raw UTF-8 bytes (the parser decodes with ``surrogatepass``, as FastAPI's does); a UTF-8 body with neither (nearly
all) skips the walk.
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
#: What can decode to a surrogate: a ``\\uD800``-``\\uDFFF`` escape (maybe half of a valid pair, maybe after an
#: escaped backslash: the walk decides) or a surrogate's raw UTF-8 bytes.
_MAYBE_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")
#: A lone surrogate (a pair decodes to one character outside the range).
_SURROGATE = re.compile("[\ud800-\udfff]")
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


def unencodable_text(data: Any) -> tuple[str, str] | None:
    """The first string of ``data`` (a parsed JSON document; keys included) that holds a lone surrogate: its path
    (``stop[1]``, ``messages[0].content``; a key's path is its object's) and the surrogate; None when all encode."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:  # iterative: depth is bounded already, but a wide document must not recurse either
        path, value = pending.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                return path or "body", found.group()
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                found = _SURROGATE.search(key)
                if found:
                    return path or "body", found.group()
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def check_text(body: bytes, data: Any) -> None:
    """BodyError (400 naming the field) when a string of ``data``, parsed from ``body``, cannot be encoded."""
    utf8 = b"\x00" not in body[:4]  # JSON in UTF-16 or -32 (the parser detects them) starts with a zero byte
    if utf8 and not _MAYBE_SURROGATE.search(body):
        return
    found = unencodable_text(data)
    if found is not None:
        path, surrogate = found
        raise BodyError(400, f"{path}: must be valid Unicode text (a lone surrogate \\u{ord(surrogate):04x})", path)


def parse_json(body: bytes, max_depth: int) -> Any:
    """``body`` parsed, or BodyError: not JSON, nested deeper than ``max_depth``, or holding a string that is not
    valid Unicode."""
    if body.count(b"[") + body.count(b"{") > max_depth and nested_deeper_than(body, max_depth):
        raise BodyError(400, f"body: JSON nested more than {max_depth} levels deep; at most {max_depth} are accepted")
    try:
        data = json.loads(body)
    except RecursionError:  # unreachable below the bound; kept so that no body can ever answer 500
        raise BodyError(400, f"body: JSON nested too deep; at most {max_depth} levels are accepted") from None
    except ValueError as e:
        raise BodyError(400, f"body: not valid JSON ({e})") from None
    check_text(body, data)
    return data


#: vLLM's refusal of a body that is not declared JSON (vllm/entrypoints/serve/utils/api_utils.py), word for word.
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` header declares JSON, as vLLM decides it (its media type alone, any case)."""
    return (content_type or "").lower().split(";", 1)[0].strip() == "application/json"


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    """The request's body as JSON, read up to ``max_bytes``: BodyError when it is too large, not declared JSON or
    not a bounded JSON document of valid text, ClientGone when the client goes away before sending all of it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyError(413, f"request body is {length} bytes; at most {max_bytes} are accepted")
    if not is_json_media_type(request.headers.get("content-type")):
        raise BodyError(400, UNSUPPORTED_MEDIA_TYPE, None)
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
