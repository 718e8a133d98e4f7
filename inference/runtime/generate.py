"""A simple greedy / sampled generation loop over an Engine (benchmarks and tests).

Serving (stop strings, streaming, scheduling) lives elsewhere; this runs a fixed set of
prompts to completion, one slot each, decoding all unfinished slots together. Tokens are drawn
by the server's own :class:`~inference.serving.sampling.Sampler` (one per prompt, seeded with
``seed``), so ``generate(seed=s)`` gives what a server request with ``seed=s`` gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference.runtime.protocol import Engine
from inference.serving.sampling import Sampler, SamplingParams


def generate(
    engine: Engine,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` for each prompt; return the new tokens per prompt.

    One prompt (a flat list) or several (a list of lists, run as a batch of slots 0..n-1, which
    are reset first). Greedy when ``temperature`` is 0. A row stops after emitting a token in
    ``eos_ids`` (default: the engine's eos ids; pass ``()`` to never stop early); the eos token
    is included in the output.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token")
    first = prompt_ids[0]
    prompts: list[list[int]] = (
        [[int(t) for t in p] for p in prompt_ids]  # type: ignore[union-attr]
        if isinstance(first, Sequence | np.ndarray) else [[int(t) for t in prompt_ids]]  # type: ignore[arg-type]
    )
    if len(prompts) > engine.info.max_slots:
        raise ValueError(
            f"{len(prompts)} prompts but the engine has {engine.info.max_slots} slots; "
            "load it with a larger max_slots"
        )
    stop = set(engine.info.eos_token_ids if eos_ids is None else eos_ids)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    samplers = [Sampler(params, engine.info.vocab_size) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outputs
    active: list[int] = []
    next_ids: list[int] = []
    for slot, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {slot} is empty; give at least one token")
        engine.reset(slot)
        token = samplers[slot].sample(engine.prefill(slot, prompt)).token_id
        outputs[slot].append(token)
        if token not in stop and max_new_tokens > 1:
            active.append(slot)
            next_ids.append(token)
    while active:
        logits = engine.decode(active, next_ids)
        still, still_ids = [], []
        for row, slot in enumerate(active):
            token = samplers[slot].sample(logits[row]).token_id
            outputs[slot].append(token)
            if token not in stop and len(outputs[slot]) < max_new_tokens:
                still.append(slot)
                still_ids.append(token)
        active, next_ids = still, still_ids
    return outputs
