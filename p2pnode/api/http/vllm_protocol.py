"""vLLM's OpenAI-compatible request and response types, and the front's modules built on them: what the HTTP front
(``server.py``) imports on the first call that needs them (``server.vllm_protocol``).

Why apart: importing them imports vLLM's config and torch, ~7 s of CPU on this host. A node whose engine is vLLM has
paid that already; a node on the simulated engine (``--engine sim``: the simulator's meshes, the fault suite, a
capacity planner's mesh) has not, and most such nodes never serve an OpenAI call, so its front starts without them and
the first call that reads a body loads them, off the node's event loop.
"""

from __future__ import annotations

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, ModelPermission
from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm.exceptions import VLLMValidationError
from vllm.version import __version__ as VLLM_VERSION

from p2pnode.api.http import anthropic_messages, responses_api
from p2pnode.api.http.openai_responses import ResponseBuilder

__all__ = [
    "VLLM_VERSION",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "LoadLoRAAdapterRequest",
    "ModelCard",
    "ModelList",
    "ModelPermission",
    "ResponseBuilder",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "UnloadLoRAAdapterRequest",
    "VLLMValidationError",
    "anthropic_messages",
    "clean_loc_for_param",
    "responses_api",
]
