"""gRPC status -> HTTP status and OpenAI's error JSON; proto field paths -> the parameter the client sent."""

from __future__ import annotations

import httpx
import pytest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse

from p2pnode.api.http import errors as http_errors
from p2pnode.serving.errors import ServeCode, ServeError, Throttle
from tests.unit.sim_nodes import make_node


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (ServeCode.INVALID_ARGUMENT, 400, "BadRequestError"),
        (ServeCode.UNAUTHENTICATED, 401, "AuthenticationError"),
        (ServeCode.NOT_FOUND, 404, "NotFoundError"),
        (ServeCode.ALREADY_EXISTS, 409, "ConflictError"),
        (ServeCode.RESOURCE_EXHAUSTED, 429, "RateLimitError"),
        (ServeCode.UNAVAILABLE, 503, "ServiceUnavailableError"),
        (ServeCode.DEADLINE_EXCEEDED, 504, "GatewayTimeoutError"),
        (ServeCode.INTERNAL, 500, "InternalServerError"),
        (ServeCode.UNKNOWN, 500, "InternalServerError"),
    ],
)
def test_status_codes_map_to_http_and_openai_error_types(code: ServeCode, status: int, kind: str) -> None:
    got_status, body = http_errors.translate(code, "something went wrong")
    assert got_status == status
    assert body["error"]["type"] == kind and body["error"]["code"] == status
    ErrorResponse.model_validate(body)  # vLLM's own error model accepts it


def test_every_grpc_code_has_an_http_status() -> None:
    assert set(http_errors.HTTP_STATUS) == set(ServeCode)


@pytest.mark.parametrize(
    ("message", "chat", "param", "text"),
    [
        ("sampling.top_p: must be in (0, 1], got 1.5", False, "top_p", "top_p: must be in (0, 1], got 1.5"),
        ("prompt.text: must not be empty", False, "prompt", "prompt: must not be empty"),
        ("prompt.token_ids: prompt is 2000 tokens", True, "messages", "messages: prompt is 2000 tokens"),
        ("sampling.stop[2]: must not be empty", False, "stop[2]", "stop[2]: must not be empty"),
        ("n: at most 128 sequences per call, got 500", False, "n", "n: at most 128 sequences per call, got 500"),
    ],
)
def test_invalid_argument_names_the_parameter_the_client_sent(message: str, chat: bool, param: str, text: str) -> None:
    status, body = http_errors.translate(ServeCode.INVALID_ARGUMENT, message, chat=chat)
    assert status == 400
    assert body["error"]["param"] == param
    assert body["error"]["message"] == text


def test_chat_renames_follow_what_the_client_used() -> None:
    renames = {"sampling.max_tokens": "max_completion_tokens", "sampling.logprobs": "top_logprobs"}
    _, body = http_errors.translate(
        ServeCode.INVALID_ARGUMENT, "sampling.max_tokens: 5000 does not fit", chat=True, renames=renames
    )
    assert body["error"]["param"] == "max_completion_tokens"
    assert body["error"]["message"].startswith("max_completion_tokens: 5000")


def test_prose_messages_carry_no_param() -> None:
    _, body = http_errors.translate(ServeCode.UNAVAILABLE, "node is draining; send to another node")
    assert body["error"]["param"] is None
    _, body = http_errors.translate(ServeCode.UNAVAILABLE, "engine unavailable: dead")
    assert body["error"]["param"] is None


def test_segment_modes_are_named_as_the_http_client_sends_them() -> None:
    """Serving's segment checks quote the gRPC enum; an HTTP client sent "exact" / "approximate" (``extra_body``), and
    every enum value serving knows has its HTTP spelling. Before, the HTTP message said SEGMENT_REUSE_EXACT."""
    from p2pnode.api.http import openai_requests
    from p2pnode.v1 import node_pb2

    assert {node_pb2.SegmentReuse.Name(v): f'"{k}"' for k, v in openai_requests.SEGMENT_MODES.items()} == \
        http_errors._HTTP_VALUES
    status, body = http_errors.translate(ServeCode.INVALID_ARGUMENT, "segment_reuse: must be SEGMENT_REUSE_EXACT or "
                                    "SEGMENT_REUSE_APPROXIMATE with segments", "segment_reuse")
    assert status == 400 and body["error"]["param"] == "segment_reuse"
    assert body["error"]["message"] == 'segment_reuse: must be "exact" or "approximate" with segments'


async def test_segments_without_a_mode_are_refused_in_http_terms() -> None:
    node = make_node()
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{node.http.address}", timeout=30) as http:
            body = {"model": "sim", "prompt": "shared context, then a question", "max_tokens": 1,
                    "segments": ["shared context"]}
            error = (await http.post("/v1/completions", json=body)).json()["error"]
            assert error["param"] == "segment_reuse" and "SEGMENT_REUSE" not in error["message"]
            assert '"exact"' in error["message"]
            body |= {"segment_reuse": "exact", "segment_recompute_tokens": 2}
            error = (await http.post("/v1/completions", json=body)).json()["error"]
            assert error["param"] == "segment_recompute_tokens" and error["message"].endswith('"approximate" only')
    finally:
        await node.stop()


def test_throttled_calls_say_rate_limit_or_overload_with_a_retry_after() -> None:
    """Over a tenant's rate limit is OpenAI's 429 RateLimitError; an overloaded node is 503 OverloadedError; both carry
    Retry-After in whole seconds (at least 1). Other failures carry none."""
    limited = ServeError(ServeCode.RESOURCE_EXHAUSTED, "rate limit: tenant 'a'", throttle=Throttle.RATE_LIMIT,
                         retry_after_s=0.2)
    overloaded = ServeError(ServeCode.RESOURCE_EXHAUSTED, "overloaded: queue full", throttle=Throttle.OVERLOAD,
                            retry_after_s=2.5)
    status, body = http_errors.translate_error(limited)
    assert status == 429 and body["error"]["type"] == "RateLimitError" and body["error"]["code"] == 429
    assert http_errors.retry_after_header(limited) == {"Retry-After": "1"}
    status, body = http_errors.translate_error(overloaded)
    assert status == 503 and body["error"]["type"] == "OverloadedError" and body["error"]["code"] == 503
    assert http_errors.retry_after_header(overloaded) == {"Retry-After": "3"}
    ErrorResponse.model_validate(body)
    assert http_errors.retry_after_header(ServeError(ServeCode.INTERNAL, "boom")) == {}
