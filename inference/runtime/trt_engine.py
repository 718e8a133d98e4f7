"""The TensorRT implementation of the Engine protocol (GPU, via pycuda).

Each slot owns one device buffer holding its K/V for every layer, each ``[1, kv_heads, length,
head_dim]`` packed at the start of a capacity-sized region. The graph reads ``past`` and writes
``present`` (TensorRT forbids aliasing an input with an output), so a batch-1 step writes into
one spare slot-sized buffer and then swaps it with the slot's: no copy, one extra buffer. A
decode step over several slots gathers their K/V (left-padded, device to device) into a batch
buffer and scatters the presents back. Host <-> device traffic per step is the token ids,
positions and mask in, and the logits of the rows that are sampled out (one row per slot;
intermediate prefill chunks copy nothing back).

All CUDA work runs in the device's primary context, pushed around every call: the scheduler
thread that drives the engine is not the thread that loaded it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inference.runtime.errors import EngineLoadError
from inference.runtime.onnxruntime_loader import KNOWN_FORMAT_VERSIONS as _FORMAT_VERSIONS
from inference.runtime.protocol import EngineInfo
from inference.runtime.slot_checks import (
    SlotLengths,
    check_decode,
    check_decode_lengths,
    check_extend,
    check_prefill,
)

log = logging.getLogger("inference.runtime.trt")


class EngineRunError(RuntimeError):
    """TensorRT refused a call while running (shape outside the profile, unbound tensor)."""


def _expect(ok: object, what: str, errors: list[str]) -> None:
    if not ok:
        raise EngineRunError(f"TensorRT refused {what}: {'; '.join(errors[-3:]) or 'no message'}")


class TrtEngine(SlotLengths):
    """An Engine over one TensorRT execution context of a bundle's plan."""

    def __init__(self, bundle_dir: Path, meta: dict[str, Any], *, max_slots: int) -> None:
        import pycuda.driver as cuda
        import tensorrt as trt

        from inference.cuda_device import cuda_device, plan_mismatch
        from inference.trt_logging import collecting_logger

        self._cuda, self._trt = cuda, trt
        device = cuda_device(0)
        mismatch = plan_mismatch(meta, str(trt.__version__), device)
        if mismatch is not None:
            raise EngineLoadError(f"{mismatch}: rebuild the bundle on this machine")
        self._layers = int(meta["num_layers"])
        self._kv_heads = int(meta["num_kv_heads"])
        self._head_dim = int(meta["head_dim"])
        vocab = int(meta["vocab_size"])
        cap = int(meta["max_kv_cache_capacity"])
        chunk = int(meta["max_input_len"])
        batch_limit = int(meta.get("max_batch_size", 1))
        if max_slots > batch_limit:
            # Decode runs all slots in one batch; the plan's profile stops at max_batch_size.
            raise EngineLoadError(f"max_slots {max_slots} exceeds the plan's max_batch_size {batch_limit}")
        self._past_names = [n for n in meta["inputs"] if n.startswith("past_key_values.")]
        self._present_names = [n for n in meta["outputs"] if n.startswith("present.")]
        self._ctx = cuda.Device(device.ordinal).retain_primary_context()
        self._logger = collecting_logger(trt)
        self._allocs: list[Any] = []
        self._allocated = 0
        self._closed = False
        plan = (Path(bundle_dir) / str(meta.get("engine_file", "engine.plan"))).read_bytes()
        try:
            with self._active():
                runtime = trt.Runtime(self._logger)
                engine = runtime.deserialize_cuda_engine(plan)
                if engine is None:
                    raise EngineLoadError(
                        f"TensorRT cannot deserialize {bundle_dir}: {'; '.join(self._logger.errors)}"
                    )
                self._runtime, self._engine = runtime, engine
                self._check_io(engine, meta)
                self._context = engine.create_execution_context()
                if self._context is None:
                    raise EngineLoadError(
                        f"TensorRT cannot create an execution context: {self._logger.errors}"
                    )
                self._stream = cuda.Stream()
                kv_type = np.dtype(trt.nptype(engine.get_tensor_dtype(self._past_names[0])))
                self._kv_dtype = kv_type
                self._kv_item = kv_type.itemsize
                # One layer's K (or V) region holds a full-capacity sequence.
                self._region = self._kv_heads * cap * self._head_dim * self._kv_item
                slot_bytes = self._region * len(self._past_names)
                self._slots = [self._alloc(slot_bytes) for _ in range(max_slots)]
                self._spare = self._alloc(slot_bytes)
                self._batch_past = self._batch_present = None
                if max_slots > 1:
                    self._batch_past = self._alloc(slot_bytes * max_slots)
                    self._batch_present = self._alloc(slot_bytes * max_slots)
                    # Left padding is masked out, but it must hold finite numbers (0 * NaN is NaN).
                    cuda.memset_d8_async(self._batch_past, 0, slot_bytes * max_slots, self._stream)
                tokens = max(chunk, max_slots)
                self._d_ids = self._alloc(tokens * 8)
                self._d_pos = self._alloc(tokens * 8)
                self._d_mask = self._alloc(max_slots * cap * 8)
                self._d_logits = self._alloc(max_slots * vocab * 4)
                self._h_ids = cuda.pagelocked_empty(tokens, np.int64)
                self._h_pos = cuda.pagelocked_empty(tokens, np.int64)
                self._h_mask = cuda.pagelocked_empty(max_slots * cap, np.int64)
                self._h_logits = cuda.pagelocked_empty((max_slots, vocab), np.float32)
                self._stream.synchronize()
        except BaseException:
            self._release()  # a failed load leaves no device memory and no context behind
            raise
        self._lengths = [0] * max_slots
        allocated = self._allocated
        workspace = int(getattr(engine, "device_memory_size_v2", 0) or 0)
        self._info = EngineInfo(
            model_type=str(meta["model_type"]),
            vocab_size=vocab,
            max_slots=max_slots,
            max_input_len=chunk,
            max_kv_capacity=cap,
            eos_token_ids=tuple(int(t) for t in meta.get("eos_token_ids", [])),
            backend="tensorrt",
            precision=str(meta["precision"]),
            device=f"cuda:{device.name}",
            # Weights live in the plan; KV, I/O buffers and TensorRT's activation memory on top.
            memory_bytes=len(plan) + allocated + workspace,
            extra={
                "bos_token_id": meta.get("bos_token_id"),
                "architecture": meta.get("architecture"),
                "tensorrt_version": trt.__version__,
                "gpu_name": device.name,
                "compute_capability": device.compute_capability,
                "kv_bytes_per_slot": slot_bytes,
            },
        )

    # --- setup helpers ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        self._ctx.push()
        try:
            yield
        finally:
            self._cuda.Context.pop()

    def _alloc(self, nbytes: int) -> Any:
        buf = self._cuda.mem_alloc(nbytes)
        self._allocs.append(buf)
        self._allocated += nbytes
        return buf

    def _check_io(self, engine: Any, meta: dict[str, Any]) -> None:
        trt = self._trt
        names = {
            engine.get_tensor_name(i): engine.get_tensor_mode(engine.get_tensor_name(i))
            for i in range(engine.num_io_tensors)
        }
        want = {n: trt.TensorIOMode.INPUT for n in meta["inputs"]}
        want.update({n: trt.TensorIOMode.OUTPUT for n in meta["outputs"]})
        if names != want:
            raise EngineLoadError(
                f"the plan's tensors {sorted(names)} differ from engine.json's {sorted(want)}; "
                "rebuild the bundle"
            )
        for name in ("input_ids", "attention_mask", "position_ids"):
            if engine.get_tensor_dtype(name) != trt.DataType.INT64:
                raise EngineLoadError(f"plan input {name} is {engine.get_tensor_dtype(name)}, expected INT64")
        if engine.get_tensor_dtype("logits") != trt.DataType.FLOAT:
            raise EngineLoadError(
                f"plan output logits is {engine.get_tensor_dtype('logits')}, expected FLOAT"
            )

    @property
    def info(self) -> EngineInfo:
        """Static facts about the engine."""
        return self._info

    # --- slot bookkeeping (slot_length, reset: SlotLengths) -----------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")

    # --- one execution -------------------------------------------------------------------------
    def _run(self, batch: int, new: int, past: int, past_base: int, present_base: int) -> None:
        """Bind shapes, then addresses, then enqueue one step (inputs already copied in)."""
        ctx, errors = self._context, self._logger.errors
        kv, hd = self._kv_heads, self._head_dim
        # Shapes first: TensorRT derives output shapes (and checks the profile) from them.
        for name, shape in (
            ("input_ids", (batch, new)),
            ("position_ids", (batch, new)),
            ("attention_mask", (batch, past + new)),
        ):
            _expect(ctx.set_input_shape(name, shape), f"shape {shape} for {name}", errors)
        for name in self._past_names:
            _expect(
                ctx.set_input_shape(name, (batch, kv, past, hd)), f"past length {past} for {name}", errors
            )
        bind = [
            ("input_ids", int(self._d_ids)),
            ("position_ids", int(self._d_pos)),
            ("attention_mask", int(self._d_mask)),
            ("logits", int(self._d_logits)),
        ]
        # With a batch buffer each layer's region is batch-sized; a slot buffer holds one row.
        stride = self._region * (batch if batch > 1 else 1)
        bind += [(n, past_base + j * stride) for j, n in enumerate(self._past_names)]
        bind += [(n, present_base + j * stride) for j, n in enumerate(self._present_names)]
        for name, address in bind:
            _expect(ctx.set_tensor_address(name, address), f"the address of {name}", errors)
        _expect(ctx.execute_async_v3(self._stream.handle), "execute_async_v3", errors)

    def _upload(self, ids: np.ndarray, pos: np.ndarray, mask_rows: int, mask_cols: int) -> None:
        cuda, stream = self._cuda, self._stream
        n = ids.size
        self._h_ids[:n] = ids
        self._h_pos[:n] = pos
        cuda.memcpy_htod_async(self._d_ids, self._h_ids[:n], stream)
        cuda.memcpy_htod_async(self._d_pos, self._h_pos[:n], stream)
        cuda.memcpy_htod_async(self._d_mask, self._h_mask[: mask_rows * mask_cols], stream)

    def _swap(self, slot: int) -> None:
        self._slots[slot], self._spare = self._spare, self._slots[slot]

    # --- the protocol ---------------------------------------------------------------------------
    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to ``slot``'s KV; return logits ``[vocab]`` of the last one."""
        self._check_open()
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        length = self._lengths[slot]
        check_prefill(slot, length, ids.size, self._info.max_kv_capacity)
        chunk = self._info.max_input_len
        vocab = self._info.vocab_size
        with self._active():
            for start in range(0, ids.size, chunk):
                part = ids[start : start + chunk]
                pos = length + start
                total = pos + part.size
                self._h_mask[:total] = 1
                self._upload(part, np.arange(pos, total, dtype=np.int64), 1, total)
                self._run(1, part.size, pos, int(self._slots[slot]), int(self._spare))
                last = start + chunk >= ids.size
                if last:  # only the final chunk's last position is sampled
                    self._cuda.memcpy_dtoh_async(self._h_logits[0], self._d_logits, self._stream)
                # The pinned inputs are rewritten next chunk: wait until the step has read them.
                self._stream.synchronize()
                self._swap(slot)
                self._lengths[slot] = total
            return np.array(self._h_logits[0, :vocab])

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each slot; return logits ``[len(slots), vocab]``."""
        self._check_open()
        check_decode(slots, len(token_ids), self._info.max_slots)
        ids = self._check_tokens(token_ids)
        lengths = [self._lengths[s] for s in slots]
        check_decode_lengths(slots, lengths, self._info.max_kv_capacity)
        batch, longest = len(slots), max(lengths)
        with self._active():
            width = longest + 1
            mask = self._h_mask[: batch * width].reshape(batch, width)
            mask[:] = 1
            for b, n in enumerate(lengths):
                mask[b, : longest - n] = 0
            self._upload(ids, np.asarray(lengths, dtype=np.int64), batch, width)
            if batch == 1:
                self._run(1, 1, longest, int(self._slots[slots[0]]), int(self._spare))
            else:
                self._gather(slots, lengths, longest)
                assert self._batch_past is not None and self._batch_present is not None
                self._run(batch, 1, longest, int(self._batch_past), int(self._batch_present))
                self._scatter(slots, lengths, longest)
            self._cuda.memcpy_dtoh_async(self._h_logits[:batch], self._d_logits, self._stream)
            self._stream.synchronize()
            if batch == 1:
                self._swap(slots[0])
            for s in slots:
                self._lengths[s] += 1
            return np.array(self._h_logits[:batch])

    def extend(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to a non-empty ``slot``; return logits ``[len(token_ids), vocab]``.

        The plan keeps the logits of the last position only (the TensorRT builder fixes
        ``logits_to_keep`` to 1: a data-dependent output shape would be a host shape tensor),
        so the tokens run as one batch-1 step each. Same numbers as one multi-token run, but
        ``k`` steps instead of one: verification on TensorRT needs a plan with all-position
        logits before it pays off.
        """
        self._check_open()
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        check_extend(slot, self._lengths[slot], ids.size, self._info.max_kv_capacity)
        return np.stack([self.decode([slot], [int(t)])[0] for t in ids])

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the first ``n`` positions of ``slot``.

        A slot packs each head's ``length`` positions one after another, so a shorter length
        moves every head but the first: the kept positions are repacked into the spare buffer
        (device to device; source and target never overlap) and the two swap.
        """
        self._check_open()
        self._check_slot(slot)
        length = self._lengths[slot]
        if not 0 <= n <= length:
            raise ValueError(f"cannot truncate slot {slot} of {length} positions to {n}")
        if 0 < n < length:
            row = self._head_dim * self._kv_item
            src_base, dst_base = int(self._slots[slot]), int(self._spare)
            with self._active():
                for j in range(len(self._past_names)):
                    for h in range(self._kv_heads):
                        self._cuda.memcpy_dtod_async(
                            self._head(dst_base, j, h, n, 0),
                            self._head(src_base, j, h, length, 0),
                            n * row,
                            self._stream,
                        )
                self._stream.synchronize()
            self._swap(slot)
        self._lengths[slot] = n

    # --- context reuse (KVEngine) ------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one position takes over all layers (K and V, in the plan's KV type)."""
        return len(self._past_names) * self._kv_heads * self._head_dim * self._kv_item

    def _head(self, slot_base: int, j: int, h: int, length: int, pos: int) -> int:
        """Device address of position ``pos`` of head ``h`` of layer tensor ``j`` in a slot
        buffer packed for ``length`` positions."""
        return slot_base + j * self._region + (h * length + pos) * self._head_dim * self._kv_item

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold exactly the first ``n`` positions of ``src`` (device to device)."""
        self._check_open()
        self._check_slot(src)
        self._check_slot(dst)
        length = self._lengths[src]
        if not 0 <= n <= length:
            raise ValueError(f"slot {src} holds {length} positions, not {n}")
        if src == dst:
            self.truncate(src, n)
            return
        row = self._head_dim * self._kv_item
        if n > 0:
            with self._active():
                for j in range(len(self._past_names)):
                    for h in range(self._kv_heads):
                        self._cuda.memcpy_dtod_async(
                            self._head(int(self._slots[dst]), j, h, n, 0),
                            self._head(int(self._slots[src]), j, h, length, 0),
                            n * row,
                            self._stream,
                        )
                self._stream.synchronize()
        self._lengths[dst] = n

    def export_kv(self, slot: int, start: int, n: int) -> np.ndarray:
        """A host copy of positions ``[start, start + n)``: ``[2*layers, kv_heads, n, head_dim]``
        in the plan's KV type."""
        self._check_open()
        self._check_slot(slot)
        length = self._lengths[slot]
        if start < 0 or n < 0 or start + n > length:
            raise ValueError(f"slot {slot} holds {length} positions; cannot export [{start}, {start + n})")
        out = np.empty((len(self._past_names), self._kv_heads, n, self._head_dim), dtype=self._kv_dtype)
        if n > 0:
            base = int(self._slots[slot])
            with self._active():
                self._stream.synchronize()
                for j in range(len(self._past_names)):
                    for h in range(self._kv_heads):
                        # out[j, h] is a contiguous [n, head_dim] view: the copy lands in place.
                        self._cuda.memcpy_dtoh(out[j, h], self._head(base, j, h, length, start))
        return out

    def import_kv(self, slot: int, start: int, kv: np.ndarray) -> None:
        """Write ``kv`` (as from :meth:`export_kv`) at ``start`` (``<= slot_length``); the slot
        then holds ``start + n``. The slot is repacked for its new length in the spare buffer."""
        self._check_open()
        self._check_slot(slot)
        n = int(kv.shape[2]) if kv.ndim == 4 else -1
        if kv.shape != (len(self._past_names), self._kv_heads, n, self._head_dim):
            raise ValueError(f"KV block of shape {kv.shape} does not fit this engine")
        length, cap = self._lengths[slot], self._info.max_kv_capacity
        if not 0 <= start <= length or start + n > cap:
            raise ValueError(
                f"cannot import {n} positions at {start} into slot {slot} holding {length} (capacity {cap})"
            )
        block = np.ascontiguousarray(kv, dtype=self._kv_dtype)
        total, row = start + n, self._head_dim * self._kv_item
        src_base, dst_base = int(self._slots[slot]), int(self._spare)
        with self._active():
            for j in range(len(self._past_names)):
                for h in range(self._kv_heads):
                    if start > 0:
                        self._cuda.memcpy_dtod_async(
                            self._head(dst_base, j, h, total, 0),
                            self._head(src_base, j, h, length, 0),
                            start * row,
                            self._stream,
                        )
            self._stream.synchronize()
            for j in range(len(self._past_names)):
                for h in range(self._kv_heads):
                    if n > 0:
                        self._cuda.memcpy_htod(self._head(dst_base, j, h, total, start), block[j, h])
        self._swap(slot)
        self._lengths[slot] = total

    def _gather(self, slots: Sequence[int], lengths: list[int], longest: int) -> None:
        """Copy each slot's K/V into row b of the batch past buffer, left-padded to ``longest``."""
        batch, kv, row = len(slots), self._kv_heads, self._head_dim * self._kv_item
        assert self._batch_past is not None
        base = int(self._batch_past)
        for j in range(len(self._past_names)):
            for b, (s, n) in enumerate(zip(slots, lengths, strict=True)):
                src = int(self._slots[s]) + j * self._region
                dst = base + j * self._region * batch
                pad = longest - n
                for h in range(kv):
                    self._cuda.memcpy_dtod_async(
                        dst + ((b * kv + h) * longest + pad) * row, src + h * n * row, n * row, self._stream
                    )

    def _scatter(self, slots: Sequence[int], lengths: list[int], longest: int) -> None:
        """Copy row b of the batch present buffer (without its padding) back into each slot."""
        batch, kv, row = len(slots), self._kv_heads, self._head_dim * self._kv_item
        assert self._batch_present is not None
        base, total = int(self._batch_present), longest + 1
        for j in range(len(self._present_names)):
            for b, (s, n) in enumerate(zip(slots, lengths, strict=True)):
                src = base + j * self._region * batch
                dst = int(self._slots[s]) + j * self._region
                pad = longest - n
                for h in range(kv):
                    self._cuda.memcpy_dtod_async(
                        dst + h * (n + 1) * row,
                        src + ((b * kv + h) * total + pad) * row,
                        (n + 1) * row,
                        self._stream,
                    )

    def close(self) -> None:
        """Free device memory and release the context."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        with self._active():
            stream = getattr(self, "_stream", None)
            if stream is not None:
                stream.synchronize()
            for buf in self._allocs:
                buf.free()
            self._allocs.clear()
            self._context = None
            self._engine = None
        self._ctx.detach()


def load_trt_engine(
    bundle_dir: Path, *, max_slots: int | None = None, threads: int | None = None
) -> TrtEngine:
    """Registry entry: a TensorRT bundle -> :class:`TrtEngine` (``threads`` does not apply).

    ``max_slots`` defaults to the bundle's max_batch_size."""
    from inference.cuda_device import tensorrt_missing
    from inference.runtime.registry import read_meta

    meta = read_meta(bundle_dir)
    if meta.get("format_version") not in _FORMAT_VERSIONS:
        raise EngineLoadError(
            f"{bundle_dir}/engine.json has format_version {meta.get('format_version')!r}; this runtime "
            f"reads {list(_FORMAT_VERSIONS)}. Rebuild the bundle with this version of the builder"
        )
    slots = int(meta.get("max_batch_size", 1)) if max_slots is None else max_slots
    if slots < 1:
        raise ValueError(f"max_slots must be at least 1, got {slots}")
    missing = tensorrt_missing()
    if missing is not None:
        raise EngineLoadError(f"cannot load the TensorRT bundle {bundle_dir} here: {missing}")
    return TrtEngine(Path(bundle_dir), meta, max_slots=slots)
