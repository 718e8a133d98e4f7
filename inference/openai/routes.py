"""Thin Litestar routes: auth and admission guard, then hand over to an endpoint.

Under ``/v1``: ``GET /models``, ``GET /models/{id}``, ``POST /completions``,
``POST /chat/completions``, ``POST /responses``, ``POST /embeddings`` (OpenAI error body) and
``POST /messages``, ``POST /messages/count_tokens`` (Anthropic error body); at the root:
``POST /tokenize`` and ``POST /detokenize`` (vLLM's, OpenAI error body).

:func:`openai_router` takes the model pool (the only model source) and builds one endpoint
object per API surface over it. The POST routes are a table (:class:`Route`: path, body type,
error surface, the endpoint method that answers) served by one handler shape: check the body,
call the method (it holds the model in the pool and releases it when the answer or stream
ends), cancel it when the client hangs up. The API key is the router's, not a model's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent
from litestar.types import ExceptionHandler

from inference.openai.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
)
from inference.openai.api_keys import any_key_matches, presented_keys
from inference.openai.body_checks import (
    LARGE_BODY_BYTES,
    has_body,
    is_json_media_type,
    json_body_problem,
)
from inference.openai.chat import ChatEndpoint
from inference.openai.completions import CompletionEndpoint
from inference.openai.embeddings import EmbeddingsEndpoint
from inference.openai.embeddings_protocol import EmbeddingRequest
from inference.openai.errors import (
    AuthenticationError,
    ClientDisconnectedError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedMediaTypeError,
    anthropic_exception_handler,
    openai_exception_handler,
    to_openai_error,
)
from inference.openai.handle import ModelHandle
from inference.openai.messages import MessagesEndpoint
from inference.openai.models import ModelsEndpoint
from inference.openai.nullable import from_wire, wire_type
from inference.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from inference.openai.responses import ResponsesEndpoint
from inference.openai.responses_protocol import ResponsesRequest
from inference.openai.tokenize import TokenizeEndpoint
from inference.serving.model_pool import ModelPool

__all__ = [
    "ANTHROPIC",
    "OPENAI",
    "TOKENIZER",
    "ErrorSurface",
    "Route",
    "check_api_key",
    "openai_router",
]

# OpenAPI descriptions of the error statuses /v1 answers.
_ERRORS = {
    400: "Invalid request; `param` names the field (code `context_length_exceeded` for long prompts)",
    401: "Missing or wrong API key",
    404: "Unknown model (`model_not_found`)",
    415: "The body is not declared `application/json` (`unsupported_media_type`)",
    429: "Queue full or waited past --queue-timeout (`server_overloaded`, with Retry-After)",
    503: "Model loading or server shutting down (`server_unavailable`)",
}
_POST_STATUSES = (400, 401, 404, 415, 429, 503)


@dataclass(frozen=True)
class ErrorSurface:
    """How a family of routes reports errors: its exception handler, error body and OpenAPI tag."""

    tag: str
    handler: ExceptionHandler
    body: type[Any]

    def documented(self, *statuses: int) -> dict[int, ResponseSpec]:
        """The OpenAPI responses of ``statuses``, each with this surface's error body."""
        return {code: ResponseSpec(data_container=self.body, description=_ERRORS[code]) for code in statuses}


OPENAI = ErrorSurface("openai", openai_exception_handler, ErrorResponse)
ANTHROPIC = ErrorSurface("anthropic", anthropic_exception_handler, AnthropicErrorResponse)
TOKENIZER = ErrorSurface("tokenizer", openai_exception_handler, ErrorResponse)


@dataclass(frozen=True)
class Route:
    """One POST route that a model answers."""

    #: The operation's name (OpenAPI summary and operation id).
    name: str
    path: str
    #: The request type ``answer`` takes (decoded as its wire type: null for an optional field
    #: means its default).
    body: type[msgspec.Struct]
    surface: ErrorSurface
    #: The endpoint method: the body in, a response or an iterator of SSE events out.
    answer: Callable[[Any], Awaitable[Any]]


def check_api_key(expected: str | None, authorization: str | None, x_api_key: str | None) -> None:
    """Raise 401 unless one of the headers carries ``expected`` (compared in constant time)."""
    if expected is None:
        return
    candidates = presented_keys(authorization, x_api_key)
    if not any_key_matches(candidates, expected):
        detail = "invalid API key" if candidates else "missing API key"
        raise AuthenticationError(f"{detail}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")


def openai_router(pool: ModelPool[ModelHandle], *, api_key: str | None = None, path: str = "/v1") -> Router:
    """The OpenAI routes under ``path`` (the Anthropic ones too), ``/tokenize`` and ``/detokenize``
    at the root (see the module docstring), answered from ``pool``; ``api_key`` (when set) is
    required on every one."""
    models = ModelsEndpoint(pool)
    chat = ChatEndpoint(pool)
    completions = CompletionEndpoint(pool)
    embeddings = EmbeddingsEndpoint(pool)
    messages = MessagesEndpoint(chat)
    responses = ResponsesEndpoint(chat)
    tokenizer = TokenizeEndpoint(chat)
    routes = (
        Route("completions", f"{path}/completions", CompletionRequest, OPENAI, completions.create_completion),
        Route(
            "chat_completions",
            f"{path}/chat/completions",
            ChatCompletionRequest,
            OPENAI,
            chat.create_chat_completion,
        ),
        Route("responses", f"{path}/responses", ResponsesRequest, OPENAI, responses.create_response),
        Route("embeddings", f"{path}/embeddings", EmbeddingRequest, OPENAI, embeddings.create_embedding),
        Route("messages", f"{path}/messages", AnthropicMessagesRequest, ANTHROPIC, messages.create_message),
        Route(
            "count_tokens",
            f"{path}/messages/count_tokens",
            AnthropicCountTokensRequest,
            ANTHROPIC,
            messages.count_message_tokens,
        ),
        Route("tokenize", "/tokenize", TokenizeRequest, TOKENIZER, tokenizer.tokenize),
        Route("detokenize", "/detokenize", DetokenizeRequest, TOKENIZER, tokenizer.detokenize),
    )

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        check_api_key(
            api_key,
            connection.headers.get("authorization"),
            connection.headers.get("x-api-key"),
        )
        pool.check_admitting()
        if has_body(connection.headers) and not is_json_media_type(connection.headers.get("content-type")):
            raise UnsupportedMediaTypeError(
                "request bodies must be JSON: send 'Content-Type: application/json' "
                f"(got {connection.headers.get('content-type')!r})"
            )

    @get("/models", responses=OPENAI.documented(401, 503))
    async def list_models() -> ModelList:
        return await models.list_models()

    @get("/models/{model_id:path}", responses=OPENAI.documented(401, 404, 503))
    async def retrieve_model(model_id: FromPath[str]) -> ModelCard:
        # A path parameter, because served names may hold a slash (``org/model``). Litestar
        # gives it with one leading "/" (and folds "//"), so an absolute checkpoint path and a
        # relative name look alike: the name first, then the path.
        name = model_id.lstrip("/")
        try:
            return await models.model_card(name)
        except ModelNotFoundError:
            try:
                return await models.model_card("/" + name)
            except ModelNotFoundError:
                pass
            raise

    return Router(
        path="/",
        route_handlers=[
            Router(
                path=path,
                route_handlers=[list_models, retrieve_model],
                exception_handlers={Exception: OPENAI.handler},
                tags=[OPENAI.tag],
            ),
            *(_handler(route) for route in routes),
        ],
        guards=[guard],
        before_request=_strict_body,
    )


def _handler(route: Route) -> HTTPRouteHandler:
    """The one shape of every POST route: ``route.answer(body)``, cancelled when the client
    hangs up first; a stream becomes Server-Sent Events."""

    async def handler(request: Request[Any, Any, Any], data: Any) -> Response[Any]:
        result = await _until_answered(request, route.answer(from_wire(data, route.body)))
        if isinstance(result, AsyncIterator):
            return ServerSentEvent(result)
        return Response(content=result)

    # Litestar reads the body type (validation, OpenAPI) from the annotations: the wire type,
    # where an optional field also takes null (inference.openai.nullable).
    wire = wire_type(route.body)
    body = JSONBody[wire]  # type: ignore[valid-type]  # a type built at runtime
    handler.__annotations__ = {"request": Request[Any, Any, Any], "data": body, "return": Response[Any]}
    handler.__name__ = handler.__qualname__ = route.name
    return post(
        route.path,
        status_code=200,
        responses=route.surface.documented(*_POST_STATUSES),
        opt={"body_type": wire},
        exception_handlers={Exception: route.surface.handler},
        tags=[route.surface.tag],
    )(handler)


async def _strict_body(request: Request[Any, Any, Any]) -> None:
    """``before_request``: bound the nesting, check the text is Unicode, and check the body with
    OpenAI's strict types.

    Litestar converts bodies leniently (``"max_tokens": "10"`` would become 10); OpenAI
    answers 400, and so do we. The handler's own conversion then runs on a valid body.
    """
    body_type = request.route_handler.opt.get("body_type")
    if body_type is None:
        return
    body = await request.body()

    def check() -> None:
        problem = json_body_problem(body)
        if problem is not None:
            raise InvalidRequestError(problem.message, param=problem.path)
        try:
            msgspec.json.decode(body, type=body_type)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise to_openai_error(exc) from None

    if len(body) > LARGE_BODY_BYTES:
        await asyncio.to_thread(check)
    else:
        check()


async def _until_disconnect(request: Request[Any, Any, Any]) -> None:
    # After the body is read, the only message left is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_answered(request: Request[Any, Any, Any], answer: Awaitable[Any]) -> Any:
    """``answer``'s result; if the client hangs up first, cancel it so its slot frees at once.

    Streams watch for disconnects themselves; this covers the wait for the model's load, a
    non-streamed answer and a stream's first token, which would otherwise run to max_tokens.
    """
    task = asyncio.ensure_future(answer)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnectedError("the client closed the connection; generation was cancelled")
    return task.result()
