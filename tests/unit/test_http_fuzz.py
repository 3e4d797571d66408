"""Fuzzing a node's HTTP front (simulated engine, real loopback HTTP): hypothesis draws bodies over the request schemas
of every JSON endpoint -- each model's own fields, given hostile values: invalid Unicode (escaped or as raw bytes),
huge and non-finite numbers, wrong types, deep nesting -- and every answer must be below 500, with no traceback in
the log. The named cases of each input check: test_http_inputs.py."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeCompletionRequest

from p2pnode.api.http import responses_api
from p2pnode.config import DEFAULT_HTTP_MAX_JSON_DEPTH
from p2pnode.node import Node
from tests.unit.sim_nodes import make_node

#: Examples per endpoint: enough to reach every field a few times, few enough for the unit suite (~0.2 s per 10).
EXAMPLES = 60

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
#: Text with a lone surrogate somewhere, or plain text (printable or not).
TEXT = st.one_of(
    st.text(max_size=12),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), SURROGATES, st.text(max_size=4)),
)
#: Numbers at and beyond every bound a field has: int32, uint32, int64, uint64, doubles, non-finite (Python's JSON
#: writes and reads NaN and Infinity), and huge integers.
NUMBERS = st.one_of(
    st.integers(min_value=-3, max_value=40),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**31) - 1, -(2**63) - 1,
                     10**30, -(10**30), 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
#: Any JSON value, a few levels deep, with the scalars above.
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


def nested(depth: int, leaf: Any) -> Any:
    """``leaf`` inside ``depth`` lists (built iteratively: the serializer recurses, so depth stays below its limit)."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


#: Nesting around the body's bound: just inside it, at it, beyond it.
DEEP = st.builds(nested, st.sampled_from([DEFAULT_HTTP_MAX_JSON_DEPTH - 2, DEFAULT_HTTP_MAX_JSON_DEPTH,
                                          DEFAULT_HTTP_MAX_JSON_DEPTH + 1, 200]), SCALARS)
HOSTILE = st.one_of(VALUES, VALUES, DEEP)

CHAT_MESSAGES = [{"role": "user", "content": "hello"}]
#: Per endpoint: its request model (the fields hostile values go into) and a valid body to start from.
ENDPOINTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "/v1/completions": (CompletionRequest, {"model": "sim", "prompt": "hello", "max_tokens": 4}),
    "/v1/chat/completions": (ChatCompletionRequest, {"model": "sim", "messages": CHAT_MESSAGES, "max_tokens": 4}),
    "/v1/responses": (responses_api.ResponsesRequest, {"model": "sim", "input": "hello", "max_output_tokens": 4}),
    "/v1/messages": (AnthropicMessagesRequest, {"model": "sim", "messages": CHAT_MESSAGES, "max_tokens": 4}),
    "/tokenize": (TokenizeCompletionRequest, {"model": "sim", "prompt": "hello"}),
    "/detokenize": (DetokenizeRequest, {"model": "sim", "tokens": [70, 71]}),
}
#: Fields whose valid values would make one example take long (a stream of thousands of tokens, 128 sequences): their
#: hostile values are still drawn, then capped to something quick when they are valid numbers.
_CAPPED = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "n": 2, "best_of": 2,
           "min_tokens": 8}


def _capped(name: str, value: Any) -> Any:
    if name in _CAPPED and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return min(value, _CAPPED[name])
    return value


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    """A body for ``path``: its valid base, up to four of its model's fields (or made-up ones) set to hostile values,
    sometimes the whole body replaced by one; serialized with surrogates escaped or as raw UTF-8 bytes."""
    model, base = ENDPOINTS[path]
    fields = sorted(model.model_fields)
    body: Any = dict(base)
    for name in draw(st.lists(st.one_of(st.sampled_from(fields), TEXT), max_size=4, unique=True)):
        body[name] = _capped(name, draw(HOSTILE))
    if draw(st.integers(0, 19)) == 0:
        body = draw(HOSTILE)
    if draw(st.booleans()):
        return json.dumps(body).encode()
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
async def node() -> AsyncIterator[Node]:
    node = make_node("fuzz")
    await node.start()
    yield node
    await node.stop()


class _Tracebacks(logging.Handler):
    """Every record with a traceback or at ERROR and above, from any logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


@pytest.fixture
def tracebacks() -> AsyncIterator[list[logging.LogRecord]]:
    handler = _Tracebacks()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler.records
    root.removeHandler(handler)


@pytest.fixture(scope="module")
async def http(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=60) as client:
        yield client


#: Every status answered, per endpoint (the last test checks the hostile values were refused, not all served).
ANSWERS: dict[str, list[int]] = {path: [] for path in ENDPOINTS}


@pytest.mark.parametrize("path", list(ENDPOINTS))
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_no_body_gives_a_server_error_or_a_traceback(
    http: httpx.AsyncClient, tracebacks: list[logging.LogRecord], path: str, data: st.DataObject
) -> None:
    tracebacks.clear()  # one example's, not an earlier one's
    body = data.draw(bodies(path), label="body")
    reply = await http.post(path, content=body, headers={"content-type": "application/json"})
    ANSWERS[path].append(reply.status_code)
    assert reply.status_code < 500, (reply.status_code, reply.text[:300])
    assert not tracebacks, [r.getMessage() for r in tracebacks]


def test_the_fuzz_reached_every_endpoint_and_was_refused() -> None:
    for path, answers in ANSWERS.items():
        assert len(answers) >= EXAMPLES, path
        assert 400 in answers, path
