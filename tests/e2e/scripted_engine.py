"""A scripted ``Engine`` for end-to-end tests, loaded into a real ``cachesvc serve`` process.

The server picks it up through its engine seam: ``CACHESVC_ENGINE_FACTORY=
tests.e2e.scripted_engine:create`` (with the repository root on ``PYTHONPATH``). What it says
comes from ``CACHESVC_SCRIPTED_ENGINE``, a JSON :class:`EngineScript`: a list of replies, each
chosen when its ``when`` text occurs in the decoded prompt (first match wins; ``""`` matches
every prompt). A reply's text is encoded with the bundle's real tokenizer, so the markup tokens
(``<think>``, ``<tool_call>``) and the server's detokenizer and parsers see exactly what a model
would have produced; after the reply the engine emits EOS.

Each step puts a logit of :data:`SCRIPT_LOGIT` on the scripted token and 0 elsewhere: greedy
decoding follows the script exactly, and sampling at temperature 1 misses it with probability
below ``vocab * exp(-SCRIPT_LOGIT)`` (~1e-10). ``delay`` seconds per engine call make a reply
slow enough to be caught in flight (queue-full and shutdown tests).

This is the one fake in the e2e suite: the engine is the hardware seam, everything around it
(app, scheduler, tokenizer, parsers, HTTP, catalog, leases) is the real code.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from inference.runtime.protocol import EngineInfo
from inference.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ENV_VAR", "FACTORY", "SCRIPT_LOGIT", "EngineScript", "Reply", "ScriptedEngine", "create"]

#: The environment variable holding the JSON script.
ENV_VAR = "CACHESVC_SCRIPTED_ENGINE"
#: What to put in ``CACHESVC_ENGINE_FACTORY`` to load this engine.
FACTORY = "tests.e2e.scripted_engine:create"
#: Logit of the scripted token (all others are 0).
SCRIPT_LOGIT = 30.0


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


class ScriptedEngine:
    """Implements ``inference.runtime.Engine``: greedy decoding replays the matching reply."""

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
        self._tok = tokenizer
        self._script = script
        self._eos = tokenizer.eos_token_ids[0]
        self._replies = [
            (r.when, tokenizer.encode(r.text, add_special_tokens=False) * r.repeat) for r in script.replies
        ]
        self._info = EngineInfo(
            model_type=model_type,
            vocab_size=tokenizer.vocab_size,
            max_slots=max_slots,
            max_input_len=max_input_len,
            max_kv_capacity=max_kv_capacity,
            eos_token_ids=tokenizer.eos_token_ids,
            backend="scripted",
            precision="none",
        )
        self._tokens: list[list[int]] = [[] for _ in range(max_slots)]
        self._prompt_len = [0] * max_slots
        self._reply: list[list[int]] = [[] for _ in range(max_slots)]

    @property
    def info(self) -> EngineInfo:
        """Static facts: the tokenizer's vocabulary, the bundle's limits."""
        return self._info

    def _pick(self, prompt: Sequence[int]) -> list[int]:
        text = self._tok.decode(prompt)
        for when, ids in self._replies:
            if when in text:
                return ids
        return []  # no reply matches: answer with EOS at once

    def _logits(self, slot: int) -> np.ndarray:
        generated = len(self._tokens[slot]) - self._prompt_len[slot]
        reply = self._reply[slot]
        target = reply[generated] if generated < len(reply) else self._eos
        logits = np.zeros(self._info.vocab_size, dtype=np.float32)
        logits[target] = SCRIPT_LOGIT
        return logits

    def _check_room(self, slot: int, n: int) -> None:
        if len(self._tokens[slot]) + n > self._info.max_kv_capacity:
            raise ValueError(
                f"slot {slot} would hold {len(self._tokens[slot]) + n} positions, "
                f"more than max_kv_capacity={self._info.max_kv_capacity}"
            )

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append prompt tokens; the reply is chosen from everything prefilled so far."""
        time.sleep(self._script.delay)
        self._check_room(slot, len(token_ids))
        self._tokens[slot].extend(token_ids)
        self._prompt_len[slot] = len(self._tokens[slot])
        self._reply[slot] = self._pick(self._tokens[slot])
        return self._logits(slot)

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token per slot; each row scores that slot's next scripted token."""
        if len(slots) != len(token_ids):
            raise ValueError(f"decode got {len(slots)} slots but {len(token_ids)} tokens")
        time.sleep(self._script.delay)
        for slot, token in zip(slots, token_ids, strict=True):
            self._check_room(slot, 1)
            self._tokens[slot].append(int(token))
        return np.stack([self._logits(s) for s in slots])

    def slot_length(self, slot: int) -> int:
        """Positions held by ``slot``."""
        return len(self._tokens[slot])

    def reset(self, slot: int) -> None:
        """Empty ``slot``."""
        self._tokens[slot] = []
        self._prompt_len[slot] = 0
        self._reply[slot] = []

    def close(self) -> None:
        """Nothing to release."""


def create(bundle_dir: Path, *, max_slots: int) -> ScriptedEngine:
    """The ``CACHESVC_ENGINE_FACTORY`` callable: a scripted engine over ``bundle_dir``'s tokenizer."""
    bundle_dir = Path(bundle_dir)
    model_type, max_input_len, max_kv = _bundle_meta(bundle_dir)
    return ScriptedEngine(
        load_tokenizer(bundle_dir),
        EngineScript.from_env(),
        model_type=model_type,
        max_slots=max_slots,
        max_input_len=max_input_len,
        max_kv_capacity=max_kv,
    )
