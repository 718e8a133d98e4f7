"""The ``int4`` precision: linear weights as onnxruntime ``MatMulNBits`` (4 bits, blocks of 32).

``MatMulNBits`` is a ``com.microsoft`` CPU op, so int4 bundles run on onnxruntime only (the
graph is not the portable one TensorRT parses). Each weight is packed as ``[N, K/32, 16]``
bytes (two codes a byte, low nibble first) with one float scale and one zero point per block:
``w = (q - zero_point) * scale``.

Where the weights come from:

* GGUF ``Q4_0`` blocks (``d``, 32 codes): scale ``d``, zero point 8 -- exact, the file's own
  codes, only repacked (llama.cpp stores codes ``j`` and ``j+16`` in one byte).
* GGUF ``Q4_1`` blocks (``d``, ``m``, 32 codes, ``w = d*q + m``): scale ``d``, zero point 0,
  plus ``m * sum(x over the block)`` added to the output through a small ``[K/32, N]`` MatMul
  on block sums of the input. A fractional zero point (``-m/d``) would be exact too, but
  onnxruntime then dequantizes the whole weight on every call (measured ~20x slower).
* Anything else (fp32/fp16/bf16 checkpoints, other GGUF types): quantized here, per block
  asymmetric min/max with an integer zero point.

The lm_head stays float32 (tied: the embedding table read by a Gemm): at 4 bits it cost
SmolLM2-135M its answers (logits cosine 0.98, "La femme de France..." for "Paris"), and
llama.cpp's Q4 files keep it at 6-8 bits for the same reason.

The raw GGUF blocks come from the checkpoint reader's ``blocks()`` (the converted directory's
``model.gguf``, see ``gguf_reader``), rows already in Hugging Face order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from inference.builder.checkpoint_reader import open_checkpoint
from inference.builder.gguf_reader import Q4_TYPES

BLOCK = 32
MS_DOMAIN = "com.microsoft"
#: 4 = int8 activations in the kernel (as llama.cpp does for its Q4 dot products): the fast
#: path; 0 computes in float32 and reproduces the dequantized weights' logits exactly.
ACCURACY_LEVEL = 4
#: Weights that stay float32 (see the module docstring).
KEEP_FLOAT = ("lm_head.weight",)


def _pack_codes(codes: np.ndarray) -> np.ndarray:
    """[N, kb, 32] codes 0..15 -> [N, kb, 16] bytes, element 2i in the low nibble of byte i."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _gguf_codes(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 16 code bytes of a block (codes j and j+16 in byte j) -> 32 codes in order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _packed_zero_points(value: int, n: int, kb: int) -> np.ndarray:
    per_row = (kb + 1) // 2
    return np.full((n * per_row,), value | (value << 4), dtype=np.uint8)


class Q4Weight:
    """One weight ready for MatMulNBits; ``block_min`` is set for Q4_1 (the ``m`` term)."""

    def __init__(self, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
                 block_min: np.ndarray | None) -> None:
        self.packed, self.scales, self.zero_points, self.block_min = packed, scales, zero_points, block_min


def from_gguf_blocks(rows: np.ndarray, type_name: str, n: int, k: int) -> Q4Weight:
    """GGUF Q4_0 / Q4_1 rows (``[N, kb * block bytes]``) -> MatMulNBits inputs, codes untouched."""
    kb = k // BLOCK
    if type_name == "Q4_0":
        blocks = rows.reshape(n, kb, 18)
        d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
        codes = _gguf_codes(blocks[..., 2:])
        return Q4Weight(_pack_codes(codes), d.reshape(-1), _packed_zero_points(8, n, kb), None)
    if type_name == "Q4_1":
        blocks = rows.reshape(n, kb, 20)
        d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        codes = _gguf_codes(blocks[..., 4:])
        return Q4Weight(_pack_codes(codes), d.reshape(-1), _packed_zero_points(0, n, kb), m)
    raise ValueError(f"not a 4-bit GGUF block type: {type_name}")


def quantize_weight(w: np.ndarray) -> Q4Weight:
    """Quantize ``w`` [N, K] (K a multiple of 32) per block: min/max, integer zero point."""
    n, k = w.shape
    kb = k // BLOCK
    blocks = w.reshape(n, kb, BLOCK).astype(np.float32)
    lo = np.minimum(blocks.min(axis=-1), 0.0)
    hi = np.maximum(blocks.max(axis=-1), 0.0)
    scale = (hi - lo) / 15.0
    scale = np.where(scale == 0.0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    codes = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    per_row = (kb + 1) // 2
    zp_padded = np.zeros((n, per_row * 2), dtype=np.uint8)
    zp_padded[:, :kb] = zp
    zp_packed = (zp_padded[:, 0::2] | (zp_padded[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return Q4Weight(_pack_codes(codes), scale.reshape(-1), zp_packed, None)


class _Q4Source:
    """The raw GGUF Q4 blocks of a checkpoint, by Hugging Face weight name (None: not Q4)."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self._ckpt = open_checkpoint(checkpoint_dir)

    def get(self, name: str, n: int, k: int) -> Q4Weight | None:
        raw = self._ckpt.blocks(name) if name in self._ckpt else None
        if raw is None or raw.type_name not in Q4_TYPES:  # Q8_0 blocks are quantized afresh
            return None
        return from_gguf_blocks(np.asarray(raw.rows), raw.type_name, n, k)


def quantize_int4(fp32_model: Path, out_model: Path, checkpoint_dir: Path) -> dict[str, int]:
    """Rewrite every MatMul by a ``*.weight`` initializer of ``fp32_model`` as MatMulNBits.

    Writes ``out_model`` (+ ``<name>.data``); returns counts ``{"gguf_blocks", "quantized"}``.
    """
    model = onnx.load(str(fp32_model), load_external_data=True)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    source = _Q4Source(Path(checkpoint_dir))
    counts = {"gguf_blocks": 0, "quantized": 0}
    block_sums: dict[str, str] = {}
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[TensorProto] = []
    replaced: set[str] = set()
    for node in graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else ""
        if not weight.endswith(".weight") or weight not in inits or weight in KEEP_FLOAT:
            new_nodes.append(node)
            continue
        w_t = numpy_helper.to_array(inits[weight])  # stored [in, out]
        k, n = w_t.shape
        if k % BLOCK:
            new_nodes.append(node)
            continue
        q = source.get(weight, n, k)
        if q is None:
            q = quantize_weight(np.ascontiguousarray(w_t.T))
            counts["quantized"] += 1
        else:
            counts["gguf_blocks"] += 1
        replaced.add(weight)
        base = weight.removesuffix(".weight")
        new_inits += [
            numpy_helper.from_array(q.packed, f"{base}.q4"),
            numpy_helper.from_array(q.scales, f"{base}.q4_scales"),
            numpy_helper.from_array(q.zero_points, f"{base}.q4_zero_points"),
        ]
        x, y = node.input[0], node.output[0]
        nbits_out = y if q.block_min is None else f"{base}.q4_out"
        new_nodes.append(helper.make_node(
            "MatMulNBits", [x, f"{base}.q4", f"{base}.q4_scales", f"{base}.q4_zero_points"], [nbits_out],
            name=f"{base}.matmul_nbits", domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=BLOCK,
            accuracy_level=ACCURACY_LEVEL,
        ))
        if q.block_min is not None:
            # w = d*q + m: the m part is (sum of x over each block) @ m^T.
            if x not in block_sums:
                shape = f"{base}.block_shape"
                dims = np.array([0, 0, k // BLOCK, BLOCK], np.int64)
                new_inits.append(numpy_helper.from_array(dims, shape))
                axes = f"{base}.block_axes"
                new_inits.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
                blocked = f"{base}.x_blocks"
                new_nodes.append(helper.make_node("Reshape", [x, shape], [blocked], name=f"{base}.x_reshape"))
                block_sums[x] = f"{base}.x_block_sums"
                new_nodes.append(helper.make_node("ReduceSum", [blocked, axes], [block_sums[x]],
                                                  name=f"{base}.x_block_sum", keepdims=0))
            mins = f"{base}.q4_block_min"
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(q.block_min.T), mins))
            min_term = f"{base}.q4_min_term"
            new_nodes.append(
                helper.make_node("MatMul", [block_sums[x], mins], [min_term], name=f"{base}.min_mm")
            )
            new_nodes.append(helper.make_node("Add", [nbits_out, min_term], [y], name=f"{base}.min_add"))
    kept = [t for t in graph.initializer if t.name not in replaced]
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    onnx.save_model(model, str(out_model), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out_model.name + ".data", size_threshold=1024)
    return counts
