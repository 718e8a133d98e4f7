"""The per-layer emitters of the decoder graph (:mod:`inference.builder.graph` assembles them).

:class:`_DecoderBuilder` writes one checkpoint's nodes into an :class:`~inference.builder.emit.Emitter`:
weights and LoRA deltas, norms, rotary tables (M-RoPE included), attention (portable, fused or
``com.microsoft.GroupQueryAttention``), the dense MLP and the mixture of experts (float or ``QMoE``),
the per-layer inputs of Gemma 4, the embedding, pooling and the lm_head. The graph's I/O, its
checks and its file are :func:`inference.builder.graph.build_decoder_graph`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from inference.builder.checkpoint_reader import CheckpointReader
from inference.builder.emit import MS_DOMAIN, Emitter, activation
from inference.builder.errors import BuildInputError
from inference.builder.image_attention import GqaImageAttention, portable_allowed
from inference.builder.layout import names_for
from inference.builder.model_config import ModelConfig
from inference.builder.quantized import (
    BLOCK,
    BlockWeight,
    QuantizedEmitter,
    Table8,
    interleave_rows,
    quantize_4bit,
)

# Additive mask value: large enough to zero a probability, small enough that a fully masked
# row (a left-padding query) stays finite instead of turning into NaN.
MASK_NEG = -1.0e9


def past_names(layer: int) -> tuple[str, str]:
    """Input names of one layer's past K and V."""
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    """Output names of one layer's present K and V."""
    return f"present.{layer}.key", f"present.{layer}.value"


def quantized_experts(cfg: ModelConfig, weight_bits: int) -> bool:
    """Whether a quantized CPU graph of ``weight_bits`` holds ``cfg``'s experts quantized: 4-bit
    ``QMoE`` when both expert dimensions split into blocks of 32. int8 keeps them float32:
    onnxruntime's 8-bit ``QMoE`` has no float path (its int8 activations at every accuracy
    level would make the exact plan inexact)."""
    moe = cfg.moe
    return (moe is not None and weight_bits == 4 and cfg.hidden_size % BLOCK == 0
            and moe.expert_size % BLOCK == 0)


class _DecoderBuilder:
    def __init__(self, cfg: ModelConfig, ckpt: CheckpointReader, em: Emitter, *,
                 max_positions: int, fused_ops: bool, kv_layout: str = "portable",
                 quant: QuantizedEmitter | None = None, lora: bool = False,
                 kv_fp16: bool = False, image_attention: str = "causal") -> None:
        self.cfg, self.ckpt, self.em = cfg, ckpt, em
        #: "bidirectional": image rows attend both ways within each image (:mod:`.image_attention`)
        self.image_attention = image_attention
        self.both_ways: GqaImageAttention | None = None
        #: float16 K/V buffers (gqa only): GroupQueryAttention runs in float16.
        self.kv_fp16 = kv_fp16
        self.half_tables: dict[str, str] = {}  # rope table -> its float16 copy
        self.table_values: dict[str, np.ndarray] = {}
        self.lora = lora
        #: The LoRA inputs (overridable initializers), in the order they were added.
        self.lora_inputs: list[onnx.ValueInfoProto] = []
        self.max_positions = max_positions
        self.fused = fused_ops
        self.gqa = kv_layout == "gqa"
        self.quant = quant
        self.embed_q8: Table8 | None = None  # the 8-bit embedding, shared by a tied lm_head
        self.names = names_for(cfg)
        self.masks: dict[int | None, str] = {}  # portable graph: the additive mask per window
        #: K/V a layer attends over, by layer, for the layers that share them (Gemma 4): the gqa
        #: graph's new k/v inputs (a sharing layer writes the same values into the same buffer),
        #: the portable graph's present tensors.
        self.kv_of: dict[int, tuple[str, str]] = {}
        self.per_layer_inputs = ""  # Gemma 4: [B,S,layers,width], one slice a layer
        #: Multimodal rotary positions (Qwen2.5-VL): ``position_ids [3,B,S]``, each layer's cos/sin
        #: gathered per token [B,S,rot/2] (:meth:`mrope_gather`), applied outside GroupQueryAttention.
        self.mrope = bool(cfg.mrope_section)
        self.layer_mrope: list[tuple[str, str] | None] = []

    # --- weights -------------------------------------------------------------------------
    def linear_weight(self, name: str, out_dim: int, in_dim: int) -> str:
        # Stored transposed ([in, out]) so the graph runs a plain MatMul.
        w = self.ckpt.get_f32(name, (out_dim, in_dim))
        return self.em.weight(name, w.T)

    def vector(self, name: str, dim: int) -> str:
        return self.em.weight(name, self.ckpt.get_f32(name, (dim,)))

    def lora_delta(self, x: str, prefix: str, out_dim: int, in_dim: int) -> str:
        """``x @ A @ B`` of the adapter active in a run (``<prefix>.lora_A [in, r]``, ``.lora_B
        [r, out]``, the adapter's scale folded into B): graph inputs whose default is rank 0,
        so with no adapter active the delta is an empty product, zero."""
        em = self.em
        names = (f"{prefix}.lora_A", f"{prefix}.lora_B")
        shapes: tuple[list[int | str], list[int | str]] = ([in_dim, "lora_rank"], ["lora_rank", out_dim])
        defaults = (np.zeros((in_dim, 0), np.float32), np.zeros((0, out_dim), np.float32))
        for name, shape, default in zip(names, shapes, defaults, strict=True):
            em.initializers.append(numpy_helper.from_array(default, name))
            self.lora_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return em.op1("MatMul", [em.op1("MatMul", [x, names[0]]), names[1]])

    def linear(self, x: str, prefix: str, out_dim: int, in_dim: int, bias: bool, *,
               adapt: bool = True) -> str:
        """``x @ W.T (+ b)`` of module ``prefix``; ``adapt``: with its LoRA input pair in a LoRA graph."""
        name = f"{prefix}.weight"
        if self.quant is not None and self.quant.fits(in_dim):
            y = self.quant.linear(x, name, out_dim, in_dim,
                                  lambda: self.ckpt.get_f32(name, (out_dim, in_dim)))
        else:
            y = self.em.op1("MatMul", [x, self.linear_weight(name, out_dim, in_dim)])
        if self.lora and adapt:
            y = self.em.op1("Add", [y, self.lora_delta(x, prefix, out_dim, in_dim)])
        if bias:
            y = self.em.op1("Add", [y, self.vector(f"{prefix}.bias", out_dim)])
        return y

    # --- building blocks -----------------------------------------------------------------
    def norm(self, x: str, module: str, dim: int, *, rms: bool | None = None) -> str:
        """The family's norm of ``x`` with the weights of ``module`` (``<module>.weight`` [dim]):
        RMSNorm or LayerNorm, times ``(offset + w)``, plus the bias where the family has one."""
        cfg = self.cfg
        weight = self.ckpt.get_f32(f"{module}.weight", (dim,))
        if cfg.norm_offset:
            weight = weight + np.float32(cfg.norm_offset)
        w = self.em.weight(f"{module}.weight", weight)
        rms = cfg.norm == "rms" if rms is None else rms
        y = self.rms_norm(x, w) if rms else self.layer_norm(x, w)
        if cfg.norm_bias:
            y = self.em.op1("Add", [y, self.vector(f"{module}.bias", dim)])
        return y

    def rms_norm(self, x: str, weight: str) -> str:
        eps = self.cfg.rms_norm_eps
        if self.fused:
            return self.em.op1("RMSNormalization", [x, weight], axis=-1, epsilon=eps, stash_type=1)
        sq = self.em.op1("Mul", [x, x])
        mean = self.em.op1("ReduceMean", [sq, self.axes_last], keepdims=1)
        std = self.em.op1("Sqrt", [self.em.op1("Add", [mean, self.em.const(np.float32(eps))])])
        normed = self.em.op1("Div", [x, std])
        return self.em.op1("Mul", [normed, weight])

    def layer_norm(self, x: str, weight: str) -> str:
        """LayerNorm without its bias (added by :meth:`norm`)."""
        eps = self.cfg.rms_norm_eps
        em = self.em
        if self.fused:
            return em.op1("LayerNormalization", [x, weight], axis=-1, epsilon=eps, stash_type=1)
        mean = em.op1("ReduceMean", [x, self.axes_last], keepdims=1)
        centred = em.op1("Sub", [x, mean])
        var = em.op1("ReduceMean", [em.op1("Mul", [centred, centred]), self.axes_last], keepdims=1)
        std = em.op1("Sqrt", [em.op1("Add", [var, em.const(np.float32(eps))])])
        return em.op1("Mul", [em.op1("Div", [centred, std]), weight])

    def activation(self, x: str) -> str:
        """The family's activation, from default-domain ops (every graph flavour runs it)."""
        return activation(self.em, x, self.cfg.act)

    def scaled(self, x: str, factor: float) -> str:
        return x if factor == 1.0 else self.em.op1("Mul", [x, self.em.const(np.float32(factor))])

    def rope(self, x: str, layer: int) -> str:
        """x [B,H,S,hd] -> rotated over the first ``rotary`` dimensions of each head, in the
        rotate_half convention (as transformers' Llama) or with neighbouring pairs
        (``rope_interleaved``); a NoPE layer's x as it is."""
        tables = self.layer_tables[layer]
        if tables is None:
            return x
        cos_t, sin_t, cos_full, sin_full = tables
        rot, hd = self.cfg.rotary_of(layer), self.cfg.head_dim_of(layer)
        interleaved = self.cfg.rope_interleaved
        if self.fused:
            attrs = {} if rot == hd else {"rotary_embedding_dim": rot}
            mrope = self.layer_mrope[layer]
            if mrope is not None:  # per-token tables [B,S,rot/2] instead of the positions
                return self.em.op1("RotaryEmbedding", [x, *mrope], interleaved=int(interleaved), **attrs)
            return self.em.op1("RotaryEmbedding", [x, cos_t, sin_t, "position_ids"],
                               interleaved=int(interleaved), **attrs)
        return self.rotate(x, rot, hd, cos_full, sin_full)

    def rotate(self, x: str, rot: int, hd: int, cos_full: str, sin_full: str) -> str:
        """``x`` (4D, the head's values last) rotated over its first ``rot`` values by tables
        ``cos_full``/``sin_full`` that broadcast against it (default-domain ops)."""
        interleaved = self.cfg.rope_interleaved
        em = self.em
        def part(lo: int, hi: int) -> str:
            return em.op1("Slice", [x, em.const(np.array([lo])), em.const(np.array([hi])), self.axes_last])
        xr = x if rot == hd else part(0, rot)
        if interleaved:  # pairs (x0, x1) ... -> (-x1, x0) ...
            pairs = em.op1("Reshape", [xr, em.const(np.array([0, 0, 0, rot // 2, 2], np.int64))])
            even, odd = em.op("Split", [pairs, em.const(np.array([1, 1], np.int64))], n_out=2, axis=-1)
            swapped = em.op1("Concat", [em.op1("Neg", [odd]), even], axis=-1)
            rotated = em.op1("Reshape", [swapped, em.const(np.array([0, 0, 0, rot], np.int64))])
        else:
            half = rot // 2
            x1, x2 = part(0, half), part(half, rot)
            rotated = em.op1("Concat", [em.op1("Neg", [x2]), x1], axis=-1)
        y = em.op1("Add", [em.op1("Mul", [xr, cos_full]), em.op1("Mul", [rotated, sin_full])])
        return y if rot == hd else em.op1("Concat", [y, part(rot, hd)], axis=-1)

    def mrope_rotate(self, x: str, n_heads: int, layer: int) -> str:
        """``x`` [B,S,n*hd] rotated by the multimodal positions (GroupQueryAttention rotates by 1D
        positions only, so the CPU graph of an M-RoPE model rotates q and k before it)."""
        tables = self.layer_mrope[layer]
        if tables is None:
            return x
        rot, hd = self.cfg.rotary_of(layer), self.cfg.head_dim_of(layer)
        em = self.em
        if self.fused:
            attrs = {} if rot == hd else {"rotary_embedding_dim": rot}
            return em.op1("RotaryEmbedding", [x, *tables], num_heads=n_heads,
                          interleaved=int(self.cfg.rope_interleaved), **attrs)
        _, _, cos_full, sin_full = self.layer_tables[layer] or ("", "", "", "")
        x4 = em.op1("Reshape", [x, em.const(np.array([0, 0, n_heads, hd], np.int64))])
        y = self.rotate(x4, rot, hd, cos_full, sin_full)
        return em.op1("Reshape", [y, em.const(np.array([0, 0, n_heads * hd], np.int64))])

    def mrope_gather(self, table: str) -> str:
        """The rows of ``table`` [positions, rot/2] for each token [B,S,rot/2]: frequency pair
        ``j`` at the position of its section (temporal, height, width ids of ``position_ids
        [3,B,S]``), as transformers' ``Qwen2_5_VLRotaryEmbedding`` recomposes them."""
        em = self.em
        rows = em.op1("Gather", [table, "position_ids"])  # [3,B,S,rot/2]
        parts, lo = [], 0
        for s, width in enumerate(self.cfg.mrope_section):
            if width:
                parts.append(em.op1("Slice", [rows, em.const(np.array([s, lo], np.int64)),
                                              em.const(np.array([s + 1, lo + width], np.int64)),
                                              em.const(np.array([0, 3], np.int64))]))
            lo += width
        joined = parts[0] if len(parts) == 1 else em.op1("Concat", parts, axis=-1)
        return em.op1("Squeeze", [joined, em.const(np.array([0], np.int64))])

    def heads(self, x: str, n_heads: int, norm_module: str | None, hd: int, *,
              plain_norm: bool = False) -> str:
        """[B,S,n*hd] -> [B,n,S,hd], with the optional per-head norm (qwen3), or a weightless one
        (``plain_norm``: Gemma 4's values)."""
        shape = self.em.const(np.array([0, 0, n_heads, hd], dtype=np.int64))
        y = self.em.op1("Reshape", [x, shape])
        if norm_module is not None:
            y = self.norm(y, norm_module, hd, rms=True)
        elif plain_norm:
            y = self.plain_rms_norm(y, hd)
        return self.em.op1("Transpose", [y], perm=[0, 2, 1, 3])

    def plain_rms_norm(self, x: str, dim: int) -> str:
        """An RMSNorm without weights over the last ``dim`` values (Gemma 4's values)."""
        return self.rms_norm(x, self.em.const(np.ones(dim, np.float32)))

    def attention(self, q: str, k: str, v: str, layer: int) -> str:
        """q [B,H,S,hd], k/v [B,kv,S,hd] -> [B,H,S,hd]; writes present K/V."""
        cfg = self.cfg
        past_k, past_v = past_names(layer)
        pres_k, pres_v = present_names(layer)
        mask = self.mask_of(layer)
        kvh, hd, scale = cfg.kv_heads_of(layer), cfg.head_dim_of(layer), cfg.query_scale_of(layer)
        source = cfg.kv_source(layer)
        if source != layer:  # K/V of an earlier layer (all positions): its present, passed on
            k_all, v_all = self.kv_of[source]
            self.em.op("Identity", [k_all], outputs=[pres_k])
            self.em.op("Identity", [v_all], outputs=[pres_v])
        if self.fused:
            attrs: dict[str, Any] = {"scale": float(scale)}
            if cfg.attn_softcap:
                attrs["softcap"] = float(cfg.attn_softcap)
            if source != layer:
                return self.em.op("Attention", [q, k_all, v_all, mask], outputs=[f"attn_{layer}_y"],
                                  **attrs)[0]
            self.kv_of[layer] = (pres_k, pres_v)
            return self.em.op("Attention", [q, k, v, mask, past_k, past_v], n_out=3,
                              outputs=[f"attn_{layer}_y", pres_k, pres_v], **attrs)[0]
        if source == layer:
            k_all = self.em.op("Concat", [past_k, k], axis=2, outputs=[pres_k])[0]
            v_all = self.em.op("Concat", [past_v, v], axis=2, outputs=[pres_v])[0]
            self.kv_of[layer] = (k_all, v_all)
        group = cfg.num_heads // kvh
        # Query head h reads kv head h // group: view q as [B,kv,group,S,hd] and broadcast.
        q5 = self.em.op1("Reshape", [q, self.em.const(np.array([0, kvh, group, -1, hd], dtype=np.int64))])
        q5 = self.em.op1("Mul", [q5, self.em.const(np.float32(scale))])
        k5 = self.em.op1("Unsqueeze", [k_all, self.em.const(np.array([2]))])
        v5 = self.em.op1("Unsqueeze", [v_all, self.em.const(np.array([2]))])
        scores = self.em.op1("MatMul", [q5, self.em.op1("Transpose", [k5], perm=[0, 1, 2, 4, 3])])
        if cfg.attn_softcap:
            cap = self.em.const(np.float32(cfg.attn_softcap))
            scores = self.em.op1("Mul", [self.em.op1("Tanh", [self.em.op1("Div", [scores, cap])]), cap])
        scores = self.em.op1("Add", [scores, self.em.op1("Unsqueeze", [mask, self.em.const(np.array([2]))])])
        probs = self.em.op1("Softmax", [scores], axis=-1)
        out5 = self.em.op1("MatMul", [probs, v5])
        shape = self.em.const(np.array([0, cfg.num_heads, -1, hd], dtype=np.int64))
        return self.em.op1("Reshape", [out5, shape])

    def head_norm(self, x: str, n_heads: int, module: str | None, hd: int) -> str:
        """Per-head norm (qwen3) on [B,S,n*hd], keeping that layout; ``module`` None: a weightless
        RMSNorm (Gemma 4's values)."""
        y = self.em.op1("Reshape", [x, self.em.const(np.array([0, 0, n_heads, hd], dtype=np.int64))])
        y = self.norm(y, module, hd, rms=True) if module is not None else self.plain_rms_norm(y, hd)
        return self.em.op1("Reshape", [y, self.em.const(np.array([0, 0, n_heads * hd], dtype=np.int64))])

    def gqa_attention(self, q: str, k: str, v: str, layer: int) -> str:
        """q/k/v [B,S,heads*hd] -> [B,S,H*hd] via GroupQueryAttention; K/V buffers updated in place.

        ``k`` and ``v`` empty: ``q`` is the packed [q | k | v] of one fused projection."""
        cfg = self.cfg
        past_k, past_v = past_names(layer)
        pres_k, pres_v = present_names(layer)
        # Measured against transformers (prefill, chunked prefill and decode): ORT's
        # local_window_size takes the checkpoint's sliding_window as is.
        window = cfg.window(layer)
        tables = self.layer_tables[layer]
        attrs: dict[str, Any] = {}
        if cfg.attn_softcap:
            attrs["softcap"] = float(cfg.attn_softcap)
        cos_t, sin_t = (tables[0], tables[1]) if tables is not None else (self.cos_table, self.sin_table)
        qkv32 = (q, k, v)  # float32, before rotation: what the image rows' attention reads
        if self.image_attention == "bidirectional" and not k:  # packed [q | k | v]
            hd, kvh = cfg.head_dim_of(layer), cfg.kv_heads_of(layer)
            q_, k_, v_ = self.split(q, [cfg.num_heads * hd, kvh * hd, kvh * hd])
            qkv32 = (q_, k_, v_)
        if self.kv_fp16:
            q, k, v = (self.em.op1("Cast", [t], to=TensorProto.FLOAT16) if t else t for t in (q, k, v))
            cos_t, sin_t = self.half_table(cos_t), self.half_table(sin_t)
        source = cfg.kv_source(layer)
        if source != layer:
            # The engine binds this layer's K/V to its source's buffers: the source's new k/v,
            # written again at the same positions, are the values already there.
            k, v = self.kv_of[source]
        elif cfg.kv_sources:
            self.kv_of[layer] = (k, v)
        y = self.em.op(
            "GroupQueryAttention",
            [q, k, v, past_k, past_v, "seqlens_k", "total_sequence_length", cos_t, sin_t],
            n_out=3, outputs=[f"attn_{layer}_y", pres_k, pres_v], domain=MS_DOMAIN,
            num_heads=cfg.num_heads, kv_num_heads=cfg.kv_heads_of(layer),
            scale=float(cfg.query_scale_of(layer)),
            do_rotary=0 if tables is None or self.mrope else 1, rotary_interleaved=int(cfg.rope_interleaved),
            local_window_size=-1 if window is None else window, **attrs,
        )[0]
        y = self.em.op1("Cast", [y], to=TensorProto.FLOAT) if self.kv_fp16 else y
        if self.image_attention == "bidirectional":
            if self.both_ways is None:
                self.both_ways = GqaImageAttention(self)
            y = self.both_ways.layer(qkv32, y, layer)
        return y

    def half_table(self, name: str) -> str:
        """The float16 copy of the rope table ``name`` (written once)."""
        if name not in self.half_tables:
            half = self.table_values[name].astype(np.float16)
            self.half_tables[name] = self.em.weight(f"{name}.fp16", half)
        return self.half_tables[name]

    def mask_of(self, layer: int) -> str:
        window = self.cfg.window(layer)
        if window not in self.masks:
            self.masks[window] = self.build_mask(window)
        return self.masks[window]

    def build_mask(self, window: int | None) -> str:
        """Additive float mask [B,1,S,T]: causal by cache index, left padding, sliding window."""
        em = self.em
        one_i = em.const(np.array(1, dtype=np.int64))
        zero_i = em.const(np.array(0, dtype=np.int64))
        total = em.op1("Squeeze", [em.op1("Shape", ["attention_mask"], start=1, end=2)])
        new = em.op1("Squeeze", [em.op1("Shape", ["input_ids"], start=1, end=2)])
        past_len = em.op1("Sub", [total, new])
        if self.image_attention == "bidirectional":  # [B,S,T]: causal or the same image
            both = portable_allowed(em, past_len, total, window, one_i, zero_i)
            allowed4 = em.op1("Unsqueeze", [both, em.const(np.array([1]))])
        else:
            kidx = em.op1("Unsqueeze", [em.op1("Range", [zero_i, total, one_i]), em.const(np.array([0]))])
            qidx = em.op1("Unsqueeze", [em.op1("Range", [past_len, total, one_i]), em.const(np.array([1]))])
            allowed = em.op1("LessOrEqual", [kidx, qidx])  # [S,T]
            if window is not None:
                w = em.const(np.array(window, dtype=np.int64))
                allowed = em.op1("And", [allowed, em.op1("Greater", [kidx, em.op1("Sub", [qidx, w])])])
            allowed4 = em.op1("Unsqueeze", [allowed, em.const(np.array([0, 1]))])
        keep = em.op1("Cast", ["attention_mask"], to=TensorProto.BOOL)
        keep4 = em.op1("Unsqueeze", [keep, em.const(np.array([1, 2]))])
        both = em.op1("And", [allowed4, keep4])
        return em.op1("Where", [both, em.const(np.float32(0.0)), em.const(np.float32(MASK_NEG))])

    def build_rope_tables(self) -> None:
        """cos/sin tables of every distinct rope of the layers (global, sliding), and each
        layer's (None for a NoPE layer)."""
        cfg = self.cfg
        if not self.fused:
            self.axes_last = self.em.const(np.array([-1]), "axes_last")
        made: dict[tuple[Any, int], tuple[str, str, str, str]] = {}
        mrope_made: dict[tuple[Any, int], tuple[str, str]] = {}
        self.layer_tables: list[tuple[str, str, str, str] | None] = []
        for i in range(cfg.num_layers):
            rope = cfg.rope_of(i)
            if rope is None:
                self.layer_tables.append(None)
                self.layer_mrope.append(None)
                continue
            key = (rope, cfg.rotary_of(i))
            if key not in made:
                suffix = "" if not made else f".{len(made)}"
                cos, sin = rope.cos_sin(key[1], self.max_positions)
                cos_t = self.em.weight(f"rope.cos{suffix}", cos)
                sin_t = self.em.weight(f"rope.sin{suffix}", sin)
                self.table_values.update({cos_t: cos, sin_t: sin})
                cos_full = sin_full = ""
                if self.mrope:
                    mrope_made[key] = (self.mrope_gather(cos_t), self.mrope_gather(sin_t))
                if not self.fused and (not self.gqa or self.mrope):
                    if self.mrope:
                        cos_g, sin_g = mrope_made[key]
                    else:
                        cos_g = self.em.op1("Gather", [cos_t, "position_ids"])  # [B,S,rot/2]
                        sin_g = self.em.op1("Gather", [sin_t, "position_ids"])
                    # the heads' axis: [B,H,S,hd] in the portable graph, [B,S,H,hd] before GQA
                    axes = self.em.const(np.array([2 if self.gqa else 1]))
                    both_cos, both_sin = (self.full_table(t, key[1]) for t in (cos_g, sin_g))
                    cos_full = self.em.op1("Unsqueeze", [both_cos, axes])
                    sin_full = self.em.op1("Unsqueeze", [both_sin, axes])
                made[key] = (cos_t, sin_t, cos_full, sin_full)
            self.layer_tables.append(made[key])
            self.layer_mrope.append(mrope_made.get(key))
        if not made:  # every layer NoPE: GroupQueryAttention still takes (unused) tables
            cos, sin = cfg.rope.cos_sin(cfg.rotary, 1)
            made[None, 0] = (self.em.weight("rope.cos", cos), self.em.weight("rope.sin", sin), "", "")
            self.table_values.update({"rope.cos": cos, "rope.sin": sin})
        first = next(iter(made.values()))
        self.cos_table, self.sin_table = first[0], first[1]

    def full_table(self, half: str, rot: int) -> str:
        """A gathered cos/sin table [B,S,rot/2] widened to the rotated dimensions: [t | t] for
        rotate_half, each value twice in place (t0, t0, t1, t1 ...) for neighbouring pairs."""
        em = self.em
        if not self.cfg.rope_interleaved:
            return em.op1("Concat", [half, half], axis=-1)
        twice = em.op1("Unsqueeze", [half, em.const(np.array([-1]))])
        pairs = em.op1("Concat", [twice, twice], axis=-1)  # [B,S,rot/2,2]
        return em.op1("Reshape", [pairs, em.const(np.array([0, 0, rot], np.int64))])

    def projections(self, x: str, parts: list[tuple[str, int]], in_dim: int,
                    bias: bool, *, split: bool = True, adapt: bool = True) -> list[str]:
        """``x`` through several linear layers (modules ``parts``: (name, out features)) of the
        same input. In a quantized graph they run as one MatMulNBits of the concatenated weights
        (one kernel call instead of several: the step of a small model is dominated by per-op
        overhead), split afterwards unless ``split`` is False (then one output, the parts side
        by side)."""
        names = [name for name, _ in parts]
        if self.quant is None or not self.quant.fits(in_dim):
            return [self.linear(x, name, n, in_dim, bias, adapt=adapt) for name, n in parts]
        sizes = [n for _, n in parts]
        fused = self.quant.linear_group(
            x, [(f"{name}.weight", n) for name, n in parts], in_dim,
            lambda name, n: self.ckpt.get_f32(name, (n, in_dim)))
        if self.lora and adapt:
            deltas = [self.lora_delta(x, name, n, in_dim) for name, n in parts]
            fused = self.em.op1("Add", [fused, self.em.op1("Concat", deltas, axis=-1) if len(deltas) > 1
                                        else deltas[0]])
        if bias:
            vectors = [self.ckpt.get_f32(f"{name}.bias", (n,)) for name, n in parts]
            fused_bias = self.em.weight(f"{names[0]}.fused_bias", np.concatenate(vectors))
            fused = self.em.op1("Add", [fused, fused_bias])
        if len(parts) == 1 or not split:
            return [fused]
        return self.split(fused, sizes)

    def split(self, x: str, sizes: list[int]) -> list[str]:
        return self.em.op("Split", [x, self.em.const(np.array(sizes, np.int64))], n_out=len(sizes), axis=-1)

    def qkv(self, normed: str, i: int) -> tuple[str, str, str]:
        """The layer's q, k, v [B,S,heads*hd]; (packed, "", "") when GroupQueryAttention can take
        the three side by side (no norm between the projection and the attention); a layer
        sharing another's K/V: (q, "", ""); keys as values (Gemma 4): v is k's projection."""
        cfg, n = self.cfg, self.names
        hd = cfg.head_dim_of(i)
        sizes = [cfg.num_heads * hd, cfg.kv_heads_of(i) * hd, cfg.kv_heads_of(i) * hd]
        if cfg.kv_source(i) != i:
            return self.linear(normed, n.layer(i, "q"), sizes[0], cfg.hidden_size, cfg.attention_bias), "", ""
        packed_ok = (self.gqa and cfg.qk_norm == "none" and not cfg.v_norm and cfg.uniform_kv
                     and not self.mrope)  # M-RoPE rotates q and k before GroupQueryAttention
        if cfg.fused_qkv:
            fused = self.linear(normed, n.layer(i, "qkv"), sum(sizes), cfg.hidden_size, cfg.attention_bias)
            if packed_ok:
                return fused, "", ""
            q, k, v = self.split(fused, sizes)
            return q, k, v
        if i in cfg.keys_as_values:
            parts = [(n.layer(i, s), size) for s, size in zip(("q", "k"), sizes, strict=False)]
            q, k = self.projections(normed, parts, cfg.hidden_size, cfg.attention_bias)
            return q, k, k
        parts = [(n.layer(i, s), size) for s, size in zip(("q", "k", "v"), sizes, strict=True)]
        if packed_ok and self.quant is not None and self.quant.fits(cfg.hidden_size):
            packed = self.projections(normed, parts, cfg.hidden_size, cfg.attention_bias, split=False)[0]
            return packed, "", ""
        q, k, v = self.projections(normed, parts, cfg.hidden_size, cfg.attention_bias)
        return q, k, v

    def attn_input(self, x: str, i: int) -> str:
        """The attention's input: ``x`` through the layer's pre-attention norm, if it has one."""
        cfg = self.cfg
        return self.norm(x, self.names.layer(i, "attn_norm"), cfg.hidden_size) if cfg.pre_attn_norm else x

    def attention_block(self, normed: str, i: int) -> str:
        """The attention branch of layer ``i`` on its input (:meth:`attn_input`)."""
        cfg, n = self.cfg, self.names
        hd, h, kvh = cfg.head_dim_of(i), cfg.num_heads, cfg.kv_heads_of(i)
        own = cfg.kv_source(i) == i
        q, k, v = self.qkv(normed, i)
        if cfg.qk_norm == "full":
            q = self.norm(q, n.layer(i, "q_norm"), h * hd, rms=True)
            k = self.norm(k, n.layer(i, "k_norm"), kvh * hd, rms=True)
        head_norms = cfg.qk_norm == "head"
        if self.gqa:
            if head_norms:
                q = self.head_norm(q, h, n.layer(i, "q_norm"), hd)
                if own:
                    k = self.head_norm(k, kvh, n.layer(i, "k_norm"), hd)
            if cfg.v_norm and own:
                v = self.head_norm(v, kvh, None, hd)
            if self.mrope:
                q = self.mrope_rotate(q, h, i)
                if own:
                    k = self.mrope_rotate(k, kvh, i)
            y = self.gqa_attention(q, k, v, i)
        else:
            q4 = self.rope(self.heads(q, h, n.layer(i, "q_norm") if head_norms else None, hd), i)
            k4 = v4 = ""
            if own:
                k4 = self.rope(self.heads(k, kvh, n.layer(i, "k_norm") if head_norms else None, hd), i)
                v4 = self.heads(v, kvh, None, hd, plain_norm=cfg.v_norm)
            y = self.attention(q4, k4, v4, i)
            y = self.em.op1("Transpose", [y], perm=[0, 2, 1, 3])
            y = self.em.op1("Reshape", [y, self.em.const(np.array([0, 0, h * hd], dtype=np.int64))])
        y = self.linear(y, n.layer(i, "o"), cfg.hidden_size, h * hd, cfg.o_bias)
        if cfg.post_attn_norm:
            y = self.norm(y, n.layer(i, "attn_post_norm"), cfg.hidden_size)
        return y

    def mlp_block(self, normed: str, i: int) -> str:
        """The MLP branch of layer ``i`` on its input (after the pre-MLP norm, if any)."""
        cfg, n = self.cfg, self.names
        y = self.moe_block(normed, i) if cfg.sparse(i) else self.dense_mlp(normed, i)
        if cfg.post_mlp_norm:
            y = self.norm(y, n.layer(i, "mlp_post_norm"), cfg.hidden_size)
        return y

    def dense_mlp(self, normed: str, i: int) -> str:
        cfg, n = self.cfg, self.names
        ff = cfg.intermediate_of(i)
        if cfg.mlp == "plain":
            hidden = self.activation(self.linear(normed, n.layer(i, "up"), ff, cfg.hidden_size, cfg.mlp_bias))
        else:
            if cfg.fused_gate_up:
                gate, up = self.split(self.linear(normed, n.layer(i, "gate_up"), 2 * ff, cfg.hidden_size,
                                                  cfg.mlp_bias), [ff, ff])
            else:
                gate, up = self.projections(normed, [(n.layer(i, "gate"), ff), (n.layer(i, "up"), ff)],
                                            cfg.hidden_size, cfg.mlp_bias)
            hidden = self.em.op1("Mul", [self.activation(gate), up])
        return self.linear(hidden, n.layer(i, "down"), cfg.hidden_size, ff, cfg.mlp_bias)

    def expert_weights(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``i``'s experts as onnxruntime's MoE op reads them: fc1 [E, 2F, H], each expert's
        gate and up rows interleaved (``swiglu_fusion=1``, the only fused layout its CPU kernel
        runs), and fc2 [E, H, F]. Read from the per-expert tensors (what checkpoints on the hub and
        transformers' ``save_pretrained`` hold, and the GGUF reader's slices of llama.cpp's 3-D
        tensors), or from transformers' fused in-memory ``experts.gate_up_proj``/``down_proj``."""
        cfg, n = self.cfg, self.names
        assert cfg.moe is not None
        e_count, ff, h = cfg.moe.num_experts, cfg.moe.expert_size, cfg.hidden_size
        fused = f"model.layers.{i}.mlp.experts"
        if f"{fused}.gate_up_proj" in self.ckpt:
            gate_up = self.ckpt.get_f32(f"{fused}.gate_up_proj", (e_count, 2 * ff, h))
            gate, up = gate_up[:, :ff], gate_up[:, ff:]
            down = self.ckpt.get_f32(f"{fused}.down_proj", (e_count, h, ff))
        else:
            def stack(slot: str, shape: tuple[int, int]) -> np.ndarray:
                return np.stack([self.ckpt.get_f32(f"{n.expert(i, slot, e)}.weight", shape)
                                 for e in range(e_count)])
            gate, up = stack("expert_gate", (ff, h)), stack("expert_up", (ff, h))
            down = stack("expert_down", (h, ff))
        fc1 = np.stack([gate, up], axis=2).reshape(e_count, 2 * ff, h)
        return fc1, down

    def float_moe(self, x: str, flat_logits: str, i: int) -> str:
        """The experts of layer ``i`` in float32: ``MoE`` on the CPU graph, every expert weighed
        on the portable one."""
        em, moe = self.em, self.cfg.moe
        assert moe is not None
        fc1_w, fc2_w = self.expert_weights(i)
        fc1 = em.weight(f"model.layers.{i}.mlp.experts.fc1", fc1_w)
        fc2 = em.weight(f"model.layers.{i}.mlp.experts.fc2", fc2_w)
        if not self.gqa:
            return self.dense_experts(x, flat_logits, fc1, fc2)
        return em.op1("MoE", [x, flat_logits, fc1, "", fc2], domain=MS_DOMAIN, k=moe.top_k,
                      activation_type="swiglu", swiglu_fusion=1,
                      normalize_routing_weights=int(moe.norm_topk_prob))

    def quantized_moe(self, x: str, flat_logits: str, i: int) -> str:
        """The experts of layer ``i`` as 4-bit ``QMoE`` (int4 builds): per expert, the GGUF's own
        Q4_0 blocks or weights quantized here (:meth:`QuantizedEmitter.expert_weight`)."""
        cfg, n, quant = self.cfg, self.names, self.quant
        assert cfg.moe is not None and quant is not None
        e_count, ff, h = cfg.moe.num_experts, cfg.moe.expert_size, cfg.hidden_size
        fused = f"model.layers.{i}.mlp.experts"
        fc1: list[BlockWeight] = []
        fc2: list[BlockWeight] = []
        if f"{fused}.gate_up_proj" in self.ckpt:  # transformers' fused in-memory layout
            gate_up = self.ckpt.get_f32(f"{fused}.gate_up_proj", (e_count, 2 * ff, h))
            down = self.ckpt.get_f32(f"{fused}.down_proj", (e_count, h, ff))
            for e in range(e_count):
                fc1.append(interleave_rows(quantize_4bit(gate_up[e, :ff]), quantize_4bit(gate_up[e, ff:])))
                fc2.append(quantize_4bit(down[e]))
        else:
            def weight(slot: str, e: int, rows: int, cols: int) -> BlockWeight:
                name = f"{n.expert(i, slot, e)}.weight"
                return quant.expert_weight(name, rows, cols, lambda: self.ckpt.get_f32(name, (rows, cols)))
            for e in range(e_count):
                fc1.append(interleave_rows(weight("expert_gate", e, ff, h), weight("expert_up", e, ff, h)))
                fc2.append(weight("expert_down", e, h, ff))
        return quant.moe(x, flat_logits, f"model.layers.{i}.mlp.experts", fc1, fc2,
                         top_k=cfg.moe.top_k, normalize=cfg.moe.norm_topk_prob)

    def moe_block(self, x: str, i: int) -> str:
        """The mixture of experts of layer ``i`` on the normed ``x`` [B,S,H]: softmax router, top-k
        experts (weights renormalised with ``norm_topk_prob``), SwiGLU experts, plus the shared
        expert (times its sigmoid gate). The CPU graph runs com.microsoft ``MoE`` (only the chosen
        experts compute); the portable graph computes every expert and weighs the unchosen by 0
        (standard ops only: exact, E/k times the work). int4 builds hold the experts in 4 bits
        (``QMoE``, :func:`quantized_experts`); int8 builds keep them fp32."""
        cfg, n, em = self.cfg, self.names, self.em
        moe = cfg.moe
        assert moe is not None
        h, e_count = cfg.hidden_size, moe.num_experts
        router = self.ckpt.get_f32(f"{n.layer(i, 'router')}.weight", (e_count, h))
        logits = em.op1("MatMul", [x, em.weight(f"{n.layer(i, 'router')}.weight", router.T)])  # [B,S,E]
        flat_logits = em.op1("Reshape", [logits, em.const(np.array([-1, e_count], np.int64))])
        if self.quant is not None and quantized_experts(cfg, self.quant.bits):
            y = self.quantized_moe(x, flat_logits, i)
        else:
            y = self.float_moe(x, flat_logits, i)
        if moe.shared_size:
            parts = [(n.layer(i, "shared_gate"), moe.shared_size), (n.layer(i, "shared_up"), moe.shared_size)]
            gate, up = self.projections(x, parts, h, False, adapt=False)
            hidden = em.op1("Mul", [self.activation(gate), up])
            shared = self.linear(hidden, n.layer(i, "shared_down"), h, moe.shared_size, False, adapt=False)
            if moe.shared_gate:
                name = f"{n.layer(i, 'shared_expert_gate')}.weight"
                gate_w = self.ckpt.get_f32(name)
                if gate_w.size != h:
                    raise BuildInputError(
                        f"weight {name!r} has shape {list(gate_w.shape)}, expected [1, {h}]")
                scale = em.op1("Sigmoid", [em.op1("MatMul", [x, em.weight(name, gate_w.reshape(h, 1))])])
                shared = em.op1("Mul", [shared, scale])
            y = em.op1("Add", [y, shared])
        return y

    def dense_experts(self, x: str, logits: str, fc1: str, fc2: str) -> str:
        """Every expert on every token, weighted by the router's top-k (0 elsewhere): x [B,S,H],
        logits [N,E] -> [B,S,H], default-domain ops only."""
        cfg, em = self.cfg, self.em
        moe = cfg.moe
        assert moe is not None
        h, e_count, ff = cfg.hidden_size, moe.num_experts, moe.expert_size
        probs = em.op1("Softmax", [logits], axis=-1)
        values, indices = em.op("TopK", [probs, em.const(np.array([moe.top_k], np.int64))], n_out=2, axis=-1)
        if moe.norm_topk_prob:
            total = em.op1("ReduceSum", [values, em.const(np.array([-1]))], keepdims=1)
            values = em.op1("Div", [values, total])
        zeros = em.op1("ConstantOfShape", [em.op1("Shape", [probs])],
                       value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
        weights = em.op1("ScatterElements", [zeros, indices, values], axis=1)  # [N,E]
        xt = em.op1("Transpose", [em.op1("Reshape", [x, em.const(np.array([-1, h], np.int64))])], perm=[1, 0])
        both = em.op1("Reshape", [em.op1("MatMul", [fc1, xt]),  # [E,2F,N] -> [E,F,2,N]
                                  em.const(np.array([e_count, ff, 2, -1], np.int64))])
        gate = em.op1("Gather", [both, em.const(np.array(0, np.int64))], axis=2)
        up = em.op1("Gather", [both, em.const(np.array(1, np.int64))], axis=2)
        out = em.op1("MatMul", [fc2, em.op1("Mul", [self.activation(gate), up])])  # [E,H,N]
        per_expert = em.op1("Unsqueeze", [em.op1("Transpose", [weights], perm=[1, 0]),
                                          em.const(np.array([1]))])  # [E,1,N]
        summed = em.op1("ReduceSum", [em.op1("Mul", [out, per_expert]), em.const(np.array([0]))], keepdims=0)
        return em.op1("Reshape", [em.op1("Transpose", [summed], perm=[1, 0]), em.op1("Shape", [x])])

    def layer(self, x: str, i: int) -> str:
        cfg, em = self.cfg, self.em
        scale = cfg.residual_scale
        normed = self.attn_input(x, i)
        attn = self.scaled(self.attention_block(normed, i), scale)
        if cfg.parallel_block:  # both branches read the attention norm's output; one add
            return em.op1("Add", [em.op1("Add", [x, attn]), self.scaled(self.mlp_block(normed, i), scale)])
        x = em.op1("Add", [x, attn])
        normed = self.norm(x, self.names.layer(i, "mlp_norm"), cfg.hidden_size) if cfg.pre_mlp_norm else x
        x = em.op1("Add", [x, self.scaled(self.mlp_block(normed, i), scale)])
        if cfg.per_layer_input:
            x = em.op1("Add", [x, self.per_layer_block(x, i)])
        if cfg.layer_scalar:
            name = self.names.layer(i, "layer_scalar")
            x = em.op1("Mul", [x, em.weight(name, self.ckpt.get_f32(name, (1,)))])
        return x

    def per_layer_inputs_of(self, ids: str, embeds: str) -> None:
        """Gemma 4's per-layer inputs [B,S,layers,width]: the token's row of the per-layer table
        (times sqrt(width)) plus the normed projection of the (scaled) embedding (times
        hidden**-0.5), the sum times 2**-0.5."""
        cfg, em, n = self.cfg, self.em, self.names
        width, layers, h = cfg.per_layer_input, cfg.num_layers, cfg.hidden_size
        name = f"{n.top('ple_embed')}.weight"
        table = self.ckpt.get_f32(name, (cfg.per_layer_vocab, layers * width))
        if self.quant is not None and self.quant.fits(layers * width):
            rows = self.quant.table_rows(n.top("ple_embed"), name, table, ids)
        else:
            rows = em.op1("Gather", [em.weight(name, table), ids])
        shape4 = em.const(np.array([0, 0, layers, width], np.int64))
        token = em.op1("Reshape", [self.scaled(rows, float(np.float32(width) ** 0.5)), shape4])
        proj = self.linear(embeds, n.top("ple_model_proj"), layers * width, h, False, adapt=False)
        proj = em.op1("Reshape", [self.scaled(proj, h ** -0.5), shape4])
        proj = self.norm(proj, n.top("ple_proj_norm"), width, rms=True)
        self.per_layer_inputs = self.scaled(em.op1("Add", [proj, token]), 2.0 ** -0.5)

    def per_layer_block(self, x: str, i: int) -> str:
        """Gemma 4's per-layer input branch of layer ``i``: norm(proj(act(gate(x)) * input_i))."""
        cfg, em, n = self.cfg, self.em, self.names
        width, h = cfg.per_layer_input, cfg.hidden_size
        mine = em.op1("Gather", [self.per_layer_inputs, em.const(np.array(i, np.int64))], axis=2)
        gate = self.activation(self.linear(x, n.layer(i, "ple_gate"), width, h, False, adapt=False))
        y = self.linear(em.op1("Mul", [gate, mine]), n.layer(i, "ple_proj"), h, width, False, adapt=False)
        return self.norm(y, n.layer(i, "ple_norm"), h)

    def embedding(self) -> tuple[str, str]:
        """The token embedding lookup; returns (its output, the embedding table's initializer)."""
        cfg = self.cfg
        table = self.ckpt.get_f32("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        if self.quant is not None and self.quant.fits(cfg.hidden_size):
            out, self.embed_q8 = self.quant.embedding(table, "input_ids")
            return out, self.embed_q8.base
        embed = self.em.weight("model.embed_tokens.weight", table)
        return self.em.op1("Gather", [embed, "input_ids"]), embed

    def pool(self, h: str, pooling: str) -> str:
        """``embeddings [B, hidden]``: ``h [B, T, hidden]`` pooled, then L2-normalised."""
        em = self.em
        if pooling == "last":
            last = em.op1("Slice", [h, em.const(np.array([-1])), em.const(np.array([np.iinfo(np.int64).max])),
                                    em.const(np.array([1]))])
            pooled = em.op1("Squeeze", [last, em.const(np.array([1]))])
        else:
            # The mask covers past + new positions; an embedding graph has no past, so T == S.
            mask = em.op1("Unsqueeze", [em.op1("Cast", ["attention_mask"], to=TensorProto.FLOAT),
                                        em.const(np.array([-1]))])
            summed = em.op1("ReduceSum", [em.op1("Mul", [h, mask]), em.const(np.array([1]))], keepdims=0)
            count = em.op1("ReduceSum", [mask, em.const(np.array([1]))], keepdims=0)
            pooled = em.op1("Div", [summed, em.op1("Max", [count, em.const(np.array(1.0, np.float32))])])
        return em.op("LpNormalization", [pooled], outputs=["embeddings"], axis=-1, p=2)[0]

    def lm_head(self, h: str, embed: str, untie: bool) -> tuple[str, bool]:
        cfg = self.cfg
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in self.ckpt
        if tied and not cfg.tie_word_embeddings:
            self.ckpt.get_f32("lm_head.weight")  # raises the clear "missing weight" error
        # The lm_head's bias (Phi-1/2; tied or not): added before the quantized head picks its top-k.
        bias = self.vector("lm_head.bias", cfg.vocab_size) if cfg.lm_head_bias else None
        if self.quant is not None and self.quant.fits(cfg.hidden_size):
            if tied and self.embed_q8 is not None:
                return self.quant.lm_head(h, self.embed_q8, bias), True
            weight = self.ckpt.get_f32("model.embed_tokens.weight" if tied else "lm_head.weight",
                                       (cfg.vocab_size, cfg.hidden_size))
            return self.quant.lm_head(h, weight, bias), tied
        if not tied or untie:
            w = (self.linear_weight("lm_head.weight", cfg.vocab_size, cfg.hidden_size) if not tied else
                 self.em.weight("lm_head.weight", self.ckpt.get_f32("model.embed_tokens.weight").T))
            if bias is not None:
                return self.em.op("Add", [self.em.op1("MatMul", [h, w]), bias], outputs=["logits"])[0], False
            return self.em.op("MatMul", [h, w], outputs=["logits"])[0], False
        # Gemm with transB reads the embedding table as is: no transposed copy of the weights.
        flat = self.em.op1("Reshape", [h, self.em.const(np.array([-1, cfg.hidden_size], dtype=np.int64))])
        logits2 = self.em.op1("Gemm", [flat, embed, *([bias] if bias is not None else [])], transB=1)
        lead = self.em.op1("Shape", [h], start=0, end=2)
        vocab = self.em.const(np.array([cfg.vocab_size], dtype=np.int64))
        shape = self.em.op1("Concat", [lead, vocab], axis=0)
        return self.em.op("Reshape", [logits2, shape], outputs=["logits"])[0], True
