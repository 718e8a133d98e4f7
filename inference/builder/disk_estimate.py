"""How much disk a build needs: what the builders hold on disk at most while they write a bundle.

Read from the checkpoint's tensor table alone (safetensors headers or the GGUF's tensor infos;
no weight is read), by the element count of each kind of weight times the bytes the build
stores it in:

* ``fp32`` (onnxruntime): 4 bytes an element in the bundle; while it builds, the portable graph's
  weights, the CPU graph's source and its onnxruntime-optimised copy are on disk at once
  (``ort_backend.build_bundle`` shares them into one file afterwards): 3 x that.
* ``int8`` / ``int4`` (onnxruntime): linear layers at 8 or 4 bits, the token embedding and
  lm_head at 8 bits, each with one float32 scale per block of 32; norms at 4 bytes. While it
  builds, the CPU graph's source and its optimised copy: 2 x that.
* an embedding bundle (``task`` ``embed``): the portable fp32 graph alone.
* ``tensorrt``: the fp32 ONNX graph the plan is built from (plus its int8 copy for ``int8``).

The figures are a floor, not a ceiling (graph protobufs, Q4_1 block minimums and scratch of
onnxruntime are not counted). Measured against the estimate (bundle; most on disk at once, read
right after onnxruntime wrote the optimised graph): SmolLM2-135M Q4_1 fp32 541.9 MB (538.1 MB);
1,614.8 MB (1,614.2 MB); int4 115.3 MB (98.3 MB); 224.1 MB (196.7 MB); int8 bundle 157.9 MB
(151.4 MB); a 1.07B Llama GGUF, int8 1,227.6 MB (1,208.2 MB), int4 741.0 MB (721.7 MB). A build
refused by it would not have fitted; one it lets through may still run out of space part way,
which the cache reports in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inference.builder.checkpoint_reader import open_checkpoint
from inference.builder.quantized import BLOCK

_FLOAT = 4
_SCALE = _FLOAT / BLOCK  # one float32 scale per block of 32 elements
_QUANT_BYTES = {"int8": 1 + _SCALE, "int4": 0.5 + _SCALE}
_TABLE_BYTES = 1 + _SCALE  # embedding and lm_head: 8-bit tables in every quantized precision


@dataclass(frozen=True)
class WeightCounts:
    """Elements of a checkpoint's weights by how a build stores them."""

    linear: int  # 2-D weights of the layers
    tables: int  # the token embedding and the lm_head
    other: int  # norms, biases: kept in float32

    @property
    def total(self) -> int:
        """Every element."""
        return self.linear + self.tables + self.other


@dataclass(frozen=True)
class DiskEstimate:
    """``bundle``: the bytes of the finished bundle; ``peak``: the most the build holds at once."""

    bundle: int
    peak: int


def weight_counts(checkpoint_dir: Path) -> WeightCounts:
    """Count the elements of ``checkpoint_dir``'s weights (headers only)."""
    ckpt = open_checkpoint(Path(checkpoint_dir))
    linear = tables = other = 0
    for name in ckpt.names():
        n = 1
        shape = ckpt.shape(name)
        for dim in shape:
            n *= int(dim)
        if "embed_tokens" in name or name.startswith("lm_head"):
            tables += n
        elif len(shape) == 2:
            linear += n
        else:
            other += n
    return WeightCounts(linear, tables, other)


def estimate_disk(checkpoint_dir: Path, *, backend: str, precision: str,
                  task: str = "generate") -> DiskEstimate:
    """What a ``backend`` build of ``checkpoint_dir`` at ``precision`` needs on disk (see above)."""
    counts = weight_counts(checkpoint_dir)
    fp32 = counts.total * _FLOAT
    if backend == "tensorrt":
        quantized = int(counts.linear * _QUANT_BYTES["int8"] + counts.tables * _TABLE_BYTES
                        + counts.other * _FLOAT) if precision == "int8" else 0
        plan = counts.total * (1 if precision == "int8" else 2)
        return DiskEstimate(bundle=plan, peak=fp32 + quantized)
    if task == "embed" or precision not in _QUANT_BYTES:
        return DiskEstimate(bundle=fp32, peak=fp32 if task == "embed" else 3 * fp32)
    bundle = int(counts.linear * _QUANT_BYTES[precision] + counts.tables * _TABLE_BYTES
                 + counts.other * _FLOAT)
    return DiskEstimate(bundle=bundle, peak=2 * bundle)
