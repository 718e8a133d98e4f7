"""Decode benchmark of the TensorRT engine against the CPU engine on the same checkpoint (GPU only).

Batch 1 and batch ``--batch``, best of ``--repeats``: prefill time of ``--prompt-len`` tokens and
decode tok/s for ``--new-tokens`` greedy tokens, for our onnxruntime fp32 bundle and our TensorRT
bundles (fp32 and ``--precision``), plus how many of the greedy tokens each TensorRT bundle
shares with the CPU engine. Needs tensorrt, pycuda and a CUDA device; run by
``scripts/gpu-check.sh``.

    PYTHONPATH=. .venv/bin/python bench/trt_decode.py                 # 0.5B-shaped Qwen2 demo
    PYTHONPATH=. .venv/bin/python bench/trt_decode.py --checkpoint DIR --precision bf16

``--quick`` (CI, ``bench/run_quick.sh``): the tiny demo checkpoint, short prompt, one run; without
TensorRT it prints one line saying so and exits 0. ``bench/run_quick.sh`` also runs it against
the fake ``tensorrt`` of the tests (``tests/support/fake_tensorrt`` first on ``PYTHONPATH``: the
ONNX graph run by onnxruntime), which checks that the script runs, not TensorRT.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.decode import best_of, best_prefill_seconds
from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.model_config import load_model_config
from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle
from inference.cuda_device import tensorrt_missing
from inference.runtime import Engine, load_engine


def measure(
    engine: Engine, prompt: list[int], new_tokens: int, batch: int, repeats: int
) -> tuple[float, float, list[int]]:
    """(best prefill seconds, best decode tok/s over all rows, greedy tokens of row 0)."""
    tokens: list[int] = []

    def decode() -> float:
        slots = list(range(batch))
        last = []
        for s in slots:
            engine.reset(s)
            last.append(int(np.argmax(engine.prefill(s, prompt))))
        tokens[:] = [last[0]]
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = engine.decode(slots, last)
            last = [int(t) for t in np.argmax(logits, axis=1)]
            tokens.append(last[0])
        return time.perf_counter() - start

    prefill_seconds = best_prefill_seconds(engine, prompt, repeats)
    return prefill_seconds, batch * new_tokens / best_of(decode, repeats), tokens


def _agree(tokens: list[int], reference: list[int]) -> str:
    """How many leading greedy tokens match the reference, as ``k/n``."""
    pairs = enumerate(zip(tokens, reference, strict=False))
    first_diff = next((i for i, (a, b) in pairs if a != b), len(tokens))
    return f"{first_diff}/{len(tokens)}"


def main(argv: list[str] | None = None) -> int:
    """Build the bundles, run them, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, help="HF checkpoint dir (default: a 0.5b qwen2 demo)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["fp16", "bf16", "int8"], default="fp16")
    parser.add_argument("--skip-cpu", action="store_true", help="no CPU baseline (slow on big models)")
    parser.add_argument("--quick", action="store_true", help="CI: the tiny demo, short prompt, one run")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_len, args.new_tokens, args.batch, args.repeats = 16, 8, 2, 1
    missing = tensorrt_missing()
    if missing is not None:
        if args.quick:
            print(f"trt_decode: skipped ({missing})")
            return 0
        print(f"trt_decode: cannot run here: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-trt-") as tmp:
        work = Path(tmp)
        checkpoint = args.checkpoint
        if checkpoint is None:
            from inference.demo import write_demo_checkpoint

            size = "tiny" if args.quick else "0.5b"
            checkpoint = write_demo_checkpoint(work / "ckpt", arch="qwen2", size=size, dtype="fp32", seed=0)
        cfg = load_model_config(checkpoint)
        shapes = {
            "max_input_len": args.prompt_len,
            "max_batch_size": args.batch,
            "max_kv_cache_capacity": args.prompt_len + args.new_tokens + 16,
        }
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, size=args.prompt_len)]
        bundles: list[tuple[str, Path]] = []
        if not args.skip_cpu:
            (work / "cpu").mkdir()
            build_bundle(checkpoint, work / "cpu", EngineBuildSpec(**shapes))
            bundles.append(("onnxruntime fp32", work / "cpu"))
        for precision in ("fp32", args.precision):
            out = work / f"trt-{precision}"
            out.mkdir()
            start = time.perf_counter()
            build_trt_bundle(
                checkpoint, out, TrtBuildSpec(precision=precision, timing_cache_dir=work / "timing", **shapes)
            )
            print(f"built TensorRT {precision} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            bundles.append((f"tensorrt {precision}", out))
        print(
            f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
            f"prompt {args.prompt_len}, {args.new_tokens} new tokens, best of {args.repeats}"
        )
        batch_col = f"tok/s b{args.batch}"
        header = f"{'engine':<20} {'prefill (s)':>12} {'tok/s b1':>10} {batch_col:>10} {'greedy = cpu':>13}"
        print(header + "\n" + "-" * len(header))
        reference: list[int] | None = None
        for name, bundle in bundles:
            engine = load_engine(bundle)
            prefill_s, rate1, tokens = measure(engine, prompt, args.new_tokens, 1, args.repeats)
            _, rate_b, _ = measure(engine, prompt, args.new_tokens, args.batch, args.repeats)
            engine.close()
            if reference is None and name.startswith("onnxruntime"):
                reference = tokens
            same = "n/a" if reference is None or name.startswith("onnxruntime") else _agree(tokens, reference)
            print(f"{name:<20} {prefill_s:>12.3f} {rate1:>10.1f} {rate_b:>10.1f} {same:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
