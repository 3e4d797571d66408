"""The access line of a call cut short says what it did: a stream the client cancels after tokens arrived was
served (before: ``served_by=- prompt_tokens=0 ... attempts=0``)."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.polling import until
from tests.unit.sim_nodes import make_node


async def test_a_cancelled_stream_is_logged_with_who_served_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.access")
    node = make_node(token_delay_s=0.002)
    await node.start()
    try:
        body = {"model": "sim", "prompt": "cancel me after a few tokens", "max_tokens": 3000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    break  # leaving closes the connection: the call is cancelled
        await until(lambda: node.ingress.counters.cancelled, "the cancelled call to be counted")
        records = [r.access for r in caplog.records if r.name == "p2pnode.access"]  # type: ignore[attr-defined]
        assert len(records) == 1
        line = records[0]
        assert line["status"] == "CANCELLED" and line["served_by"] == "h1" and line["attempts"] == 1
        assert line["prompt_tokens"] == len(body["prompt"]) and line["completion_tokens"] >= 5
    finally:
        await node.stop()
