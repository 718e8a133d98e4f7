"""What a quantized CPU graph holds on each CPU class, and why.

``accuracy_level`` of onnxruntime's ``MatMulNBits`` chooses how the weights meet the
activations: 0 computes in float32 (the same numbers on every CPU, as fp32 bundles), 4
quantizes the activations to int8 per block of 32 and runs integer dot products (faster, but
the result depends on the CPU's int8 kernels and on outliers in the activations). Measured
with SmolLM2-135M-Instruct from its Q4_1 GGUF (quality gate: 8 chat prompts x 32 greedy tokens
against fp32 of the same weights; "France": the greedy answer to "What is the capital of
France?", whose first token beats "L" by 0.08 logits in fp32):

| layers (int4)        | head                 | CPU          | agreement | France            |
|----------------------|----------------------|--------------|-----------|-------------------|
| level 4              | float32              | AMX          | 0.949     | Paris             |
| level 4              | float32              | AVX2 (emul.) | -         | "La femme de..."  |
| level 4              | 8-bit, top-32 exact  | AMX          | 0.977     | "L'Étoile, ..."   |
| level 0              | 8-bit, top-32 exact  | AMX          | 1.000     | Paris             |

Level 4 flips near-ties on every class (and on plain AVX2 its kernels go further wrong), so the
linear layers of both precisions compute in float32 on every class: int4 as 4-bit
``MatMulNBits`` at level 0, int8 as two 4-bit planes at level 0 (see :mod:`.quantized`; the
8-bit op has no usable float path). Their answers are then the fp32 answers of the quantized
weights, on any CPU.

What still depends on the class is the lm_head (vocab x hidden, the largest matrix). It runs at
level 4 (fast) with its top 32 logits recomputed exactly wherever the int8 kernels cannot
saturate on what it holds:

* VNNI/AMX (``vpdpbusd``, 32-bit sums; measured on AMX, AVX-512 VNNI runs the same kernels): the
  8-bit codes as one table;
* AVX2, AVX2-VNNI and AVX-512 without VNNI: ``vpmaddubsw`` adds two u8 x s8 products into a
  saturating 16-bit sum, which 8-bit codes can overflow (255 x 127 x 2) but 4-bit values cannot
  (at most 255 x 15 x 2), so the head is the two 4-bit planes of the float path, at level 4
  (measured on a 2-core AMD EPYC, AVX2: the head 1.7 ms a token instead of 5.3 ms exact);
* arm64 and older x86 (unmeasured here): computed exactly as two 4-bit planes at level 0.

So the graph differs by class: the CPU class is part of a quantized bundle's profile, the
choice is recorded in ``engine.json`` (``kernels``) and a bundle built for another class is
stale and never served.

Plans and the gate (issue 35): the layers' float32 compute above is the *exact* plan. On every
class whose int8 kernels cannot saturate on 4-bit values (every x86 class with AVX2 and up, and
arm64: the layers' weights are 4-bit codes, or for int8 two 4-bit planes), level 4 in the layers
is several times faster at ~1B parameters (one ``MatMulNBits`` in 1B-Llama shapes: 0.16-0.29 ms
against 0.94-1.20 ms at one row, 1.0 against 7.9 ms at eight), so :func:`candidate_plans` lists
plans from fastest to exact — every projection at level 4 (``fast``), ``down_proj`` only
(``down``), every projection at level 4 with the activations' int8 rounding taken back by a
second term (``twoterm``, :mod:`.two_term`: float32's answers at int8 kernels' speed where the
weights bound a step), none (``exact``) — and the quality gate (:mod:`.quality`) publishes the
fastest one whose answers are fp32's on this CPU. The plans differ in the ``accuracy_level``
attribute of the layers' ``MatMulNBits`` nodes and, for ``twoterm``, in a few small ops around
them (:func:`retarget` writes and removes both), so one written graph serves them all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import onnx

from inference.build_profile import KERNEL_MODES, QUANTIZED_PRECISIONS
from inference.builder.two_term import set_two_term, strip_two_term
from inference.cpu_class import CPU_CLASSES

#: CPU classes whose lm_head runs with int8 activations (VNNI/AMX kernels) on its 8-bit codes,
#: top-k rescored.
FAST_HEAD_CLASSES: tuple[str, ...] = ("amx", "avx512-vnni")
#: CPU classes whose lm_head runs with int8 activations on two 4-bit planes (their 16-bit pair
#: sums cannot saturate on 4-bit values), top-k rescored.
PLANE_HEAD_CLASSES: tuple[str, ...] = ("avx2", "avx2-vnni", "avx512")
#: How many of the fast lm_head's top logits are recomputed exactly.
RESCORE_TOP_K = 32
#: The projection groups of a layer, by the name part of their weights (q/k/v and gate/up run
#: fused, see ``graph.py``): what a mixed plan sets per group.
PROJECTION_GROUPS: dict[str, str] = {
    "qkv": "self_attn.q_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_proj", "down": "mlp.down_proj",
}
#: Classes whose int8 kernels can run the layers at level 4 without saturating (the layers hold
#: 4-bit values: 4-bit codes, or int8's two 4-bit planes): every class but ``generic``.
INT8_ACTIVATION_CLASSES: tuple[str, ...] = ("avx2", "avx2-vnni", "avx512", "avx512-vnni", "amx", "arm64")
#: The candidate plans from fastest to exact: name -> the projection groups at level 4.
PLAN_GROUPS: dict[str, tuple[str, ...]] = {
    "fast": tuple(PROJECTION_GROUPS), "down": ("down",), "twoterm": tuple(PROJECTION_GROUPS), "exact": (),
}
#: Plans whose level-4 products take the activations in two int8 terms (:mod:`.two_term`):
#: float32's answers at int8 kernels' speed where the weights, not dispatch, bound a step.
TWO_TERM_PLANS: tuple[str, ...] = ("twoterm",)


@dataclass(frozen=True)
class KernelPlan:
    """The quantized kernels of one precision on one CPU class."""

    precision: str
    cpu_class: str
    weight_bits: int
    accuracy_level: int
    head_bits: int
    head_accuracy_level: int
    rescore_top_k: int
    #: How the 8-bit head table is held: ``codes`` (one uint8 a weight) or ``planes`` (two
    #: 4-bit ones, see :mod:`.quantized`).
    head_layout: str = "planes"
    #: The plan's name (:data:`PLAN_GROUPS`; ``forced`` for a test's override).
    name: str = "exact"
    #: Projection groups (:data:`PROJECTION_GROUPS`) whose ``MatMulNBits`` run at level 4;
    #: the others at ``accuracy_level``.
    int8_groups: tuple[str, ...] = ()
    #: How int8 layers at level 4 hold their weights: ``planes`` (two 4-bit ``MatMulNBits``, the
    #: layout every plan shares, so the gate can retarget it) or ``codes`` (one 8-bit
    #: ``MatMulNBits``: the same products, 1.3x faster at one row and 1.9x at eight in 1B shapes;
    #: written after the gate chose a plan, and checked again).
    int8_layout: str = "planes"
    #: Whether the level-4 products take the activations in two int8 terms (:mod:`.two_term`).
    two_term: bool = False

    def record(self) -> dict[str, Any]:
        """What ``engine.json`` records under ``kernels``."""
        out = asdict(self)
        out["int8_groups"] = list(self.int8_groups)
        return out

    def level_of(self, weight: str) -> int:
        """The accuracy level of the layer weight named ``weight`` (``model.layers.3.mlp.down_proj...``)."""
        for group in self.int8_groups:
            if f".{PROJECTION_GROUPS[group]}" in weight:
                return 4
        return self.accuracy_level


def kernel_plan(precision: str, cpu_class: str, *, accuracy_level: int | None = None) -> KernelPlan:
    """The plan for ``precision`` (int4 or int8) on ``cpu_class``.

    ``accuracy_level`` overrides the linear layers' float32 compute (tests force a bad choice
    with it: 4 is the int8-activation path).
    """
    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not quantized; quantized: {QUANTIZED_PRECISIONS}")
    if cpu_class not in CPU_CLASSES:
        raise ValueError(f"unknown CPU class {cpu_class!r}; known: {', '.join(CPU_CLASSES)}")
    bits = 4 if precision == "int4" else 8
    fast_head = cpu_class in FAST_HEAD_CLASSES or cpu_class in PLANE_HEAD_CLASSES
    return KernelPlan(precision=precision, cpu_class=cpu_class, weight_bits=bits,
                      accuracy_level=0 if accuracy_level is None else accuracy_level, head_bits=8,
                      head_accuracy_level=4 if fast_head else 0,
                      rescore_top_k=RESCORE_TOP_K if fast_head else 0,
                      head_layout="codes" if cpu_class in FAST_HEAD_CLASSES else "planes",
                      name="exact" if accuracy_level is None else "forced")


def float_plan(precision: str, cpu_class: str) -> KernelPlan:
    """The one "plan" of a float graph (fp32 weights, no ``MatMulNBits``): what the quality gate
    measures when only the KV dtype differs from fp32 (``--kv-cache-dtype fp16``)."""
    return KernelPlan(precision=precision, cpu_class=cpu_class, weight_bits=32, accuracy_level=0,
                      head_bits=32, head_accuracy_level=0, rescore_top_k=0, name="exact")


def candidate_plans(precision: str, cpu_class: str, mode: str = "auto") -> list[KernelPlan]:
    """The plans the gate tries for ``precision`` on ``cpu_class``, fastest first, the exact plan
    last (``mode`` ``exact``: the exact plan only; ``generic`` CPUs have no other)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    exact = kernel_plan(precision, cpu_class)
    if mode == "exact" or cpu_class not in INT8_ACTIVATION_CLASSES:
        return [exact]
    return [replace(exact, name=name, int8_groups=groups, two_term=name in TWO_TERM_PLANS)
            for name, groups in PLAN_GROUPS.items()]


def _layer_weight(node: onnx.NodeProto) -> str | None:
    if node.op_type != "MatMulNBits" or len(node.input) < 2 or ".layers." not in node.input[1]:
        return None
    return node.input[1]


def retarget(model: onnx.ModelProto, plan: KernelPlan) -> int:
    """Set the accuracy level of every layer ``MatMulNBits`` of ``model`` to ``plan``'s (the head
    keeps its own), and of every ``QMoE`` (int4 experts: level 4 only in a one-term plan that puts
    both of the MLP's groups there), and write or remove the two-term form of the plan's level-4
    products; returns how many nodes the plan puts at level 4. Whatever plan ``model`` held
    before, it then holds ``plan``'s."""
    strip_two_term(model.graph)
    fast = 0
    one_term_mlp = {"gate_up", "down"} <= set(plan.int8_groups) and not plan.two_term
    experts_level = 4 if one_term_mlp else plan.accuracy_level
    for node in model.graph.node:
        if node.op_type == "QMoE":  # int4 experts: int8 activations with the whole MLP only
            fast += experts_level == 4
            _set_level(node, experts_level)
            continue
        weight = _layer_weight(node)
        if weight is None:
            continue
        level = plan.level_of(weight)
        fast += level == 4
        _set_level(node, level)
    if plan.two_term:
        set_two_term(model.graph, lambda node: _layer_weight(node) is not None
                     and plan.level_of(node.input[1]) == 4)
    return fast


def _set_level(node: onnx.NodeProto, level: int) -> None:
    for attr in node.attribute:
        if attr.name == "accuracy_level":
            attr.i = level
            return
    node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
