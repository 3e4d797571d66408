"""Serving's codes -> HTTP status and OpenAI's error JSON, and proto field paths -> OpenAI parameter names.

The ingress reports every failure as a ``ServeCode`` whose message starts with the proto path of the field at
fault (``sampling.top_p: must be in (0, 1], got 1.5``). An HTTP client sent ``top_p``, so the HTTP front answers
``400 {"error": {"message": "top_p: must be in (0, 1], got 1.5", "type": "BadRequestError", "param": "top_p",
"code": 400}}`` — the shape of vLLM's ``ErrorResponse`` and the ``type`` names of the openai client's exceptions.

A throttled call (``Throttle``) says which kind it is, with a ``Retry-After`` header (``retry_after_header``): over its
tenant's rate limit is OpenAI's answer to that, ``429 RateLimitError``; an overloaded node or mesh (its queue full, a
request shed after waiting) is OpenAI's answer to an overloaded engine, ``503``, of type ``OverloadedError``. So a
client can tell "slow down" from "try later or elsewhere", and the openai client retries both after Retry-After.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from p2pnode.serving.errors import ServeCode, ServeError, Throttle

#: Serving's code (gRPC's canonical ones) -> HTTP status (google.rpc's published mapping; CANCELLED is nginx's 499
#: "client closed request").
HTTP_STATUS: dict[ServeCode, int] = {
    ServeCode.OK: 200,
    ServeCode.CANCELLED: 499,
    ServeCode.UNKNOWN: 500,
    ServeCode.INVALID_ARGUMENT: 400,
    ServeCode.DEADLINE_EXCEEDED: 504,
    ServeCode.NOT_FOUND: 404,
    ServeCode.ALREADY_EXISTS: 409,
    ServeCode.PERMISSION_DENIED: 403,
    ServeCode.RESOURCE_EXHAUSTED: 429,
    ServeCode.FAILED_PRECONDITION: 400,
    ServeCode.ABORTED: 409,
    ServeCode.OUT_OF_RANGE: 400,
    ServeCode.UNIMPLEMENTED: 501,
    ServeCode.INTERNAL: 500,
    ServeCode.UNAVAILABLE: 503,
    ServeCode.DATA_LOSS: 500,
    ServeCode.UNAUTHENTICATED: 401,
}

#: HTTP status -> error ``type``: the openai client's exception class for that status.
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

#: Proto paths whose OpenAI name differs (or is not just the part after ``sampling.``).
_COMPLETION_PARAMS = {"prompt": "prompt", "prompt.text": "prompt", "prompt.token_ids": "prompt"}
_CHAT_PARAMS = {"prompt": "messages", "prompt.text": "messages", "prompt.token_ids": "messages"}
#: Statuses whose message starts with the field at fault (others start with prose: "node is draining; ...").
_FIELD_CODES = frozenset({ServeCode.INVALID_ARGUMENT, ServeCode.NOT_FOUND, ServeCode.ALREADY_EXISTS})
#: A message that starts with a field path: ``sampling.stop[2]: ...``.
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*(?:\[\d+\])*): ")
#: The gRPC enum values serving's messages quote -> the JSON values an HTTP client sends for them
#: (``openai_requests.SEGMENT_MODES``): "must be SEGMENT_REUSE_EXACT or ..." means nothing to an ``extra_body`` client.
_HTTP_VALUES = {"SEGMENT_REUSE_EXACT": '"exact"', "SEGMENT_REUSE_APPROXIMATE": '"approximate"'}
_PROTO_VALUE = re.compile("|".join(_HTTP_VALUES))


#: A throttled call's (HTTP status, error type).
THROTTLED: dict[Throttle, tuple[int, str]] = {
    Throttle.RATE_LIMIT: (429, "RateLimitError"),
    Throttle.OVERLOAD: (503, "OverloadedError"),
}


def http_status(code: ServeCode) -> int:
    return HTTP_STATUS.get(code, 500)


def retry_after_header(error: ServeError) -> dict[str, str]:
    """The ``Retry-After`` header of a throttled call (whole seconds, at least 1); none for any other failure."""
    if error.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def field_of(message: str) -> str | None:
    """The field path a message starts with, if any (``sampling.top_p: ...`` -> ``sampling.top_p``)."""
    m = _LEADING_FIELD.match(message)
    return m.group(1) if m else None


def openai_param(field: str, *, chat: bool, renames: Mapping[str, str] | None = None) -> str:
    """The OpenAI request parameter for a proto field path (``sampling.top_p`` -> ``top_p``)."""
    if renames and field in renames:
        return renames[field]
    fixed = (_CHAT_PARAMS if chat else _COMPLETION_PARAMS).get(field)
    if fixed is not None:
        return fixed
    if field.startswith("prompt.") or field.startswith("prompt["):
        return "messages" if chat else "prompt"
    return field.removeprefix("sampling.")


def error_body(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> dict[str, dict[str, object]]:
    """OpenAI's error JSON (vLLM's ErrorResponse shape: ``code`` is the HTTP status; ``kind``: the type, when not
    the status's own)."""
    return {"error": {"message": message, "type": kind or error_type(status), "param": param, "code": status}}


def translate(
    code: ServeCode,
    message: str,
    field: str | None = None,
    *,
    chat: bool = False,
    renames: Mapping[str, str] | None = None,
    throttle: Throttle | None = None,
) -> tuple[int, dict[str, dict[str, object]]]:
    """An ingress failure as (HTTP status, OpenAI error JSON), the field renamed and the enum values quoted the way
    the client spelled them; a throttled one as its kind says (``THROTTLED``)."""
    if throttle is not None:
        status, kind = THROTTLED[throttle]
        return status, error_body(status, message, kind=kind)
    status = http_status(code)
    message = _PROTO_VALUE.sub(lambda m: _HTTP_VALUES[m.group(0)], message)
    if field is None and code in _FIELD_CODES:
        field = field_of(message)
    param = None
    if field == "sampling":  # the engine refused the sampling as a whole, naming no parameter
        message = message.removeprefix("sampling: ")
    elif field is not None:
        param = openai_param(field, chat=chat, renames=renames)
        if message.startswith(f"{field}: "):
            message = f"{param}: {message[len(field) + 2:]}"
    return status, error_body(status, message, param)


def translate_error(
    error: ServeError, *, chat: bool = False, renames: Mapping[str, str] | None = None
) -> tuple[int, dict[str, dict[str, object]]]:
    """``translate`` of a ServeError (its throttle included)."""
    return translate(error.code, error.message, error.field, chat=chat, renames=renames, throttle=error.throttle)
