"""The quality gate: does a quantized bundle answer like fp32 of the same weights, on this CPU?

After a quantized graph is written, the gate runs fixed chat prompts through the fp32 reference
graph of the same checkpoint (its graph in a scratch folder, its weights in memory; never
published) and through the quantized graph, both on this machine:

1. the reference decodes ``TOKENS`` greedy tokens after each prompt (all prompts as one batch),
   keeping the logits that chose them: fp32's own answers;
2. the quantized graph reads each prompt plus those tokens in two runs (prefill, then
   ``extend``, which returns logits at every position: teacher forcing, so one early
   disagreement does not make every later position disagree too);
3. ``greedy_agreement`` is the share of positions where the quantized graph's arg-max is the
   token fp32 chose; ``min_logit_cosine`` the smallest cosine between the two logit vectors at
   any position.

fp32 takes the sequential part (one batched decode step per token) because on the CPU its
batched steps are the cheapest (float ``MatMul`` against ``MatMulNBits`` unpacking its blocks
for every step; int8's layers are two 4-bit products). SmolLM2 on a 2-core AVX2 CPU, the other
way round: the quantized graph decoding and fp32 reading took 2.8 s + 1.4 s (int4) and 4.6 s +
1.3 s (int8); this way, fp32 decoding and the quantized graph reading, 1.9 s + 1.9 s and 2.0 s +
3.0 s. Both parts are bound by arithmetic (8 prompts x 32 tokens through each model), not by
the number of runs: reading all 8 sequences as one padded batch took as long as 16 runs.

Below :data:`MIN_AGREEMENT` the build fails with one line naming the precision, the figure and
the precision to use instead, and nothing is published. The figures are recorded in
``engine.json`` under ``quality``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.builder.errors import BuildInputError
from inference.runtime.onnxruntime_engine import GqaEngine
from inference.tokenizer import load_tokenizer

#: Greedy agreement a quantized bundle needs (share of fp32's greedy tokens it also picks there).
MIN_AGREEMENT = 0.9
TOKENS = 32
#: Short everyday requests: facts, code, lists, arithmetic, advice, writing.
PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Who wrote Romeo and Juliet?",
    "What is 12 times 7?",
    "Give me a tip for better sleep.",
)


class QualityGateError(BuildInputError):
    """A quantized build answers too differently from fp32 on this CPU."""


@dataclass(frozen=True)
class Quality:
    """What ``engine.json`` records under ``quality``."""

    reference: str
    prompts: int
    tokens: int
    greedy_agreement: float
    min_logit_cosine: float
    cpu_class: str
    threshold: float
    seconds: float

    def record(self) -> dict[str, Any]:
        """The JSON-ready figures."""
        return asdict(self)


def gate_prompts(tokenizer_dir: Path, vocab_size: int) -> list[list[int]]:
    """The gate's prompts as token ids: :data:`PROMPTS` in the model's chat template where it has
    one; a checkpoint without a tokenizer gets as many fixed pseudo-random 24-token prompts."""
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        rng = np.random.default_rng(0)
        return [[int(t) for t in rng.integers(0, vocab_size, size=24)] for _ in PROMPTS]
    tok = load_tokenizer(tokenizer_dir)
    if tok.has_chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                 for p in PROMPTS]
    else:
        texts = list(PROMPTS)
    prompts = [tok.encode(text) for text in texts]
    return [p for p in prompts if p]


def _teacher_forced(engine: GqaEngine, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Logits ``[len(tokens), vocab]``: row i is the prediction of ``tokens[i]``."""
    engine.reset(0)
    first = engine.prefill(0, prompt)
    if len(tokens) == 1:
        return first[None]
    return np.vstack([first[None], engine.extend(0, tokens[:-1])])


def _greedy(engine: GqaEngine, prompts: Sequence[Sequence[int]],
            tokens: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens after each prompt (all decoded as one batch) and the logits that chose them."""
    chosen: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    for slot, prompt in enumerate(prompts):
        engine.reset(slot)
        row = engine.prefill(slot, prompt)
        logits[slot].append(row)
        chosen[slot].append(int(row.argmax()))
    slots = list(range(len(prompts)))
    for _ in range(tokens - 1):
        rows = engine.decode(slots, [chosen[s][-1] for s in slots])
        for s in slots:
            logits[s].append(rows[s])
            chosen[s].append(int(rows[s].argmax()))
    return chosen, [np.stack(rows) for rows in logits]


def measure(reference: GqaEngine, candidate: GqaEngine, prompts: Sequence[Sequence[int]],
            tokens: int = TOKENS) -> tuple[float, float]:
    """(greedy agreement, min logit cosine) of ``candidate`` against ``reference`` (the
    reference decodes, so it needs one slot per prompt; one is enough for the candidate)."""
    chosen, ref_logits = _greedy(reference, prompts, tokens)
    agree = total = 0
    min_cos = 1.0
    for prompt, path, ref in zip(prompts, chosen, ref_logits, strict=True):
        got = _teacher_forced(candidate, prompt, path)
        agree += int((got.argmax(-1) == np.asarray(path)).sum())
        total += len(path)
        norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1)
        cos = (ref * got).sum(-1) / np.maximum(norms, 1e-30)
        min_cos = min(min_cos, float(cos.min()))
    return agree / max(total, 1), min_cos


def run_gate(reference_model: Path, candidate_model: Path, meta: dict[str, Any], tokenizer_dir: Path,
             *, cpu_class: str, threads: int, threshold: float = MIN_AGREEMENT,
             reference_weights: Mapping[str, np.ndarray] | None = None) -> Quality:
    """Measure ``candidate_model`` against the fp32 ``reference_model`` (both GQA graphs of the
    same bundle metadata ``meta``; the reference's large weights from ``reference_weights`` when
    its data file was not written); raise :class:`QualityGateError` below ``threshold``."""
    started = time.monotonic()
    prompts = gate_prompts(tokenizer_dir, int(meta["vocab_size"]))
    capacity = int(meta["max_kv_cache_capacity"])
    prompts = [p[: max(1, capacity - TOKENS)] for p in prompts]
    tokens = min(TOKENS, capacity - max(len(p) for p in prompts))
    # KV buffers as long as the gate needs, not the bundle's capacity (8 slots of 8k positions
    # would allocate gigabytes for nothing).
    needed = {"max_kv_cache_capacity": max(len(p) for p in prompts) + tokens}
    ref_meta = {**meta, **needed, "optimized_model": None}
    reference = GqaEngine(reference_model, ref_meta, max_slots=len(prompts), threads=threads,
                          initializers=reference_weights)
    try:
        candidate = GqaEngine(candidate_model, {**meta, **needed}, max_slots=1, threads=threads)
        try:
            agreement, min_cos = measure(reference, candidate, prompts, tokens)
        finally:
            candidate.close()
    finally:
        reference.close()
    quality = Quality(reference="fp32", prompts=len(prompts), tokens=tokens * len(prompts),
                      greedy_agreement=round(agreement, 4), min_logit_cosine=round(min_cos, 5),
                      cpu_class=cpu_class, threshold=threshold,
                      seconds=round(time.monotonic() - started, 2))
    if agreement < threshold:
        precision = str(meta["precision"])
        instead = "int8 or fp32" if precision == "int4" else "fp32"
        raise QualityGateError(
            f"the {precision} build failed the quality gate on this CPU ({cpu_class}): greedy agreement "
            f"with fp32 {agreement:.3f} < {threshold} over {quality.prompts} prompts x {tokens} tokens; "
            f"build --precision {instead} instead"
        )
    return quality
