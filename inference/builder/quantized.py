"""Quantized weights for the CPU graph: onnxruntime ``MatMulNBits`` and ``GatherBlockQuantized``.

Both are ``com.microsoft`` CPU ops, so quantized bundles have no portable graph (TensorRT builds
its own bundles from the checkpoint). Weights are blocks of 32 along the input dimension, one
float scale per block: ``w = (q - zero_point) * scale``.

* **int4** linear layers: 4-bit codes, two a byte (low nibble first).
  - GGUF ``Q4_0`` blocks (``d``, 32 codes): scale ``d``, zero point 8 — the file's own codes.
  - GGUF ``Q4_1`` blocks (``w = d*q + m = d*(q - 8) + (m + 8d)``): scale ``d``, the default
    zero point 8, plus ``(m + 8d) * sum(x over the block)`` added through a small MatMul on
    block sums of the input (a fractional zero point ``-m/d`` is exact too, but onnxruntime
    then dequantizes the whole weight on every call: measured 4-35x slower per layer).
  - Anything else: quantized here per block (min/max, integer zero point).
* **int8** linear layers, and the token embedding and lm_head of both precisions: 8-bit codes,
  symmetric (``scale = max|w| / 127``, stored as ``q + 128`` with the default zero point 128).
  That is exactly llama.cpp's ``Q8_0``: re-quantizing the dequantized values of a ``Q8_0``
  tensor gives back its own codes and scales, so a Q8_0 GGUF loses nothing here.
* **Tied embedding and lm_head share one copy**: the lm_head is a ``MatMulNBits`` over the
  ``[vocab, hidden/32, 32]`` codes and ``[vocab, hidden/32]`` scales, and the embedding gathers
  rows of the same two initializers and dequantizes them (``GatherBlockQuantized`` would want
  the scales in another shape, i.e. a second copy).
* **Exact top-k rescoring of the lm_head**: the 8-bit lm_head with int8 activations
  (``accuracy_level`` 4, fast) misranks near-ties — SmolLM2's "What is the capital of France?"
  starts with "L'Étoile" instead of "The capital…" — while its float path dequantizes the whole
  table on every call (30x slower than float32). So the graph takes the fast logits' top ``k``
  tokens, recomputes their logits exactly (their dequantized rows, gathered, times the hidden
  state in float32) and scatters them back: the greedy token and the head of the distribution
  are those of the float32 weights; only the tail keeps the fast path's small error.
* What depends on the CPU class (the lm_head's path) is chosen in :mod:`.kernel_plan`; the
  linear layers compute in float32 on every class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

from inference.builder.emit import MS_DOMAIN
from inference.builder.gguf_reader import Q4_TYPES, RawBlocks

if TYPE_CHECKING:
    from inference.builder.checkpoint_reader import CheckpointReader
    from inference.builder.emit import Emitter
    from inference.builder.kernel_plan import KernelPlan

BLOCK = 32
#: The largest ``K`` whose Q4_1 block sums are a product with a ``[K, K/32]`` 0/1 matrix rather
#: than a reshape and a sum (one op a chain instead of two). Measured on SmolLM2, int4, side by
#: side: with it at K 576 only, decode 1.07-1.09x and a 400-token prefill 0.95-0.99x; at 1,536
#: too (down_proj), decode 1.04x but prefill 0.92-0.93x (the product is K/32 wide: 48 columns
#: through SGEMM for every prompt row cost more than the reshape saves).
BLOCK_SUM_MATRIX_MAX_K = 1024


@dataclass(frozen=True)
class BlockWeight:
    """One weight ready for ``MatMulNBits``: ``codes`` ``[N, K/32, 32*bits/8]`` uint8, ``scales``
    ``[N, K/32]``, ``zero_points`` (packed, None for the op's default) and, for Q4_1, the block
    minimums ``[N, K/32]`` (the ``m`` term)."""

    bits: int
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    block_min: np.ndarray | None = None


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[N, kb, 32] codes 0..15 -> [N, kb, 16] bytes, element 2i in the low nibble of byte i."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _gguf_codes(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 16 code bytes of a block (codes j and j+16 in byte j) -> 32 codes in order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _packed_zero_points(value: int, n: int, kb: int) -> np.ndarray:
    per_row = (kb + 1) // 2
    return np.full((n * per_row,), value | (value << 4), dtype=np.uint8)


def zero_point_rows(w: BlockWeight) -> np.ndarray:
    """A 4-bit weight's packed zero points, one row of ``ceil(K/64)`` bytes per output row, the
    op's default (8) spelled out where ``w`` has none."""
    n, kb = w.codes.shape[0], w.codes.shape[1]
    packed = w.zero_points if w.zero_points is not None else _packed_zero_points(8, n, kb)
    return packed.reshape(n, (kb + 1) // 2)


def from_q4_blocks(rows: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """GGUF Q4_0 / Q4_1 rows (``[N, kb * block bytes]``) -> 4-bit weight, codes untouched."""
    kb = k // BLOCK
    if type_name == "Q4_0":
        blocks = rows.reshape(n, kb, 18)
        d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
        return BlockWeight(4, _pack_nibbles(_gguf_codes(blocks[..., 2:])), d,
                           _packed_zero_points(8, n, kb))
    if type_name == "Q4_1":
        blocks = rows.reshape(n, kb, 20)
        d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        # d*q + m == d*(q - 8) + (m + 8d): the op's default zero point (8) needs no table.
        return BlockWeight(4, _pack_nibbles(_gguf_codes(blocks[..., 4:])), d, None, m + 8 * d)
    raise ValueError(f"not a 4-bit GGUF block type: {type_name}")


def q4_0_as_8bit(rows: np.ndarray, n: int, k: int) -> BlockWeight:
    """GGUF Q4_0 rows as the same weights in the 8-bit layout, exactly: ``d*(q - 8)`` is code
    ``q - 8 + 128`` with scale ``d``."""
    blocks = rows.reshape(n, k // BLOCK, 18)
    d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
    return BlockWeight(8, (_gguf_codes(blocks[..., 2:]) + 120).astype(np.uint8), d, None)


def quantize_4bit(w: np.ndarray) -> BlockWeight:
    """Quantize ``w`` [N, K] (K a multiple of 32) to 4 bits per block: min/max, integer zero point."""
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
    return BlockWeight(4, _pack_nibbles(codes), scale, zp_packed)


def quantize_8bit(w: np.ndarray) -> BlockWeight:
    """Quantize ``w`` [N, K] (K a multiple of 32) as llama.cpp's Q8_0: per block ``scale =
    max|w| / 127``, codes ``round(w / scale)`` stored as ``q + 128`` (the default zero point)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    scale = (np.abs(blocks).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale == 0.0, np.float32(1.0), scale)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int16)
    return BlockWeight(8, (q + 128).astype(np.uint8), scale, None)


def q8_0_as_8bit(rows: np.ndarray, n: int, k: int) -> BlockWeight:
    """GGUF Q8_0 rows (``d``, 32 int8 codes per block) as the 8-bit layout: codes + 128, scale ``d``."""
    blocks = rows.reshape(n, k // BLOCK, 34)
    d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
    return BlockWeight(8, codes.astype(np.uint8), d, None)


class GgufBlocks:
    """A checkpoint's weights as the GGUF file stores them, where that helps (by Hugging Face
    name; a safetensors checkpoint has none)."""

    def __init__(self, ckpt: CheckpointReader | None) -> None:
        self._ckpt = ckpt

    def _raw(self, name: str) -> RawBlocks | None:
        if self._ckpt is None or name not in self._ckpt:
            return None
        return self._ckpt.blocks(name)

    def get(self, name: str, n: int, k: int) -> BlockWeight | None:
        """The file's own 4-bit blocks of ``name`` ([N, K] weight), or None."""
        raw = self._raw(name)
        if raw is None or raw.type_name not in Q4_TYPES:
            return None
        return from_q4_blocks(raw.rows, raw.type_name, n, k)

    def get_8bit(self, name: str, n: int, k: int) -> BlockWeight | None:
        """``name`` in the 8-bit layout without loss where the file stores it as Q8_0 or Q4_0,
        or None (Q4_1's ``d*q + m`` has no exact symmetric 8-bit form)."""
        raw = self._raw(name)
        if raw is None:
            return None
        if raw.type_name == "Q8_0":
            return q8_0_as_8bit(raw.rows, n, k)
        if raw.type_name == "Q4_0":
            return q4_0_as_8bit(raw.rows, n, k)
        return None


def _concat(weights: list[BlockWeight]) -> BlockWeight:
    """Weights of the same input dimension as one, their rows (outputs) one after another."""
    if len(weights) == 1:
        return weights[0]
    bits = weights[0].bits
    if any(w.bits != bits for w in weights):
        raise ValueError("cannot fuse weights of different bit widths")
    zero_points = None
    if any(w.zero_points is not None for w in weights):  # the op's default (8 for 4 bits) spelled out
        zero_points = np.concatenate([zero_point_rows(w).reshape(-1) for w in weights])
    block_min = None
    if any(w.block_min is not None for w in weights):
        block_min = np.concatenate([
            w.block_min if w.block_min is not None else np.zeros(w.scales.shape, np.float32)
            for w in weights])
    return BlockWeight(bits, np.concatenate([w.codes for w in weights]),
                       np.concatenate([w.scales for w in weights]), zero_points, block_min)


def interleave_rows(a: BlockWeight, b: BlockWeight) -> BlockWeight:
    """Two 4-bit weights of the same shape as one whose rows alternate ``a[0], b[0], a[1], ...``
    (the gate/up layout of a fused SwiGLU, ``swiglu_fusion=1``)."""
    n, kb = a.scales.shape[0], a.codes.shape[1]

    def both(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.stack([x, y], axis=1).reshape(2 * n, *x.shape[1:])

    return BlockWeight(4, both(a.codes, b.codes), both(a.scales.reshape(n, kb), b.scales.reshape(n, kb)),
                       both(zero_point_rows(a), zero_point_rows(b)).reshape(-1))


@dataclass(frozen=True)
class Table8:
    """An 8-bit weight ``[n, k]`` written into the graph, in one of two layouts: ``codes`` (one
    uint8 code per weight, for level-4 ``MatMulNBits``) or ``planes`` (two 4-bit planes, for the
    float path, see :meth:`QuantizedEmitter.linear`)."""

    base: str
    layout: str
    n: int
    k: int


class QuantizedEmitter:
    """Writes quantized linear layers, embedding and lm_head into a graph being built."""

    def __init__(self, em: Emitter, plan: KernelPlan, q4: GgufBlocks) -> None:
        head_layout, head_level = plan.head_layout, plan.head_accuracy_level
        if head_layout not in ("codes", "planes") or (head_layout == "codes" and head_level == 0):
            raise ValueError(f"head layout {head_layout!r} at level {head_level}: "
                             "codes need level 4 (8-bit MatMulNBits has no fast float path)")
        self.em = em
        self.bits = plan.weight_bits
        #: The layers' accuracy level per weight name (the plan's groups).
        self.level_of = plan.level_of
        self.int8_codes = plan.int8_layout == "codes"
        self.head_level = head_level
        self.head_layout = head_layout
        self.top_k = plan.rescore_top_k
        self.q4 = q4
        self.counts = {"gguf_blocks": 0, "quantized": 0}
        self._block_sums: dict[str, str] = {}
        self._block_sum_matrices: dict[int, str] = {}
        self._times16: dict[str, str] = {}

    @staticmethod
    def fits(k: int) -> bool:
        """Whether an input dimension splits into whole blocks."""
        return k % BLOCK == 0

    def _weight(self, name: str, n: int, k: int, load: Callable[[], np.ndarray]) -> BlockWeight:
        if self.bits == 4:
            raw = self.q4.get(name, n, k)
            if raw is not None:
                self.counts["gguf_blocks"] += 1
                return raw
            self.counts["quantized"] += 1
            return quantize_4bit(load())
        self.counts["quantized"] += 1
        return quantize_8bit(load())

    def _weight_8bit(self, name: str, w: np.ndarray) -> BlockWeight:
        """An 8-bit table of ``w`` (the checkpoint's ``name``): the file's own codes for Q8_0
        and Q4_0 blocks; else quantized here (for a Q8_0 tensor's float values that gives back
        the same codes)."""
        n, k = w.shape
        return self.q4.get_8bit(name, n, k) or quantize_8bit(w)

    # --- MatMulNBits -----------------------------------------------------------------------
    def _matmul_nbits(self, x: str, inputs: list[str], n: int, k: int, bits: int, level: int,
                      out: str | None = None) -> str:
        return self.em.op("MatMulNBits", [x, *inputs], domain=MS_DOMAIN,
                          outputs=[out] if out is not None else None,
                          K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=level)[0]

    def _store(self, base: str, q: BlockWeight) -> list[str]:
        """The initializers of one MatMulNBits weight: codes, scales (, zero points)."""
        em = self.em
        names = [em.weight(f"{base}.q{q.bits}", q.codes), em.weight(f"{base}.q{q.bits}_scales", q.scales)]
        if q.zero_points is not None:
            names.append(em.weight(f"{base}.q{q.bits}_zero_points", q.zero_points))
        return names

    def _min_term(self, x: str, base: str, q: BlockWeight, k: int) -> str:
        """Q4_1's ``sum(x over each block) @ m^T``; block sums computed once per input.

        Where ``K`` is small (:data:`BLOCK_SUM_MATRIX_MAX_K`) the block sums are one product
        with a shared ``[K, K/32]`` 0/1 matrix (one op where a reshape and a sum are two: a
        small model's step is bound by dispatch); larger ``K`` keeps the reshape and sum,
        cheaper for a prompt's many rows.
        """
        em = self.em
        if x not in self._block_sums:
            if k <= BLOCK_SUM_MATRIX_MAX_K:
                if k not in self._block_sum_matrices:
                    ones = np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
                    self._block_sum_matrices[k] = em.weight(f"q4_block_sum_matrix.{k}", ones)
                self._block_sums[x] = em.op1("MatMul", [x, self._block_sum_matrices[k]])
            else:
                blocked = em.op1("Reshape", [x, em.const(np.array([0, 0, k // BLOCK, BLOCK], np.int64))])
                self._block_sums[x] = em.op1("ReduceSum", [blocked, em.const(np.array([-1], np.int64))],
                                             keepdims=0)
        assert q.block_min is not None
        mins = em.weight(f"{base}.q4_block_min", np.ascontiguousarray(q.block_min.T))
        return em.op1("MatMul", [self._block_sums[x], mins])

    def linear(self, x: str, name: str, n: int, k: int, load: Callable[[], np.ndarray]) -> str:
        """``x @ w.T`` for the checkpoint weight ``name`` [N, K]; ``load`` reads it as float32
        (not called where the file's own 4-bit blocks are used).

        8-bit weights at level 0 (float compute) are written as two 4-bit planes: onnxruntime
        has no float path for 8-bit ``MatMulNBits`` (it dequantizes the whole table per call),
        but a fast one for 4 bits, and a code ``c = 16a + b`` gives ``s*(c - 128) = 16s*(a - 8)
        + s*(b - 0)``: two 4-bit products, summed, are the 8-bit weights' exact products (the
        planes share one scale table: the high one reads ``16x``).
        """
        return self._weight_matmul(x, name.removesuffix(".weight"), self._weight(name, n, k, load), n, k)

    def linear_group(self, x: str, parts: list[tuple[str, int]], k: int,
                     load: Callable[[str, int], np.ndarray]) -> str:
        """``x @ [w1; w2; ...].T`` for checkpoint weights ``parts`` ((name, N) each, same K) as
        one op: their blocks concatenated along N (``load(name, n)`` reads one as float32)."""
        weights = [self._weight(name, n, k, functools.partial(load, name, n)) for name, n in parts]
        base = parts[0][0].removesuffix(".weight") + "+" + "+".join(
            name.rsplit(".", 2)[-2] for name, _ in parts[1:])
        return self._weight_matmul(x, base, _concat(weights), sum(size for _, size in parts), k)

    def _weight_matmul(self, x: str, base: str, q: BlockWeight, n: int, k: int) -> str:
        """``x`` times the weight ``q`` [N, K] written under ``base``: 8 bits as a table (two
        planes in float32), 4 bits as one MatMulNBits plus Q4_1's minimum term."""
        # int8 layers are two 4-bit planes at either level: level 4 on planes is level 4 on the
        # codes (16x quantizes to x's int8 values times 16), and 4-bit values cannot saturate
        # AVX2's 16-bit pair sums, so one layout serves every plan the gate tries (kernel_plan).
        # A chosen plan may hold its level-4 weights as 8-bit codes instead (faster, same products).
        level = self.level_of(base)
        if q.bits == 8:
            layout = "codes" if level == 4 and self.int8_codes else "planes"
            return self._table_matmul(x, self._table(base, q, layout), level)
        y = self._matmul_nbits(x, self._store(base, q), n, k, 4, level)
        if q.block_min is None:
            return y
        return self.em.op1("Add", [y, self._min_term(x, base, q, k)])

    # --- mixture of experts -----------------------------------------------------------------
    def expert_weight(self, name: str, n: int, k: int, load: Callable[[], np.ndarray]) -> BlockWeight:
        """One expert's 4-bit weight for ``QMoE``: the GGUF's own Q4_0 blocks where it has them
        (scale ``d``, zero point 8), else quantized here (min/max, integer zero point): QMoE
        takes integer zero points only, so Q4_1's ``m`` term has no place and its experts are
        quantized again from their float values."""
        raw = self.q4.get(name, n, k)
        if raw is not None and raw.block_min is None:
            self.counts["gguf_blocks"] += 1
            return raw
        self.counts["quantized"] += 1
        return quantize_4bit(load())

    def moe(self, x: str, router_logits: str, base: str, fc1: list[BlockWeight], fc2: list[BlockWeight],
            *, top_k: int, normalize: bool) -> str:
        """onnxruntime's ``QMoE`` over 4-bit experts (blocks of 32 along the input, one scale and
        one integer zero point each): ``fc1`` per expert ``[2F, H]`` (gate and up rows
        interleaved, ``swiglu_fusion=1``), ``fc2`` ``[H, F]``. At accuracy level 0 the products
        are float32's of the dequantized weights (measured equal to ``MoE`` over them to 4e-7);
        the gate's fastest plan retargets the node to level 4 (:func:`.kernel_plan.retarget`)."""
        em = self.em
        y_width = fc2[0].scales.shape[0]  # the hidden size
        names: list[str] = []
        for tag, weights in (("fc1", fc1), ("fc2", fc2)):
            n, kb = weights[0].scales.shape[0], weights[0].codes.shape[1]
            codes = np.stack([w.codes.reshape(n, kb * BLOCK // 2) for w in weights])
            scales = np.stack([w.scales.reshape(n, kb) for w in weights])
            zps = np.stack([zero_point_rows(w) for w in weights])
            names.append(em.weight(f"{base}.{tag}.q4", codes))
            names.append(em.weight(f"{base}.{tag}.q4_scales", scales))
            names.append(em.weight(f"{base}.{tag}.q4_zero_points", zps))
        fc1_w, fc1_s, fc1_z, fc2_w, fc2_s, fc2_z = names
        # onnxruntime 1.32's CPU QMoE renormalises the top-k weights whatever
        # normalize_routing_weights says (measured: MoE's unnormalised result differs by the
        # top-k's share of the softmax). Un-normalised routing is that share times the
        # renormalised result, per token: the sum of the top-k softmax probabilities.
        y = em.op("QMoE", [x, router_logits, fc1_w, fc1_s, "", fc2_w, fc2_s, "", "", "", "", fc1_z, fc2_z],
                  domain=MS_DOMAIN, k=top_k, activation_type="swiglu", swiglu_fusion=1,
                  normalize_routing_weights=1, expert_weight_bits=4, block_size=BLOCK,
                  weights_prepacked=0, accuracy_level=0)[0]
        if normalize:
            return y
        probs = em.op1("Softmax", [router_logits], axis=-1)  # [T, E]
        top = em.op("TopK", [probs, em.const(np.array([top_k], np.int64))], n_out=2, axis=-1)[0]
        share = em.op1("ReduceSum", [top, em.const(np.array([-1], np.int64))], keepdims=1)  # [T, 1]
        flat = em.op1("Reshape", [y, em.const(np.array([-1, y_width], np.int64))])
        return em.op1("Reshape", [em.op1("Mul", [flat, share]), em.op1("Shape", [x])])

    # --- 8-bit tables (int8 layers, embedding, lm_head) -------------------------------------
    def _table(self, base: str, q: BlockWeight, layout: str) -> Table8:
        n, kb, _ = q.codes.shape
        em = self.em
        if layout == "codes":
            self._store(base, q)
        else:
            em.weight(f"{base}.hi.q4", _pack_nibbles(q.codes >> 4))
            em.weight(f"{base}.lo.q4", _pack_nibbles(q.codes & 0x0F))
            em.weight(f"{base}.q8_scales", q.scales)
            em.weight(f"{base}.lo.q4_zero_points", _packed_zero_points(0, n, kb))
        return Table8(base, layout, n, kb * BLOCK)

    def _table_matmul(self, x: str, t: Table8, level: int, out: str | None = None) -> str:
        scales = f"{t.base}.q8_scales"
        if t.layout == "codes":
            return self._matmul_nbits(x, [f"{t.base}.q8", scales], t.n, t.k, 8, level, out)
        # 16s*(a - 8) == s*(a - 8) applied to 16x (exact: a power of two), so both planes share
        # one scale table: the high plane with the default zero point 8, the low one with 0.
        # Level 0 is float32; level 4 (a head on AVX2, top-k rescored) quantizes 16x and x alike.
        if x not in self._times16:
            self._times16[x] = self.em.op1("Mul", [x, self.em.const(np.float32(16.0))])
        hi = self._matmul_nbits(self._times16[x], [f"{t.base}.hi.q4", scales], t.n, t.k, 4, level)
        lo = self._matmul_nbits(x, [f"{t.base}.lo.q4", scales, f"{t.base}.lo.q4_zero_points"],
                                t.n, t.k, 4, level)
        return self.em.op("Add", [hi, lo], outputs=[out] if out is not None else None)[0]

    def _table_rows(self, t: Table8, ids: str) -> str:
        """Rows ``ids`` of an 8-bit table as float32 ``[*ids.shape, k]``."""
        em = self.em
        last = em.const(np.array([-1], np.int64))
        if t.layout == "codes":
            codes = em.op1("Cast", [em.op1("Gather", [f"{t.base}.q8", ids])], to=TensorProto.FLOAT)
        else:
            planes = []
            for plane in ("hi", "lo"):
                packed = em.op1("Gather", [f"{t.base}.{plane}.q4", ids])  # [..., kb, 16]
                low = em.op1("BitwiseAnd", [packed, em.const(np.uint8(0x0F))])
                high = em.op1("BitShift", [packed, em.const(np.uint8(4))], direction="RIGHT")
                # [..., kb, 16, 2]: element 2i is the low nibble
                pairs = em.op1("Concat", [em.op1("Unsqueeze", [low, last]),
                                          em.op1("Unsqueeze", [high, last])], axis=-1)
                shape = em.op1("Concat", [em.op1("Shape", [packed], end=-1),
                                          em.const(np.array([BLOCK], np.int64))], axis=0)
                planes.append(em.op1("Cast", [em.op1("Reshape", [pairs, shape])], to=TensorProto.FLOAT))
            codes = em.op1("Add", [em.op1("Mul", [planes[0], em.const(np.float32(16.0))]), planes[1]])
        scales = f"{t.base}.q8_scales"
        w = em.op1("Mul", [em.op1("Sub", [codes, em.const(np.float32(128.0))]),
                           em.op1("Unsqueeze", [em.op1("Gather", [scales, ids]), last])])
        shape = em.op1("Concat", [em.op1("Shape", [ids]), em.const(np.array([t.k], np.int64))], axis=0)
        return em.op1("Reshape", [w, shape])

    def embedding(self, table: np.ndarray, ids: str) -> tuple[str, Table8]:
        """Token embedding lookup of ``table`` [V, H] stored at 8 bits in the lm_head's layout
        (so a tied lm_head reads the same initializers); returns (output, the table)."""
        t = self._table("model.embed_tokens", self._weight_8bit("model.embed_tokens.weight", table),
                        self.head_layout)
        return self._table_rows(t, ids), t

    def table_rows(self, base: str, name: str, table: np.ndarray, ids: str) -> str:
        """Rows ``ids`` of another token table (Gemma 4's per-layer inputs, ``name`` [V, W]) held
        at 8 bits like the embedding: float32 ``[*ids.shape, W]``."""
        return self._table_rows(self._table(base, self._weight_8bit(name, table), self.head_layout), ids)

    def lm_head(self, hidden: str, table: Table8 | np.ndarray, bias: str | None = None) -> str:
        """Logits ``[B, S, vocab]`` of ``hidden`` [B, S, H] through the 8-bit lm_head: the tied
        embedding's :class:`Table8`, or an untied weight [V, H] (plus ``bias``, an initializer
        [V], where it has one). At level 4 the top-k logits are recomputed exactly (see the
        module docstring); at level 0 every logit is exact."""
        em = self.em
        t = table if isinstance(table, Table8) else self._table(
            "lm_head", self._weight_8bit("lm_head.weight", table), self.head_layout)
        if self.head_level == 0 or self.top_k <= 0:
            if bias is None:
                return self._table_matmul(hidden, t, self.head_level, out="logits")
            return em.op("Add", [self._table_matmul(hidden, t, self.head_level), bias], outputs=["logits"])[0]
        fast = self._table_matmul(hidden, t, self.head_level)
        if bias is not None:
            fast = em.op1("Add", [fast, bias])
        _, top = em.op("TopK", [fast, em.const(np.array([self.top_k], np.int64))], n_out=2, axis=-1)
        rows = self._table_rows(t, top)  # [B,S,k,H]
        col = em.op1("Unsqueeze", [hidden, em.const(np.array([-1], np.int64))])  # [B,S,H,1]
        exact = em.op1("Squeeze", [em.op1("MatMul", [rows, col]), em.const(np.array([-1], np.int64))])
        if bias is not None:
            exact = em.op1("Add", [exact, em.op1("Gather", [bias, top])])
        return em.op("ScatterElements", [fast, top, exact], outputs=["logits"], axis=-1)[0]
