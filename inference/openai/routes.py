"""Thin Litestar routes for ``/v1``: auth and admission guard, then hand over to ``OpenAIServing``.

:func:`openai_router` takes a provider (a zero-argument callable returning the
:class:`OpenAIServing`, or None while the engine is still loading) so the app can build the
router before its lifespan has loaded the engine; an ``OpenAIServing`` instance works too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

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
    ServerUnavailableError,
    UnsupportedMediaTypeError,
    openai_exception_handler,
    to_openai_error,
)
from inference.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelList
from inference.openai.serving import OpenAIServing

__all__ = ["ServingProvider", "any_key_matches", "check_api_key", "openai_router", "presented_keys"]

ServingProvider = Callable[[], "OpenAIServing | None"]

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


def openai_router(serving_provider: ServingProvider | OpenAIServing, *, path: str = "/v1") -> Router:
    """Routes ``GET /models``, ``POST /completions``, ``POST /chat/completions`` under ``path``."""
    if isinstance(serving_provider, OpenAIServing):
        instance = serving_provider

        def provider() -> OpenAIServing | None:
            return instance
    else:
        provider = serving_provider

    def current() -> OpenAIServing:
        serving = provider()
        if serving is None:
            raise ServerUnavailableError("the model is still loading; retry shortly")
        return serving

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        serving = current()
        check_api_key(
            serving.options.api_key,
            connection.headers.get("authorization"),
            connection.headers.get("x-api-key"),
        )
        serving.check_admitting()
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

    def respond(result: Any) -> Response[Any]:
        if isinstance(result, AsyncIterator):
            return ServerSentEvent(result)
        return Response(content=result)

    def documented(*statuses: int) -> dict[int, ResponseSpec]:
        return {
            code: ResponseSpec(data_container=ErrorResponse, description=_ERRORS[code]) for code in statuses
        }

    @get("/models", sync_to_thread=False, responses=documented(401, 503))
    def models() -> ModelList:
        return current().list_models()

    async def until_disconnect(request: Request[Any, Any, Any]) -> None:
        # After the body is read, the only message left is the client's disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def answer(request: Request[Any, Any, Any], work: Awaitable[Any]) -> Response[Any]:
        """Run ``work``; if the client hangs up first, cancel it so its slot frees at once.

        Streams watch for disconnects themselves; this covers the wait for a non-streamed
        answer (and a stream's first token), which would otherwise run to max_tokens.
        """
        task = asyncio.ensure_future(work)
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
        return respond(task.result())

    @post(
        "/completions",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": CompletionRequest},
    )
    async def completions(
        request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
    ) -> Response[Any]:
        return await answer(request, current().create_completion(data))

    @post(
        "/chat/completions",
        status_code=200,
        responses=documented(400, 401, 404, 415, 429, 503),
        opt={"body_type": ChatCompletionRequest},
    )
    async def chat_completions(
        request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]
    ) -> Response[Any]:
        return await answer(request, current().create_chat_completion(data))

    return Router(
        path=path,
        route_handlers=[models, completions, chat_completions],
        guards=[guard],
        before_request=strict_body,
        exception_handlers={Exception: openai_exception_handler},
        tags=["openai"],
    )
