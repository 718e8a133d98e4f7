"""OpenAI request -> engine -> response or SSE chunks, for one model. Talks only to the ``Engine`` protocol.

:class:`OpenAIServing` is one model's handle (:mod:`inference.openai.handle`: engine, tokenizer,
scheduler, parsers, lifecycle) with its endpoints (:mod:`~inference.openai.completions`,
:mod:`~inference.openai.chat`). It validates a request (every error names its field), renders
the prompt, hands a :class:`~inference.scheduler.GenerationRequest` to the scheduler thread and
turns the outputs into OpenAI responses. Streams are async iterators of JSON strings (one per
SSE ``data:`` line) ending in ``[DONE]``; the routes wrap them in Litestar's SSE response.
"""

from __future__ import annotations

from inference.openai.chat import ChatEndpoints
from inference.openai.completions import CompletionEndpoints
from inference.openai.handle import AUTO_PARSERS, ServingObserver, ServingOptions, resolve_parsers
from inference.openai.messages import MessagesEndpoints
from inference.openai.responses import ResponsesEndpoints
from inference.openai.tokenize import TokenizeEndpoints

__all__ = ["AUTO_PARSERS", "OpenAIServing", "ServingObserver", "ServingOptions", "resolve_parsers"]


class OpenAIServing(
    CompletionEndpoints, MessagesEndpoints, ResponsesEndpoints, TokenizeEndpoints, ChatEndpoints
):
    """One model's handle with its endpoints: ``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/messages`` (Anthropic), ``/v1/responses``, ``/tokenize`` and ``/detokenize``."""
