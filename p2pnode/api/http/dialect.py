"""How a generation call's results are written for the API it came through: the OpenAI JSON and server-sent
events the chat and completion builders make (``OPENAI``), or another API's made from them (Anthropic's Messages:
``anthropic_messages.DIALECT``). Every dialect serves through the same admit/run path."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response


@dataclass(frozen=True)
class Dialect:
    """``whole``: the finished response model as an HTTP response; ``stream``: OpenAI's events as this API's;
    ``error``: (HTTP status, OpenAI error JSON) as this API's error."""

    whole: Callable[[Any], Response]
    stream: Callable[[AsyncIterator[str]], AsyncIterator[str]]
    error: Callable[[int, dict[str, Any]], Response]

    async def events(self, source: AsyncIterator[str]) -> AsyncIterator[str]:
        """``stream(source)``, closing ``source`` as soon as this ends however it ends (the ingress stream under it
        then aborts its engine requests at once, not at garbage collection)."""
        try:
            async for event in self.stream(source):
                yield event
        finally:
            await source.aclose()  # type: ignore[attr-defined]


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _same(events: AsyncIterator[str]) -> AsyncIterator[str]:
    return events


OPENAI = Dialect(whole=_json, stream=_same, error=lambda status, body: JSONResponse(body, status_code=status))
