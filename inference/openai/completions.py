"""``/v1/completions`` on one model's handle: prompt (text or token ids) -> response or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

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
    _interleave,
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
        """``POST /v1/completions``: a response, or an iterator of SSE data strings.

        ``echo`` puts the prompt text before each choice's text; with ``logprobs`` the prompt's
        tokens are listed too, with ``null`` logprobs (the engine computes logits for the last
        prompt position only).
        """
        self.check_admitting()
        self._check_model(req.model)
        if req.suffix:
            raise InvalidRequestError(
                f"suffix is not supported: the model {req.model!r} on this server does not do insertion "
                "(fill-in-the-middle); send the whole prompt without suffix",
                param="suffix",
            )
        if req.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        fmt = req.response_format
        taken = "response_format" if fmt is not None and fmt.type != "text" else None
        grammar = await self._guided_grammar(req, taken) or await self._response_format_grammar(fmt)
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
        echo = _Echo(text, self._prompt_logprobs(ids) if plan.want_logprobs else None) if req.echo else None
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        runs = self._submit(plan, await self._constraints(grammar, plan.n))
        if plan.stream:
            firsts = await self._first(runs)
            return _closing(runs, self._completion_stream(runs, firsts, plan, rid, created, req.model, echo))
        choices: list[CompletionChoice] = []
        outcomes = await self._collect_all(runs)
        for index, (text_out, lps, last) in enumerate(outcomes):
            logprobs = None
            if plan.want_logprobs:
                logprobs = _completion_logprobs(lps, len(echo.text) if echo else 0)
                if echo is not None and echo.logprobs is not None:
                    logprobs = _joined(echo.logprobs, logprobs)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=(echo.text if echo else "") + text_out,
                    finish_reason=last.finish_reason,
                    logprobs=logprobs,
                )
            )
        usage = _usage(*(last for _, _, last in outcomes))
        return CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage)

    def _prompt_logprobs(self, ids: Sequence[int]) -> CompletionLogprobs:
        """The prompt's tokens for an echo with logprobs: texts and offsets, no logprobs."""
        tokens = [self.tokenizer.token_text(t) for t in ids]
        offsets: list[int] = []
        pos = 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None] * len(tokens),
            top_logprobs=[None] * len(tokens),
            text_offset=offsets,
        )

    async def _completion_stream(
        self,
        runs: list[_Run],
        firsts: list[StepOutput],
        plan: _Plan,
        rid: str,
        created: int,
        model: str,
        echo: _Echo | None,
    ) -> AsyncIterator[str]:
        def chunk(index: int, text: str, finish: str | None, lps: CompletionLogprobs | None) -> str:
            choice = CompletionStreamChoice(index=index, text=text, finish_reason=finish, logprobs=lps)
            return _json(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))

        offsets = [len(echo.text) if echo else 0] * len(runs)
        lasts = list(firsts)
        try:
            if echo is not None:
                for index in range(len(runs)):
                    yield chunk(index, echo.text, None, echo.logprobs)
            async for index, out in _interleave(runs, firsts):
                lasts[index] = out
                if out.text or out.logprobs or out.finished:
                    lps = _completion_logprobs(out.logprobs, offsets[index]) if plan.want_logprobs else None
                    offsets[index] += sum(len(lp.token) for lp in out.logprobs)
                    yield chunk(index, out.text, out.finish_reason, lps)
            if plan.include_usage:
                usage = CompletionStreamResponse(
                    id=rid, created=created, model=model, choices=[], usage=_usage(*lasts)
                )
                yield _json(usage)
        except OpenAIError as exc:
            yield _json(error_body(exc))
        finally:
            for run in runs:
                run.close()
        yield _DONE


@dataclass(frozen=True)
class _Echo:
    """What ``echo`` puts before every choice."""

    text: str
    #: The prompt's tokens, when logprobs are asked for.
    logprobs: CompletionLogprobs | None


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


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
