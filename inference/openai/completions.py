"""``/v1/completions`` over the model pool: prompt(s) (text or token ids) -> response or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from inference.openai.chat import check_text_length
from inference.openai.constraints import guided_grammar, response_format_grammar
from inference.openai.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OpenAIError,
    error_body,
)
from inference.openai.handle import (
    CHARS_MARGIN,
    DONE,
    MAX_PROMPT_LIST_TOKENS,
    MAX_PROMPTS,
    ModelHandle,
    to_json,
    usage_of,
)
from inference.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from inference.serving.engine_client import ChoiceRun, closing, collect_all, first_outputs, interleave
from inference.serving.generation import StepOutput, TokenLogprob
from inference.serving.generation_spec import GenerationSpec
from inference.serving.model_pool import ModelHold, ModelPool

__all__ = ["CompletionEndpoint"]


class CompletionEndpoint:
    """``POST /v1/completions`` over the model pool."""

    def __init__(self, pool: ModelPool[ModelHandle]) -> None:
        self.pool = pool

    async def create_completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """``POST /v1/completions``: a response, or an iterator of SSE data strings.

        ``prompt`` may list several prompts (strings, or lists of token ids): their choices are
        submitted together (the scheduler batches them) and indexed as OpenAI does, prompt-major:
        choice ``j`` of prompt ``i`` is ``index = i * n + j``; ``usage`` counts every prompt once
        and sums the completions.

        ``echo`` puts the prompt text before each choice's text; with ``logprobs`` the prompt's
        tokens are listed too, with ``null`` logprobs (the engine computes logits for the last
        prompt position only).
        """
        async with self.pool.hold(req.model, keep_alive=req.keep_alive) as held:
            return await self._complete(held, req)

    def _prompt_list(self, handle: ModelHandle, req: CompletionRequest) -> list[str | list[int]]:
        """``prompt`` in each form OpenAI accepts, as a list of prompts: a string, a list of
        strings, a list of token ids (one prompt), or a list of lists of token ids."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be an empty list", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [[int(t) for t in prompt]]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            prompts: list[str | list[int]] = list(prompt)  # type: ignore[arg-type]
        else:
            raise InvalidRequestError(
                "prompt must be a string, a list of strings, a list of token ids or a list of lists "
                "of token ids; a list may not mix these",
                param="prompt",
            )
        n_seqs = len(prompts) * req.n
        scheduler = handle.client.scheduler
        capacity = scheduler.max_batch_size + scheduler.max_queued_requests
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"prompt lists {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed per request",
                param="prompt",
            )
        if len(prompts) > 1 and n_seqs > capacity:
            # One prompt's n choices keep the scheduler's answer (429 when they do not fit now).
            raise InvalidRequestError(
                f"prompt lists {len(prompts)} prompts with n={req.n}: {n_seqs} sequences, more than "
                f"this server runs or queues at once ({capacity}); send fewer prompts per request",
                param="prompt",
            )
        return prompts

    async def _completion_prompts(
        self, handle: ModelHandle, req: CompletionRequest
    ) -> list[tuple[list[int], str]]:
        """Every prompt of the request as (token ids, text), checked: each within the model's
        input length and vocabulary, all together within :data:`MAX_PROMPT_LIST_TOKENS`."""
        prompts = self._prompt_list(handle, req)
        limit = handle.options.max_input_len
        texts = [p for p in prompts if isinstance(p, str)]
        if len(prompts) > 1:
            # Refuse before tokenizing: the cost of a len(), not seconds of work.
            chars = sum(len(t) for t in texts)
            budget = MAX_PROMPT_LIST_TOKENS * handle.tokenizer.max_token_chars * CHARS_MARGIN
            if chars > budget:
                raise InvalidRequestError(
                    f"prompt lists {chars} characters, more than {MAX_PROMPT_LIST_TOKENS} tokens can "
                    f"hold over all prompts (at most {budget} characters); send fewer or shorter prompts",
                    param="prompt",
                )

        def where(i: int) -> str:
            return f"prompt[{i}]" if len(prompts) > 1 else "prompt"

        for i, p in enumerate(prompts):
            if isinstance(p, str):
                check_text_length(handle, len(p), "prompt")
            elif len(p) > limit:
                raise ContextLengthExceededError(
                    f"{where(i)} has {len(p)} tokens; this model accepts at most {limit} input tokens",
                    param="prompt",
                )
        encoded = await asyncio.gather(
            *(
                asyncio.to_thread(handle.tokenizer.encode, p, add_special_tokens=True)
                for p in texts
            )
        )
        out: list[tuple[list[int], str]] = []
        by_text = iter(encoded)
        for i, p in enumerate(prompts):
            ids = next(by_text) if isinstance(p, str) else p
            if not ids:  # an empty list, or text of no tokens: named here, with its index
                raise InvalidRequestError(f"{where(i)} is empty", param="prompt")
            if isinstance(p, str):
                out.append((ids, p))
                continue
            for t in p:
                if not 0 <= t < handle.vocab_size:
                    raise InvalidRequestError(
                        f"{where(i)}: token id {t} is outside the vocabulary", param="prompt"
                    )
            out.append((p, ""))
        total = sum(len(ids) for ids, _ in out)
        if total > MAX_PROMPT_LIST_TOKENS:
            raise InvalidRequestError(
                f"prompt lists {total} tokens over {len(out)} prompts; at most {MAX_PROMPT_LIST_TOKENS} "
                "are allowed per request",
                param="prompt",
            )
        # Token-id prompts are decoded for echo only (text prompts keep their own text).
        decoded = await asyncio.gather(
            *(asyncio.to_thread(handle.tokenizer.decode, ids) for ids, text in out if not text and req.echo)
        )
        texts_out = iter(decoded)
        return [(ids, text or (next(texts_out) if req.echo else "")) for ids, text in out]

    async def _complete(
        self, held: ModelHold[ModelHandle], req: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        handle = held.handle
        handle.client.check_admitting()
        req.check_supported()
        fmt = req.response_format
        taken = "response_format" if fmt is not None and fmt.type != "text" else None
        client = handle.client
        grammar = await guided_grammar(client, req, taken) or await response_format_grammar(client, fmt)
        prompts = await self._completion_prompts(handle, req)
        handle.check_generates()
        adapter = handle.lora_names.get(req.model)
        specs: list[GenerationSpec] = [
            req.to_spec(ids, client.limits, prompt_param="prompt", grammar=grammar, adapter=adapter)
            for ids, _ in prompts
        ]
        echoes: list[_Echo | None] = []
        for spec, (ids, text) in zip(specs, prompts, strict=True):
            echo = None
            if req.echo:
                prompt_lps = _prompt_logprobs(handle, ids) if spec.logprobs else None
                echo = _Echo(text, prompt_lps)
            echoes += [echo] * spec.n
        logprobs = specs[0].logprobs
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        runs = await client.generate(*specs)  # prompt-major: index = i * n + j
        if req.stream:
            firsts = await first_outputs(runs)
            stream = self._completion_stream(runs, firsts, req, logprobs, rid, created, echoes)
            return held.held_by(closing(runs, stream))
        choices: list[CompletionChoice] = []
        outcomes = await collect_all(runs)
        for index, ((text_out, lps, last), echo) in enumerate(zip(outcomes, echoes, strict=True)):
            choice_lps = None
            if logprobs:
                choice_lps = _completion_logprobs(lps, len(echo.text) if echo else 0)
                if echo is not None and echo.logprobs is not None:
                    choice_lps = _joined(echo.logprobs, choice_lps)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=(echo.text if echo else "") + text_out,
                    finish_reason=last.finish_reason,
                    logprobs=choice_lps,
                )
            )
        usage = usage_of(*(last for _, _, last in outcomes), n=req.n)
        return CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage)

    async def _completion_stream(
        self,
        runs: list[ChoiceRun],
        firsts: list[StepOutput],
        req: CompletionRequest,
        logprobs: bool,
        rid: str,
        created: int,
        echoes: Sequence[_Echo | None],
    ) -> AsyncIterator[str]:
        model = req.model

        def chunk(index: int, text: str, finish: str | None, lps: CompletionLogprobs | None) -> str:
            choice = CompletionStreamChoice(index=index, text=text, finish_reason=finish, logprobs=lps)
            return to_json(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))

        offsets = [len(echo.text) if echo else 0 for echo in echoes]
        lasts = list(firsts)
        try:
            for index, echo in enumerate(echoes):
                if echo is not None:
                    yield chunk(index, echo.text, None, echo.logprobs)
            async for index, out in interleave(runs, firsts):
                lasts[index] = out
                if out.text or out.logprobs or out.finished:
                    lps = _completion_logprobs(out.logprobs, offsets[index]) if logprobs else None
                    offsets[index] += sum(len(lp.token) for lp in out.logprobs)
                    yield chunk(index, out.text, out.finish_reason, lps)
            if req.stream_usage:
                usage = CompletionStreamResponse(
                    id=rid, created=created, model=model, choices=[], usage=usage_of(*lasts, n=req.n)
                )
                yield to_json(usage)
        except OpenAIError as exc:
            yield to_json(error_body(exc))
        finally:
            for run in runs:
                run.close()
        yield DONE


@dataclass(frozen=True)
class _Echo:
    """What ``echo`` puts before every choice."""

    text: str
    #: The prompt's tokens, when logprobs are asked for.
    logprobs: CompletionLogprobs | None


def _prompt_logprobs(handle: ModelHandle, ids: Sequence[int]) -> CompletionLogprobs:
    """The prompt's tokens for an echo with logprobs: texts and offsets, no logprobs."""
    tokens = [handle.tokenizer.token_text(t) for t in ids]
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
