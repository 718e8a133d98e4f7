"""``/tokenize`` and ``/detokenize`` over the model pool (vLLM's request and response shapes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec

from inference.openai.chat import ChatEndpoint, encode
from inference.openai.errors import InvalidRequestError
from inference.openai.handle import ModelHandle
from inference.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["TokenizeEndpoint"]


class TokenizeEndpoint:
    """``POST /tokenize``, ``POST /detokenize``: the model's own tokenizer, and its chat template
    as the chat endpoint renders it. ``model`` may be left out: the pool's default model."""

    def __init__(self, chat: ChatEndpoint) -> None:
        self.chat = chat

    @contextlib.asynccontextmanager
    async def _model(self, name: str | None, keep_alive: float | None) -> AsyncIterator[ModelHandle]:
        """The handle of the model ``name`` (the pool's default one when None), held for the block."""
        pool = self.chat.pool
        name = name if name is not None else pool.default_model()
        async with pool.hold(name, keep_alive=keep_alive) as held:
            held.handle.client.check_admitting()
            yield held.handle

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """A prompt, or messages through the chat template (as chat requests render them), to ids."""
        async with self._model(req.model, req.keep_alive) as handle:
            if (req.prompt is None) == (req.messages is None):
                raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
            if req.prompt is not None:
                special = True if req.add_special_tokens is None else req.add_special_tokens
                ids = await encode(handle, req.prompt, add_special_tokens=special, param="prompt")
            else:
                assert req.messages is not None
                self.chat.check_size(handle, req.messages)
                tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
                rendered = await self.chat.prompt_ids(
                    handle,
                    req.messages,
                    tools=tools,
                    add_generation_prompt=req.add_generation_prompt,
                    chat_template_kwargs=req.chat_template_kwargs,
                    add_special_tokens=bool(req.add_special_tokens),
                )
                ids = rendered.ids
            strs = [handle.tokenizer.token_text(t) for t in ids] if req.return_token_strs else None
            return TokenizeResponse(
                count=len(ids), max_model_len=handle.options.max_model_len, tokens=ids, token_strs=strs
            )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids back to text (special tokens dropped, as in generated text)."""
        async with self._model(req.model, req.keep_alive) as handle:
            for i, t in enumerate(req.tokens):
                if not 0 <= t < handle.vocab_size:
                    raise InvalidRequestError(
                        f"token id {t} is outside the vocabulary (0..{handle.vocab_size - 1})",
                        param=f"tokens[{i}]",
                    )
            text = await asyncio.to_thread(handle.tokenizer.decode, req.tokens)
            return DetokenizeResponse(prompt=text)
