"""``/v1/completions`` on one model's handle: prompt (text or token ids) -> response or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from inference.generation import StepOutput, TokenLogprob
from inference.openai.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OpenAIError,
    error_body,
)
from inference.openai.handle import (
    _DONE,
    MAX_TOP_LOGPROBS,
    ModelHandle,
    _closing,
    _json,
    _Plan,
    _Run,
    _usage,
)
from inference.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)

__all__ = ["CompletionEndpoints"]


class CompletionEndpoints(ModelHandle):
    """``POST /v1/completions``."""

    async def _completion_prompt(self, req: CompletionRequest) -> tuple[list[int], str]:
        prompt = req.prompt
        if isinstance(prompt, str):
            return await self._encode(prompt, add_special_tokens=True, param="prompt"), prompt
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return await self._encode(prompt[0], add_special_tokens=True, param="prompt"), prompt[0]
        if len(prompt) > self.options.max_input_len or (
            len(prompt) == 1 and isinstance(prompt[0], list) and len(prompt[0]) > self.options.max_input_len
        ):
            n = len(prompt) if len(prompt) > 1 else len(prompt[0])  # type: ignore[arg-type]
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens; this model accepts at most {self.options.max_input_len} "
                "input tokens",
                param="prompt",
            )
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        elif len(prompt) == 1 and isinstance(prompt[0], list):
            ids = list(prompt[0])
        else:
            raise InvalidRequestError(
                "prompt must be a string, a list with exactly one string, or a list of token ids "
                "(batched prompts are not supported)",
                param="prompt",
            )
        for t in ids:
            if not 0 <= t < self._vocab_size:
                raise InvalidRequestError(f"prompt token id {t} is outside the vocabulary", param="prompt")
        return ids, await asyncio.to_thread(self.tokenizer.decode, ids)

    async def create_completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """``POST /v1/completions``: a response, or an iterator of SSE data strings."""
        self.check_admitting()
        self._check_model(req.model)
        if req.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        grammar = await self._response_format_grammar(req.response_format)
        ids, text = await self._completion_prompt(req)
        plan = self._plan(
            req,
            prompt_ids=ids,
            prompt_text=text,
            prompt_param="prompt",
            max_tokens=req.max_tokens,
            max_tokens_param="max_tokens",
            top_logprobs=req.logprobs,
        )
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        run = self._submit(plan, await self._constraint(grammar))
        if plan.stream:
            first = await self._first(run)
            return _closing(run, self._completion_stream(run, first, plan, rid, created, req.model))
        text_out, lps, last = await self._collect(run)
        choice = CompletionChoice(
            index=0,
            text=text_out,
            finish_reason=last.finish_reason,
            logprobs=_completion_logprobs(lps, 0) if plan.want_logprobs else None,
        )
        return CompletionResponse(
            id=rid, created=created, model=req.model, choices=[choice], usage=_usage(last)
        )

    async def _completion_stream(
        self, run: _Run, first: StepOutput, plan: _Plan, rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        offset = 0
        try:
            out = first
            while True:
                if out.text or out.logprobs or out.finished:
                    lps = _completion_logprobs(out.logprobs, offset) if plan.want_logprobs else None
                    offset += sum(len(lp.token) for lp in out.logprobs)
                    choice = CompletionStreamChoice(
                        index=0, text=out.text, finish_reason=out.finish_reason, logprobs=lps
                    )
                    yield _json(
                        CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice])
                    )
                if out.finished:
                    break
                out = await run.next()
            if plan.include_usage:
                usage = CompletionStreamResponse(
                    id=rid, created=created, model=model, choices=[], usage=_usage(out)
                )
                yield _json(usage)
        except OpenAIError as exc:
            yield _json(error_body(exc))
        finally:
            run.close()
        yield _DONE


def _completion_logprobs(lps: Sequence[TokenLogprob], start_offset: int) -> CompletionLogprobs:
    offsets: list[int] = []
    pos = start_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return CompletionLogprobs(
        tokens=[lp.token for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[{t.token: t.logprob for t in lp.top} for lp in lps],
        text_offset=offsets,
    )
