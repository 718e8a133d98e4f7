"""``--speculative-config``: the speculative-decoding method and its draft model, parsed from JSON
and validated; every error names the flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cachesvc.errors import ConfigError
from cachesvc.settings.rules import Invalid, is_int
from inference.build_profile import (
    CHAIN_SPECULATIVE_METHODS,
    METHODS_NEEDING_DRAFT_MODEL,
    METHODS_REFUSING_DRAFT_MODEL,
    METHODS_WITHOUT_DRAFT_MODEL,
    SPECULATIVE_METHODS,
)

#: Speculative methods whose ``num_speculative_tokens`` overrides ``--draft-step``.
METHODS_OVERRIDING_DRAFT_STEP = ("eagle3", "mtp", *CHAIN_SPECULATIVE_METHODS)
#: ``--speculative-config`` keys that only the ngram method reads.
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_SPEC_FLAG = "--speculative-config"
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", *_NGRAM_KEYS)
SPEC_EXAMPLE = '{"method": "eagle3", "model": "org/draft-model", "num_speculative_tokens": 3}'


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            # json.loads would silently keep the last one; a doubled key is a typo to report.
            raise ConfigError(_SPEC_FLAG, f"key {key!r} appears more than once")
        seen[key] = value
    return seen


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: the speculative-decoding method and its draft model."""

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                _SPEC_FLAG, f"'method' must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        tokens = self.num_speculative_tokens
        if tokens is not None and (not is_int(tokens) or tokens <= 0):
            raise ConfigError(
                _SPEC_FLAG, f"'num_speculative_tokens' must be a positive integer, got {tokens!r}"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ConfigError(
                _SPEC_FLAG, f"'model' must be a non-blank draft model id or directory, got {self.model!r}"
            )
        if self.model is None and self.method in METHODS_NEEDING_DRAFT_MODEL:
            raise ConfigError(
                _SPEC_FLAG,
                f'method {self.method!r} needs a draft model: add "model": "<hf-id-or-dir>" '
                f"(only {' and '.join(METHODS_WITHOUT_DRAFT_MODEL)} run without one)",
            )
        if self.model is not None and self.method in METHODS_REFUSING_DRAFT_MODEL:
            raise ConfigError(_SPEC_FLAG, f"method {self.method!r} uses no draft model: drop 'model'")
        for key in _NGRAM_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if self.method != "ngram":
                raise ConfigError(_SPEC_FLAG, f"'{key}' applies to method 'ngram' only")
            if not is_int(value) or value <= 0:
                raise ConfigError(_SPEC_FLAG, f"'{key}' must be a positive integer, got {value!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ConfigError(
                _SPEC_FLAG, f"'prompt_lookup_min' ({low}) must not exceed 'prompt_lookup_max' ({high})"
            )

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> SpeculativeConfig:
        """Parse the flag's JSON object text (or an already-decoded mapping); errors name the flag."""
        data: object
        if isinstance(value, str):
            try:
                data = json.loads(value, object_pairs_hook=_reject_duplicate_keys)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    _SPEC_FLAG, f"must be a JSON object such as {SPEC_EXAMPLE}; invalid JSON: {exc}"
                ) from None
        else:
            data = value
        if not isinstance(data, Mapping):
            raise ConfigError(
                _SPEC_FLAG, f"must be a JSON object such as {SPEC_EXAMPLE}, got {type(data).__name__}"
            )
        unknown = sorted(str(k) for k in data if k not in _SPEC_KEYS)
        if unknown:
            raise ConfigError(_SPEC_FLAG, f"unknown key {unknown[0]!r} (known: {', '.join(_SPEC_KEYS)})")
        if "method" not in data:
            raise ConfigError(_SPEC_FLAG, f"'method' is required (one of {', '.join(SPECULATIVE_METHODS)})")
        return cls(
            method=data["method"],
            num_speculative_tokens=data.get("num_speculative_tokens"),
            model=data.get("model"),
            prompt_lookup_min=data.get("prompt_lookup_min"),
            prompt_lookup_max=data.get("prompt_lookup_max"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The set keys only, in the flag's JSON shape."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_json(self) -> str:
        """Flag text that :meth:`parse` turns back into an equal object."""
        return json.dumps(self.to_dict(), sort_keys=True)


def speculative_arg(text: str) -> SpeculativeConfig:
    """The flag's argparse ``type=``: the JSON text parsed, an error in argparse's words."""
    try:
        return SpeculativeConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


def speculative_rule(value: object) -> SpeculativeConfig | None:
    """The setting's rule: a parsed config or None (JSON text goes through ``parse`` first)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    raise Invalid(
        f"must be a SpeculativeConfig or None, got {type(value).__name__} "
        "(use ServeConfig.from_mapping or SpeculativeConfig.parse for JSON text)"
    )
