"""``/tokenize`` and ``/detokenize`` on one model's handle (vLLM's request and response shapes)."""

from __future__ import annotations

import asyncio

import msgspec

from inference.openai.chat import ChatEndpoints
from inference.openai.errors import InvalidRequestError
from inference.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["TokenizeEndpoints"]


class TokenizeEndpoints(ChatEndpoints):
    """``POST /tokenize``, ``POST /detokenize``: the model's own tokenizer and chat template."""

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """A prompt, or messages through the chat template (as chat requests render them), to ids."""
        self.check_admitting()
        if req.model is not None:
            self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self._encode(req.prompt, add_special_tokens=special, param="prompt")
        else:
            assert req.messages is not None
            self._check_chat_size(req.messages)
            tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
            prompt = await self._render_chat(
                req.messages,
                tools=tools,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            ids = await self._encode(
                prompt, add_special_tokens=bool(req.add_special_tokens), param="messages"
            )
        strs = [self.tokenizer.token_text(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.options.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids back to text (special tokens dropped, as in generated text)."""
        self.check_admitting()
        if req.model is not None:
            self._check_model(req.model)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < self._vocab_size:
                raise InvalidRequestError(
                    f"token id {t} is outside the vocabulary (0..{self._vocab_size - 1})",
                    param=f"tokens[{i}]",
                )
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        return DetokenizeResponse(prompt=text)
