"""Thin Litestar routes for ``/v1``: auth and admission guard, then hand over to a model.

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
from inference.openai.pool import ModelLease, ModelPool
from inference.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelList
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
    """Routes ``GET /models``, ``POST /completions``, ``POST /chat/completions`` under ``path``;
    ``api_key`` (when set) is required on every one."""
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

    def documented(*statuses: int) -> dict[int, ResponseSpec]:
        return {
            code: ResponseSpec(data_container=ErrorResponse, description=_ERRORS[code]) for code in statuses
        }

    @get("/models", responses=documented(401, 503))
    async def list_models() -> ModelList:
        return await current().list_models()

    async def until_disconnect(request: Request[Any, Any, Any]) -> None:
        # After the body is read, the only message left is the client's disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def answer(
        request: Request[Any, Any, Any],
        body: CompletionRequest | ChatCompletionRequest,
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

    return Router(
        path=path,
        route_handlers=[list_models, completions, chat_completions],
        guards=[guard],
        before_request=strict_body,
        exception_handlers={Exception: openai_exception_handler},
        tags=["openai"],
    )


async def _run(
    models: Models,
    body: CompletionRequest | ChatCompletionRequest,
    work: Callable[[OpenAIServing], Awaitable[Any]],
) -> tuple[Any, ModelLease | _Held]:
    lease = await models.acquire(body.model, keep_alive=body.keep_alive)
    try:
        return await work(lease.serving), lease
    except BaseException:
        lease.release()
        raise


def _releasing(stream: AsyncIterator[str], lease: ModelLease | _Held) -> AsyncIterator[str]:
    """``stream``, releasing the model's lease when it ends or is dropped unstarted."""

    async def wrapped() -> AsyncIterator[str]:
        try:
            async for item in stream:
                yield item
        finally:
            lease.release()

    gen = wrapped()
    weakref.finalize(gen, lease.release)
    return gen
