"""OpenAI request bodies (vLLM's pydantic models) -> GenerateRequest: every supported parameter lands in the
gRPC request, unsupported ones are refused by name, defaults are vLLM's."""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from p2pnode.api.http import openai_requests as oa


def test_completion_sampling_parameters_reach_the_grpc_request() -> None:
    body = CompletionRequest.model_validate({
        "model": "tiny", "prompt": "hello", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "seed": 3, "stop": "END", "n": 2, "logprobs": 2, "presence_penalty": 0.1, "frequency_penalty": -0.2,
        "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "user": "u1",
    })
    [request] = oa.completion_requests(body, "rid")
    s = request.sampling
    assert request.text == "hello" and request.request_id == "rid" and request.n == 2
    assert (request.user, request.model) == ("u1", "tiny")
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), s.logprobs, s.min_tokens, s.ignore_eos) == (
        7, 5, 3, ["END"], 2, 2, True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.presence_penalty == pytest.approx(0.1) and s.frequency_penalty == pytest.approx(-0.2)
    assert s.repetition_penalty == pytest.approx(1.1)


def test_unset_parameters_stay_unset_and_vllm_defaults_apply() -> None:
    [request] = oa.completion_requests(CompletionRequest.model_validate({"prompt": [5, 6, 7]}), "")
    s = request.sampling
    assert list(request.token_ids.ids) == [5, 6, 7]
    assert s.max_tokens == 16  # vLLM's completion default
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "min_tokens"):
        assert not s.HasField(name), name
    assert oa.completion_requests(CompletionRequest.model_validate({"prompt": "x", "seed": -1}), "")[0] \
        .sampling.HasField("seed") is False  # vLLM: -1 is no seed


def test_several_prompts_become_several_requests() -> None:
    texts = oa.completion_requests(CompletionRequest.model_validate({"prompt": ["a", "b"]}), "")
    assert [r.text for r in texts] == ["a", "b"]
    ids = oa.completion_requests(CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}), "")
    assert [list(r.token_ids.ids) for r in ids] == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "allowed_token_ids": [1]}, "allowed_token_ids"),
        ({"prompt": "x", "seed": -5}, "seed"),
        ({"prompt": "x", "n": 0}, "n"),
    ],
)
def test_unsupported_or_unrepresentable_parameters_are_refused_by_name(body: dict, param: str) -> None:
    with pytest.raises(oa.BadParameter) as err:
        oa.completion_requests(CompletionRequest.model_validate(body), "", list(body))
    assert err.value.param == param


def test_vllm_sampling_parameters_reach_the_grpc_request() -> None:
    """min_p, stop_token_ids, include_stop_str_in_output, logit_bias (clamped to [-100, 100], as vLLM does),
    prompt_logprobs (echo asks for them), priority, and structured outputs from response_format or
    structured_outputs (vLLM's own normalization, as JSON)."""
    body = {"prompt": "x", "min_p": 0.25, "stop_token_ids": [7, 9], "include_stop_str_in_output": True,
            "logit_bias": {"5": 250.0, "6": -1.5}, "priority": 3, "echo": True, "logprobs": 2,
            "structured_outputs": {"choice": ["yes", "no"]}}
    s = oa.completion_requests(CompletionRequest.model_validate(body), "", list(body))[0].sampling
    assert s.min_p == 0.25 and list(s.stop_token_ids) == [7, 9] and s.include_stop_str_in_output
    assert dict(s.logit_bias) == {5: 100.0, 6: -1.5} and s.priority == 3 and s.prompt_logprobs == 2
    assert json.loads(s.structured_outputs) == {"choice": ["yes", "no"]}
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}})
    request = oa.chat_request(chat, "", [1, 2, 3], 64)
    assert json.loads(request.sampling.structured_outputs) == {"json": {"type": "object"}}
    assert request.sampling.prompt_logprobs == 0
    assert oa.chat_renames(chat)["sampling.structured_outputs"] == "response_format"


def test_defaults_sent_explicitly_are_fine() -> None:
    body = {"prompt": "x", "echo": False, "logit_bias": None, "use_beam_search": False, "best_of": None}
    assert oa.completion_requests(CompletionRequest.model_validate(body), "", list(body))


def test_chat_max_tokens_default_to_the_rest_of_the_context() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    request = oa.chat_request(body, "", [1, 2, 3], max_model_len=100)
    assert request.sampling.max_tokens == 97 and list(request.token_ids.ids) == [1, 2, 3]
    assert oa.chat_renames(body)["sampling.max_tokens"] == "max_completion_tokens"
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                                 "logprobs": True, "top_logprobs": 4})
    request = oa.chat_request(body, "", [1], max_model_len=100)
    assert request.sampling.max_tokens == 9 and request.sampling.logprobs == 4
    assert "sampling.max_tokens" not in oa.chat_renames(body)  # plain max_tokens: the default spelling


def test_chat_tools_are_refused() -> None:
    for extra, param in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),):
        data = {"messages": [{"role": "user", "content": "hi"}], **extra}
        sent = list(data)
        with pytest.raises(oa.BadParameter) as err:
            oa.check_supported(ChatCompletionRequest.model_validate(data), oa.CHAT_PARAMS, sent)
        assert err.value.param == param


def test_request_id_from_the_body_or_the_header() -> None:
    body = CompletionRequest.model_validate({"prompt": "x"})
    assert oa.call_request_id(body, {"x-request-id": "h"}) == "h"  # vLLM's random default is not the client's
    body = CompletionRequest.model_validate({"prompt": "x", "request_id": "b"})
    assert oa.call_request_id(body, {"x-request-id": "h"}) == "b"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [5, 10**12]}, "prompt"),
        ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
        ({"prompt": "x", "min_tokens": 2**40}, "min_tokens"),
        ({"prompt": "x", "logprobs": 2**40}, "logprobs"),
    ],
)
def test_numbers_the_grpc_request_cannot_carry_are_refused_by_name(body: dict[str, object], param: str) -> None:
    """Found by fuzzing: a JSON number beyond the proto field's range made the setter raise, and the HTTP API
    answered 500 with a traceback. Now it is a 400 naming the parameter."""
    with pytest.raises(oa.BadParameter) as info:
        oa.completion_requests(CompletionRequest.model_validate(body), "")
    assert info.value.param == param
