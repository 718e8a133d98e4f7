"""How an embedding engine groups inputs into runs, and the working memory one run may take.

The rule: one run of the graph (a batch left-padded to its longest input) holds at most the
bundle's ``max_input_len`` padded tokens (rows x width) and at most :data:`MAX_ROWS` rows. The
graph's attention keeps a ``[rows, heads, width, width]`` fp32 probability tensor (and a
``[rows, 1, width, width]`` mask), so its size grows with rows x width²; under the rule
rows x width² <= max_input_len x width <= max_input_len², and no run costs more than a single
input of the longest length the bundle accepts, whatever a request holds (2,048 inputs, 300,000
tokens). Runs are sequential (the engine holds a lock), so :func:`working_bytes` bounds the
engine's working memory; the model's memory estimate counts it, so ``--memory-budget-gb`` does.

Pure arithmetic on ``engine.json`` fields: nothing here imports onnxruntime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inference.runtime.kv_layers import kv_layer_shapes

#: Most inputs in one run (short inputs: one run of this many amortises the per-run overhead).
MAX_ROWS = 32

#: Bytes per padded token of a run: the fp32 activations around a layer, bounded by
#: 24 x hidden_size floats, and each layer's K and V (2 x layers x kv_heads x head_dim floats).
_ACTIVATION_FLOATS_PER_HIDDEN = 24

#: The session's CPU arena reserves more than a run's tensors take (it gives it back after the
#: run): measured up to 1.5x the live tensors (the tiny demo model, one input of 4,096 tokens).
_ARENA_SLACK = 1.5


def run_plan(lengths: Sequence[int], *, max_tokens: int, max_rows: int = MAX_ROWS) -> list[list[int]]:
    """The indices of ``lengths`` grouped into runs, shortest inputs first (less padding): each
    run has at most ``max_rows`` rows and at most ``max_tokens`` padded tokens (rows x its
    longest input); an input longer than ``max_tokens`` is a ValueError (the engine refuses it
    before, naming the input)."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens and max_rows must be at least 1, got {max_tokens} and {max_rows}")
    runs: list[list[int]] = []
    run: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if lengths[i] > max_tokens:
            raise ValueError(f"input {i} has {lengths[i]} tokens, more than a run holds ({max_tokens})")
        # Ascending order: input i is the longest of the run it joins, so it sets the width.
        if run and (len(run) == max_rows or (len(run) + 1) * lengths[i] > max_tokens):
            runs.append(run)
            run = []
        run.append(i)
    if run:
        runs.append(run)
    return runs


def working_bytes(meta: Mapping[str, Any]) -> int:
    """The most memory one run of an embedding bundle takes beyond its weights: a run of
    ``max_input_len`` tokens (every run under :func:`run_plan`'s rule costs at most that).

    Per padded token: :data:`_ACTIVATION_FLOATS_PER_HIDDEN` x hidden_size floats of activations
    and every layer's K and V; per (query, key) pair of a row: the attention probabilities of
    each head (fp32), the additive fp32 mask and its two bool precursors; then the arena's
    slack. Measured (onnxruntime 1.32, one input of 1,024 / 2,048 / 4,096 tokens): SmolLM2-135M
    128 / 334 / 1,013 MiB against a bound of 212 / 549 / 1,602 MiB; the tiny demo model
    35 / 126 (2,000 tokens) / 511 MiB against 43 / 145 / 567 MiB."""
    tokens = int(meta["max_input_len"])
    kv_floats = sum(2 * heads * dim for i, (heads, dim, src) in enumerate(kv_layer_shapes(meta)) if src == i)
    per_token = 4 * (_ACTIVATION_FLOATS_PER_HIDDEN * int(meta["hidden_size"]) + kv_floats)
    per_pair = 4 * (int(meta["num_heads"]) + 1) + 2
    return int((tokens * per_token + tokens * tokens * per_pair) * _ARENA_SLACK)


__all__ = ["MAX_ROWS", "run_plan", "working_bytes"]
