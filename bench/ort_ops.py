"""ONNX Runtime's CPU kernels one at a time, in SmolLM2-135M's shapes (or a 1B Llama's,
``--model llama-1b``): what a decode step costs.

For each choice the CPU builder weighs (``docs/quantization.md``, ``docs/benchmarks.md``) it times
one batch-1 token through graphs of single ops with random weights, 2 threads by default:

* the linear layers of all ``--layers`` layers (q|k|v, o, gate|up, down): float32 ``MatMul``,
  4-bit ``MatMulNBits`` at accuracy level 0 (float32 compute) and 4 (int8 activations), 8-bit at
  level 0 and 4, int8's two 4-bit planes at level 0, and 4-bit / 8-bit at level 4 in two int8
  terms (``T2``: the ``twoterm`` kernel plan, ``inference/builder/two_term.py``); for each
  ``--rows`` count of tokens at once (1: a decode step; 8: eight clients' step);
* the lm_head (vocab x hidden): float32, 4-bit, two 4-bit planes at level 0 and at level 4, 8-bit
  at level 4, and 4-bit with float zero points (what Q4_1's ``d*q + m`` would need as one op);
* GroupQueryAttention of all layers after 400 and 1,500 tokens, KV in float32 and in float16.

Each figure is the best of ``--repeats`` runs of one session, made for its row and dropped after
it: sessions alive side by side would slow each other (each has its own threads, which spin for a
while after a run), so the rows are measured one after the other, not interleaved.

    PYTHONPATH=. .venv/bin/python bench/ort_ops.py [--threads 2] [--repeats 20] [--quick]

``--quick`` (CI, ``bench/run_quick.sh``): 2 layers, 3 repeats, a 4,096-token vocabulary.

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.builder.two_term import set_two_term
from inference.cpu_class import cpu_class


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions: hidden, MLP, query and KV heads, head size, layers."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @property
    def linears(self) -> tuple[tuple[str, int, int], ...]:
        """(name, in, out) of one layer's projections as the builder fuses them."""
        return (("q|k|v", self.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim),
                ("o", self.heads * self.head_dim, self.hidden), ("gate|up", self.hidden, 2 * self.inter),
                ("down", self.inter, self.hidden))


#: SmolLM2-135M's shapes, and the real-size case's (bench/real_size.py: Llama 3.2 1B's).
MODELS = {"smollm2": Shape(576, 1536, 9, 3, 64, 30), "llama-1b": Shape(2048, 8192, 32, 8, 64, 16)}
BLOCK = 32
MS = "com.microsoft"
rng = np.random.default_rng(0)


def _session(nodes: list[helper.NodeProto], inputs: list[helper.ValueInfoProto], outputs: list[str],
             inits: list[TensorProto], threads: int, elem: int = TensorProto.FLOAT,
             two_term: bool = False) -> ort.InferenceSession:
    outs = [helper.make_tensor_value_info(o, elem, None) for o in outputs]
    graph = helper.make_graph(nodes, "g", inputs, outs, initializer=inits)
    if two_term:  # every product in two int8 terms, as the twoterm kernel plan writes them
        set_two_term(graph, lambda node: True)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _linear(name: str, x: str, k: int, n: int, kind: str) -> tuple[list[helper.NodeProto], list[TensorProto]]:
    """One ``x @ W`` node (and its initializers) of ``kind``: fp32, or ``{bits}bit L{level}``,
    ``planes L{level}`` or ``4bit fzp`` (float zero points)."""
    if kind == "fp32":
        w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), name + ".w")
        return [helper.make_node("MatMul", [x, w.name], [name])], [w]
    blocks = k // BLOCK

    def nbits(tag: str, xin: str, bits: int, level: int, zero_points: np.ndarray | None = None,
              out: str | None = None) -> tuple[helper.NodeProto, list[TensorProto]]:
        codes = rng.integers(0, 256, size=(n, blocks, BLOCK * bits // 8), dtype=np.uint8)
        scales = (rng.random(n * blocks) * 0.01).astype(np.float32)
        base = f"{name}.{tag}"
        inits = [numpy_helper.from_array(codes, base + ".q"), numpy_helper.from_array(scales, base + ".s")]
        if zero_points is not None:
            inits.append(numpy_helper.from_array(zero_points, base + ".z"))
        node = helper.make_node("MatMulNBits", [xin, *(t.name for t in inits)], [out or base], domain=MS,
                                K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=level)
        return node, inits

    if kind.startswith("planes"):
        level = int(kind[-1])
        hi, hi_inits = nbits("hi", x, 4, level)
        lo, lo_inits = nbits("lo", x, 4, level)
        return [hi, lo, helper.make_node("Add", [hi.output[0], lo.output[0]], [name])], hi_inits + lo_inits
    if kind == "4bit fzp":
        node, inits = nbits("w", x, 4, 0, (rng.random(n * blocks) * 8).astype(np.float32), out=name)
        return [node], inits
    bits, level = int(kind[0]), 4 if kind.endswith("T2") else int(kind[-1])
    node, inits = nbits("w", x, bits, level, out=name)
    return [node], inits


def _best(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def linear_layers(shape: Shape, kinds: Sequence[str], layers: int, threads: int, repeats: int,
                  rows: Sequence[int] = (1,)) -> None:
    print(f"\nlinear layers of {layers} layers, {'/'.join(map(str, rows))} tokens at once (ms)")
    for kind in kinds:
        nodes, inits, inputs, outs = [], [], [], []
        widths: list[int] = []
        for part, k, n in shape.linears:
            x = f"x{k}"
            if k not in widths:
                widths.append(k)
                inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, ["rows", k]))
            for layer in range(layers):
                more_nodes, more_inits = _linear(f"{part}.{layer}", x, k, n, kind)
                nodes += more_nodes
                inits += more_inits
                outs.append(f"{part}.{layer}")
        session = _session(nodes, inputs, outs, inits, threads, two_term=kind.endswith("T2"))
        cells = []
        for m in rows:
            feeds = {f"x{k}": rng.standard_normal((m, k)).astype(np.float32) for k in widths}
            cells.append(f"{m}: {_best(functools.partial(session.run, None, feeds), repeats):7.2f}")
        print(f"  {kind:<12} " + "  ".join(cells))
        del session


def lm_head(shape: Shape, kinds: Sequence[str], vocab: int, threads: int, repeats: int) -> None:
    hidden = shape.hidden
    print(f"\nlm_head {vocab} x {hidden}, one token (ms)")
    feeds = {"x": rng.standard_normal((1, hidden)).astype(np.float32)}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])]
    for kind in kinds:
        nodes, inits = _linear("logits", "x", hidden, vocab, kind)
        session = _session(nodes, inputs, ["logits"], inits, threads)
        print(f"  {kind:<12} {_best(functools.partial(session.run, None, feeds), repeats):8.2f}")
        del session


def attention(shape: Shape, layers: int, capacity: int, contexts: Sequence[int], threads: int,
              repeats: int) -> None:
    """GroupQueryAttention of ``layers`` layers, each with its own K/V buffer bound in place."""
    HEADS, KV_HEADS, HEAD_DIM = shape.heads, shape.kv_heads, shape.head_dim
    print(f"\nGroupQueryAttention of {layers} layers, one token, K/V written in place (ms)")
    for dtype, proto in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
        qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        inputs = [helper.make_tensor_value_info("qkv", proto, [1, 1, qkv_width]),
                  helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
                  helper.make_tensor_value_info("total", TensorProto.INT32, []),
                  helper.make_tensor_value_info("cos", proto, [capacity, HEAD_DIM // 2]),
                  helper.make_tensor_value_info("sin", proto, [capacity, HEAD_DIM // 2])]
        nodes, outs = [], []
        kv_shape = [1, KV_HEADS, capacity, HEAD_DIM]
        for layer in range(layers):
            inputs += [helper.make_tensor_value_info(f"past_k{layer}", proto, kv_shape),
                       helper.make_tensor_value_info(f"past_v{layer}", proto, kv_shape)]
            nodes.append(helper.make_node(
                "GroupQueryAttention",
                ["qkv", "", "", f"past_k{layer}", f"past_v{layer}", "seqlens_k", "total", "cos", "sin"],
                [f"y{layer}", f"k{layer}", f"v{layer}"], domain=MS, num_heads=HEADS, kv_num_heads=KV_HEADS,
                scale=HEAD_DIM ** -0.5, do_rotary=1, rotary_interleaved=0))
            outs.append(f"y{layer}")
        kv_outs = [f"{kv}{layer}" for layer in range(layers) for kv in "kv"]
        session = _session(nodes, inputs, outs + kv_outs, [], threads, elem=proto)
        kv = [rng.random((1, KV_HEADS, capacity, HEAD_DIM)).astype(dtype) for _ in range(2 * layers)]
        tables = rng.random((capacity, HEAD_DIM // 2)).astype(dtype)
        binding = session.io_binding()
        for layer in range(layers):
            for i, kind in enumerate("kv"):
                past, present, buf = f"past_{kind}{layer}", f"{kind}{layer}", kv[2 * layer + i]
                binding.bind_input(past, "cpu", 0, dtype, list(buf.shape), buf.ctypes.data)
                binding.bind_output(present, "cpu", 0, dtype, list(buf.shape), buf.ctypes.data)
        for out in outs:
            binding.bind_output(out)
        binding.bind_cpu_input("qkv", rng.random((1, 1, qkv_width)).astype(dtype))
        binding.bind_cpu_input("cos", tables)
        binding.bind_cpu_input("sin", tables)
        figures = []
        for context in contexts:
            binding.bind_cpu_input("seqlens_k", np.array([context], np.int32))
            binding.bind_cpu_input("total", np.array(context + 1, np.int32))
            figures.append(_best(functools.partial(session.run_with_iobinding, binding), repeats))
        cells = [f"after {c}: {ms:6.2f}" for c, ms in zip(contexts, figures, strict=True)]
        print(f"  KV {np.dtype(dtype).name:<8}", "  ".join(cells))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="whose shapes")
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="1,2,8", help="tokens at once through the linear layers")
    p.add_argument("--kinds", default="fp32,4bit L0,4bit L4,4bit T2,8bit L0,8bit L4,8bit T2,planes L0",
                   help="linear kinds: fp32, {4,8}bit L{0,4}, {4,8}bit T2 (level 4, two int8 terms), "
                        "planes L{0,4}")
    p.add_argument("--quick", action="store_true", help="CI: 2 layers, 3 repeats, a small vocabulary")
    args = p.parse_args(argv)
    shape = MODELS[args.model]
    args.layers = args.layers or shape.layers
    if args.quick:
        args.layers, args.repeats, args.vocab = 2, 3, 4096
    print(f"CPU class {cpu_class()}, onnxruntime {ort.__version__}, {args.threads} threads, "
          f"best of {args.repeats}")
    linear_layers(shape, args.kinds.split(","), args.layers, args.threads, args.repeats,
                  [int(m) for m in args.rows.split(",")])
    lm_head(shape, ("fp32", "4bit L0", "planes L0", "planes L4", "8bit L4", "4bit fzp"), args.vocab,
            args.threads, args.repeats)
    capacity = 256 if args.quick else 2048
    attention(shape, args.layers, capacity, (100, 200) if args.quick else (400, 1500), args.threads,
              args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
