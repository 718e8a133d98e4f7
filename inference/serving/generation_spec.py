"""The generation spec: one request as the engine runs it, whatever surface it came from.

Each serving surface converts its request once into a :class:`GenerationSpec` (the OpenAI
requests: ``protocol._SamplingFields.to_spec``), checked against the model's :class:`ModelLimits`;
:meth:`inference.serving.engine_client.EngineClient.generate` runs it. Nothing here knows a wire format.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.images.features import PromptImages
from inference.serving.sampling import SamplingParams

__all__ = ["GenerationSpec", "ModelLimits"]


@dataclass(frozen=True)
class ModelLimits:
    """What one loaded model takes: its context, its prompts, its vocabulary."""

    max_model_len: int
    max_input_len: int
    #: Token ids the engine can emit and the tokenizer can decode (``[0, vocab_size)``).
    vocab_size: int


@dataclass(frozen=True)
class GenerationSpec:
    """One request as the engine runs it, whatever surface it came from: ``n`` choices of at
    most ``max_tokens`` tokens each after ``prompt_ids``."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    #: vLLM's ``ignore_eos``: end-of-sequence tokens do not end a choice.
    ignore_eos: bool = False
    #: The output constraint (an llguidance grammar; each choice follows its own matcher).
    grammar: str | None = None
    #: The LoRA adapter the request runs (None: the base weights).
    adapter: str | None = None
    #: False: no cached prompt prefix is used and this prompt's KV is not kept for others.
    cache_prompt: bool = True
    #: vLLM's ``cache_salt``: seeds the context cache's hash chain (None: unsalted).
    cache_salt: str | None = None
    #: A vision-language prompt's images (their digests key its KV; features as needed).
    images: PromptImages | None = None

    @property
    def logprobs(self) -> bool:
        """Whether each output token comes with its logprob (and ``top_logprobs`` alternatives)."""
        return self.sampling.top_logprobs is not None
