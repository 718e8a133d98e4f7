"""The per-model handle: one loaded model as the serving surfaces see it.

:class:`ModelHandle` holds what every endpoint of one model shares: its engine client
(:class:`~inference.serving.engine_client.EngineClient`: engine, tokenizer, scheduler, lifecycle and
``generate``), what this server promises for it (:class:`ServingOptions`), its reasoning and
tool-call parsers, the served names of its LoRA adapters and its vision and embedding sides. The
model pool (:mod:`inference.serving.model_pool`) holds one handle per loaded model; the endpoints
(``completions``, ``chat`` and the surfaces built on chat) take a hold on a handle for each
request, convert the request into a generation spec and run it with ``handle.client.generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from inference.families import auto_parsers
from inference.images.features import DEFAULT_IMAGE_CACHE_BYTES
from inference.images.media import MediaPolicy
from inference.openai.errors import InvalidRequestError
from inference.openai.protocol import PromptTokensDetails, Usage
from inference.openai.reasoning import ReasoningParser, get_reasoning_parser
from inference.openai.tool_parsers import ToolParser, get_tool_parser
from inference.runtime.protocol import Embedder, Engine, ImageEngine, VisionModel
from inference.serving.context_cache import PrefixStore
from inference.serving.engine_client import EngineClient
from inference.serving.generation import StepOutput
from inference.serving.scheduler import SchedulerObserver
from inference.serving.speculative import ProposerFactory
from inference.serving.structured import GrammarLimits
from inference.serving.tokenizer import Tokenizer

__all__ = ["AUTO_PARSERS", "ModelHandle", "ServingObserver", "ServingOptions", "resolve_parsers"]

# Metrics hooks: the scheduler calls them from its thread.
ServingObserver = SchedulerObserver

#: Most prompts one ``/v1/completions`` request may list (OpenAI's own limit is 2048 for
#: embeddings-style batches; a generating server holds every choice of every prompt at once,
#: and the scheduler's slots and queue bound that further).
MAX_PROMPTS = 64
#: Most prompt tokens one ``/v1/completions`` request may list over all its prompts (each one
#: is also bounded by the model's ``max_input_len``): tokenizing and holding them is work done
#: before anything is admitted.
MAX_PROMPT_LIST_TOKENS = 65536
#: Safety factor on the cheap "too long to tokenize" bound (normalizers may fold characters).
CHARS_MARGIN = 2
DONE = "[DONE]"

# ``auto`` parser choice by config.json ``model_type``: (reasoning parser, tool-call parser),
# as each model family declares it (:mod:`inference.families`). Anything else: no parsing unless
# named.
AUTO_PARSERS: dict[str, tuple[str, str]] = auto_parsers()


def resolve_parsers(model_type: str, reasoning: str, tool_call: str) -> tuple[str, str]:
    """Turn ``auto`` into concrete parser names for ``model_type`` (see :data:`AUTO_PARSERS`)."""
    auto = AUTO_PARSERS.get(model_type.lower(), ("none", "none"))
    return (auto[0] if reasoning == "auto" else reasoning, auto[1] if tool_call == "auto" else tool_call)


@dataclass(frozen=True)
class ServingOptions:
    """What one model promises: its name, limits and parsers (auth is the router's)."""

    served_model_name: str
    max_model_len: int
    max_input_len: int
    max_batch_size: int
    max_queued_requests: int = 16
    queue_timeout: float = 600.0
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    enable_auto_tool_choice: bool = False
    model_type: str = ""
    capabilities: Mapping[str, object] = field(default_factory=dict)
    #: What one request's structured-output constraint may cost (schema size, compile time).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    #: Where image parts may come from besides data: URLs (local files, fetched hosts).
    media: MediaPolicy = field(default_factory=MediaPolicy)
    #: Bytes of image features a vision-language model keeps by image digest (0: none).
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("max_model_len", "max_input_len", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be 0 or more")
        if self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be positive")


def to_json(value: msgspec.Struct | dict[str, Any]) -> str:
    return msgspec.json.encode(value).decode("utf-8")


class ModelHandle:
    """One loaded model as the serving surfaces see it (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        options: ServingOptions,
        *,
        observer: ServingObserver | None = None,
        context_cache: PrefixStore | None = None,
        prefill_chunk: int = 256,
        proposer: ProposerFactory | None = None,
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Build the engine client; raise ValueError for an unknown or unsupported parser name.

        ``context_cache`` enables context reuse (engines with the KV operations only).
        """
        self.options = options
        self.engine = engine
        self.tokenizer = tokenizer
        #: The engine's embedding side when the bundle is an embedding model (``/v1/embeddings``),
        #: else None; an embedding model answers no generation request.
        self.embedder: Embedder | None = engine if isinstance(engine, Embedder) else None
        #: The bundle's vision side (image parts accepted) or None (a text-only model).
        self.vision: VisionModel | None = engine.vision if isinstance(engine, ImageEngine) else None
        #: Served names that run this model with a LoRA adapter loaded in its engine: name ->
        #: the engine's adapter name (``--lora-modules``, ``POST /v1/load_lora_adapter``).
        self.lora_names: dict[str, str] = {}
        reasoning_name, tool_name = resolve_parsers(
            options.model_type or engine.info.model_type, options.reasoning_parser, options.tool_call_parser
        )
        self.reasoning_parser_name = reasoning_name
        self.tool_call_parser_name = tool_name
        self.reasoning: ReasoningParser | None = get_reasoning_parser(reasoning_name)
        self.tool_parser: ToolParser | None = get_tool_parser(tool_name)
        self.client = EngineClient(
            engine,
            tokenizer,
            max_model_len=options.max_model_len,
            max_input_len=options.max_input_len,
            max_batch_size=options.max_batch_size,
            max_queued_requests=options.max_queued_requests,
            queue_timeout=options.queue_timeout,
            grammar_limits=options.grammar_limits,
            observer=observer,
            context_cache=context_cache,
            prefill_chunk=prefill_chunk,
            proposer=proposer,
            closers=closers,
            image_cache_bytes=options.image_cache_bytes,
        )
        #: Image features by image digest, for a vision model (the engine client's).
        self.image_cache = self.client.image_cache
        self.vocab_size = self.client.limits.vocab_size
        #: Text longer than this cannot fit ``max_input_len`` tokens: refused before tokenizing.
        self.max_prompt_chars = options.max_input_len * tokenizer.max_token_chars * CHARS_MARGIN

    def health(self) -> dict[str, Any]:
        """Status for ``/health``: ok | draining | stopped (stopped also before start) |
        unavailable (with its reason)."""
        client = self.client
        scheduler = client.scheduler
        caps: dict[str, Any] = {
            "chat": self.tokenizer.has_chat_template,
            "completions": True,
            "streaming": True,
            "reasoning_parser": self.reasoning_parser_name,
            "tool_call_parser": self.tool_call_parser_name,
            "auto_tool_choice": self.options.enable_auto_tool_choice,
            "max_model_len": self.options.max_model_len,
            "max_batch_size": scheduler.max_batch_size,
            "context_reuse": scheduler.context_reuse,
            "images": self.vision is not None,
        }
        caps.update(self.options.capabilities)
        extra = {"reason": client.unavailable} if client.unavailable is not None else {}
        health: dict[str, Any] = {
            **extra,
            "status": client.status,
            "model": self.options.served_model_name,
            "active_requests": scheduler.active,
            "queued_requests": scheduler.queued,
            "capabilities": caps,
        }
        cache = scheduler.context_cache_stats()
        if cache is not None:
            health["context_cache"] = cache.as_dict()
        if self.image_cache is not None:
            health["image_cache"] = self.image_cache.stats().as_dict()
        return health

    def check_generates(self) -> None:
        """400 for an embedding model: it answers no generation request."""
        if self.embedder is not None:
            raise InvalidRequestError(
                f"model {self.options.served_model_name!r} is an embedding model: it computes vectors, "
                "not text; send its inputs to POST /v1/embeddings", param="model")


def usage_of(*outs: StepOutput, n: int | None = None) -> Usage:
    """Usage of a request's choices: each prompt counted once, the completions summed.

    ``outs`` are the choices in order; with ``n``, every ``n`` of them share one prompt (a
    list of prompts, prompt-major), else all of them do."""
    per = n or len(outs)
    prompt = sum(out.prompt_tokens for out in outs[::per])
    cached = sum(out.cached_tokens for out in outs[::per])
    completion = sum(out.completion_tokens for out in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
