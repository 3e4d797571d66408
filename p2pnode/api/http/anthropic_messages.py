"""Anthropic's Messages API (``POST /v1/messages``) as ``vllm serve`` answers it, through vLLM's own
``AnthropicServingMessages``: its request model, its conversion to a chat completion request (system prompt,
content blocks, tools, stop sequences, thinking), and its conversions of the chat's response and events back to
Anthropic's. The chat in between is served like any ``/v1/chat/completions`` call: admitted, routed across the mesh,
retried, cancelled, drained and counted the same way.

Errors raised while serving are Anthropic's ``{"type": "error", "error": {type, message}}`` with the HTTP status of
the failure, as vLLM's router writes them; a body its model refuses is OpenAI's error JSON (400), as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response
from vllm.entrypoints.anthropic.protocol import AnthropicError, AnthropicErrorResponse, AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

from p2pnode.api.http.dialect import Dialect

__all__ = ["DIALECT", "AnthropicMessagesRequest", "to_chat"]


@functools.lru_cache(maxsize=8)
def _merge_inline_system(chat_template: str | None) -> bool:
    """Whether the chat template needs every system message first (vLLM probes it the same way)."""
    return AnthropicServingMessages._detect_merge_inline_system(chat_template)


def to_chat(request: AnthropicMessagesRequest, engine: Any) -> Any:
    """vLLM's conversion of the Messages request to a ChatCompletionRequest for this node's chat template."""
    template = getattr(engine, "chat_template", None)
    return AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=_merge_inline_system(template), disabled_thinking_effort="none"
    )


def _whole(response: Any) -> Response:
    message = AnthropicServingMessages.messages_full_converter(None, response)  # type: ignore[arg-type]
    return JSONResponse(message.model_dump(exclude_none=True))


def _stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    return AnthropicServingMessages.message_stream_converter(None, events)  # type: ignore[arg-type]


def _error(status: int, body: dict[str, Any]) -> Response:
    error = body.get("error") or {}
    wrapped = AnthropicErrorResponse(
        error=AnthropicError(type=str(error.get("type", "error")), message=str(error.get("message", "")))
    )
    return JSONResponse(wrapped.model_dump(), status_code=status)


DIALECT = Dialect(whole=_whole, stream=_stream, error=_error)
