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

**Choosing the kernels.** The gate measures the kernel plans of :func:`.kernel_plan.candidate_plans`
from fastest to exact on the same written graph (:func:`.kernel_plan.retarget`) and
publishes the first that passes. A plan faster than exact must answer like fp32 (``auto``): the
agreement floor **and** free-running identity, the first :data:`IDENTITY_TOKENS` greedy tokens of
every gate prompt equal to fp32's (decoded freely, so an early flip shows). The exact plan
computes in float32: what differs from fp32 is the weights' own rounding, judged by the agreement
floor as before (its identity is recorded too). ``fast`` takes the fastest plan above the floor
alone; ``exact`` tries only the exact plan. A two-term plan (:mod:`.two_term`: float32's answers
at int8 kernels' speed, but twice the rows through the products) is published only when it also
pays for itself against the exact plan: at least 0.95x its decode tok/s at one row and
:data:`TWO_TERM_SPEEDUP` x at one row or at one row per prompt (on small models dispatch, not the
weights, bounds a step, and its extra ops can make it slower than exact), the two plans timed side
by side in alternating rounds (:func:`_paired_speeds`) unless the figures timed apart are
decisive (:func:`_decisive`).
Each candidate's figures (agreement, min cosine, identity, decode tok/s at 1 row and at one row
per prompt, seconds) are recorded.

fp32's answers (greedy tokens and the logits that chose them, float16) are kept per checkpoint
when the caller gives a file (:func:`reference_answers`): the next quantized build of the same
weights skips the fp32 graph and its decode.

Below :data:`MIN_AGREEMENT` the build fails with one line naming the precision, the figure and
the precision to use instead, and nothing is published. The figures are recorded in
``engine.json`` under ``quality``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from inference.builder.errors import BuildInputError
from inference.builder.kernel_plan import KernelPlan, retarget
from inference.runtime.onnxruntime_engine import GqaEngine
from inference.serving.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

#: Greedy agreement a quantized bundle needs (share of fp32's greedy tokens it also picks there).
MIN_AGREEMENT = 0.9
TOKENS = 32
#: Free-running identity: a plan faster than exact must decode these first greedy tokens of
#: every gate prompt exactly as fp32 does.
IDENTITY_TOKENS = 16
#: Decode steps timed per candidate (at one row, best of two rounds).
TIMED_STEPS = 8
#: How much faster than the exact plan a two-term plan must decode (at one row, or at one row per
#: gate prompt while no slower than 0.95x at one row) to be published.
TWO_TERM_SPEEDUP = 1.1
#: Rounds of the side-by-side timing of a two-term plan against the exact plan (both open, timed
#: in turn, best of each): timed minutes apart, a shared machine's drift decided the choice (a
#: SmolLM2 int4 build published a two-term plan that decoded 0.90x the exact plan's tok/s).
PAIRED_ROUNDS = 3
#: How far from the rule's thresholds the figures timed apart must be for their verdict to stand
#: without the side-by-side timing (1.5: a drift of 50% between them cannot turn it). At 1B the
#: two-term plans decode ~1.9x the exact plan, and timing the pair there costs 30-45 s a plan.
DECISIVE_MARGIN = 1.5
#: Bump when the reference file's content changes (a stale file is recomputed, never trusted).
REFERENCE_VERSION = 1
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
class Candidate:
    """One kernel plan as the gate measured it."""

    plan: str
    int8_groups: tuple[str, ...]
    int8_layout: str
    greedy_agreement: float
    min_logit_cosine: float
    #: Prompts whose first :data:`IDENTITY_TOKENS` free-running greedy tokens equal fp32's.
    identical: int
    decode_tok_s: float
    decode_tok_s_rows: float
    passed: bool
    seconds: float
    #: A two-term plan that answered like fp32 but decoded no faster than the exact plan (the
    #: rule of ``_Trials.slower_than_exact``), so the gate went on to the next plan.
    slower_than_exact: bool = False
    #: For a two-term plan weighed against the exact plan: the exact plan's tok/s at one row and
    #: at one row per prompt, the figures the rule read (:meth:`_Trials.beside_exact`).
    exact_decode_tok_s: float | None = None
    exact_decode_tok_s_rows: float | None = None
    #: Whether the two were timed side by side (then ``decode_tok_s`` and ``decode_tok_s_rows``
    #: are this plan's figures of the same rounds, :func:`_paired_speeds`), else each on its own,
    #: minutes apart, figures that were decisive (:data:`DECISIVE_MARGIN`).
    side_by_side: bool = False


@dataclass(frozen=True)
class Quality:
    """What ``engine.json`` records under ``quality`` (the chosen plan's figures first)."""

    reference: str
    prompts: int
    tokens: int
    greedy_agreement: float
    min_logit_cosine: float
    cpu_class: str
    threshold: float
    seconds: float
    kernels_mode: str = "auto"
    plan: str = "exact"
    identical: int = 0
    identity_tokens: int = IDENTITY_TOKENS
    #: The candidate's K/V element type (``engine.json``'s ``kv_cache.dtype``); fp32's is float32.
    kv_cache_dtype: str = "float32"
    #: Whether fp32's answers came from the per-checkpoint file instead of a fresh decode.
    reference_cached: bool = False
    reference_seconds: float = 0.0
    candidates: list[Candidate] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The JSON-ready figures."""
        out = asdict(self)
        for c in out["candidates"]:
            c.update(int8_groups=list(c["int8_groups"]), greedy_agreement=round(c["greedy_agreement"], 4),
                     min_logit_cosine=round(c["min_logit_cosine"], 5),
                     decode_tok_s=round(c["decode_tok_s"], 1),
                     decode_tok_s_rows=round(c["decode_tok_s_rows"], 1), seconds=round(c["seconds"], 2))
            if c["exact_decode_tok_s"] is None:  # only a two-term plan is weighed against exact
                for key in ("exact_decode_tok_s", "exact_decode_tok_s_rows", "side_by_side"):
                    del c[key]
            else:
                for key in ("exact_decode_tok_s", "exact_decode_tok_s_rows"):
                    c[key] = round(c[key], 1)
        return out


@dataclass(frozen=True)
class Reference:
    """fp32's answers to the gate prompts: greedy tokens and the logits that chose them."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    #: ``[tokens, vocab]`` per prompt, float16 (the figures are computed against these, so a
    #: cached reference gives the same figures as a fresh one).
    logits: list[np.ndarray]


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


def _greedy(engine: GqaEngine, prompts: Sequence[Sequence[int]], tokens: int,
            step_times: list[float] | None = None) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens after each prompt (all decoded as one batch) and the logits that chose them
    (``step_times`` receives each batched step's seconds)."""
    chosen: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    for slot, prompt in enumerate(prompts):
        engine.reset(slot)
        row = engine.prefill(slot, prompt)
        logits[slot].append(row)
        chosen[slot].append(int(row.argmax()))
    slots = list(range(len(prompts)))
    for _ in range(tokens - 1):
        started = time.perf_counter()
        rows = engine.decode(slots, [chosen[s][-1] for s in slots])
        if step_times is not None:
            step_times.append(time.perf_counter() - started)
        for s in slots:
            logits[s].append(rows[s])
            chosen[s].append(int(rows[s].argmax()))
    return chosen, [np.stack(rows) for rows in logits]


def measure(reference: Reference, candidate: GqaEngine) -> tuple[float, float]:
    """(greedy agreement, min logit cosine) of ``candidate`` (one slot is enough) read
    teacher-forced along fp32's greedy path."""
    agree = total = 0
    min_cos = 1.0
    for prompt, path, ref16 in zip(reference.prompts, reference.tokens, reference.logits, strict=True):
        got = _teacher_forced(candidate, prompt, path)
        ref = ref16.astype(np.float32)
        agree += int((got.argmax(-1) == np.asarray(path)).sum())
        total += len(path)
        norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1)
        cos = (ref * got).sum(-1) / np.maximum(norms, 1e-30)
        min_cos = min(min_cos, float(cos.min()))
    return agree / max(total, 1), min_cos


def _prompts_key(prompts: Sequence[Sequence[int]], tokens: int) -> str:
    payload = json.dumps({"v": REFERENCE_VERSION, "tokens": tokens, "prompts": prompts})
    return hashlib.sha256(payload.encode()).hexdigest()


def _load_reference(path: Path, key: str) -> Reference | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["key"]) != key:
                return None
            lengths = [int(n) for n in data["prompt_lengths"]]
            flat = [int(t) for t in data["prompts"]]
            prompts, at = [], 0
            for n in lengths:
                prompts.append(flat[at:at + n])
                at += n
            tokens = [[int(t) for t in row] for row in data["tokens"]]
            logits = list(data["logits"])
    except (OSError, KeyError, ValueError) as exc:  # missing, damaged or foreign: recompute
        if path.exists():
            log.warning("ignoring the gate's fp32 reference %s (%s); computing it again", path, exc)
        return None
    return Reference(prompts, tokens, logits)


def _save_reference(path: Path, key: str, ref: Reference) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(key), prompt_lengths=np.array([len(p) for p in ref.prompts]),
                     prompts=np.array([t for p in ref.prompts for t in p], np.int64),
                     tokens=np.array(ref.tokens, np.int64), logits=np.stack(ref.logits))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a cache, not a result: the build goes on without it
        tmp.unlink(missing_ok=True)
        log.warning("could not keep the gate's fp32 reference in %s: %s", path, exc)


def reference_answers(open_reference: Callable[[int], GqaEngine], prompts: list[list[int]], tokens: int,
                      cache_file: Path | None = None) -> tuple[Reference, bool]:
    """fp32's answers to ``prompts`` (``open_reference(slots)`` opens the fp32 engine, only when
    they are not in ``cache_file``); returns them and whether they came from the file."""
    key = _prompts_key(prompts, tokens)
    if cache_file is not None:
        cached = _load_reference(cache_file, key)
        if cached is not None:
            return cached, True
    engine = open_reference(len(prompts))
    try:
        chosen, logits = _greedy(engine, prompts, tokens)
    finally:
        engine.close()
    ref = Reference(prompts, chosen, [rows.astype(np.float16) for rows in logits])
    if cache_file is not None:
        _save_reference(cache_file, key, ref)
    return ref, False


def _time_decode(engine: GqaEngine, prompt: Sequence[int], first: int) -> float:
    """Decode tok/s at one row after ``prompt``: best of two rounds of :data:`TIMED_STEPS`."""
    best = float("inf")
    for _ in range(2):
        engine.reset(0)
        engine.prefill(0, prompt)
        token = first
        started = time.perf_counter()
        for _ in range(TIMED_STEPS):
            token = int(engine.decode([0], [token])[0].argmax())
        best = min(best, time.perf_counter() - started)
    return TIMED_STEPS / best


def _steps(engine: GqaEngine, slots: list[int], tokens: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds of ``steps`` greedy decode steps of ``slots`` (one row each) fed ``tokens``, and
    the tokens they end on."""
    started = time.perf_counter()
    for _ in range(steps):
        rows = engine.decode(slots, tokens)
        tokens = [int(row.argmax()) for row in rows]
    return time.perf_counter() - started, tokens


def _paired_speeds(engines: Sequence[GqaEngine], reference: Reference, steps: int,
                   rounds: int) -> list[tuple[float, float]]:
    """Each engine's decode tok/s at one row and at one row per prompt (every prompt's slot at
    once), best of ``rounds``, timed in turn: round r times every engine before round r + 1, so
    a shared machine's drift weighs on all of them alike. Each slot starts from its prompt's
    first token alone (a one-token prefill runs at one row: whole prompts would cost a float
    plan's dequantizing path, and a few dozen positions of attention change no figure); the first
    slot grows by ``2 * steps`` positions a round, the others by ``steps``."""
    slots = list(range(len(reference.prompts)))
    last: list[list[int]] = []
    for engine in engines:
        firsts = []
        for slot, prompt in zip(slots, reference.prompts, strict=True):
            engine.reset(slot)
            firsts.append(int(engine.prefill(slot, prompt[:1]).argmax()))
        last.append(firsts)
    best = [(0.0, 0.0) for _ in engines]
    for _ in range(rounds):
        for i, engine in enumerate(engines):
            one, ended = _steps(engine, [0], last[i][:1], steps)
            rows, last[i] = _steps(engine, slots, [ended[0], *last[i][1:]], steps)
            best[i] = (max(best[i][0], steps / one), max(best[i][1], steps * len(slots) / rows))
    return best


def _free_run(engine: GqaEngine, prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], float]:
    """The first :data:`IDENTITY_TOKENS` greedy tokens after each prompt, decoded freely as one
    batch, and the batch's decode tok/s (one row per prompt; median step)."""
    steps: list[float] = []
    free, _ = _greedy(engine, prompts, IDENTITY_TOKENS, steps)
    return free, (len(prompts) / float(np.median(steps)) if steps else 0.0)


def _set_plan(model: Path, plan: KernelPlan) -> None:
    """Retarget the graph file ``model`` to ``plan`` in place (its weights file is untouched)."""
    proto = onnx.load(str(model), load_external_data=False)
    retarget(proto, plan)
    onnx.save(proto, str(model))


def _open_plan(model: Path, plan: KernelPlan, meta: dict[str, Any], slots: int, threads: int) -> GqaEngine:
    _set_plan(model, plan)
    return GqaEngine(model, meta, max_slots=slots, threads=threads)


def _try_plan(model: Path, plan: KernelPlan, meta: dict[str, Any], reference: Reference,
              threads: int) -> tuple[Candidate, list[list[int]]]:
    """``plan``'s figures (``passed`` left False for the caller) and its free-running tokens."""
    started = time.monotonic()
    engine = _open_plan(model, plan, meta, len(reference.prompts), threads)
    try:
        agreement, min_cos = measure(reference, engine)
        free, rows = _free_run(engine, reference.prompts)
        tok_s = _time_decode(engine, reference.prompts[0], reference.tokens[0][0])
    finally:
        engine.close()
    identical = sum(got == ref[:IDENTITY_TOKENS] for got, ref in zip(free, reference.tokens, strict=True))
    return Candidate(plan=plan.name, int8_groups=plan.int8_groups, int8_layout=plan.int8_layout,
                     greedy_agreement=agreement,
                     min_logit_cosine=min_cos, identical=identical, decode_tok_s=tok_s,
                     decode_tok_s_rows=rows, passed=False, seconds=time.monotonic() - started), free


def _gate_failure(precision: str, kv_dtype: str, last: Candidate, quality: Quality, tokens: int,
                  ) -> QualityGateError:
    """The error of a gate no plan passed: the figure that failed and the build to ask instead."""
    instead = "--precision " + ("int8 or fp32" if precision == "int4" else "fp32")
    what = f"the {precision} build"
    if kv_dtype != "float32":
        what += " with float16 KV (--kv-cache-dtype fp16)"
        instead = ("--kv-cache-dtype fp32" if precision not in ("int8", "int4")
                   else instead + " or --kv-cache-dtype fp32")
    figure = (f"greedy agreement with fp32 {last.greedy_agreement:.3f} < {quality.threshold}"
              if last.greedy_agreement < quality.threshold else
              f"{last.identical} of {quality.prompts} prompts' first {IDENTITY_TOKENS} tokens "
              "equal fp32's")
    return QualityGateError(
        f"{what} failed the quality gate on this CPU ({quality.cpu_class}): {figure} over {quality.prompts} "
        f"prompts x {tokens} tokens; build {instead} instead"
    )


def _margins(figures: Candidate) -> tuple[float, float]:
    """How far a two-term plan's figures (with the exact plan's) clear the rule's two
    thresholds: its one-row tok/s over 0.95x the exact plan's, and its best speedup (one row
    or one row per prompt) over :data:`TWO_TERM_SPEEDUP`; it pays when both are >= 1."""
    one, rows = figures.exact_decode_tok_s, figures.exact_decode_tok_s_rows
    assert one is not None and rows is not None
    speedup = max(figures.decode_tok_s / one, figures.decode_tok_s_rows / rows)
    return figures.decode_tok_s / (0.95 * one), speedup / TWO_TERM_SPEEDUP


def _decisive(figures: Candidate) -> bool:
    """Whether figures timed apart decide the rule whatever the machine did between them: both
    margins at least :data:`DECISIVE_MARGIN`, or one of them under its inverse."""
    low = min(_margins(figures))
    return low >= DECISIVE_MARGIN or low < 1 / DECISIVE_MARGIN


#: Rewrites the candidate graph in a faster layout of a plan (None: puts back what was measured).
Relayout = Callable[[KernelPlan | None], KernelPlan | None]


@dataclass
class _Trials:
    """The candidate plans of one gate run, measured one after another on the written graph
    ``model`` against fp32's answers ``reference`` (see :func:`run_gate`)."""

    model: Path
    plans: Sequence[KernelPlan]
    meta: dict[str, Any]
    reference: Reference
    threads: int
    mode: str
    threshold: float
    strict: bool
    tried: list[Candidate] = field(default_factory=list)
    #: The exact plan's free-running tokens and tok/s at one row and at one row per prompt,
    #: measured once, when a candidate first needs them.
    _exact: tuple[list[list[int]], float, float] | None = None
    #: The exact plan's engine for side-by-side timing: opened at the first two-term plan whose
    #: figures timed apart do not decide (on two 4-bit planes, the layout every plan shares; a
    #: later relayout moves the files, not what the open engine reads), closed by :meth:`close`.
    #: Kept only then: at 1B and up, where the figures decide, the gate holds one engine at once.
    _pair_engine: GqaEngine | None = None

    @property
    def wanted(self) -> list[list[int]]:
        """fp32's free-running answers."""
        return [ref[:IDENTITY_TOKENS] for ref in self.reference.tokens]

    def exact(self) -> tuple[list[list[int]], float, float]:
        """The exact plan's free-running tokens and tok/s at one row and at one row per prompt
        (leaves the graph file at the exact plan when it measures: the caller sets the plan it
        measures next)."""
        if self._exact is None:
            prompts = self.reference.prompts
            engine = _open_plan(self.model, self.plans[-1], self.meta, len(prompts), self.threads)
            try:
                one = _time_decode(engine, prompts[0], self.reference.tokens[0][0])
                free, rows = _free_run(engine, prompts)
            finally:
                engine.close()
            self._exact = (free, one, rows)
        return self._exact

    def close(self) -> None:
        if self._pair_engine is not None:
            self._pair_engine.close()
            self._pair_engine = None

    def answers_like_exact(self, free: list[list[int]]) -> bool:
        """Whether each prompt's free-running tokens are fp32's or, where the exact plan's own
        differ from fp32's (the weights' rounding), the exact plan's."""
        wanted = self.wanted
        if free == wanted:
            return True
        exact_free = self.exact()[0]
        return all(got in (ref, ex) for got, ref, ex in zip(free, wanted, exact_free, strict=True))

    def beside_exact(self, plan: KernelPlan, figures: Candidate) -> Candidate:
        """``figures`` with the exact plan's decode speeds: those it was timed at apart when they
        are decisive (:func:`_decisive`), else ``plan``'s and the exact plan's timed side by side
        (:func:`_paired_speeds`); leaves the graph file at ``plan``."""
        started = time.monotonic()
        _, one, rows = self.exact()
        apart = replace(figures, exact_decode_tok_s=one, exact_decode_tok_s_rows=rows)
        slots = len(self.reference.prompts)
        decisive = _decisive(apart)
        if self._pair_engine is None and not decisive and plan.int8_layout != "codes":
            self._pair_engine = _open_plan(self.model, self.plans[-1], self.meta, slots, self.threads)
        if self._pair_engine is None or decisive:
            # Decisive; or (rare) first close on 8-bit codes, whose exact plan would time the
            # codes' dequantize-everything path: the figures timed apart are the best there are.
            _set_plan(self.model, plan)
            return apart
        engine = _open_plan(self.model, plan, self.meta, slots, self.threads)
        try:
            budget = int(self.meta["max_kv_cache_capacity"]) - 1  # positions past the first token
            steps = max(1, min(TIMED_STEPS, budget // (2 * PAIRED_ROUNDS)))
            (e1, er), (p1, pr) = _paired_speeds([self._pair_engine, engine], self.reference, steps,
                                                max(1, min(PAIRED_ROUNDS, budget // (2 * steps))))
        finally:
            engine.close()
        return replace(figures, decode_tok_s=p1, decode_tok_s_rows=pr, exact_decode_tok_s=e1,
                       exact_decode_tok_s_rows=er, side_by_side=True,
                       seconds=figures.seconds + time.monotonic() - started)

    @staticmethod
    def slower_than_exact(figures: Candidate) -> bool:
        """Whether a two-term plan fails to pay for itself (its figures :meth:`beside_exact`):
        under 0.95x the exact plan's tok/s at one row, or under :data:`TWO_TERM_SPEEDUP` x at
        both one row and one row per prompt."""
        return min(_margins(figures)) < 1.0

    def measured(self, plan: KernelPlan) -> bool:
        """Measure ``plan``, record its figures and verdict; whether it passed."""
        figures, free = _try_plan(self.model, plan, self.meta, self.reference, self.threads)
        # A plan that trades float32 compute for speed must give fp32's answers (``auto``); the
        # exact plan, ``fast`` and a plan the caller forces (``forced``) face the floor alone.
        passed = figures.greedy_agreement >= self.threshold and (
            free == self.wanted if self.strict else
            self.mode in ("fast", "forced") or plan.name == "exact" or self.answers_like_exact(free))
        if passed and plan.two_term and self.mode != "forced":
            figures = self.beside_exact(plan, figures)
        slower = passed and plan.two_term and self.mode != "forced" and self.slower_than_exact(figures)
        self.tried.append(replace(figures, passed=passed and not slower, slower_than_exact=slower))
        return passed and not slower

    def _relaid(self, plan: KernelPlan, relayout: Relayout | None) -> KernelPlan | None:
        """``plan`` in the faster layout ``relayout`` writes, when there is one and it passes;
        else None, with the graph the gate measured put back."""
        if relayout is None or (again := relayout(plan)) is None:
            return None
        if self.measured(again):
            return again
        relayout(None)
        return None

    def choose(self, relayout: Relayout | None) -> KernelPlan | None:
        """The first plan that passes (in its faster layout where that passes too), or None."""
        for plan in self.plans:
            if self.measured(plan):
                return self._relaid(plan, relayout) or plan
            # A two-term int8 plan that answered like fp32 but was no faster on two planes gets
            # its faster layout (8-bit codes: one product per projection, not two) first.
            if self.tried[-1].slower_than_exact and (again := self._relaid(plan, relayout)):
                return again
        return None


def run_gate(fp32_reference: Callable[[], tuple[Path, Mapping[str, np.ndarray]]], candidate_model: Path,
             meta: dict[str, Any], tokenizer_dir: Path, *, cpu_class: str, threads: int,
             plans: Sequence[KernelPlan], mode: str = "auto", threshold: float = MIN_AGREEMENT,
             reference_file: Path | None = None,
             relayout: Relayout | None = None,
             strict: bool = False) -> tuple[KernelPlan, Quality]:
    """Choose among ``plans`` (fastest first, the written graph ``candidate_model`` holding their
    weights) by measuring each against fp32 of the same weights (``fp32_reference()`` writes its
    GQA graph of the same bundle metadata ``meta`` and returns it with its large weights, called
    only when ``reference_file`` does not hold fp32's answers already).

    ``relayout(plan)`` may rewrite ``candidate_model`` in a faster layout of the chosen ``plan``
    and return that plan (None: nothing faster); it is measured under the same rule and kept when
    it passes, else ``relayout(None)`` puts back what the gate measured. A two-term plan that
    answered like fp32 but was slower than the exact plan is tried in that layout too before the
    gate moves on. ``strict``: every plan,
    the exact one too, must give fp32's first tokens (a float graph whose float16 KV is all that
    differs from fp32: no weight rounding excuses a different answer).
    The candidate's KV dtype is ``meta``'s (``kv_cache.dtype``); fp32's reference holds float32.
    Leaves ``candidate_model`` set to the chosen plan and returns it with the figures; raises
    :class:`QualityGateError` when no plan passes (see the module docstring for ``mode``)."""
    started = time.monotonic()
    prompts = gate_prompts(tokenizer_dir, int(meta["vocab_size"]))
    capacity = int(meta["max_kv_cache_capacity"])
    prompts = [p[: max(1, capacity - TOKENS)] for p in prompts]
    tokens = min(TOKENS, capacity - max(len(p) for p in prompts))
    # KV buffers as long as the gate needs, not the bundle's capacity (8 slots of 8k positions
    # would allocate gigabytes for nothing).
    needed = {"max_kv_cache_capacity": max(len(p) for p in prompts) + tokens}
    kv_dtype = str(meta.get("kv_cache", {}).get("dtype", "float32"))
    ref_meta = {**meta, **needed, "optimized_model": None,
                "kv_cache": {**meta.get("kv_cache", {}), "dtype": "float32"}}

    def open_reference(slots: int) -> GqaEngine:
        model, weights = fp32_reference()
        return GqaEngine(model, ref_meta, max_slots=slots, threads=threads, initializers=weights)

    reference, cached = reference_answers(open_reference, prompts, tokens, reference_file)
    reference_seconds = time.monotonic() - started

    trials = _Trials(candidate_model, plans, {**meta, **needed}, reference, threads, mode, threshold, strict)
    try:
        chosen = trials.choose(relayout)
    finally:
        trials.close()
    tried = trials.tried
    last = next((c for c in reversed(tried) if c.passed), tried[-1])
    if chosen is not None:  # the exact plan's free run may have retargeted the file since
        _set_plan(candidate_model, chosen)
    quality = Quality(reference="fp32", prompts=len(prompts), tokens=tokens * len(prompts),
                      greedy_agreement=round(last.greedy_agreement, 4),
                      min_logit_cosine=round(last.min_logit_cosine, 5),
                      cpu_class=cpu_class, threshold=threshold,
                      seconds=round(time.monotonic() - started, 2), kernels_mode=mode, plan=last.plan,
                      identical=last.identical, reference_cached=cached, kv_cache_dtype=kv_dtype,
                      reference_seconds=round(reference_seconds, 2), candidates=tried)
    if chosen is None:
        raise _gate_failure(str(meta["precision"]), kv_dtype, last, quality, tokens)
    if mode == "fast" and chosen.name != "exact":
        log.info("--kernels fast: the %s build runs plan %r (agreement %.3f, %d of %d prompts identical to "
                 "fp32 for %d tokens), chosen for speed over fp32's answers", meta["precision"], chosen.name,
                 last.greedy_agreement, last.identical, len(prompts), IDENTITY_TOKENS)
    return chosen, quality
