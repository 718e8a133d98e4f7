"""Thin Litestar routes: auth and admission guard, then hand over to a model.

Under ``/v1``: ``GET /models``, ``GET /models/{id}``, ``POST /completions``,
``POST /chat/completions``, ``POST /responses`` (OpenAI error body) and ``POST /messages``,
``POST /messages/count_tokens`` (Anthropic error body); at the root: ``POST /tokenize`` and
``POST /detokenize`` (vLLM's, OpenAI error body).

:func:`openai_router` takes the models: a :class:`~inference.openai.pool.ModelPool` (every
request ``acquire``s its model's handle and releases it when the answer or stream ends), an
:class:`OpenAIServing` (one model), or a zero-argument callable returning either (None while
loading). The API key is the router's, not a model's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent
from litestar.types import ExceptionHandlersMap

from inference.openai.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
)
from inference.openai.body_checks import (
    LARGE_BODY_BYTES,
    has_body,
    is_json_media_type,
    json_nesting_error,
)
from inference.openai.errors import (
    AuthenticationError,
    ClientDisconnectedError,
    InvalidRequestError,
    ModelNotFoundError,
    ServerUnavailableError,
    UnsupportedMediaTypeError,
    anthropic_exception_handler,
    openai_exception_handler,
    to_openai_error,
)
from inference.openai.pool import ModelLease, ModelPool
from inference.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from inference.openai.responses_protocol import ResponsesRequest
from inference.openai.serving import OpenAIServing

__all__ = [
    "Models",
    "ServingProvider",
    "SingleModel",
    "any_key_matches",
    "check_api_key",
    "openai_router",
    "presented_keys",
]


class _Held:
    """A one-model lease: nothing to release."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def release(self) -> None:
        return None


class SingleModel:
    """One always-loaded model behind the same interface as the pool."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def check_admitting(self) -> None:
        """503 unless the model admits requests."""
        self.serving.check_admitting()

    async def acquire(self, name: str, *, keep_alive: float | None = None) -> _Held:
        """The model itself (its own name check answers 404 for others)."""
        return _Held(self.serving)

    async def list_models(self) -> ModelList:
        """``GET /v1/models``."""
        return self.serving.list_models()

    async def model_card(self, name: str) -> ModelCard:
        """``GET /v1/models/{name}``."""
        return self.serving.model_card(name)

    @property
    def primary(self) -> str:
        """The model a request without ``model`` means."""
        return self.serving.options.served_model_name


Models = ModelPool | SingleModel
ServingProvider = Callable[[], "OpenAIServing | ModelPool | None"]

# OpenAPI descriptions of the error statuses /v1 answers (all with the OpenAI error body).
_ERRORS = {
    400: "Invalid request; `param` names the field (code `context_length_exceeded` for long prompts)",
    401: "Missing or wrong API key",
    404: "Unknown model (`model_not_found`)",
    415: "The body is not declared `application/json` (`unsupported_media_type`)",
    429: "Queue full or waited past --queue-timeout (`server_overloaded`, with Retry-After)",
    503: "Model loading or server shutting down (`server_unavailable`)",
}


def presented_keys(authorization: str | None, x_api_key: str | None) -> list[str]:
    """Credentials a request carries: ``Authorization: Bearer <key>`` and ``x-api-key: <key>``."""
    keys: list[str] = []
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            keys.append(token.strip())
    if x_api_key and x_api_key.strip():
        keys.append(x_api_key.strip())
    return keys


def any_key_matches(candidates: list[str], expected: str) -> bool:
    """Constant-time check of every candidate (no early exit, so timing does not reveal which)."""
    want = expected.encode("utf-8")
    ok = False
    for cand in candidates:
        ok |= hmac.compare_digest(cand.encode("utf-8"), want)
    return ok


def check_api_key(expected: str | None, authorization: str | None, x_api_key: str | None) -> None:
    """Raise 401 unless one of the headers carries ``expected`` (compared in constant time)."""
    if expected is None:
        return
    candidates = presented_keys(authorization, x_api_key)
    if not any_key_matches(candidates, expected):
        detail = "invalid API key" if candidates else "missing API key"
        raise AuthenticationError(f"{detail}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")


def openai_router(
    models: ServingProvider | OpenAIServing | ModelPool,
    *,
    api_key: str | None = None,
    path: str = "/v1",
) -> Router:
    """The OpenAI routes under ``path`` (the Anthropic ones too), ``/tokenize`` and ``/detokenize``
    at the root (see the module docstring); ``api_key`` (when set) is required on every one."""
    if isinstance(models, OpenAIServing | ModelPool):
        instance = models

        def provider() -> OpenAIServing | ModelPool | None:
            return instance
    else:
        provider = models

    def current() -> Models:
        found = provider()
        if found is None:
            raise ServerUnavailableError("the model is still loading; retry shortly")
        return SingleModel(found) if isinstance(found, OpenAIServing) else found

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        check_api_key(
            api_key,
            connection.headers.get("authorization"),
            connection.headers.get("x-api-key"),
        )
        current().check_admitting()
        if has_body(connection.headers) and not is_json_media_type(connection.headers.get("content-type")):
            raise UnsupportedMediaTypeError(
                "request bodies must be JSON: send 'Content-Type: application/json' "
                f"(got {connection.headers.get('content-type')!r})"
            )

    async def strict_body(request: Request[Any, Any, Any]) -> None:
        """``before_request``: bound the nesting and check the body with OpenAI's strict types.

        Litestar converts bodies leniently (``"max_tokens": "10"`` would become 10); OpenAI
        answers 400, and so do we. The handler's own conversion then runs on a valid body.
        """
        body_type = request.route_handler.opt.get("body_type")
        if body_type is None:
            return
        body = await request.body()

        def check() -> None:
            problem = json_nesting_error(body)
            if problem is not None:
                raise InvalidRequestError(problem)
            try:
                msgspec.json.decode(body, type=body_type)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise to_openai_error(exc) from None

        if len(body) > LARGE_BODY_BYTES:
            await asyncio.to_thread(check)
        else:
            check()

    def respond(result: Any, lease: ModelLease | _Held) -> Response[Any]:
        if isinstance(result, AsyncIterator):
            return ServerSentEvent(_releasing(result, lease))
        lease.release()
        return Response(content=result)

    def documented(*statuses: int, body: type[Any] = ErrorResponse) -> dict[int, ResponseSpec]:
        return {code: ResponseSpec(data_container=body, description=_ERRORS[code]) for code in statuses}

    @get("/models", responses=documented(401, 503))
    async def list_models() -> ModelList:
        return await current().list_models()

    @get("/models/{model_id:path}", responses=documented(401, 404, 503))
    async def retrieve_model(model_id: FromPath[str]) -> ModelCard:
        # A path parameter, because served names may hold a slash (``org/model``). Litestar
        # gives it with one leading "/" (and folds "//"), so an absolute checkpoint path and a
        # relative name look alike: the name first, then the path.
        models = current()
        name = model_id.lstrip("/")
        try:
            return await models.model_card(name)
        except ModelNotFoundError:
            try:
                return await models.model_card("/" + name)
            except ModelNotFoundError:
                pass
            raise

    async def until_disconnect(request: Request[Any, Any, Any]) -> None:
        # After the body is read, the only message left is the client's disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def answer(
        request: Request[Any, Any, Any],
        body: _Routed,
        work: Callable[[OpenAIServing], Awaitable[Any]],
    ) -> Response[Any]:
        """Acquire the model, run ``work`` on it and release it when the answer is written.

        If the client hangs up first, cancel the work so its slot frees at once. Streams watch
        for disconnects themselves; this covers the wait for the model's load, a non-streamed
        answer and a stream's first token, which would otherwise run to max_tokens.
        """
        task = asyncio.ensure_future(_run(current(), body, work))
        watcher = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnectedError("the client closed the connection; generation was cancelled")
        result, lease = task.result()
        return respond(result, lease)

    @post(
        "/completions",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": CompletionRequest},
    )
    async def completions(
        request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
    ) -> Response[Any]:
        return await answer(request, data, lambda s: s.create_completion(data))

    @post(
        "/chat/completions",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": ChatCompletionRequest},
    )
    async def chat_completions(
        request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]
    ) -> Response[Any]:
        return await answer(request, data, lambda s: s.create_chat_completion(data))

    @post(
        "/responses",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": ResponsesRequest},
    )
    async def responses(request: Request[Any, Any, Any], data: JSONBody[ResponsesRequest]) -> Response[Any]:
        return await answer(request, data, lambda s: s.create_response(data))

    @post(
        "/messages",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503, body=AnthropicErrorResponse),
        opt={"body_type": AnthropicMessagesRequest},
    )
    async def messages(
        request: Request[Any, Any, Any], data: JSONBody[AnthropicMessagesRequest]
    ) -> Response[Any]:
        return await answer(request, data, lambda s: s.create_message(data))

    @post(
        "/messages/count_tokens",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503, body=AnthropicErrorResponse),
        opt={"body_type": AnthropicCountTokensRequest},
    )
    async def count_tokens(
        request: Request[Any, Any, Any], data: JSONBody[AnthropicCountTokensRequest]
    ) -> Response[Any]:
        return await answer(request, data, lambda s: s.count_message_tokens(data))

    @post(
        "/tokenize",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": TokenizeRequest},
    )
    async def tokenize(request: Request[Any, Any, Any], data: JSONBody[TokenizeRequest]) -> Response[Any]:
        return await answer(request, data, lambda s: s.tokenize(data))

    @post(
        "/detokenize",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": DetokenizeRequest},
    )
    async def detokenize(request: Request[Any, Any, Any], data: JSONBody[DetokenizeRequest]) -> Response[Any]:
        return await answer(request, data, lambda s: s.detokenize(data))

    shared: dict[str, Any] = {"guards": [guard], "before_request": strict_body}
    openai_errors: ExceptionHandlersMap = {Exception: openai_exception_handler}
    return Router(
        path="/",
        route_handlers=[
            Router(
                path=path,
                route_handlers=[list_models, retrieve_model, completions, chat_completions, responses],
                exception_handlers=openai_errors,
                tags=["openai"],
                **shared,
            ),
            Router(
                path=path,
                route_handlers=[messages, count_tokens],
                exception_handlers={Exception: anthropic_exception_handler},
                tags=["anthropic"],
                **shared,
            ),
            Router(
                path="/",
                route_handlers=[tokenize, detokenize],
                exception_handlers=openai_errors,
                tags=["tokenizer"],
                **shared,
            ),
        ],
    )


_Routed = (
    CompletionRequest
    | ChatCompletionRequest
    | ResponsesRequest
    | AnthropicMessagesRequest
    | AnthropicCountTokensRequest
    | TokenizeRequest
    | DetokenizeRequest
)


async def _run(
    models: Models,
    body: _Routed,
    work: Callable[[OpenAIServing], Awaitable[Any]],
) -> tuple[Any, ModelLease | _Held]:
    name = body.model
    if name is None:
        # /tokenize and /detokenize may leave the model out (vLLM): the server's own model.
        name = models.primary
        if name is None:
            raise InvalidRequestError("model is required: this server has no default model", param="model")
    lease = await models.acquire(name, keep_alive=body.keep_alive)
    try:
        return await work(lease.serving), lease
    except BaseException:
        lease.release()
        raise


def _releasing(stream: AsyncIterator[Any], lease: ModelLease | _Held) -> AsyncIterator[Any]:
    """``stream``, releasing the model's lease when it ends or is dropped unstarted."""

    async def wrapped() -> AsyncIterator[Any]:
        try:
            async for item in stream:
                yield item
        finally:
            lease.release()

    gen = wrapped()
    weakref.finalize(gen, lease.release)
    return gen
