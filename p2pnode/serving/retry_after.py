"""A throttled refusal's retry delay on the gRPC wire: whole seconds, in the ``retry-after`` trailing metadata.

One form for every gRPC answer that carries one -- a client's call (``api/grpc``), a peer's Forward call and a
request's end on a peer link (``forward.py``, ``peer_link.py``) -- and one reader, so an ingress reads a peer's delay
the same way whichever transport brought it.
"""

from __future__ import annotations

import contextlib
import math

import grpc

__all__ = ["RETRY_AFTER_KEY", "retry_after_of", "retry_after_seconds", "trailing_metadata"]

#: The trailing metadata key of a throttled call's retry delay (whole seconds, as HTTP's Retry-After).
RETRY_AFTER_KEY = "retry-after"


def retry_after_seconds(seconds: float) -> int:
    """A retry delay as HTTP's ``Retry-After`` and gRPC's ``retry-after`` metadata say it: whole seconds, at least 1."""
    return max(1, math.ceil(seconds))


def trailing_metadata(retry_after_s: float | None) -> tuple[tuple[str, str], ...]:
    """A refusal's trailing metadata: its ``retry-after`` when it has one."""
    return () if retry_after_s is None else ((RETRY_AFTER_KEY, str(retry_after_seconds(retry_after_s))),)


#: The longest retry delay taken from a peer (seconds): an hour, past any queue's or rate limit's own.
MAX_RETRY_AFTER_S = 3600.0


def retry_after_of(error: grpc.aio.AioRpcError) -> float | None:
    """The ``retry-after`` a peer's refusal carries, at most ``MAX_RETRY_AFTER_S`` (None: none, or not a finite
    number -- ``inf`` or ``nan`` from a peer made the answer INTERNAL where it is RESOURCE_EXHAUSTED)."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY and isinstance(value, str):
            with contextlib.suppress(ValueError):
                seconds = float(value)
                if math.isfinite(seconds):
                    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
    return None
