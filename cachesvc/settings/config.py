"""Launch configuration of ``cachesvc serve`` (and of the app): every flag, validated, frozen.

The flags keep the names of the OpenAI-compatible server cachesvc replaces, so existing launch
scripts keep working, and its defaults except two that suit a server rather than a demo:
``--max-batch-size`` is 4 (was 1) and context reuse is on (``--no-enable-context-reuse`` turns
it off; ``--enable-context-reuse`` still parses). ``--help`` says why at each. A few flags of our
own (``--catalog-url``, ``--admin-api-key``, ``--backend``, ``--precision``) configure the cache
and the builder.

Each setting is declared once, as a field of its group (:class:`HttpSettings`,
:class:`CacheSettings`, :class:`BuildSettings`, :class:`ServingSettings`,
:class:`FleetSettings`): type and default on the field, help, rule, flag layout and environment
variable in its :class:`~cachesvc.settings.declare.Setting`. The flags, ``--help``, the
environment list (:data:`ENVIRONMENT`) and the table of ``docs/configuration.md``
(:func:`settings_table`) are generated from the declarations. :class:`ServeConfig` is composed
of the groups: code reads ``config.http.port``, ``config.build.precision``...

Three ways in, one set of rules:

* ``ServeConfig(...)`` -- the groups, or settings by name (``ServeConfig(port=9000)``), each
  checked by its rule when its group is built;
* ``ServeConfig.from_mapping({...})`` -- python names (``max_batch_size``) or flag names
  (``max-batch-size``); unknown keys are rejected by name; unambiguous conversions only
  (``str`` -> ``Path`` for ``cache_dir``, a JSON string or a dict for ``speculative_config``,
  integral floats for integer options, ints for float options);
* argparse -- :func:`add_serve_arguments` / :func:`add_build_arguments` add the flags and
  :meth:`ServeConfig.from_namespace` builds the config from the parsed namespace.

Every error is a :class:`cachesvc.errors.ConfigError` whose ``field`` is the CLI flag
(``--max-batch-size``; the positional is ``model``), e.g.
``--max-batch-size: must be a positive integer, got 0``. Argparse-level errors name the flag too:
``argument --port: must be an integer between 1 and 65535, got 0``. Rules that span several
flags (``--max-input-len`` <= ``--max-kv-cache-capacity``, the context-cache flags needing
context reuse on) are checked when the config is built: within a group by the group, across
groups by :class:`ServeConfig`.

Flags kept for compatibility that would have no effect in this version are refused, each with
one line that names it (``cachesvc`` exits 2): those declared with ``no_effect`` and
``--draft-step`` without a method that reads it. Their defaults still parse.

The declarations (the five groups, the environment, every setting by name) are in
:mod:`cachesvc.settings.groups`; this module composes them.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import ConfigError
from cachesvc.settings.arguments import add_flag, add_flags, add_plain_flag
from cachesvc.settings.compose import build_groups, mapping_values, namespace_values
from cachesvc.settings.groups import (
    BUILD,
    CACHE,
    DECLARED,
    ENVIRONMENT,
    GROUP_OF,
    HTTP,
    POOL,
    RUNTIME,
    SETTINGS_GROUPS,
    BuildSettings,
    CacheSettings,
    FleetSettings,
    HttpSettings,
    ServingSettings,
    flag_for,
)
from cachesvc.settings.rules import split_list
from cachesvc.settings.table import markdown_table
from inference.build_profile import CHAIN_SPECULATIVE_METHODS


def settings_table() -> str:
    """The Markdown table of every setting and variable (kept in docs/configuration.md)."""
    items = ((GROUP_OF[d.name], d) for d in DECLARED.values())
    return markdown_table(items, [var for var in ENVIRONMENT if var.setting is None])


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
    if flag is None and field in DECLARED:
        flag = flag_for(field)
    return f"{flag}: {exc.detail}" if flag else str(exc)


# --- the config ----------------------------------------------------------------------------------


@dataclass(frozen=True, init=False, repr=False)
class ServeConfig:
    """Every launch option of ``cachesvc serve``, in five groups; validated, immutable.

    Built from the groups, or from settings by name (``ServeConfig(port=9000)``), which go to
    their group; ``dataclasses.replace(config, port=1)`` works the same way.
    """

    http: HttpSettings
    cache: CacheSettings
    build: BuildSettings
    serving: ServingSettings
    fleet: FleetSettings

    def __init__(
        self,
        *,
        http: HttpSettings | None = None,
        cache: CacheSettings | None = None,
        build: BuildSettings | None = None,
        serving: ServingSettings | None = None,
        fleet: FleetSettings | None = None,
        **values: Any,
    ) -> None:
        given = {"http": http, "cache": cache, "build": build, "serving": serving, "fleet": fleet}
        for name, group in build_groups(SETTINGS_GROUPS, given, values).items():
            object.__setattr__(self, name, group)
        self._check_lora()
        self._refuse_draft_step()

    def _check_lora(self) -> None:
        build, serving = self.build, self.serving
        if not self.lora_enabled:
            return
        if len(serving.lora_modules) > serving.max_loras:
            raise ConfigError("--lora-modules", f"names {len(serving.lora_modules)} adapters but --max-loras "
                              f"is {serving.max_loras}; raise --max-loras or name fewer")
        if build.task == "embed":
            raise ConfigError("--lora-modules" if serving.lora_modules else "--enable-lora",
                              "LoRA adapters run on text models; drop them or --task embed")
        if build.backend == "tensorrt":
            raise ConfigError("--backend", "LoRA adapters run on the onnxruntime backend; drop --backend")
        names = {m.partition("=")[0] for m in serving.lora_modules}
        taken = names & {self.served_name, serving.served_model_name}
        if taken:
            raise ConfigError("--lora-modules", f"adapter name {sorted(taken)[0]!r} is the base model's "
                              "served name; give the adapter a name of its own")

    def _refuse_draft_step(self) -> None:
        """--draft-step would change nothing without a method that reads it: refused."""
        spec = self.build.speculative_config
        if self.build.draft_step is not None and (
            spec is None or spec.method not in CHAIN_SPECULATIVE_METHODS
        ):
            raise ConfigError(
                "--draft-step",
                f"has no effect in this version (only {' and '.join(CHAIN_SPECULATIVE_METHODS)} speculate "
                "here, and --speculative-config names neither): drop --draft-step",
            )

    def __repr__(self) -> str:
        groups = ", ".join(f"{name}={getattr(self, name)!r}" for name in SETTINGS_GROUPS)
        return f"ServeConfig({groups})"

    # --- constructors ---

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> ServeConfig:
        """Build from python names or flag names; unknown keys are rejected by name."""
        return cls(**mapping_values(mapping, DECLARED))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> ServeConfig:
        """Build from parsed arguments; attributes that are not options (subcommand state) are ignored.

        Options the parser did not define keep their defaults, so a namespace from a parser set
        up with :func:`add_build_arguments` alone works too.
        """
        return cls(**namespace_values(namespace, DECLARED))

    # --- derived values that span groups ---

    @property
    def served_name(self) -> str:
        """The model name clients see: ``--served-model-name``, else the model, else ``demo``."""
        return self.serving.served_model_name or self.build.model or "demo"

    @property
    def lora_enabled(self) -> bool:
        """The bundle is built with LoRA inputs: ``--enable-lora`` or any ``--lora-modules``."""
        return self.build.enable_lora or bool(self.serving.lora_modules)

    def model_roots(self) -> tuple[Path, ...]:
        """``--allowed-model-roots``, else the cache's checkpoints dir and the served model's dir.

        Local checkpoints named over HTTP (``POST /admin/builds``) must lie under one of them.
        """
        if self.http.allowed_model_roots is not None:
            return tuple(Path(p).expanduser().absolute() for p in split_list(self.http.allowed_model_roots))
        roots = [(self.cache.cache_dir / "checkpoints").absolute()]
        model = self.build.model
        if model is not None and Path(model).expanduser().is_dir():
            roots.append(Path(model).expanduser().absolute())
        return tuple(roots)

    def profile_request(self) -> ProfileRequest:
        """The build profile this config asks for (``auto`` values are resolved by the manager)."""
        build = self.build
        spec = build.speculative_config
        return ProfileRequest(
            backend=build.backend,
            precision=build.precision,
            max_input_len=build.max_input_len,
            max_batch_size=build.max_batch_size,
            max_kv_cache_capacity=build.max_kv_cache_capacity,
            speculative_method=spec.method if spec else None,
            draft_model=spec.model if spec else None,
            task=build.task,
            pooling=build.pooling,
            lora=self.lora_enabled,
            kernels=build.kernels,
            kv_cache_dtype=build.kv_cache_dtype,
            max_image_tokens=build.max_image_tokens,
            max_image_tokens_per_image=build.max_image_tokens_per_image,
        )


# --- argparse ------------------------------------------------------------------------------------


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the cache-location and build-profile flags (the set ``cachesvc prepare`` uses).

    Cache: --cache-dir, --catalog-url, --engine-cache-max-size-gb. Build: --backend,
    --precision, --kernels, --kv-cache-dtype, --task, --pooling, --max-input-len, --max-batch-size,
    --max-kv-cache-capacity, --max-image-tokens, --max-image-tokens-per-image, --speculative-config,
    --draft-top-k, --draft-step, --verify-tree-size.
    """
    add_flags(parser, DECLARED.values(), (CACHE, BUILD))


def add_serve_arguments(parser: argparse.ArgumentParser, *, include_http: bool = True) -> None:
    """Add every ``cachesvc serve`` flag: the positional model, build and runtime flags, and the
    HTTP flags (host, port, keys, parsers, queue, pool, log level) unless ``include_http`` is false."""
    add_flag(parser, DECLARED["model"])
    add_flags(parser, DECLARED.values(), (CACHE, BUILD, RUNTIME, *((HTTP, POOL) if include_http else ())))


def add_cache_flags(group: Any, prefix: str = "") -> None:
    """The cache flags (``--cache-dir`` ...) with no default, stored as ``prefix + name``: for the
    options given before a ``cachesvc`` command, validated with the rest of the config."""
    for item in DECLARED.values():
        if item.spec.section == CACHE:
            add_plain_flag(group, item, prefix + item.name)
