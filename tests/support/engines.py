"""Engines for tests: the one fake in the suite (the engine is the hardware seam).

Everything around an engine (scheduler, tokenizer, parsers, HTTP, catalog, leases) is real code
in every test; these stand in for the model where a test needs exact, cheap or slow outputs:

- :class:`TableEngine`: logits = row ``last_token`` of a seeded random table, so greedy output
  is a fixed function of the prompt (:meth:`TableEngine.greedy` says what it must be).
- :class:`TokenScriptEngine`: greedy decoding emits a given token sequence, then EOS.
- :class:`ReplyScriptEngine`: picks a reply by text found in the decoded prompt and emits its
  tokens (encoded with the bundle's real tokenizer, so markup such as ``<think>`` and
  ``<tool_call>`` reaches the server's detokenizer and parsers as a model would write it). A
  real ``cachesvc serve`` process loads it through the engine seam:
  ``EngineScript(...).to_env()`` sets ``CACHESVC_ENGINE_FACTORY`` to :data:`FACTORY`.

All share :class:`SlotEngine`'s KV bookkeeping (per-slot lengths, capacity checks) and an
optional per-call ``delay`` that makes work slow enough to be caught in flight.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.runtime.protocol import EngineInfo
from inference.serving.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ENV_VAR",
    "FACTORY",
    "SCRIPT_LOGIT",
    "EngineScript",
    "KVTableEngine",
    "Reply",
    "ReplyScriptEngine",
    "SlotEngine",
    "TableEngine",
    "TokenScriptEngine",
    "create_reply_engine",
]

#: The environment variable holding a :class:`ReplyScriptEngine`'s JSON script.
ENV_VAR = "CACHESVC_SCRIPTED_ENGINE"
#: What to put in ``CACHESVC_ENGINE_FACTORY`` to load a :class:`ReplyScriptEngine`.
FACTORY = "tests.support.engines:create_reply_engine"
#: Logit of a scripted token (all others are 0): greedy follows the script exactly, and sampling
#: at temperature 1 misses it with probability below ``vocab * exp(-SCRIPT_LOGIT)`` (~1e-10).
SCRIPT_LOGIT = 30.0


def fake_info(
    vocab_size: int,
    *,
    max_slots: int,
    capacity: int,
    model_type: str = "qwen2",
    max_input_len: int | None = None,
    eos_token_ids: tuple[int, ...] = (2,),
) -> EngineInfo:
    """EngineInfo for a fake engine (backend ``scripted``)."""
    return EngineInfo(
        model_type=model_type,
        vocab_size=vocab_size,
        max_slots=max_slots,
        max_input_len=capacity if max_input_len is None else max_input_len,
        max_kv_capacity=capacity,
        eos_token_ids=eos_token_ids,
        backend="scripted",
        precision="none",
    )


class SlotEngine:
    """KV bookkeeping shared by the fake engines; subclasses say what the logits are."""

    def __init__(self, info: EngineInfo, *, delay: float = 0.0) -> None:
        self._info = info
        self.delay = delay
        self.lengths = [0] * info.max_slots
        self.tokens: list[list[int]] = [[] for _ in range(info.max_slots)]
        self.decode_batches: list[int] = []
        self.prefill_chunks: list[int] = []
        self.extend_calls: list[int] = []
        self.resets: list[int] = []
        self.closed = False

    @property
    def info(self) -> EngineInfo:
        return self._info

    def _append(self, slot: int, ids: Sequence[int]) -> None:
        if self.lengths[slot] + len(ids) > self._info.max_kv_capacity:
            raise ValueError(
                f"slot {slot} would hold {self.lengths[slot] + len(ids)} positions, "
                f"more than max_kv_capacity={self._info.max_kv_capacity}"
            )
        self.lengths[slot] += len(ids)
        self.tokens[slot].extend(int(t) for t in ids)

    def _logits(self, slot: int) -> np.ndarray:
        raise NotImplementedError

    def _prefilled(self, slot: int) -> None:
        """Called after each prefill chunk is appended (before its logits are computed)."""

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay)
        self._append(slot, token_ids)
        self.prefill_chunks.append(len(token_ids))
        self._prefilled(slot)
        return self._logits(slot)

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        if len(slots) != len(token_ids):
            raise ValueError(f"decode got {len(slots)} slots but {len(token_ids)} tokens")
        if self.delay:
            time.sleep(self.delay)
        self.decode_batches.append(len(slots))
        rows = []
        for slot, tok in zip(slots, token_ids, strict=True):
            self._append(slot, [tok])
            rows.append(self._logits(slot))
        return np.stack(rows)

    def extend(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Speculative verification: one logits row per appended token (each as if decoded)."""
        if not token_ids:
            raise ValueError("extend needs at least one token")
        if self.lengths[slot] == 0:
            raise ValueError(f"slot {slot} is empty; prefill it before extending")
        if self.delay:
            time.sleep(self.delay)
        self.extend_calls.append(len(token_ids))
        rows = []
        for tok in token_ids:
            self._append(slot, [tok])
            rows.append(self._logits(slot))
        return np.stack(rows)

    def truncate(self, slot: int, n: int) -> None:
        if not 0 <= n <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of {self.lengths[slot]} positions to {n}")
        self.lengths[slot] = n
        del self.tokens[slot][n:]

    def slot_length(self, slot: int) -> int:
        return self.lengths[slot]

    def reset(self, slot: int) -> None:
        self.resets.append(slot)
        self.lengths[slot] = 0
        self.tokens[slot] = []

    def close(self) -> None:
        self.closed = True


class TableEngine(SlotEngine):
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
            fake_info(vocab_size, max_slots=max_slots, capacity=capacity, model_type=model_type), delay=delay
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


class KVTableEngine(TableEngine):
    """A :class:`TableEngine` with the KV operations (a ``KVEngine``); records ``copy_prefix`` calls."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.copies: list[tuple[int, int, int]] = []

    @property
    def kv_bytes_per_token(self) -> int:
        return 8

    def truncate(self, slot: int, n: int) -> None:
        self.lengths[slot] = n
        self.tokens[slot] = self.tokens[slot][:n]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.copies.append((src, dst, n))
        self.lengths[dst] = n
        self.tokens[dst] = self.tokens[src][:n]

    def export_kv(self, slot: int, start: int, n: int) -> np.ndarray:
        return np.asarray(self.tokens[slot][start : start + n], dtype=np.int64).reshape(1, 1, n)

    def import_kv(self, slot: int, start: int, kv: np.ndarray) -> None:
        self.tokens[slot] = self.tokens[slot][:start] + [int(t) for t in kv.reshape(-1)]
        self.lengths[slot] = len(self.tokens[slot])


class _ScriptedSlots(SlotEngine):
    """A slot engine whose greedy continuation after the prompt is a per-slot token list."""

    def __init__(self, info: EngineInfo, *, delay: float = 0.0) -> None:
        super().__init__(info, delay=delay)
        self.prompt_len = [0] * info.max_slots
        self._reply: list[list[int]] = [[] for _ in range(info.max_slots)]

    def _choose(self, slot: int) -> list[int]:
        raise NotImplementedError

    def _prefilled(self, slot: int) -> None:
        # The reply is chosen from everything prefilled so far (chunked prefill included).
        self.prompt_len[slot] = self.lengths[slot]
        self._reply[slot] = self._choose(slot)

    def _logits(self, slot: int) -> np.ndarray:
        step = self.lengths[slot] - self.prompt_len[slot]
        reply = self._reply[slot]
        logits = np.zeros(self._info.vocab_size, dtype=np.float32)
        logits[reply[step] if step < len(reply) else self._info.eos_token_ids[0]] = SCRIPT_LOGIT
        return logits

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self.prompt_len[slot] = 0
        self._reply[slot] = []


class TokenScriptEngine(_ScriptedSlots):
    """Greedy decoding yields ``script`` token by token, then EOS (id 2)."""

    def __init__(
        self, script: Sequence[int], vocab_size: int = 1024, *, capacity: int = 512, **kw: Any
    ) -> None:
        info = fake_info(
            vocab_size,
            max_slots=kw.get("max_slots", 2),
            capacity=capacity,
            model_type=kw.get("model_type", "qwen3"),
        )
        super().__init__(info, delay=kw.get("delay", 0.0))
        self.script = [int(t) for t in script]

    def _choose(self, slot: int) -> list[int]:
        return self.script


@dataclass(frozen=True)
class Reply:
    """One scripted reply for prompts containing ``when``: the token ids of ``text``, ``repeat`` times."""

    text: str
    when: str = ""
    repeat: int = 1

    def __post_init__(self) -> None:
        if not self.text:
            raise ValueError("Reply.text must not be empty")
        if self.repeat < 1:
            raise ValueError(f"Reply.repeat must be at least 1, got {self.repeat}")


@dataclass(frozen=True)
class EngineScript:
    """The whole script: replies in match order and a per-call delay in seconds."""

    replies: tuple[Reply, ...]
    delay: float = 0.0

    def __post_init__(self) -> None:
        if not self.replies:
            raise ValueError("EngineScript needs at least one reply")
        if self.delay < 0:
            raise ValueError(f"EngineScript.delay must be >= 0, got {self.delay}")

    def to_env(self) -> dict[str, str]:
        """Environment entries that make a ``cachesvc serve`` child run this script."""
        return {"CACHESVC_ENGINE_FACTORY": FACTORY, ENV_VAR: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> EngineScript:
        """Read the script from :data:`ENV_VAR`; a missing or malformed one says what to set."""
        raw = os.environ.get(ENV_VAR)
        if not raw:
            raise ValueError(f"{ENV_VAR} is not set; put EngineScript(...).to_env() into the environment")
        try:
            data = json.loads(raw)
            replies = tuple(Reply(**r) for r in data.pop("replies"))
            return cls(replies=replies, **data)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{ENV_VAR} is not a valid EngineScript JSON: {exc}") from exc


def _bundle_meta(bundle_dir: Path) -> tuple[str, int, int]:
    # The real bundle's engine.json carries the model type and built limits; serve with the same
    # ones so the server's parser choice and context checks match a real engine from this bundle.
    meta = json.loads((bundle_dir / "engine.json").read_text())
    return str(meta["model_type"]), int(meta["max_input_len"]), int(meta["max_kv_cache_capacity"])


class ReplyScriptEngine(_ScriptedSlots):
    """Greedy decoding replays the first reply whose ``when`` text occurs in the decoded prompt."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        script: EngineScript,
        *,
        model_type: str,
        max_slots: int,
        max_input_len: int,
        max_kv_capacity: int,
    ) -> None:
        """Encode every reply once; EOS is the tokenizer's first EOS id."""
        if not tokenizer.eos_token_ids:
            raise ValueError("the tokenizer has no EOS token; the scripted engine needs one to stop")
        info = fake_info(
            tokenizer.vocab_size,
            max_slots=max_slots,
            capacity=max_kv_capacity,
            max_input_len=max_input_len,
            model_type=model_type,
            eos_token_ids=tuple(tokenizer.eos_token_ids),
        )
        super().__init__(info, delay=script.delay)
        self._tok = tokenizer
        self._replies = [
            (r.when, tokenizer.encode(r.text, add_special_tokens=False) * r.repeat) for r in script.replies
        ]

    def _choose(self, slot: int) -> list[int]:
        text = self._tok.decode(self.tokens[slot])
        for when, ids in self._replies:
            if when in text:
                return ids
        return []  # no reply matches: answer with EOS at once


def create_reply_engine(bundle_dir: Path, *, max_slots: int) -> ReplyScriptEngine:
    """The ``CACHESVC_ENGINE_FACTORY`` callable: a reply-scripted engine over a real bundle.

    The bundle's ``engine.json`` gives the model type and built limits, so the server's parser
    choice and context checks match a real engine from this bundle; the tokenizer is the real one.
    """
    bundle_dir = Path(bundle_dir)
    meta = json.loads((bundle_dir / "engine.json").read_text())
    return ReplyScriptEngine(
        load_tokenizer(bundle_dir),
        EngineScript.from_env(),
        model_type=str(meta["model_type"]),
        max_slots=max_slots,
        max_input_len=int(meta["max_input_len"]),
        max_kv_capacity=int(meta["max_kv_cache_capacity"]),
    )
