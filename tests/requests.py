"""Admitted requests for tests that drive the router or an engine directly (a node builds them at admission)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p2pnode.request import Request, SamplingOptions


def admitted(
    tokens: Sequence[int], routing_key: str = "", max_tokens: int = 16, request_id: str = "r", **fields: Any
) -> Request:
    """A request as admission would hand it on: ``tokens`` with ``max_tokens`` of default sampling."""
    return Request(request_id, tokens, SamplingOptions(max_tokens, 1.0, 1.0, 0), routing_key=routing_key, **fields)
