"""Image rows that attend to one another both ways, in the decoder graphs of a vision-language
bundle whose language model does so (Gemma 3; ``build_decoder_graph(image_attention=
"bidirectional")``).

transformers' Gemma 3 masks a prompt's prefill with ``causal OR same image`` (and, in the sliding
layers, AND the window): every run of consecutive image rows (its ``token_type_ids`` 1) is one
image, whose rows see each other whole; text rows stay causal and decode steps are plain causal.
The graphs read the runs from the chunk's ``image_rows`` input (batch row, chunk position), so
an image's rows must all be in one prefill chunk (the engine and the scheduler keep them whole:
:func:`inference.runtime.protocol.whole_runs_end`); rows of earlier chunks are past positions,
which every chunk row sees anyway.

The portable graph builds that mask instead of the causal one (an explicit-mask ``Softmax``
already). The CPU graph's GroupQueryAttention is causal only, so each layer keeps it and adds an
``If`` on "this chunk has image rows": then the layer's attention is computed again with the
explicit mask (over the past K/V the chunk can see and the chunk's own k/v, rotated here with the
same tables) and replaces GroupQueryAttention's output; decode steps and text chunks run the else
branch, GroupQueryAttention's output as it is. The masks, the first key each window can see and
the rotary tables at the chunk's positions are made once per run, in one ``If`` before the layers.

Measured (a 2-layer slice of Gemma 3 4B's shapes, one 256-row image in a 298-token chunk, 2
cores, onnxruntime's profiler): the branch takes 17-20 ms a layer at an empty cache and 46-90 ms
at 1,500 past positions (GroupQueryAttention's own: 8-16 and 40-80 ms), against ~550 ms a layer
for the rest of the chunk; the prep ``If`` 2 ms; decode steps and text chunks take the else
branches at no measurable cost (0.13 ms a step either way on the tiny model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper

from inference.builder.emit import Emitter

if TYPE_CHECKING:
    from inference.builder.decoder_layers import _DecoderBuilder


def past_names(layer: int) -> tuple[str, str]:
    """The layer's past K and V inputs (graph.past_names)."""
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"

# The additive mask value of the decoder graphs (graph.MASK_NEG).
MASK_NEG = -1.0e9


def image_blocks(em: Emitter) -> str:
    """``[B, S]`` int64: each chunk position's image (0, 1, ... in order; a run of consecutive
    image rows is one image, as transformers' ``get_block_sequence_ids_for_mask``), -1 for text."""
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    zeros = em.op1("ConstantOfShape", [em.op1("Shape", ["input_ids"])], value=zero)
    rows = em.op1("Shape", ["image_rows"], start=0, end=1)
    ones = em.op1("Expand", [em.const(np.array([1], np.int64)), rows])
    is_image = em.op1("ScatterND", [zeros, "image_rows", ones])
    one, axis1 = em.const(np.array([1], np.int64)), em.const(np.array([1], np.int64))
    first = em.op1("Slice", [zeros, em.const(np.array([0], np.int64)), one, axis1])
    shifted = em.op1("Slice", [is_image, em.const(np.array([0], np.int64)),
                               em.const(np.array([-1], np.int64)), axis1])
    previous = em.op1("Concat", [first, shifted], axis=1)
    starts = em.op1("Cast", [em.op1("Greater", [is_image, previous])], to=TensorProto.INT64)
    group = em.op1("Sub", [em.op1("CumSum", [starts, em.const(np.array(1, np.int64))]), one])
    image = em.op1("Cast", [is_image], to=TensorProto.BOOL)
    return em.op1("Where", [image, group, em.const(np.array(-1, np.int64))])


def allowed(em: Emitter, blocks: str, qpos: str, kidx: str, window: int | None) -> str:
    """``[B, S, T]`` bool: query row (at cache index ``qpos [B|1, S]``) may attend to cache index
    ``kidx [T]``: causal or the same image, within ``window`` where the layer slides.
    ``blocks [B, S]`` are :func:`image_blocks` of the chunk, which starts at ``qpos[:, 0]``."""
    def unsqueeze(x: str, *axes: int) -> str:
        return em.op1("Unsqueeze", [x, em.const(np.array(axes, np.int64))])

    q3 = unsqueeze(qpos, 2)  # [B,S,1]
    causal = em.op1("LessOrEqual", [kidx, q3])  # [B,S,T]
    start = em.op1("Slice", [qpos, em.const(np.array([0], np.int64)), em.const(np.array([1], np.int64)),
                             em.const(np.array([1], np.int64))])  # [B|1,1]
    j = em.op1("Sub", [unsqueeze(kidx, 0), start])  # [B|1,T]: the position in the chunk
    new = em.op1("Shape", [blocks], start=1, end=2)  # [1]: S
    inside = em.op1("And", [em.op1("GreaterOrEqual", [j, em.const(np.array(0, np.int64))]),
                            em.op1("Less", [j, new])])
    last = em.op1("Sub", [new, em.const(np.array([1], np.int64))])
    clamped = em.op1("Min", [em.op1("Max", [j, em.const(np.array(0, np.int64))]), last])
    rows_t = em.op1("Concat", [em.op1("Shape", [blocks], start=0, end=1), em.op1("Shape", [kidx])], axis=0)
    gathered = em.op1("GatherElements", [blocks, em.op1("Expand", [clamped, rows_t])], axis=1)  # [B,T]
    key_blocks = em.op1("Where", [inside, gathered, em.const(np.array(-1, np.int64))])
    b3 = unsqueeze(blocks, 2)
    same = em.op1("And", [em.op1("Equal", [b3, unsqueeze(key_blocks, 1)]),
                          em.op1("GreaterOrEqual", [b3, em.const(np.array(0, np.int64))])])
    out = em.op1("Or", [causal, same])
    if window is not None:
        lowest = em.op1("Sub", [q3, em.const(np.array(window, np.int64))])
        out = em.op1("And", [out, em.op1("Greater", [kidx, lowest])])
    return out


class _Branch:
    """Emit into a subgraph: ``em``'s nodes go to a list of their own while inside (constants and
    weights stay the main graph's initializers, which a subgraph reads from the outer scope)."""

    def __init__(self, em: Emitter) -> None:
        self.em = em
        self.nodes: list[onnx.NodeProto] = []

    def __enter__(self) -> _Branch:
        self._saved, self.em.nodes = self.em.nodes, self.nodes
        return self

    def __exit__(self, *exc: object) -> None:
        self.em.nodes = self._saved

    def graph(self, name: str, outputs: list[tuple[str, int]]) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, [], [helper.make_tensor_value_info(o, t, None)
                                                        for o, t in outputs])


class GqaImageAttention:
    """The CPU graph's both-ways image attention (see the module docstring), per layer."""

    def __init__(self, b: _DecoderBuilder) -> None:
        self.b, self.em = b, b.em
        cfg = b.cfg
        if cfg.kv_sources:
            raise ValueError("image rows attending both ways are built for layers with their own K/V only")
        em = self.em
        self.has_images = em.op1("Greater", [em.op1("Size", ["image_rows"]), em.const(np.array(0, np.int64))])
        windows = sorted({cfg.window(i) or 0 for i in range(cfg.num_layers)})
        tables = [t for t in dict.fromkeys(b.layer_tables) if t is not None]
        # Made once per run, in one If: each window's first key the chunk can see ([1]: 0, or for a
        # sliding layer the window before the chunk's first row) and its additive mask over the
        # keys from there [B,1,S,T'], and each rotary table's cos/sin at the chunk's positions
        # [B,1,S,rot]; tiny stand-ins when no images.
        made: list[tuple[str, int]] = []
        with _Branch(em) as then:
            past = em.op1("Sub", [em.op1("Cast", ["seqlens_k"], to=TensorProto.INT64),
                                  em.op1("Sub", [em.op1("Shape", ["input_ids"], start=1, end=2),
                                                 em.const(np.array([1], np.int64))])])  # [B]
            steps = em.op1("Range", [em.const(np.array(0, np.int64)),
                                     em.op1("Squeeze", [em.op1("Shape", ["input_ids"], start=1, end=2)]),
                                     em.const(np.array(1, np.int64))])
            qpos = em.op1("Add", [em.op1("Unsqueeze", [past, em.const(np.array([1], np.int64))]), steps])
            total = em.op1("Cast", ["total_sequence_length"], to=TensorProto.INT64)
            blocks = image_blocks(em)
            earliest = em.op1("ReduceMin", [past], keepdims=1)  # [1]
            for w in windows:
                first = em.const(np.array([0], np.int64))
                if w:  # keys before the window of the chunk's first row: masked for every row
                    first = em.op1("Max", [em.op1("Sub", [earliest, em.const(np.array([w - 1], np.int64))]),
                                           em.const(np.array([0], np.int64))])
                em.op("Identity", [first], outputs=[f"image_keys.{w}.then"])
                kidx = em.op1("Range", [em.op1("Squeeze", [first]), total, em.const(np.array(1, np.int64))])
                ok = allowed(em, blocks, qpos, kidx, w or None)
                mask = em.op1("Where", [ok, em.const(np.float32(0.0)), em.const(np.float32(MASK_NEG))])
                em.op("Unsqueeze", [mask, em.const(np.array([1], np.int64))],
                      outputs=[f"image_mask.{w}.then"])
                made += [(f"image_keys.{w}", TensorProto.INT64), (f"image_mask.{w}", TensorProto.FLOAT)]
            for k, (cos_t, sin_t, _, _) in enumerate(tables):
                for kind, table in (("cos", cos_t), ("sin", sin_t)):
                    rot = 2 * int(b.table_values[table].shape[1])
                    full = b.full_table(em.op1("Gather", [table, qpos]), rot)  # [B,S,rot]
                    em.op("Unsqueeze", [full, em.const(np.array([1], np.int64))],
                          outputs=[f"image_{kind}.{k}.then"])
                    made.append((f"image_{kind}.{k}", TensorProto.FLOAT))
        with _Branch(em) as otherwise:
            stand_ins: dict[int, str] = {TensorProto.FLOAT: em.const(np.zeros((1, 1, 1, 1), np.float32)),
                                         TensorProto.INT64: em.const(np.zeros(1, np.int64))}
            for name, elem in made:
                em.op("Identity", [stand_ins[elem]], outputs=[name + ".else"])
        em.op("If", [self.has_images], outputs=[name for name, _ in made],
              then_branch=then.graph("image_prep_then", [(o + ".then", t) for o, t in made]),
              else_branch=otherwise.graph("image_prep_else", [(o + ".else", t) for o, t in made]))
        self.masks = {w: f"image_mask.{w}" for w in windows}
        self.keys = {w: f"image_keys.{w}" for w in windows}
        self.tables = {t[0]: (f"image_cos.{k}", f"image_sin.{k}") for k, t in enumerate(tables)}

    def rotate(self, x: str, layer: int) -> str:
        """x [B,H,S,hd] rotated at the chunk's positions (the decomposed rope of graph.rope)."""
        b, em = self.b, self.em
        tables = b.layer_tables[layer]
        if tables is None:
            return x
        cos_full, sin_full = self.tables[tables[0]]
        rot, hd = b.cfg.rotary_of(layer), b.cfg.head_dim_of(layer)
        last = em.const(np.array([-1], np.int64))

        def part(lo: int, hi: int) -> str:
            return em.op1("Slice", [x, em.const(np.array([lo], np.int64)),
                                    em.const(np.array([hi], np.int64)), last])

        xr = x if rot == hd else part(0, rot)
        if b.cfg.rope_interleaved:
            pairs = em.op1("Reshape", [xr, em.const(np.array([0, 0, 0, rot // 2, 2], np.int64))])
            even, odd = em.op("Split", [pairs, em.const(np.array([1, 1], np.int64))], n_out=2, axis=-1)
            swapped = em.op1("Concat", [em.op1("Neg", [odd]), even], axis=-1)
            rotated = em.op1("Reshape", [swapped, em.const(np.array([0, 0, 0, rot], np.int64))])
        else:
            rotated = em.op1("Concat", [em.op1("Neg", [part(rot // 2, rot)]), part(0, rot // 2)], axis=-1)
        y = em.op1("Add", [em.op1("Mul", [xr, cos_full]), em.op1("Mul", [rotated, sin_full])])
        return y if rot == hd else em.op1("Concat", [y, part(rot, hd)], axis=-1)

    def heads(self, x: str, n: int, hd: int) -> str:
        """[B,S,n*hd] -> [B,n,S,hd]."""
        em = self.em
        return em.op1("Transpose", [em.op1("Reshape", [x, em.const(np.array([0, 0, n, hd], np.int64))])],
                      perm=[0, 2, 1, 3])

    def layer(self, qkv: tuple[str, str, str], y: str, layer: int) -> str:
        """GroupQueryAttention's output ``y [B,S,H*hd]`` of ``layer``, or, for a chunk with image
        rows, the attention of ``qkv`` (the chunk's q/k/v ``[B,S,heads*hd]``, float32, before
        rotation) over the past K/V the chunk can see and its own, with the image mask.

        The past positions are read from the layer's past input, whose positions below the chunk
        GroupQueryAttention leaves as they are, and the chunk's own k/v are rotated here: the
        branch consumes no present output, so the in-place buffers stay outputs only, as in every
        CPU graph. A chunk with image rows is one sequence (``prefill_images``: B = 1)."""
        b, em, cfg = self.b, self.em, self.b.cfg
        h, kvh, hd = cfg.num_heads, cfg.kv_heads_of(layer), cfg.head_dim_of(layer)
        name = f"attn_{layer}_both_ways"
        window = cfg.window(layer) or 0
        with _Branch(em) as then:
            q4 = self.rotate(self.heads(qkv[0], h, hd), layer)
            new = [self.rotate(self.heads(qkv[1], kvh, hd), layer), self.heads(qkv[2], kvh, hd)]
            total = em.op1("Reshape", [em.op1("Cast", ["total_sequence_length"], to=TensorProto.INT64),
                                       em.const(np.array([1], np.int64))])
            past_len = em.op1("Sub", [total, em.op1("Shape", [qkv[0]], start=1, end=2)])
            kv = []
            for buf, chunk in zip(past_names(layer), new, strict=True):  # the keys it sees: [B,kv,T',hd]
                seen = em.op1("Slice", [buf, self.keys[window], past_len, em.const(np.array([2], np.int64))])
                seen = em.op1("Cast", [seen], to=TensorProto.FLOAT) if b.kv_fp16 else seen
                kv.append(em.op1("Concat", [seen, chunk], axis=2))
            group = h // kvh
            q5 = em.op1("Reshape", [q4, em.const(np.array([0, kvh, group, -1, hd], np.int64))])
            q5 = em.op1("Mul", [q5, em.const(np.float32(cfg.query_scale_of(layer)))])
            k5, v5 = (em.op1("Unsqueeze", [t, em.const(np.array([2], np.int64))]) for t in kv)
            scores = em.op1("MatMul", [q5, em.op1("Transpose", [k5], perm=[0, 1, 2, 4, 3])])
            if cfg.attn_softcap:
                cap = em.const(np.float32(cfg.attn_softcap))
                scores = em.op1("Mul", [em.op1("Tanh", [em.op1("Div", [scores, cap])]), cap])
            mask = self.masks[window]
            scores = em.op1("Add", [scores, em.op1("Unsqueeze", [mask, em.const(np.array([2], np.int64))])])
            out = em.op1("MatMul", [em.op1("Softmax", [scores], axis=-1), v5])
            out = em.op1("Reshape", [out, em.const(np.array([0, h, -1, hd], np.int64))])
            out = em.op1("Transpose", [out], perm=[0, 2, 1, 3])
            em.op("Reshape", [out, em.const(np.array([0, 0, h * hd], np.int64))], outputs=[name + ".then"])
        with _Branch(em) as otherwise:
            em.op("Identity", [y], outputs=[name + ".else"])
        return em.op("If", [self.has_images], outputs=[name],
                     then_branch=then.graph(f"{name}_then", [(name + ".then", TensorProto.FLOAT)]),
                     else_branch=otherwise.graph(f"{name}_else", [(name + ".else", TensorProto.FLOAT)]))[0]


def portable_allowed(em: Emitter, past_len: str, total: str, window: int | None, one: str,
                     zero: str) -> str:
    """The portable graph's ``[B, S, T]`` allowed pairs with image rows both ways (every row's
    chunk starts at ``past_len``; cache indices ``[0, total)``; ``one``, ``zero``: int64 scalars)."""
    qpos = em.op1("Unsqueeze", [em.op1("Range", [past_len, total, one]), em.const(np.array([0], np.int64))])
    kidx = em.op1("Range", [zero, total, one])
    return allowed(em, image_blocks(em), qpos, kidx, window)

