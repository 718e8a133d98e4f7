"""Multimodal rotary positions (Qwen2.5-VL's M-RoPE) of a prompt: a pure function of its length,
where each image's rows are and each image's grid (what transformers' ``get_rope_index`` derives
from the input ids, ``mm_token_type_ids`` and ``image_grid_thw``).

Text tokens advance the temporal, height and width ids together (one more each token); an image's
rows, in row-major order of its grid ``(t, h, w)``, take ``start + (t_index, row, column)`` where
``start`` is where the text before it ended; the text after the image continues from ``start +
max(h, w)`` (the largest id of the image + 1). A prompt without images has the plain positions
``0 .. n-1`` in all three. Decoding continues from the last position + 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(length: int, rows: np.ndarray, grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """``[3, length]`` int64 positions of a prompt of ``length`` tokens whose image rows are
    ``rows`` (ascending, every image's ``t * h * w`` rows in prompt order, each image's side by
    side) with grids ``grids`` (one per image, in order). ``ValueError`` where they disagree."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if sum(t * h * w for t, h, w in grids) != rows.size:
        raise ValueError(f"{rows.size} image rows for grids {list(grids)}")
    out = np.empty((3, length), np.int64)
    current = 0  # the position the next token takes
    done = 0  # tokens placed
    taken = 0  # rows used
    for t, h, w in grids:
        count = t * h * w
        mine = rows[taken:taken + count]
        taken += count
        start = int(mine[0])
        if start < done or int(mine[-1]) - start != count - 1 or start + count > length:
            raise ValueError(f"an image's {count} rows must be side by side, in order, within the prompt")
        text = start - done
        out[:, done:start] = current + np.arange(text)
        current += text
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, start:start + count] = current + np.stack([tt, hh, ww]).reshape(3, -1)
        current += max(h, w)
        done = start + count
    out[:, done:] = current + np.arange(length - done)
    return out
