"""How serving fails, in its own words: a code and a message that names the cause (and the field, for a bad request).

The serving core (``ingress``, ``local``, ``forward``) raises these and never a protocol's status; each front door
maps the code to its own (``api/grpc/status.py``: the gRPC status of the same name; ``api/http/errors.py``: an HTTP
status and OpenAI's error JSON). The codes are gRPC's canonical ones -- the mesh's wire is gRPC and every status a
client can see has one -- so the mapping is by name and loses nothing.
"""

from __future__ import annotations

import enum

__all__ = ["RETRYABLE", "ServeCode", "ServeError", "TargetFailed", "Throttle"]


class ServeCode(enum.Enum):
    """Why a call or an attempt ended (gRPC's canonical codes, by name)."""

    OK = "ok"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
    INVALID_ARGUMENT = "invalid_argument"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out_of_range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    UNAUTHENTICATED = "unauthenticated"


#: Codes after which another node may serve a request (when nothing was streamed yet): the node could not serve
#: it now, which says nothing about the others. INVALID_ARGUMENT, ALREADY_EXISTS and the like would fail anywhere.
RETRYABLE = frozenset({
    ServeCode.UNAVAILABLE,
    ServeCode.RESOURCE_EXHAUSTED,
    ServeCode.INTERNAL,
    ServeCode.UNKNOWN,
    ServeCode.UNAUTHENTICATED,
    ServeCode.PERMISSION_DENIED,
    ServeCode.ABORTED,
})


class Throttle(enum.Enum):
    """Why a RESOURCE_EXHAUSTED call may be sent again later (the front doors answer each differently, with the
    ``Retry-After`` the refusal carries): the tenant is over its rate limit, or the node (mesh) is overloaded."""

    RATE_LIMIT = "rate_limit"
    OVERLOAD = "overload"


class ServeError(Exception):
    """A call failed or was refused: ``code`` says why, ``message`` is the client-facing text (for INVALID_ARGUMENT it
    starts with the field's path, ``field``); a throttled call (``throttle``) says when to try again
    (``retry_after_s``)."""

    def __init__(
        self,
        code: ServeCode,
        message: str,
        field: str | None = None,
        *,
        throttle: Throttle | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.throttle = throttle
        self.retry_after_s = retry_after_s


class TargetFailed(Exception):
    """A node could not serve (or finish serving) a request; ``retryable`` says whether another node may still serve
    it, which is only true while nothing has been streamed (the ingress tracks that)."""

    def __init__(
        self,
        node_id: str,
        code: ServeCode,
        message: str,
        *,
        retryable: bool,
        throttle: Throttle | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{node_id}: {message}")
        self.node_id = node_id
        self.code = code
        self.message = message
        self.retryable = retryable
        self.throttle = throttle
        self.retry_after_s = retry_after_s

    def serve_error(self) -> ServeError:
        """The failure as the call's own (its throttle and Retry-After kept)."""
        return ServeError(self.code, self.message, throttle=self.throttle, retry_after_s=self.retry_after_s)
