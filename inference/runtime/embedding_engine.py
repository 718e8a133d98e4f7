"""The engine of an embedding bundle (``engine.json`` ``task`` ``embed``): token ids -> vectors.

The bundle's graph (``model.onnx``) is the checkpoint's decoder up to the final norm, pooled
over each sequence (``pooling`` ``last`` or ``mean``) and L2-normalised in the graph. A batch is
left-padded to its longest input (the graph's mask convention), position ids count real tokens
only, and there is no KV cache: each call runs its inputs from the first token.

``embed`` runs on the caller's thread (the HTTP layer calls it from a worker thread) and holds
a lock, so one session serves one batch at a time; inputs longer than the bundle's
``max_input_len`` are refused, never cut. Batches follow
:func:`~inference.runtime.embedding_batches.run_plan` (at most ``max_input_len`` padded tokens
each), so a run never takes more than
:func:`~inference.runtime.embedding_batches.working_bytes`, and each run ends by shrinking the
session's CPU arena: the memory a long batch took goes back to the system after it.

It also answers the :class:`~inference.runtime.protocol.Engine` protocol so the model pool can
hold it like any loaded model (info, memory, close); the generation methods refuse with one
line, and the serving layer refuses completions for an embedding model before reaching them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import onnxruntime as ort

from inference.runtime.embedding_batches import MAX_ROWS, run_plan
from inference.runtime.kv_layers import kv_layer_shapes
from inference.runtime.ort_session import cpu_session
from inference.runtime.protocol import EngineInfo
from inference.runtime.registry import is_embedding

#: The model file of an embedding bundle.
EMBEDDING_MODEL = "model.onnx"


class EmbeddingInputError(ValueError):
    """An input the engine cannot embed (empty, too long, ids outside the vocabulary)."""


class EmbeddingEngine:
    """One onnxruntime session of an embedding graph."""

    def __init__(self, model_path: Path, meta: dict[str, Any], *, threads: int,
                 max_batch: int = MAX_ROWS) -> None:
        if not is_embedding(meta):
            raise ValueError(f"{model_path.parent} is not an embedding bundle (engine.json task "
                             f"{meta.get('task', 'generate')!r})")
        self._session: ort.InferenceSession | None = cpu_session(model_path, threads=threads, optimized=False)
        self._past = [n for n in meta["inputs"] if n.startswith("past_key_values.")]
        shapes = kv_layer_shapes(meta)
        #: each past input's (K/V heads, head size): a run feeds them empty
        self._past_shapes = {name: shapes[int(name.split(".")[1])][:2] for name in self._past}
        self.vocab_size = int(meta["vocab_size"])
        self.dimensions = int(meta["embedding_dim"])
        self.max_input_len = int(meta["max_input_len"])
        self.pooling = str(meta["pooling"])
        matryoshka = meta.get("matryoshka")
        #: None: no truncation; []: any size; else the sizes allowed.
        self.truncations: list[int] | None = (
            None if matryoshka is None else list(matryoshka.get("dimensions") or []))
        self._max_batch = max(1, max_batch)
        # The arena keeps its largest allocation otherwise: one long batch would hold its
        # attention memory for the life of the model.
        self._run_options = ort.RunOptions()
        self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._lock = threading.Lock()
        self._info = EngineInfo(
            model_type=str(meta["model_type"]),
            vocab_size=self.vocab_size,
            max_slots=1,
            max_input_len=self.max_input_len,
            max_kv_capacity=self.max_input_len,
            eos_token_ids=tuple(int(t) for t in meta.get("eos_token_ids", [])),
            backend="onnxruntime",
            precision=str(meta["precision"]),
            extra={"task": "embed", "pooling": self.pooling, "dimensions": self.dimensions,
                   "threads": threads, "model_file": model_path.name},
        )

    @property
    def info(self) -> EngineInfo:
        """Static facts about the engine (``extra["task"]`` is ``embed``)."""
        return self._info

    def set_memory_bytes(self, n: int) -> None:
        """Record the loader's memory estimate in :attr:`info`."""
        self._info = dataclasses.replace(self._info, memory_bytes=n)

    def _refuse(self) -> NoReturn:
        raise ValueError("this is an embedding model: it computes vectors (/v1/embeddings), not tokens")

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Refused: an embedding model generates nothing."""
        self._refuse()

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Refused: an embedding model generates nothing."""
        self._refuse()

    def slot_length(self, slot: int) -> int:
        """Always 0: there is no KV cache."""
        return 0

    def reset(self, slot: int) -> None:
        """Nothing to reset: there is no KV cache."""

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """Raise :class:`EmbeddingInputError` for an input ``embed`` would refuse."""
        for i, ids in enumerate(inputs):
            if len(ids) == 0:
                raise EmbeddingInputError(f"input {i} is empty: give at least one token")
            if len(ids) > self.max_input_len:
                raise EmbeddingInputError(f"input {i} has {len(ids)} tokens; this model embeds at most "
                                          f"{self.max_input_len} (its bundle's max_input_len)")
            low, high = min(ids), max(ids)
            if low < 0 or high >= self.vocab_size:
                raise EmbeddingInputError(f"input {i} has token ids outside [0, {self.vocab_size})")

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit vectors ``[len(inputs), dimensions]`` float32, one per input, in order."""
        self.check(inputs)
        out = np.empty((len(inputs), self.dimensions), dtype=np.float32)
        plan = run_plan([len(ids) for ids in inputs], max_tokens=self.max_input_len, max_rows=self._max_batch)
        for rows in plan:
            out[rows] = self._run([inputs[i] for i in rows])
        return out

    def _run(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        width = max(len(ids) for ids in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, tokens in enumerate(batch):
            ids[row, width - len(tokens):] = tokens
            mask[row, width - len(tokens):] = 1
        feed: dict[str, np.ndarray] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": np.maximum(np.cumsum(mask, axis=1) - 1, 0),
            **{name: np.zeros((len(batch), heads, 0, dim), dtype=np.float32)
               for name, (heads, dim) in self._past_shapes.items()},
        }
        with self._lock:
            if self._session is None:
                raise RuntimeError("engine is closed")
            (vectors,) = self._session.run(["embeddings"], feed, self._run_options)
        return np.asarray(vectors, dtype=np.float32)

    def close(self) -> None:
        """Release the session (further calls raise)."""
        with self._lock:
            self._session = None

