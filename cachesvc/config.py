"""Launch configuration of ``cachesvc serve`` (and of the app): every flag, validated, frozen.

The flags keep the names of the OpenAI-compatible server cachesvc replaces, so existing launch
scripts keep working, and its defaults except two that suit a server rather than a demo:
``--max-batch-size`` is 4 (was 1) and context reuse is on (``--no-enable-context-reuse`` turns
it off; ``--enable-context-reuse`` still parses). ``--help`` says why at each. A few flags of our
own (``--catalog-url``, ``--admin-api-key``, ``--backend``, ``--precision``) configure the cache
and the builder.

Three ways in, one set of rules:

* ``ServeConfig(...)`` -- direct construction validates in ``__post_init__``;
* ``ServeConfig.from_mapping({...})`` -- python names (``max_batch_size``) or flag names
  (``max-batch-size``); unknown keys are rejected by name; unambiguous conversions only
  (``str`` -> ``Path`` for ``cache_dir``, a JSON string or a dict for ``speculative_config``,
  integral floats for integer options, ints for float options);
* argparse -- :func:`add_serve_arguments` / :func:`add_build_arguments` add the flags and
  :meth:`ServeConfig.from_namespace` builds the config from the parsed namespace.

Every error is a :class:`cachesvc.errors.ConfigError` whose ``field`` is the CLI flag
(``--max-batch-size``; the positional is ``model``), e.g.
``--max-batch-size: must be a positive integer, got 0``. Argparse-level errors (a value that
is not a number, a choice that does not exist, a value out of range) name the flag too:
``argument --port: must be an integer between 1 and 65535, got 0``. Rules that span several
flags (``--max-input-len`` <= ``--max-kv-cache-capacity``, the context-cache flags needing
context reuse on) are checked when the config is built.

Speculative decoding: ``--speculative-config`` is a JSON object with only the keys ``method``
(required; eagle3, mtp, dflash, jetspec, dspark, ngram, draft_model), ``model`` (the draft
checkpoint, required for every method except mtp and ngram, refused for ngram),
``num_speculative_tokens`` (positive int) and, for ngram only, ``prompt_lookup_min`` /
``prompt_lookup_max`` (positive ints, min <= max; vLLM's n-gram window). For eagle3, mtp,
ngram and draft_model, ``num_speculative_tokens`` overrides ``--draft-step`` (see
:attr:`ServeConfig.effective_draft_step`); for ngram and draft_model that is ``k``, the tokens
guessed and verified per step.

Flags kept for compatibility that would have no effect in this version are refused, each with
one line that names it (``cachesvc`` exits 2): ``--draft-top-k`` and ``--verify-tree-size`` (they
shape a draft *tree*; ngram and draft_model, the methods that speculate here, verify one chain),
``--draft-step`` without one of those methods, ``--context-cache-recurrent-snapshot-pool-bytes``
other than 0 (these models keep no recurrent state) and ``--allowed-local-media-path`` (requests
carry no media). Their defaults and the values ``--help`` documents still parse.

Settings come in five groups (:class:`HttpSettings`, :class:`CacheSettings`,
:class:`BuildSettings`, :class:`ServingSettings`, :class:`FleetSettings`; ``config.http``,
``config.serving``, ...), one frozen view each over the flat, validated :class:`ServeConfig`. A
new setting is a field of ``ServeConfig`` (with its rule in ``_RULES`` and its flag in
``add_serve_arguments``) and of exactly one group.

Environment: every ``CACHESVC_*`` variable is declared in :data:`ENVIRONMENT` (name, default,
help, the flag or setting it stands for) and read here, through :func:`env_value`, and nowhere
else in ``cachesvc`` or ``inference`` (``tests/service/test_settings_env.py`` checks the source), with
one exception: ``CACHESVC_CRASH_AT``, a test hook read by :mod:`cachesvc.crashpoints` at the
bottom layer, which cannot import this module. Settings without a flag
(``CACHESVC_SHUTDOWN_GRACE_SECONDS``, ``CACHESVC_PREFILL_CHUNK``, ``CACHESVC_DISABLE_GPU``) are
fields of ``ServeConfig`` whose default is read from the environment when a config is built; an
invalid value is a :class:`~cachesvc.errors.ConfigError` naming the variable.

The cache directory defaults to ``$CACHESVC_CACHE_DIR`` or ``~/.cache/cachesvc`` (read when a
config is built, not at import) and the catalog to ``sqlite:///<cache-dir>/catalog.sqlite3``
(:attr:`ServeConfig.catalog_url_resolved`). ``repr()`` masks the API keys and any password in
the catalog URL, so a config can be logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cachesvc import crashpoints
from cachesvc.errors import ConfigError
from cachesvc.profiles import ProfileRequest
from inference.build_profile import (
    BACKEND_CHOICES,
    CHAIN_SPECULATIVE_METHODS,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    DEFAULT_TASK,
    KERNEL_MODES,
    KV_CACHE_DTYPES,
    METHODS_NEEDING_DRAFT_MODEL,
    METHODS_REFUSING_DRAFT_MODEL,
    METHODS_WITHOUT_DRAFT_MODEL,
    POOLING_METHODS,
    PRECISION_CHOICES,
    SHAPE_LIMITS,
    SPECULATIVE_METHODS,
    TASKS,
    ProfileError,
    check_shape,
    check_shapes,
)
from inference.context_cache import DEFAULT_MAX_BYTES as DEFAULT_RECORD_POOL_BYTES
from inference.context_disk import DEFAULT_DISK_BYTES
from inference.openai.reasoning import REASONING_PARSER_CHOICES as REASONING_PARSERS
from inference.openai.tool_parsers import TOOL_PARSER_CHOICES as TOOL_CALL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")

#: Speculative methods whose ``num_speculative_tokens`` overrides ``--draft-step``.
METHODS_OVERRIDING_DRAFT_STEP = ("eagle3", "mtp", *CHAIN_SPECULATIVE_METHODS)
#: ``--speculative-config`` keys that only the ngram method reads.
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")

CACHE_DIR_ENV = "CACHESVC_CACHE_DIR"
SHUTDOWN_GRACE_ENV = "CACHESVC_SHUTDOWN_GRACE_SECONDS"
PREFILL_CHUNK_ENV = "CACHESVC_PREFILL_CHUNK"
DISABLE_GPU_ENV = "CACHESVC_DISABLE_GPU"
ENGINE_FACTORY_ENV = "CACHESVC_ENGINE_FACTORY"
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_SPEC_FLAG = "--speculative-config"
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", *_NGRAM_KEYS)
_SPEC_EXAMPLE = '{"method": "eagle3", "model": "org/draft-model", "num_speculative_tokens": 3}'
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_URL_PASSWORD_RE = re.compile(r"(://[^:/@]*:)[^@/]*@")
_SECRET_FIELDS = frozenset({"api_key", "admin_api_key"})
_CONTEXT_CACHE_FIELDS = (
    "context_cache_max_records",
    "context_cache_recurrent_snapshot_pool_bytes",
    "context_cache_partial_kv_snapshot_pool_bytes",
    "context_cache_disk_bytes",
)


# --- the environment -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvVar:
    """One ``CACHESVC_*`` environment variable."""

    name: str
    #: Its value when unset or blank, as text.
    default: str
    help: str
    #: The flag that wins over it (``--cache-dir`` over ``CACHESVC_CACHE_DIR``), if any.
    flag: str | None = None
    #: The :class:`ServeConfig` field it sets, if it is a launch setting.
    setting: str | None = None


#: Every ``CACHESVC_*`` variable cachesvc reads (the test suite's own variables are not cachesvc's
#: and are not declared here).
ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar(
        CACHE_DIR_ENV,
        "~/.cache/cachesvc",
        "cache root (read when a config is built, not at import)",
        flag="--cache-dir",
        setting="cache_dir",
    ),
    EnvVar(
        SHUTDOWN_GRACE_ENV,
        "30",
        "seconds in-flight requests get to finish after SIGTERM/SIGINT; then what is left is failed "
        "with a proper answer (503 server_unavailable, or an error chunk and [DONE] in a stream); "
        "for tests and orchestrators with a shorter kill timeout",
        setting="shutdown_grace_seconds",
    ),
    EnvVar(
        PREFILL_CHUNK_ENV,
        "256",
        "prompt tokens prefilled per scheduler step: smaller chunks let running streams decode more "
        "often while a long prompt is prefilled; larger ones prefill that prompt a little faster",
        setting="prefill_chunk",
    ),
    EnvVar(
        DISABLE_GPU_ENV,
        "",
        "any non-empty value: use no GPU (no tensorrt builder is offered, --backend tensorrt is "
        "refused and TensorRT bundles are stale on this node)",
        setting="gpu_disabled",
    ),
    EnvVar(
        ENGINE_FACTORY_ENV,
        "",
        "test only: 'module:callable' that loads the engines of a spawned `cachesvc serve` "
        "(the engine seam; the callable takes (bundle_dir, *, max_slots) and returns an Engine)",
    ),
    EnvVar(
        crashpoints.ENV_VAR,
        "",
        "test only: SIGKILL the process at the named crash point (see cachesvc.crashpoints, "
        "which reads it itself: it sits below every other module)",
    ),
)
_ENV_BY_NAME = {var.name: var for var in ENVIRONMENT}
#: Settings with a variable and no flag: errors in their values name the variable.
_ENV_SETTINGS = {var.setting: var.name for var in ENVIRONMENT if var.setting and var.flag is None}


def env_value(name: str) -> str:
    """The value of the ``CACHESVC_*`` variable ``name``, stripped, or its default when unset or
    blank. The one place that reads them (``name`` must be declared in :data:`ENVIRONMENT`)."""
    var = _ENV_BY_NAME[name]
    return os.environ.get(name, "").strip() or var.default


def engine_factory_spec() -> str | None:
    """``CACHESVC_ENGINE_FACTORY`` (test only; see :data:`ENVIRONMENT`), None when unset."""
    return env_value(ENGINE_FACTORY_ENV) or None


def default_cache_dir() -> Path:
    """``$CACHESVC_CACHE_DIR`` when set and non-empty, else ``~/.cache/cachesvc`` (expanded)."""
    return Path(env_value(CACHE_DIR_ENV)).expanduser()


def _from_env(name: str, convert: Callable[[str], Any], what: str) -> Callable[[], Any]:
    """A field's default factory: variable ``name`` (its default when unset) as ``convert`` makes it."""

    def read() -> Any:
        text = env_value(name)
        try:
            return convert(text)
        except ValueError:
            raise ConfigError(name, f"must be {what}, got {text!r}") from None

    return read


def _gpu_disabled_from_env() -> bool:
    return bool(env_value(DISABLE_GPU_ENV))


def field_default(name: str) -> Any:
    """The default of a :class:`ServeConfig` field (what ``--help`` shows)."""
    return _FIELD_DEFAULTS[name]


def flag_for(name: str) -> str:
    """The CLI flag of a :class:`ServeConfig` field (``max_batch_size`` -> ``--max-batch-size``);
    for a setting without a flag, its environment variable (``prefill_chunk`` ->
    ``CACHESVC_PREFILL_CHUNK``)."""
    if name in _ENV_SETTINGS:
        return _ENV_SETTINGS[name]
    return "model" if name == "model" else "--" + name.replace("_", "-")


#: Neutral field names (used by the domain and the HTTP API) whose flag is not ``flag_for(name)``.
_FIELD_FLAGS = {
    "max_size_bytes": "--engine-cache-max-size-gb",
    "speculative_method": "--speculative-config",
    "draft_model": "--speculative-config",
    "draft_digest": "--speculative-config",
}


def cli_message(exc: ConfigError) -> str:
    """``exc`` in the words of the command line: a neutral field (``backend``) becomes its flag."""
    field = exc.field
    if field.startswith("--") or field == "model":
        return str(exc)
    flag = _FIELD_FLAGS.get(field)
    if flag is None and field in _RULES:
        flag = flag_for(field)
    return f"{flag}: {exc.detail}" if flag else str(exc)


class _Invalid(Exception):
    """A value breaks a rule; the caller attaches the flag (ConfigError or ArgumentTypeError)."""


# --- value rules, shared by ServeConfig.__post_init__ and the argparse type functions -------------


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a batch size is a bug, not a request for 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_rule(minimum: int, maximum: int | None = None) -> Callable[[object], int]:
    if maximum is not None:
        if minimum == 1 and maximum == 65535:
            what = f"an integer between {minimum} and {maximum}"
        else:
            what = f"a {'positive' if minimum == 1 else 'non-negative'} integer <= {maximum}"
    else:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"

    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"must be {what}, got {value!r} ({type(value).__name__})")
        if value < minimum or (maximum is not None and value > maximum):
            raise _Invalid(f"must be {what}, got {value}")
        return value

    return check


def _optional(rule: Callable[[object], Any]) -> Callable[[object], Any]:
    def check(value: object) -> Any:
        return None if value is None else rule(value)

    return check


def _keep_alive(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"must be seconds (-1 = never unload, 0 = unload when idle), got {value!r}")
    number = float(value)
    if not math.isfinite(number) or (number < 0 and number != -1):
        raise _Invalid(f"must be -1 (never unload), 0 (unload when idle) or positive seconds, got {value!r}")
    return number


def _positive_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"must be a finite number greater than 0, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise _Invalid(f"must be a finite number greater than 0, got {value!r}")
    return number


def _non_negative_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"must be a finite number, 0 or more, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise _Invalid(f"must be a finite number, 0 or more, got {value!r}")
    return number


def _choice_rule(choices: tuple[str, ...]) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise _Invalid(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _text_rule(what: str, *, optional: bool) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value.strip():
            raise _Invalid(f"must be {what}, got {value!r}")
        return value

    return check


def _list_rule(what: str) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not _split_list(value):
            raise _Invalid(f"must be {what}, got {value!r}")
        return value

    return check


def _split_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


#: A LoRA adapter's served name: what a request's ``model`` names to run it.
_LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
DEFAULT_MAX_LORAS = 4


def _lora_modules_rule(value: object) -> tuple[str, ...]:
    """vLLM's ``--lora-modules``: ``NAME=PATH`` or ``{"name": ..., "path": ...}`` each; returned
    as ``NAME=PATH`` strings, names unique."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise _Invalid(f"must be a list of NAME=PATH entries, got {value!r}")
    out: list[str] = []
    names: set[str] = set()
    for item in value:
        name, path = _lora_module(item)
        if name in names:
            raise _Invalid(f"names the adapter {name!r} twice")
        names.add(name)
        out.append(f"{name}={path}")
    return tuple(out)


def _lora_module(item: object) -> tuple[str, str]:
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            obj = json.loads(item)
        except ValueError:
            raise _Invalid(f"{item!r} is not valid JSON; give NAME=PATH or "
                           '{"name": NAME, "path": PATH}') from None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("path"), str)):
            raise _Invalid(f'{item!r} needs string "name" and "path" keys')
        name, path = obj["name"], obj["path"]
    elif isinstance(item, str) and "=" in item:
        name, _, path = item.partition("=")
    else:
        raise _Invalid(f"{item!r} is not NAME=PATH (a served name, then the PEFT adapter's directory "
                       "or hub id)")
    name, path = name.strip(), path.strip()
    if not _LORA_NAME_RE.match(name):
        raise _Invalid(f"adapter name {name!r} must be 1-128 letters, digits or ._:/- (first a letter "
                       "or digit)")
    if not path:
        raise _Invalid(f"adapter {name!r} has no path")
    return name, path


def lora_module_pairs(modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """``--lora-modules`` as (served name, adapter source) pairs."""
    return [(m.partition("=")[0], m.partition("=")[2]) for m in modules]


def _bool_rule(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _path_rule(value: object) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(os.fspath(value)).strip():
        raise _Invalid(f"must be a directory path, got {value!r}")
    return Path(value).expanduser()


def _catalog_url_rule(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _URL_RE.match(value):
        raise _Invalid(
            "must be an SQLAlchemy database URL such as sqlite:////var/lib/cachesvc/catalog.sqlite3 "
            f"or postgresql+psycopg://user@host/db, got {value!r}"
        )
    return value


def _speculative_rule(value: object) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    raise _Invalid(
        f"must be a SpeculativeConfig or None, got {type(value).__name__} "
        "(use ServeConfig.from_mapping or SpeculativeConfig.parse for JSON text)"
    )


def _shape_rule(name: str) -> Callable[[object], int]:
    def check(value: object) -> int:
        try:
            return check_shape(name, value)
        except ProfileError as exc:
            raise _Invalid(exc.detail) from None

    return check


def _flagged(exc: ProfileError) -> ConfigError:
    """A profile rule's error in the words of the command line (field names become flags)."""
    detail = exc.detail
    for name in SHAPE_LIMITS:
        detail = re.sub(rf"\b{name}\b", flag_for(name), detail)
    return ConfigError(flag_for(exc.field), detail)


_positive_int = _int_rule(1)
_non_negative_int = _int_rule(0)

#: field name -> rule; a rule returns the (normalised) value or raises _Invalid.
_RULES: dict[str, Callable[[object], Any]] = {
    "model": _text_rule("a Hugging Face model id or a checkpoint directory (non-blank)", optional=True),
    "host": _text_rule("a non-blank host name or IP address", optional=False),
    "port": _int_rule(1, 65535),
    "served_model_name": _text_rule("a non-blank model name", optional=True),
    "api_key": _text_rule("a non-blank key", optional=True),
    "reasoning_parser": _choice_rule(REASONING_PARSERS),
    "tool_call_parser": _choice_rule(TOOL_CALL_PARSERS),
    "enable_auto_tool_choice": _bool_rule,
    "max_queued_requests": _non_negative_int,
    "queue_timeout": _positive_float,
    "max_schema_bytes": _positive_int,
    "max_schema_properties": _positive_int,
    "grammar_compile_timeout": _positive_float,
    "max_loaded_models": _positive_int,
    "memory_budget_gb": _optional(_positive_float),
    "keep_alive": _keep_alive,
    "allowed_local_media_path": _text_rule("a non-blank directory path", optional=True),
    "log_level": _choice_rule(LOG_LEVELS),
    "cache_dir": _path_rule,
    "engine_cache_max_size_gb": _positive_float,
    "clear_engine_cache": _bool_rule,
    "max_input_len": _shape_rule("max_input_len"),
    "max_batch_size": _shape_rule("max_batch_size"),
    "max_kv_cache_capacity": _shape_rule("max_kv_cache_capacity"),
    "draft_top_k": _optional(_positive_int),
    "draft_step": _optional(_positive_int),
    "verify_tree_size": _optional(_positive_int),
    "speculative_config": _speculative_rule,
    "enable_context_reuse": _bool_rule,
    "enable_lora": _bool_rule,
    "lora_modules": _lora_modules_rule,
    "max_loras": _int_rule(1, 1024),
    "context_cache_max_records": _int_rule(0, INT32_MAX),
    "context_cache_recurrent_snapshot_pool_bytes": _int_rule(0, INT64_MAX),
    "context_cache_partial_kv_snapshot_pool_bytes": _int_rule(0, INT64_MAX),
    "context_cache_disk_bytes": _int_rule(0, INT64_MAX),
    "catalog_url": _catalog_url_rule,
    "node_name": _text_rule("a non-blank node name", optional=True),
    "heartbeat_seconds": _positive_float,
    "event_retention_days": _non_negative_float,
    "event_retention_rows": _int_rule(0, INT64_MAX),
    "admin_api_key": _text_rule("a non-blank key", optional=True),
    "allowed_hosts": _list_rule("host names or IP addresses (comma-separated; '*' allows any)"),
    "allowed_model_roots": _list_rule("directories (comma-separated)"),
    "cors_allowed_origins": _list_rule("origins such as https://app.example.com (comma-separated)"),
    "backend": _choice_rule(BACKEND_CHOICES),
    "precision": _choice_rule(PRECISION_CHOICES),
    "kernels": _choice_rule(KERNEL_MODES),
    "kv_cache_dtype": _choice_rule(KV_CACHE_DTYPES),
    "task": _choice_rule(TASKS),
    "pooling": _optional(_choice_rule(POOLING_METHODS)),
    "gpu_disabled": _bool_rule,
    "prefill_chunk": _positive_int,
    "shutdown_grace_seconds": _non_negative_float,
}

#: Flags accepted for compatibility (launch scripts of the replaced server) that would have no
#: effect in this version: field -> why. Given with a value other than the default, they are
#: refused (``--draft-step`` only without a method that reads it; see ServeConfig.__post_init__).
_NO_EFFECT = {
    "draft_top_k": "it shapes a draft tree, and no speculative method here decodes one (ngram and "
    "draft_model verify one chain)",
    "verify_tree_size": "it shapes a draft tree, and no speculative method here decodes one (ngram "
    "and draft_model verify one chain)",
    "context_cache_recurrent_snapshot_pool_bytes": "the models served here keep no recurrent state",
    "allowed_local_media_path": "requests carry no media here",
}


# --- speculative decoding ------------------------------------------------------------------------


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
        if tokens is not None and (not _is_int(tokens) or tokens <= 0):
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
            if not _is_int(value) or value <= 0:
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
                    _SPEC_FLAG, f"must be a JSON object such as {_SPEC_EXAMPLE}; invalid JSON: {exc}"
                ) from None
        else:
            data = value
        if not isinstance(data, Mapping):
            raise ConfigError(
                _SPEC_FLAG, f"must be a JSON object such as {_SPEC_EXAMPLE}, got {type(data).__name__}"
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


def _speculative_arg(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


# --- the config ----------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class ServeConfig:
    """Every launch option of ``cachesvc serve``; validated on construction, immutable."""

    model: str | None = None
    # HTTP
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    enable_auto_tool_choice: bool = False
    max_queued_requests: int = 16
    queue_timeout: float = 600.0
    max_schema_bytes: int = 256 * 1024
    max_schema_properties: int = 2048
    grammar_compile_timeout: float = 10.0
    max_loaded_models: int = 3
    memory_budget_gb: float | None = None
    keep_alive: float = 300.0
    allowed_local_media_path: str | None = None
    log_level: str = "info"
    # build / runtime
    cache_dir: Path = field(default_factory=default_cache_dir)
    engine_cache_max_size_gb: float = 50.0
    clear_engine_cache: bool = False
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: int = DEFAULT_MAX_KV_CACHE_CAPACITY
    draft_top_k: int | None = None
    draft_step: int | None = None
    verify_tree_size: int | None = None
    speculative_config: SpeculativeConfig | None = None
    # On by default, unlike the replaced server: see the "runtime" group of ``--help``.
    enable_context_reuse: bool = True
    #: LoRA: the bundle takes adapters (implied by ``lora_modules``); served names of adapters.
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    context_cache_max_records: int = 1024
    context_cache_recurrent_snapshot_pool_bytes: int = 0
    context_cache_partial_kv_snapshot_pool_bytes: int = 0
    context_cache_disk_bytes: int = DEFAULT_DISK_BYTES  # ours: records kept across restarts
    # ours
    catalog_url: str | None = None
    node_name: str | None = None
    heartbeat_seconds: float = 5.0
    event_retention_days: float = 7.0
    event_retention_rows: int = 100_000
    admin_api_key: str | None = None
    allowed_hosts: str | None = None
    allowed_model_roots: str | None = None
    cors_allowed_origins: str | None = None
    backend: str = "auto"
    precision: str = "auto"
    kernels: str = "auto"
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    task: str = DEFAULT_TASK
    pooling: str | None = None
    # environment only (no flag): see ENVIRONMENT
    gpu_disabled: bool = field(default_factory=_gpu_disabled_from_env)
    prefill_chunk: int = field(
        default_factory=_from_env(PREFILL_CHUNK_ENV, int, "a positive integer")
    )
    shutdown_grace_seconds: float = field(
        default_factory=_from_env(SHUTDOWN_GRACE_ENV, float, "seconds (a number, 0 or more)")
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                normalised = _RULES[f.name](value)
            except _Invalid as exc:
                raise ConfigError(flag_for(f.name), str(exc)) from None
            if normalised is not value:
                # Frozen: normalisation (int -> float, ~ expansion) happens once, here.
                object.__setattr__(self, f.name, normalised)
        try:
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
        except ProfileError as exc:
            raise _flagged(exc) from None
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ConfigError(
                "--admin-api-key",
                "must differ from --api-key: every completion client would hold the admin key",
            )
        spec = self.speculative_config
        if spec is not None and spec.method in CHAIN_SPECULATIVE_METHODS:
            for name in ("draft_top_k", "verify_tree_size"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        flag_for(name),
                        f"shapes a draft tree (eagle3, dflash, ...); {spec.method} verifies one chain "
                        f"of --draft-step tokens: drop {flag_for(name)}",
                    )
        if not self.enable_context_reuse:
            for name in _CONTEXT_CACHE_FIELDS:
                default = _FIELD_DEFAULTS[name]
                if getattr(self, name) != default:
                    raise ConfigError(
                        flag_for(name),
                        f"applies only with context reuse (got {getattr(self, name)}, default "
                        f"{default}), which --no-enable-context-reuse turns off; drop "
                        f"--no-enable-context-reuse or drop {flag_for(name)}",
                    )
        self._check_task()
        self._check_lora()
        self._refuse_no_effect()

    def _check_lora(self) -> None:
        if not self.lora_enabled:
            return
        if len(self.lora_modules) > self.max_loras:
            raise ConfigError("--lora-modules", f"names {len(self.lora_modules)} adapters but --max-loras is "
                              f"{self.max_loras}; raise --max-loras or name fewer")
        if self.task == "embed":
            raise ConfigError("--lora-modules" if self.lora_modules else "--enable-lora",
                              "LoRA adapters run on text models; drop them or --task embed")
        if self.backend == "tensorrt":
            raise ConfigError("--backend", "LoRA adapters run on the onnxruntime backend; drop --backend")
        names = {m.partition("=")[0] for m in self.lora_modules}
        taken = names & {self.served_name, self.served_model_name}
        if taken:
            raise ConfigError("--lora-modules", f"adapter name {sorted(taken)[0]!r} is the base model's "
                              "served name; give the adapter a name of its own")

    def _check_task(self) -> None:
        """``--pooling`` needs ``--task embed``; an embedding bundle is fp32 on onnxruntime,
        without speculation."""
        if self.task != "embed":
            if self.pooling is not None:
                raise ConfigError("--pooling", "applies only with --task embed; add it or drop --pooling")
            return
        if self.precision not in ("auto", "fp32"):
            raise ConfigError("--precision", f"--task embed builds fp32 only, got {self.precision}; "
                              "drop --precision or give fp32")
        if self.backend == "tensorrt":
            raise ConfigError("--backend", "--task embed runs on the onnxruntime backend; drop --backend")
        if self.speculative_config is not None:
            raise ConfigError("--speculative-config", "speculative decoding generates tokens; an "
                              "embedding model (--task embed) generates none: drop it")

    def _refuse_no_effect(self) -> None:
        """A compatibility flag that would change nothing is refused, naming the flag."""
        for name, why in _NO_EFFECT.items():
            if getattr(self, name) != _FIELD_DEFAULTS[name]:
                raise ConfigError(
                    flag_for(name), f"has no effect in this version ({why}): drop {flag_for(name)}"
                )
        spec = self.speculative_config
        if self.draft_step is not None and (spec is None or spec.method not in CHAIN_SPECULATIVE_METHODS):
            raise ConfigError(
                "--draft-step",
                f"has no effect in this version (only {' and '.join(CHAIN_SPECULATIVE_METHODS)} speculate "
                "here, and --speculative-config names neither): drop --draft-step",
            )

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRET_FIELDS and value is not None:
                parts.append(f"{f.name}='***'")
            elif f.name == "catalog_url" and value is not None:
                masked = _URL_PASSWORD_RE.sub(r"\1***@", value)
                parts.append(f"{f.name}={masked!r}")
            else:
                parts.append(f"{f.name}={value!r}")
        return f"ServeConfig({', '.join(parts)})"

    # --- constructors ---

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> ServeConfig:
        """Build from python names or flag names; unknown keys are rejected by name."""
        known = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise ConfigError(repr(key), f"option names must be strings, got {type(key).__name__}")
            name = key.removeprefix("--").replace("-", "_")
            if name not in _RULES:
                hint = difflib.get_close_matches(name, known, n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
                raise ConfigError(key, f"unknown option {key!r}{suggestion} (known: {', '.join(known)})")
            if name in values:
                raise ConfigError(flag_for(name), f"given twice (as {given_as[name]!r} and {key!r})")
            given_as[name] = key
            values[name] = _convert(name, value)
        cache_dir = values.pop("cache_dir", None)
        if cache_dir is not None:
            values["cache_dir"] = cache_dir
        return cls(**values)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> ServeConfig:
        """Build from parsed arguments; attributes that are not options (subcommand state) are ignored.

        Options the parser did not define keep their defaults, so a namespace from a parser set
        up with :func:`add_build_arguments` alone works too.
        """
        given = vars(namespace)
        values = {name: given[name] for name in _RULES if name in given}
        if values.get("cache_dir") is None:
            # The parser's None means "the default", which depends on the environment.
            values.pop("cache_dir", None)
        else:
            values["cache_dir"] = Path(values["cache_dir"])
        return cls(**values)

    # --- the groups ---

    def _group(self, cls: type[_G]) -> _G:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @property
    def http(self) -> HttpSettings:
        """Where the server listens, who may call it, what it logs."""
        return self._group(HttpSettings)

    @property
    def cache(self) -> CacheSettings:
        """The engine cache: directory, catalog, size cap."""
        return self._group(CacheSettings)

    @property
    def build(self) -> BuildSettings:
        """What a prepare builds: the model and its build profile."""
        return self._group(BuildSettings)

    @property
    def serving(self) -> ServingSettings:
        """How the models are served: parsers, queues, limits, the pool, context reuse, drain."""
        return self._group(ServingSettings)

    @property
    def fleet(self) -> FleetSettings:
        """This node in a fleet sharing one catalog: name, heartbeat, audit-event retention."""
        return self._group(FleetSettings)

    # --- derived values ---

    @property
    def catalog_url_resolved(self) -> str:
        """``--catalog-url``, or ``sqlite:///<cache-dir>/catalog.sqlite3`` when unset."""
        if self.catalog_url is not None:
            return self.catalog_url
        return f"sqlite:///{self.cache_dir / 'catalog.sqlite3'}"

    @property
    def node_name_resolved(self) -> str:
        """``--node-name``, or this machine's host name."""
        return self.node_name or socket.gethostname()

    @property
    def engine_cache_max_size_bytes(self) -> int:
        """The cache size cap in bytes (decimal GB: 1 GB = 10**9 bytes)."""
        return int(self.engine_cache_max_size_gb * 1e9)

    @property
    def effective_draft_step(self) -> int | None:
        """``num_speculative_tokens`` for eagle3 and mtp when set, else ``--draft-step``."""
        spec = self.speculative_config
        if (
            spec is not None
            and spec.method in METHODS_OVERRIDING_DRAFT_STEP
            and spec.num_speculative_tokens is not None
        ):
            return spec.num_speculative_tokens
        return self.draft_step

    @property
    def memory_budget_bytes(self) -> int:
        """``--memory-budget-gb`` in bytes, else 75% of this machine's RAM (0 when unknown)."""
        if self.memory_budget_gb is not None:
            return int(self.memory_budget_gb * 1e9)
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0
        return int(total * 0.75)

    @property
    def served_name(self) -> str:
        """The model name clients see: ``--served-model-name``, else the model, else ``demo``."""
        return self.served_model_name or self.model or "demo"

    def allowed_host_names(self) -> tuple[str, ...]:
        """``--allowed-hosts``, else loopback names plus the bind address ("*" allows any)."""
        if self.allowed_hosts is not None:
            return _split_list(self.allowed_hosts)
        names = ["localhost", "127.0.0.1", "::1", self.host]
        return tuple(dict.fromkeys(names))

    def allowed_host_headers(self) -> tuple[str, ...]:
        """``Host`` header values to accept: each allowed name bare and with ``--port``.

        IPv6 literals are bracketed as they appear in a ``Host`` header.
        """
        out: list[str] = []
        for name in self.allowed_host_names():
            if name == "*":
                return ("*",)
            host = f"[{name}]" if ":" in name and not name.startswith("[") else name
            out += [host, f"{host}:{self.port}"]
        return tuple(dict.fromkeys(out))

    def model_roots(self) -> tuple[Path, ...]:
        """``--allowed-model-roots``, else the cache's checkpoints dir and the served model's dir.

        Local checkpoints named over HTTP (``POST /admin/builds``) must lie under one of them.
        """
        if self.allowed_model_roots is not None:
            return tuple(Path(p).expanduser().absolute() for p in _split_list(self.allowed_model_roots))
        roots = [(self.cache_dir / "checkpoints").absolute()]
        if self.model is not None and Path(self.model).expanduser().is_dir():
            roots.append(Path(self.model).expanduser().absolute())
        return tuple(roots)

    def cors_origins(self) -> tuple[str, ...]:
        """``--cors-allowed-origins`` (CORS for ``/v1`` only); empty means no CORS headers."""
        return _split_list(self.cors_allowed_origins) if self.cors_allowed_origins else ()

    def profile_request(self) -> ProfileRequest:
        """The build profile this config asks for (``auto`` values are resolved by the manager)."""
        spec = self.speculative_config
        return ProfileRequest(
            backend=self.backend,
            precision=self.precision,
            max_input_len=self.max_input_len,
            max_batch_size=self.max_batch_size,
            max_kv_cache_capacity=self.max_kv_cache_capacity,
            speculative_method=spec.method if spec else None,
            draft_model=spec.model if spec else None,
            task=self.task,
            pooling=self.pooling,
            lora=self.lora_enabled,
            kernels=self.kernels,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    @property
    def lora_enabled(self) -> bool:
        """The bundle is built with LoRA inputs: ``--enable-lora`` or any ``--lora-modules``."""
        return self.enable_lora or bool(self.lora_modules)


# --- the groups ----------------------------------------------------------------------------------
# Each field of ServeConfig belongs to exactly one group (tests/service/test_config.py checks it),
# as litestar-fullstack splits its settings (lib/settings.py) into one dataclass per concern.


@dataclass(frozen=True)
class HttpSettings:
    """HTTP: the listening socket, the keys, the allowed hosts/roots/origins, the log level."""

    host: str
    port: int
    api_key: str | None
    admin_api_key: str | None
    allowed_hosts: str | None
    allowed_model_roots: str | None
    cors_allowed_origins: str | None
    allowed_local_media_path: str | None
    log_level: str


@dataclass(frozen=True)
class CacheSettings:
    """The engine cache: where it lives, its catalog, its size cap, a clear at startup."""

    cache_dir: Path
    catalog_url: str | None
    engine_cache_max_size_gb: float
    clear_engine_cache: bool


@dataclass(frozen=True)
class BuildSettings:
    """Model build: the model and the build profile a prepare asks for."""

    model: str | None
    backend: str
    precision: str
    kernels: str
    kv_cache_dtype: str
    task: str
    pooling: str | None
    enable_lora: bool
    max_input_len: int
    max_batch_size: int
    max_kv_cache_capacity: int
    speculative_config: SpeculativeConfig | None
    draft_top_k: int | None
    draft_step: int | None
    verify_tree_size: int | None
    gpu_disabled: bool


@dataclass(frozen=True)
class ServingSettings:
    """Serving: the served name, parsers, queue and schema limits, the model pool, context reuse,
    the prefill chunk and the shutdown grace period. A new serving flag goes here."""

    served_model_name: str | None
    reasoning_parser: str
    tool_call_parser: str
    enable_auto_tool_choice: bool
    max_queued_requests: int
    queue_timeout: float
    max_schema_bytes: int
    max_schema_properties: int
    grammar_compile_timeout: float
    max_loaded_models: int
    memory_budget_gb: float | None
    keep_alive: float
    enable_context_reuse: bool
    context_cache_max_records: int
    context_cache_recurrent_snapshot_pool_bytes: int
    context_cache_partial_kv_snapshot_pool_bytes: int
    context_cache_disk_bytes: int
    lora_modules: tuple[str, ...]
    max_loras: int
    prefill_chunk: int
    shutdown_grace_seconds: float


@dataclass(frozen=True)
class FleetSettings:
    """The fleet: this node's name, its heartbeat, how long its audit events are kept."""

    node_name: str | None
    heartbeat_seconds: float
    event_retention_days: float
    event_retention_rows: int


_G = TypeVar("_G", HttpSettings, CacheSettings, BuildSettings, ServingSettings, FleetSettings)
#: The groups by their ServeConfig property name.
SETTINGS_GROUPS: dict[str, type] = {
    "http": HttpSettings,
    "cache": CacheSettings,
    "build": BuildSettings,
    "serving": ServingSettings,
    "fleet": FleetSettings,
}

_FIELD_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(ServeConfig) if f.default is not dataclasses.MISSING
}
_INT_FIELDS = frozenset(
    name for name in _RULES if ServeConfig.__dataclass_fields__[name].type in ("int", "int | None")
)
_FLOAT_FIELDS = frozenset(name for name in _RULES if ServeConfig.__dataclass_fields__[name].type == "float")


def _convert(name: str, value: Any) -> Any:
    """from_mapping's unambiguous conversions; everything else goes to the rules unchanged."""
    if name == "cache_dir" and isinstance(value, str) and value.strip():
        return Path(value)
    if name == "speculative_config" and isinstance(value, str | Mapping):
        return SpeculativeConfig.parse(value)
    if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# --- argparse ------------------------------------------------------------------------------------


def _arg_type(name: str, convert: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses the text and applies the field's rule."""
    rule = _RULES[name]

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        try:
            return rule(value)
        except _Invalid as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


def _add(group: Any, name: str, help_text: str, *, show_default: bool = True, **kwargs: Any) -> None:
    """Add ``--<name>`` with the field's default, typed by its rule, help showing the default."""
    if "action" not in kwargs and "type" not in kwargs and "choices" not in kwargs:
        if name in _INT_FIELDS:
            kwargs["type"] = _arg_type(name, int, "an integer")
            kwargs.setdefault("metavar", "N")
        elif name in _FLOAT_FIELDS:
            kwargs["type"] = _arg_type(name, float, "a number")
            kwargs.setdefault("metavar", "NUM")
        else:
            kwargs["type"] = _arg_type(name, str, "text")
    kwargs.setdefault("default", _FIELD_DEFAULTS.get(name))
    # The field's own default, not the parser's: some commands parse "not given" as None so
    # that a value given before the command can win, and --help must still show the real one.
    default = _FIELD_DEFAULTS.get(name)
    if show_default and kwargs.get("action") != "store_true" and default is not None:
        help_text += f" (default: {default})"
    group.add_argument(flag_for(name), dest=name, help=help_text, **kwargs)


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the cache-location and build-profile flags (the set ``cachesvc prepare`` uses).

    Cache: --cache-dir, --catalog-url, --engine-cache-max-size-gb. Build: --backend,
    --precision, --max-input-len, --max-batch-size, --max-kv-cache-capacity,
    --speculative-config, --draft-top-k, --draft-step, --verify-tree-size.
    """
    cache = parser.add_argument_group("engine cache")
    cache.add_argument(
        "--cache-dir",
        dest="cache_dir",
        default=None,
        type=_arg_type("cache_dir", str, "a directory path"),
        metavar="DIR",
        help=f"cache root (default: ${CACHE_DIR_ENV} or ~/.cache/cachesvc)",
    )
    _add(
        cache,
        "catalog_url",
        "SQLAlchemy URL of the bundle catalog (default: sqlite:///<cache-dir>/catalog.sqlite3)",
        show_default=False,
        metavar="URL",
    )
    _add(
        cache,
        "engine_cache_max_size_gb",
        "size cap of the engine cache in GB (10**9 bytes); LRU eviction above it",
        metavar="GB",
    )

    build = parser.add_argument_group("engine build")
    _add(
        build,
        "backend",
        "builder backend; auto picks tensorrt when it imports and a GPU exists",
        choices=BACKEND_CHOICES,
    )
    _add(
        build,
        "precision",
        "engine weight precision; auto keeps the checkpoint's own on the CPU (a Q4 GGUF builds "
        "int4, Q8_0 int8, float weights fp32) and picks fp16 on TensorRT; int8/int4 builds must "
        "pass a quality gate against fp32 on this CPU",
        choices=PRECISION_CHOICES,
    )
    _add(
        build,
        "kernels",
        "int8/int4 on the CPU: how the quality gate picks the kernels: auto (the fastest plan whose "
        "answers equal fp32's on the gate prompts), exact (float32 compute in every layer), fast "
        "(the fastest plan above the agreement floor, answers may differ; said in one log line)",
        choices=KERNEL_MODES,
    )
    _add(
        build,
        "kv_cache_dtype",
        "the KV cache's element type on the CPU (onnxruntime): fp32, or fp16 for half the KV memory "
        "and half the bytes a reused prefix copies (judged by the quality gate against fp32; a "
        "little slower a step where the CPU has no float16 arithmetic)",
        choices=KV_CACHE_DTYPES,
    )
    _add(
        build,
        "task",
        "what the bundle is for: generate (text), or embed (vectors for /v1/embeddings: the "
        "decoder's final hidden state pooled by --pooling and L2-normalised; fp32)",
        choices=TASKS,
    )
    _add(
        build,
        "pooling",
        "how --task embed pools over the tokens: last (the last token's state, as "
        "Qwen3-Embedding does; default) or mean",
        choices=POOLING_METHODS,
    )
    _add(build, "max_input_len", "longest prompt in tokens (<= --max-kv-cache-capacity)")
    _add(
        build,
        "max_batch_size",
        "sequences decoded together; 4, not the replaced server's 1, so concurrent clients "
        "share decode steps instead of queueing (llama-server also picks 4 slots; vLLM's 256 "
        "suits a GPU, not a CPU)",
    )
    _add(build, "max_kv_cache_capacity", "KV cache tokens per sequence (prompt + generated)")
    _add(
        build,
        "speculative_config",
        f"speculative decoding as JSON, e.g. '{_SPEC_EXAMPLE}'; keys: method "
        f"({', '.join(SPECULATIVE_METHODS)}; required), model (draft; required except for "
        f"{', '.join(m for m in SPECULATIVE_METHODS if m not in METHODS_NEEDING_DRAFT_MODEL)}), "
        f"num_speculative_tokens (overrides --draft-step for {', '.join(METHODS_OVERRIDING_DRAFT_STEP)}), "
        "prompt_lookup_min/prompt_lookup_max (ngram only)",
        type=_speculative_arg,
        metavar="JSON",
    )
    _add(build, "draft_top_k", "draft candidates kept per step (positive integer; tree methods)")
    _add(build, "draft_step", "draft tokens proposed per step (positive integer; k of ngram/draft_model)")
    _add(build, "verify_tree_size", "draft-tree tokens verified per step (positive integer; tree methods)")


def add_serve_arguments(parser: argparse.ArgumentParser, *, include_http: bool = True) -> None:
    """Add every ``cachesvc serve`` flag: the positional model, build and runtime flags, and the
    HTTP flags (host, port, keys, parsers, queue, log level) unless ``include_http`` is false."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        type=_arg_type("model", str, "a model id or directory"),
        help="Hugging Face model id, checkpoint directory or .gguf file (default: SmolLM2 if installed)",
    )
    add_build_arguments(parser)

    runtime = parser.add_argument_group("runtime")
    _add(runtime, "clear_engine_cache", "remove all idle engine bundles at startup", action="store_true")
    _add(
        runtime,
        "enable_context_reuse",
        "reuse cached prompt prefixes across requests (default: on; --no-enable-context-reuse "
        "turns it off). The replaced server kept it off; on matches llama-server's prompt cache "
        "and vLLM's prefix caching, and outputs are identical either way. A request's cache_salt "
        "keeps its prefixes from other tenants (the time to first token shows a cache hit)",
        show_default=False,
        action=argparse.BooleanOptionalAction,
    )
    _add(runtime, "context_cache_max_records", "prefix records kept (64-token KV blocks, LRU)")
    _add(
        runtime,
        "context_cache_recurrent_snapshot_pool_bytes",
        "bytes for recurrent-state snapshots (no effect on attention-only models)",
    )
    _add(
        runtime,
        "context_cache_partial_kv_snapshot_pool_bytes",
        f"bytes of KV the prefix records may hold; 0 = {DEFAULT_RECORD_POOL_BYTES >> 20} MiB "
        "(llama-server's --cache-ram defaults to 8 GiB; this default keeps a default server "
        "on a small machine within a few GiB)",
    )
    _add(
        runtime,
        "enable_lora",
        "build the bundle with LoRA inputs so that adapters can be loaded (implied by "
        "--lora-modules; costs ~4%% of decode speed with no adapter active)",
        action="store_true",
    )
    _add(
        runtime,
        "lora_modules",
        "a LoRA adapter to serve, as NAME=PATH (PATH: a PEFT adapter directory or hub id) or "
        '\'{"name": NAME, "path": PATH}\'; repeatable. A request whose model is NAME runs the '
        "base model with that adapter; /v1/models lists it with parent = the base model",
        action="append",
        metavar="NAME=PATH",
        default=None,
        show_default=False,
    )
    _add(runtime, "max_loras", "LoRA adapters loaded at once")
    _add(
        runtime,
        "context_cache_disk_bytes",
        "bytes of prefix records kept on disk under <cache-dir>/context/<bundle_id>/ so that they "
        "survive a restart (LRU; counted in the cache size, removed with their bundle; 0 = off)",
    )
    if not include_http:
        return

    http = parser.add_argument_group("HTTP server")
    _add(http, "host", "address to listen on", metavar="HOST")
    _add(http, "port", "TCP port to listen on (1..65535)")
    _add(
        http,
        "served_model_name",
        "model name reported to clients (default: the model argument, or 'demo')",
        show_default=False,
        metavar="NAME",
    )
    _add(
        http,
        "api_key",
        "require this key on /v1 routes (Bearer or x-api-key) (default: none, open)",
        show_default=False,
        metavar="KEY",
    )
    _add(
        http,
        "node_name",
        "this node's name on its catalog rows (fleets share one catalog; default: the host name)",
        show_default=False,
        metavar="NAME",
    )
    _add(http, "heartbeat_seconds", "seconds between this node's fleet heartbeats and desired-state checks")
    _add(
        http,
        "event_retention_days",
        "drop this node's audit events older than this many days, checked every heartbeat (0: no age limit)",
    )
    _add(
        http,
        "event_retention_rows",
        "keep at most this many of this node's newest audit events (0: no cap); totals are kept",
    )
    _add(
        http,
        "admin_api_key",
        "require this key on /admin routes (default: none, loopback clients only)",
        show_default=False,
        metavar="KEY",
    )
    _add(
        http,
        "allowed_hosts",
        "names the Host header may carry, comma-separated; '*' for any "
        "(default: localhost, 127.0.0.1, ::1 and --host)",
        show_default=False,
        metavar="HOSTS",
    )
    _add(
        http,
        "allowed_model_roots",
        "directories under which POST /admin/builds may name local checkpoints, comma-separated "
        "(default: <cache-dir>/checkpoints and the served model's directory)",
        show_default=False,
        metavar="DIRS",
    )
    _add(
        http,
        "cors_allowed_origins",
        "origins allowed to call /v1 from a browser (CORS), comma-separated (default: none); "
        "admin routes never answer a foreign Origin",
        show_default=False,
        metavar="ORIGINS",
    )
    _add(
        http, "reasoning_parser", "split <think> reasoning into reasoning_content", choices=REASONING_PARSERS
    )
    _add(http, "tool_call_parser", "tool-call format to parse from model output", choices=TOOL_CALL_PARSERS)
    _add(http, "enable_auto_tool_choice", "let the model decide when to call tools", action="store_true")
    _add(http, "max_queued_requests", "requests waiting for a slot before 429 (non-negative integer)")
    _add(http, "queue_timeout", "seconds a request may wait in the queue before 429", metavar="SECONDS")
    _add(
        http,
        "max_schema_bytes",
        "largest JSON schema / regex / grammar a request may constrain its output with, in bytes (else 400)",
    )
    _add(
        http, "max_schema_properties", "most properties (over all nested objects) of a request's JSON schema"
    )
    _add(
        http,
        "grammar_compile_timeout",
        "seconds a request's structured-output grammar may take to compile before a 400",
        metavar="SECONDS",
    )
    pool = parser.add_argument_group("model pool")
    _add(pool, "max_loaded_models", "engines kept loaded at once; least recently used idle ones unload first")
    _add(
        pool,
        "memory_budget_gb",
        "memory the loaded engines may take, in GB (estimate: weights + KV capacity x slots) "
        "(default: 75%% of RAM)",
        show_default=False,
        type=_arg_type("memory_budget_gb", float, "a number"),
        metavar="GB",
    )
    _add(
        pool,
        "keep_alive",
        "seconds an idle model stays loaded (-1: never unload, 0: unload when idle); "
        "a request's keep_alive field overrides it",
        metavar="SECONDS",
    )
    _add(
        http,
        "allowed_local_media_path",
        "directory requests may read local media from (default: none)",
        show_default=False,
        metavar="DIR",
    )
    _add(http, "log_level", "log level", choices=LOG_LEVELS)
