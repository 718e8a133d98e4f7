"""Fixtures for the serving tests: the demo tokenizer and numpy engines implementing ``Engine``.

The engines are the only fakes (the engine is hardware in production): ``TableEngine`` gives
deterministic logits from a seeded random table keyed on the last token, so greedy output is a
fixed function of the prompt; ``ScriptedEngine`` makes greedy decoding emit a given token
sequence (then EOS), to drive the reasoning and tool-call parsers through the real tokenizer.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from litestar import Litestar

from inference.demo import write_demo_checkpoint
from inference.openai import OpenAIServing, ServingOptions, openai_router
from inference.runtime.protocol import EngineInfo
from inference.tokenizer import Tokenizer, load_tokenizer

MODEL = "demo-tiny"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", size="tiny")


@pytest.fixture(scope="session")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return load_tokenizer(demo_dir)


class _SlotEngine:
    """KV bookkeeping shared by the fake engines: per-slot lengths and capacity checks."""

    def __init__(
        self, vocab_size: int, *, max_slots: int, capacity: int, delay: float, model_type: str
    ) -> None:
        self._info = EngineInfo(
            model_type=model_type,
            vocab_size=vocab_size,
            max_slots=max_slots,
            max_input_len=capacity,
            max_kv_capacity=capacity,
            eos_token_ids=(2,),
        )
        self.delay = delay
        self.lengths = [0] * max_slots
        self.tokens: list[list[int]] = [[] for _ in range(max_slots)]
        self.decode_batches: list[int] = []
        self.prefill_chunks: list[int] = []
        self.resets: list[int] = []
        self.closed = False

    @property
    def info(self) -> EngineInfo:
        return self._info

    def _append(self, slot: int, ids: Sequence[int]) -> None:
        if self.lengths[slot] + len(ids) > self._info.max_kv_capacity:
            raise ValueError("slot would exceed max_kv_capacity")
        self.lengths[slot] += len(ids)
        self.tokens[slot].extend(ids)

    def _logits(self, slot: int) -> np.ndarray:
        raise NotImplementedError

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay)
        self._append(slot, token_ids)
        self.prefill_chunks.append(len(token_ids))
        return self._logits(slot)

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        assert len(slots) == len(token_ids)
        if self.delay:
            time.sleep(self.delay)
        self.decode_batches.append(len(slots))
        rows = []
        for slot, tok in zip(slots, token_ids, strict=True):
            self._append(slot, [tok])
            rows.append(self._logits(slot))
        return np.stack(rows)

    def slot_length(self, slot: int) -> int:
        return self.lengths[slot]

    def reset(self, slot: int) -> None:
        self.resets.append(slot)
        self.lengths[slot] = 0
        self.tokens[slot] = []

    def close(self) -> None:
        self.closed = True


class TableEngine(_SlotEngine):
    """Logits = row ``last_token`` of a seeded random table; special ids (0..2) held low."""

    def __init__(
        self,
        vocab_size: int = 1024,
        *,
        max_slots: int = 4,
        capacity: int = 256,
        delay: float = 0.0,
        seed: int = 1234,
        model_type: str = "qwen2",
    ) -> None:
        super().__init__(
            vocab_size, max_slots=max_slots, capacity=capacity, delay=delay, model_type=model_type
        )
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((vocab_size, vocab_size)) * 3.0).astype(np.float32)
        self.table[:, :3] = -30.0  # never end by EOS on its own: length tests stay exact

    def _logits(self, slot: int) -> np.ndarray:
        return self.table[self.tokens[slot][-1]].copy()

    def greedy(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        """What greedy decoding must produce for ``prompt_ids``."""
        out: list[int] = []
        last = prompt_ids[-1]
        for _ in range(n):
            last = int(np.argmax(self.table[last]))
            out.append(last)
        return out


class ScriptedEngine(_SlotEngine):
    """Greedy decoding yields ``script`` token by token, then EOS."""

    def __init__(
        self, script: Sequence[int], vocab_size: int = 1024, *, capacity: int = 512, **kw: Any
    ) -> None:
        super().__init__(
            vocab_size,
            max_slots=kw.get("max_slots", 2),
            capacity=capacity,
            delay=kw.get("delay", 0.0),
            model_type=kw.get("model_type", "qwen3"),
        )
        self.script = list(script)
        self.prompt_len = [0] * self._info.max_slots

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        if self.lengths[slot] == 0:
            self.prompt_len[slot] = 0
        self.prompt_len[slot] += len(token_ids)
        return super().prefill(slot, token_ids)

    def _logits(self, slot: int) -> np.ndarray:
        step = self.lengths[slot] - self.prompt_len[slot]
        logits = np.zeros(self._info.vocab_size, dtype=np.float32)
        logits[self.script[step] if step < len(self.script) else 2] = 50.0
        return logits


def make_options(**overrides: Any) -> ServingOptions:
    base: dict[str, Any] = {
        "served_model_name": MODEL,
        "max_model_len": 256,
        "max_input_len": 128,
        "max_batch_size": 4,
        "max_queued_requests": 4,
        "queue_timeout": 30.0,
    }
    base.update(overrides)
    return ServingOptions(**base)


def make_app(serving: OpenAIServing) -> Litestar:
    async def stop() -> None:
        await serving.stop()

    return Litestar(
        route_handlers=[openai_router(lambda: serving)], on_startup=[serving.start], on_shutdown=[stop]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """uvicorn serving the app on a loopback port from a background thread."""

    def __init__(self, app: Litestar, *, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def live_server() -> Iterator[type[LiveServer]]:
    yield LiveServer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
