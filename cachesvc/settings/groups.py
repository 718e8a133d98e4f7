"""The launch settings of ``cachesvc serve``, each declared once, and what is read off them.

Five groups, one frozen dataclass per concern (:class:`HttpSettings`, :class:`CacheSettings`,
:class:`BuildSettings`, :class:`ServingSettings`, :class:`FleetSettings`): each setting is a
field with its type and default, and a :class:`~cachesvc.settings.declare.Setting` with its help,
rule, flag layout and environment variable. Read off the declarations: every setting by name
(:data:`DECLARED`, its group in :data:`GROUP_OF`), its flag (:func:`flag_for`) and fixed default
(:func:`field_default`), the cache options (:data:`CACHE_OPTIONS`), the ``--help`` headings.
:class:`~cachesvc.settings.config.ServeConfig` composes the groups.

Environment: every ``CACHESVC_*`` variable is in :data:`ENVIRONMENT` and read here, through
:func:`env_value`, and nowhere else in ``cachesvc`` or ``inference``
(``tests/service/test_settings_env.py`` checks the source), except ``CACHESVC_CRASH_AT``, a test
hook read by :mod:`cachesvc.cache.crashpoints` at the bottom layer. A setting with a variable reads it
when a config is built (not at import); an invalid value is a ConfigError naming the variable.
``repr()`` masks the API keys and any password in the catalog URL, so a config can be logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.cache import crashpoints
from cachesvc.cache.registry import RegistrySettings, parse_ref
from cachesvc.errors import ConfigError
from cachesvc.settings.declare import Declared, EnvVar, Group, Setting, declared, setting, setting_from
from cachesvc.settings.rules import (
    INT32_MAX,
    INT64_MAX,
    Invalid,
    bool_rule,
    catalog_url_rule,
    choice_rule,
    int_rule,
    keep_alive_rule,
    list_rule,
    lora_modules_rule,
    non_negative_float,
    non_negative_int,
    optional,
    path_rule,
    positive_float,
    positive_int,
    shape_rule,
    split_list,
    text_rule,
)
from cachesvc.settings.speculative import (
    METHODS_OVERRIDING_DRAFT_STEP,
    SPEC_EXAMPLE,
    SpeculativeConfig,
    speculative_arg,
    speculative_rule,
)
from inference.build_profile import (
    BACKEND_CHOICES,
    CHAIN_SPECULATIVE_METHODS,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    DEFAULT_TASK,
    IMAGE_TOKEN_FIELDS,
    KERNEL_MODES,
    KV_CACHE_DTYPES,
    MAX_IMAGES_PER_REQUEST,
    MAX_TOKENS_LIMIT,
    METHODS_NEEDING_DRAFT_MODEL,
    POOLING_METHODS,
    PRECISION_CHOICES,
    SHAPE_LIMITS,
    SPECULATIVE_METHODS,
    TASKS,
    ProfileError,
    check_image_limits,
    check_shapes,
)
from inference.images.features import DEFAULT_IMAGE_CACHE_BYTES
from inference.images.media import MediaPolicy
from inference.openai.reasoning import REASONING_PARSER_CHOICES as REASONING_PARSERS
from inference.openai.tool_parsers import TOOL_PARSER_CHOICES as TOOL_CALL_PARSERS
from inference.serving.context_cache import DEFAULT_MAX_BYTES as DEFAULT_RECORD_POOL_BYTES
from inference.serving.context_disk import DEFAULT_DISK_BYTES

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_MAX_LORAS = 4

CACHE_DIR_ENV = "CACHESVC_CACHE_DIR"
SHUTDOWN_GRACE_ENV = "CACHESVC_SHUTDOWN_GRACE_SECONDS"
PREFILL_CHUNK_ENV = "CACHESVC_PREFILL_CHUNK"
DISABLE_GPU_ENV = "CACHESVC_DISABLE_GPU"
REGISTRY_ENV = "CACHESVC_REGISTRY"
ENGINE_FACTORY_ENV = "CACHESVC_ENGINE_FACTORY"

#: The ``--help`` headings, in order; :func:`add_build_arguments` adds the first two.
CACHE, BUILD, RUNTIME, HTTP, POOL = "engine cache", "engine build", "runtime", "HTTP server", "model pool"

_URL_PASSWORD_RE = re.compile(r"(://[^:/@]*:)[^@/]*@")


def _mask_key(value: object) -> str:
    return "'***'"


def _mask_url(value: object) -> str:
    return repr(_URL_PASSWORD_RE.sub(r"\1***@", str(value)))


# --- the environment -----------------------------------------------------------------------------


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


def default_registry() -> str | None:
    """``$CACHESVC_REGISTRY`` when set and non-empty, else None (no registry)."""
    return env_value(REGISTRY_ENV) or None


def registry_rule(value: object) -> str | None:
    """An ``oci://host[:port]/namespace`` reference (no tag), or None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise Invalid(f"must be oci://host[:port]/namespace, got {type(value).__name__}")
    try:
        return str(parse_ref(value, allow_tag=False))
    except ConfigError as exc:
        raise Invalid(exc.detail) from None


def _env_setting(env: str, text: str, convert: Callable[[str], Any], what: str, spec: Setting) -> Any:
    """A setting without a flag: its default is variable ``env`` (``text`` when unset) as
    ``convert`` makes it, read when a config is built."""

    def read() -> Any:
        value = env_value(env)
        try:
            return convert(value)
        except ValueError:
            raise ConfigError(env, f"must be {what}, got {value!r}") from None

    return setting_from(read, dataclasses.replace(spec, env=env, env_default=text))


# --- the groups ----------------------------------------------------------------------------------
# One frozen dataclass per concern, as litestar-fullstack splits its settings (lib/settings.py);
# each field declared once. A new setting is one field of one group.


@dataclass(frozen=True, repr=False)
class HttpSettings(Group):
    """HTTP: the listening socket, the keys, the allowed hosts/roots/origins, the log level."""

    host: str = setting("0.0.0.0", Setting(
        "address to listen on", text_rule("a non-blank host name or IP address", optional=False), HTTP,
        metavar="HOST"))
    port: int = setting(8000, Setting("TCP port to listen on (1..65535)", int_rule(1, 65535), HTTP))
    api_key: str | None = setting(None, Setting(
        "require this key on /v1 routes (Bearer or x-api-key) (default: none, open)",
        text_rule("a non-blank key", optional=True), HTTP, metavar="KEY", show_default=False,
        mask=_mask_key, doc_default="none (open)"))
    admin_api_key: str | None = setting(None, Setting(
        "require this key on /admin routes (default: none, loopback clients only)",
        text_rule("a non-blank key", optional=True), HTTP, metavar="KEY", show_default=False,
        mask=_mask_key, doc_default="none (loopback only)"))
    allowed_hosts: str | None = setting(None, Setting(
        "names the Host header may carry, comma-separated; '*' for any "
        "(default: localhost, 127.0.0.1, ::1 and --host)",
        list_rule("host names or IP addresses (comma-separated; '*' allows any)"), HTTP, metavar="HOSTS",
        show_default=False, doc_default="`localhost`, `127.0.0.1`, `::1` and `--host`"))
    allowed_model_roots: str | None = setting(None, Setting(
        "directories under which POST /admin/builds may name local checkpoints, comma-separated "
        "(default: <cache-dir>/checkpoints and the served model's directory)",
        list_rule("directories (comma-separated)"), HTTP, metavar="DIRS", show_default=False,
        doc_default="`<cache-dir>/checkpoints` and the served model's directory"))
    cors_allowed_origins: str | None = setting(None, Setting(
        "origins allowed to call /v1 from a browser (CORS), comma-separated (default: none); "
        "admin routes never answer a foreign Origin",
        list_rule("origins such as https://app.example.com (comma-separated)"), HTTP, metavar="ORIGINS",
        show_default=False))
    allowed_local_media_path: str | None = setting(None, Setting(
        "directory whose files image parts may name as file:// URLs (symlinks resolved first; "
        "default: none, only data: URLs and the allowed domains)",
        text_rule("an existing directory", optional=True), HTTP, metavar="DIR", show_default=False))
    allowed_media_domains: str | None = setting(None, Setting(
        "hosts whose http(s) image URLs are fetched (20 MiB, 10 s, 3 redirects on these hosts at "
        "most), comma-separated (default: none: such URLs are refused)",
        list_rule("host names such as images.example.com (comma-separated)"), HTTP, metavar="HOSTS",
        show_default=False))
    log_level: str = setting("info", Setting("log level", choice_rule(LOG_LEVELS), HTTP, choices=LOG_LEVELS))

    def check(self) -> None:
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ConfigError("--allowed-local-media-path",
                              f"{self.allowed_local_media_path!r} is not an existing directory")
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ConfigError(
                "--admin-api-key",
                "must differ from --api-key: every completion client would hold the admin key",
            )

    def allowed_host_names(self) -> tuple[str, ...]:
        """``--allowed-hosts``, else loopback names plus the bind address ("*" allows any)."""
        if self.allowed_hosts is not None:
            return split_list(self.allowed_hosts)
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

    def cors_origins(self) -> tuple[str, ...]:
        """``--cors-allowed-origins`` (CORS for ``/v1`` only); empty means no CORS headers."""
        return split_list(self.cors_allowed_origins) if self.cors_allowed_origins else ()

    def media_policy(self) -> MediaPolicy:
        """Where image parts may come from besides data: URLs (:mod:`inference.images.media`)."""
        root = self.allowed_local_media_path
        domains = split_list(self.allowed_media_domains) if self.allowed_media_domains else ()
        return MediaPolicy(local_root=Path(root) if root else None,
                           domains=tuple(d.lower() for d in domains))


@dataclass(frozen=True, repr=False)
class CacheSettings(Group):
    """The engine cache: where it lives, its catalog, its size cap, a clear at startup."""

    cache_dir: Path = setting_from(default_cache_dir, Setting(
        f"cache root (default: ${CACHE_DIR_ENV} or ~/.cache/cachesvc)", path_rule, CACHE, env=CACHE_DIR_ENV,
        env_default="~/.cache/cachesvc", env_help="cache root (read when a config is built, not at import)",
        metavar="DIR", doc_default="`$CACHESVC_CACHE_DIR` or `~/.cache/cachesvc`"))
    catalog_url: str | None = setting(None, Setting(
        "SQLAlchemy URL of the bundle catalog (default: sqlite:///<cache-dir>/catalog.sqlite3)",
        catalog_url_rule, CACHE, metavar="URL", show_default=False, mask=_mask_url,
        doc_default="`sqlite:///<cache-dir>/catalog.sqlite3`"))
    engine_cache_max_size_gb: float = setting(50.0, Setting(
        "size cap of the engine cache in GB (10**9 bytes); LRU eviction above it", positive_float, CACHE,
        metavar="GB"))
    clear_engine_cache: bool = setting(False, Setting(
        "remove all idle engine bundles at startup", bool_rule, RUNTIME, action="store_true"))

    @property
    def catalog_url_resolved(self) -> str:
        """``--catalog-url``, or ``sqlite:///<cache-dir>/catalog.sqlite3`` when unset."""
        if self.catalog_url is not None:
            return self.catalog_url
        return f"sqlite:///{self.cache_dir / 'catalog.sqlite3'}"

    @property
    def engine_cache_max_size_bytes(self) -> int:
        """The cache size cap in bytes (decimal GB: 1 GB = 10**9 bytes)."""
        return int(self.engine_cache_max_size_gb * 1e9)


_TREE = ("it shapes a draft tree, and no speculative method here decodes one (ngram and draft_model "
         "verify one chain)")


@dataclass(frozen=True, repr=False)
class BuildSettings(Group):
    """Model build: the model and the build profile a prepare asks for."""

    model: str | None = setting(None, Setting(
        "Hugging Face model id, checkpoint directory or .gguf file (default: SmolLM2 if installed)",
        text_rule("a Hugging Face model id or a checkpoint directory (non-blank)", optional=True), None,
        positional=True, doc_default="SmolLM2-135M-Instruct if installed"))
    backend: str = setting("auto", Setting(
        "builder backend; auto picks tensorrt when it imports and a GPU exists",
        choice_rule(BACKEND_CHOICES), BUILD, choices=BACKEND_CHOICES))
    precision: str = setting("auto", Setting(
        "engine weight precision; auto keeps the checkpoint's own on the CPU (a Q4 GGUF builds "
        "int4, Q8_0 int8, float weights fp32) and picks fp16 on TensorRT; int8/int4 builds must "
        "pass a quality gate against fp32 on this CPU",
        choice_rule(PRECISION_CHOICES), BUILD, choices=PRECISION_CHOICES))
    kernels: str = setting("auto", Setting(
        "int8/int4 on the CPU: how the quality gate picks the kernels: auto (the fastest plan whose "
        "answers equal fp32's on the gate prompts), exact (float32 compute in every layer), fast "
        "(the fastest plan above the agreement floor, answers may differ; said in one log line)",
        choice_rule(KERNEL_MODES), BUILD, choices=KERNEL_MODES))
    kv_cache_dtype: str = setting(DEFAULT_KV_CACHE_DTYPE, Setting(
        "the KV cache's element type on the CPU (onnxruntime): fp32, or fp16 for half the KV memory "
        "and half the bytes a reused prefix copies (judged by the quality gate against fp32; a "
        "little slower a step where the CPU has no float16 arithmetic)",
        choice_rule(KV_CACHE_DTYPES), BUILD, choices=KV_CACHE_DTYPES))
    task: str = setting(DEFAULT_TASK, Setting(
        "what the bundle is for: generate (text), or embed (vectors for /v1/embeddings: the "
        "decoder's final hidden state pooled by --pooling and L2-normalised; fp32)",
        choice_rule(TASKS), BUILD, choices=TASKS))
    pooling: str | None = setting(None, Setting(
        "how --task embed pools over the tokens: last (the last token's state, as "
        "Qwen3-Embedding does; default) or mean",
        optional(choice_rule(POOLING_METHODS)), BUILD, choices=POOLING_METHODS,
        doc_default="`last` with `--task embed`"))
    max_input_len: int = setting(DEFAULT_MAX_INPUT_LEN, Setting(
        "longest prompt in tokens (<= --max-kv-cache-capacity)", shape_rule("max_input_len"), BUILD))
    max_batch_size: int = setting(DEFAULT_MAX_BATCH_SIZE, Setting(
        "sequences decoded together; 4, not the replaced server's 1, so concurrent clients "
        "share decode steps instead of queueing (llama-server also picks 4 slots; vLLM's 256 "
        "suits a GPU, not a CPU)", shape_rule("max_batch_size"), BUILD))
    max_kv_cache_capacity: int = setting(DEFAULT_MAX_KV_CACHE_CAPACITY, Setting(
        "KV cache tokens per sequence (prompt + generated)", shape_rule("max_kv_cache_capacity"), BUILD))
    max_image_tokens: int | None = setting(None, Setting(
        "vision-language models: image tokens one request may carry, all its images together "
        "(<= --max-input-len; a request over it is a 400 naming the image part). Default: "
        f"{MAX_IMAGES_PER_REQUEST} images' worth, within --max-input-len. Part of the bundle's profile; "
        "refused for a text-only model", optional(int_rule(1, MAX_TOKENS_LIMIT)), BUILD,
        doc_default=f"{MAX_IMAGES_PER_REQUEST} images, within `--max-input-len`"))
    max_image_tokens_per_image: int | None = setting(None, Setting(
        "vision-language models: image tokens one image may take (<= --max-image-tokens; at least "
        "what one image of the model takes: LLaVA's are fixed). Default: the model's tokens per "
        "image. Part of the bundle's profile; refused for a text-only model",
        optional(int_rule(1, MAX_TOKENS_LIMIT)), BUILD, doc_default="the model's tokens per image"))
    speculative_config: SpeculativeConfig | None = setting(None, Setting(
        f"speculative decoding as JSON, e.g. '{SPEC_EXAMPLE}'; keys: method "
        f"({', '.join(SPECULATIVE_METHODS)}; required), model (draft; required except for "
        f"{', '.join(m for m in SPECULATIVE_METHODS if m not in METHODS_NEEDING_DRAFT_MODEL)}), "
        f"num_speculative_tokens (overrides --draft-step for {', '.join(METHODS_OVERRIDING_DRAFT_STEP)}), "
        "prompt_lookup_min/prompt_lookup_max (ngram only)",
        speculative_rule, BUILD, arg_type=speculative_arg, metavar="JSON"))
    draft_top_k: int | None = setting(None, Setting(
        "draft candidates kept per step (positive integer; tree methods)", optional(positive_int), BUILD,
        no_effect=_TREE))
    draft_step: int | None = setting(None, Setting(
        "draft tokens proposed per step (positive integer; k of ngram/draft_model)", optional(positive_int),
        BUILD))
    verify_tree_size: int | None = setting(None, Setting(
        "draft-tree tokens verified per step (positive integer; tree methods)", optional(positive_int), BUILD,
        no_effect=_TREE))
    enable_lora: bool = setting(False, Setting(
        "build the bundle with LoRA inputs so that adapters can be loaded (implied by "
        "--lora-modules; costs ~4%% of decode speed with no adapter active)",
        bool_rule, RUNTIME, action="store_true"))
    gpu_disabled: bool = _env_setting(DISABLE_GPU_ENV, "", bool, "true or false", Setting(
        "any non-empty value: use no GPU (no tensorrt builder is offered, --backend tensorrt is "
        "refused and TensorRT bundles are stale on this node)", bool_rule, None))

    def check(self) -> None:
        try:
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
        except ProfileError as exc:
            detail = exc.detail
            for name in SHAPE_LIMITS:
                detail = re.sub(rf"\b{name}\b", flag_for(name), detail)
            raise ConfigError(flag_for(exc.field), detail) from None
        try:
            check_image_limits(self.max_image_tokens, self.max_image_tokens_per_image, self.max_input_len)
        except ProfileError as exc:
            detail = exc.detail
            for name in (*IMAGE_TOKEN_FIELDS, "max_input_len"):
                detail = re.sub(rf"\b{name}\b", flag_for(name), detail)
            raise ConfigError(flag_for(exc.field), detail) from None
        spec = self.speculative_config
        if spec is not None and spec.method in CHAIN_SPECULATIVE_METHODS:
            for name in ("draft_top_k", "verify_tree_size"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        flag_for(name),
                        f"shapes a draft tree (eagle3, dflash, ...); {spec.method} verifies one chain "
                        f"of --draft-step tokens: drop {flag_for(name)}",
                    )
        self._check_task()

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


_CONTEXT_CACHE_FIELDS = (
    "context_cache_max_records",
    "context_cache_recurrent_snapshot_pool_bytes",
    "context_cache_partial_kv_snapshot_pool_bytes",
    "context_cache_disk_bytes",
)


@dataclass(frozen=True, repr=False)
class ServingSettings(Group):
    """Serving: the served name, parsers, queue and schema limits, the model pool, context reuse,
    the prefill chunk and the shutdown grace period. A new serving flag goes here."""

    served_model_name: str | None = setting(None, Setting(
        "model name reported to clients (default: the model argument, or 'demo')",
        text_rule("a non-blank model name", optional=True), HTTP, metavar="NAME", show_default=False,
        doc_default="the model argument, or `demo`"))
    reasoning_parser: str = setting("auto", Setting(
        "split <think> reasoning into reasoning_content", choice_rule(REASONING_PARSERS), HTTP,
        choices=REASONING_PARSERS))
    tool_call_parser: str = setting("auto", Setting(
        "tool-call format to parse from model output", choice_rule(TOOL_CALL_PARSERS), HTTP,
        choices=TOOL_CALL_PARSERS))
    enable_auto_tool_choice: bool = setting(False, Setting(
        "let the model decide when to call tools", bool_rule, HTTP, action="store_true"))
    max_queued_requests: int = setting(16, Setting(
        "requests waiting for a slot before 429 (non-negative integer)", non_negative_int, HTTP))
    queue_timeout: float = setting(600.0, Setting(
        "seconds a request may wait in the queue before 429", positive_float, HTTP, metavar="SECONDS"))
    max_schema_bytes: int = setting(256 * 1024, Setting(
        "largest JSON schema / regex / grammar a request may constrain its output with, in bytes (else 400)",
        positive_int, HTTP))
    max_schema_properties: int = setting(2048, Setting(
        "most properties (over all nested objects) of a request's JSON schema", positive_int, HTTP))
    grammar_compile_timeout: float = setting(10.0, Setting(
        "seconds a request's structured-output grammar may take to compile before a 400", positive_float,
        HTTP, metavar="SECONDS"))
    max_loaded_models: int = setting(3, Setting(
        "engines kept loaded at once; least recently used idle ones unload first", positive_int, POOL))
    memory_budget_gb: float | None = setting(None, Setting(
        "memory the loaded engines may take, in GB (estimate: weights + KV capacity x slots) "
        "(default: 75%% of RAM)", optional(positive_float), POOL, metavar="GB", show_default=False,
        doc_default="75% of RAM"))
    keep_alive: float = setting(300.0, Setting(
        "seconds an idle model stays loaded (-1: never unload, 0: unload when idle); "
        "a request's keep_alive field overrides it", keep_alive_rule, POOL, metavar="SECONDS"))
    # On by default, unlike the replaced server: see the "runtime" group of ``--help``.
    enable_context_reuse: bool = setting(True, Setting(
        "reuse cached prompt prefixes across requests (default: on; --no-enable-context-reuse "
        "turns it off). The replaced server kept it off; on matches llama-server's prompt cache "
        "and vLLM's prefix caching, and outputs are identical either way. A request's cache_salt "
        "keeps its prefixes from other tenants (the time to first token shows a cache hit)",
        bool_rule, RUNTIME, action=argparse.BooleanOptionalAction, show_default=False))
    context_cache_max_records: int = setting(1024, Setting(
        "prefix records kept (64-token KV blocks, LRU)", int_rule(0, INT32_MAX), RUNTIME))
    context_cache_recurrent_snapshot_pool_bytes: int = setting(0, Setting(
        "bytes for recurrent-state snapshots (no effect on attention-only models)", int_rule(0, INT64_MAX),
        RUNTIME, no_effect="the models served here keep no recurrent state"))
    context_cache_partial_kv_snapshot_pool_bytes: int = setting(0, Setting(
        f"bytes of KV the prefix records may hold; 0 = {DEFAULT_RECORD_POOL_BYTES >> 20} MiB "
        "(llama-server's --cache-ram defaults to 8 GiB; this default keeps a default server "
        "on a small machine within a few GiB)", int_rule(0, INT64_MAX), RUNTIME))
    context_cache_disk_bytes: int = setting(DEFAULT_DISK_BYTES, Setting(
        "bytes of prefix records kept on disk under <cache-dir>/context/<bundle_id>/ so that they "
        "survive a restart (LRU; counted in the cache size, removed with their bundle; 0 = off)",
        int_rule(0, INT64_MAX), RUNTIME))
    image_feature_cache_bytes: int = setting(DEFAULT_IMAGE_CACHE_BYTES, Setting(
        "vision-language models: bytes of image features kept per model by image digest, so a "
        f"repeated image is neither decoded nor encoded again (LRU; 0 = off; default "
        f"{DEFAULT_IMAGE_CACHE_BYTES >> 20} MiB: seven LLaVA 1.5 7B images)", int_rule(0, INT64_MAX),
        RUNTIME))
    lora_modules: tuple[str, ...] = setting((), Setting(
        "a LoRA adapter to serve, as NAME=PATH (PATH: a PEFT adapter directory or hub id) or "
        '\'{"name": NAME, "path": PATH}\'; repeatable. A request whose model is NAME runs the '
        "base model with that adapter; /v1/models lists it with parent = the base model",
        lora_modules_rule, RUNTIME, action="append", metavar="NAME=PATH", show_default=False,
        doc_default="none"))
    max_loras: int = setting(DEFAULT_MAX_LORAS, Setting(
        "LoRA adapters loaded at once", int_rule(1, 1024), RUNTIME))
    prefill_chunk: int = _env_setting(PREFILL_CHUNK_ENV, "256", int, "a positive integer", Setting(
        "prompt tokens prefilled per scheduler step: smaller chunks let running streams decode more "
        "often while a long prompt is prefilled; larger ones prefill that prompt a little faster",
        positive_int, None))
    shutdown_grace_seconds: float = _env_setting(
        SHUTDOWN_GRACE_ENV, "30", float, "seconds (a number, 0 or more)", Setting(
            "seconds in-flight requests get to finish after SIGTERM/SIGINT; then what is left is failed "
            "with a proper answer (503 server_unavailable, or an error chunk and [DONE] in a stream); "
            "for tests and orchestrators with a shorter kill timeout", non_negative_float, None))

    def check(self) -> None:
        if self.enable_context_reuse:
            return
        for name in _CONTEXT_CACHE_FIELDS:
            default = field_default(name)
            if getattr(self, name) != default:
                raise ConfigError(
                    flag_for(name),
                    f"applies only with context reuse (got {getattr(self, name)}, default "
                    f"{default}), which --no-enable-context-reuse turns off; drop "
                    f"--no-enable-context-reuse or drop {flag_for(name)}",
                )

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


@dataclass(frozen=True, repr=False)
class FleetSettings(Group):
    """The fleet: this node's name, its heartbeat, how long its audit events are kept."""

    node_name: str | None = setting(None, Setting(
        "this node's name on its catalog rows (fleets share one catalog; default: the host name)",
        text_rule("a non-blank node name", optional=True), HTTP, metavar="NAME", show_default=False,
        doc_default="the host name"))
    heartbeat_seconds: float = setting(5.0, Setting(
        "seconds between this node's fleet heartbeats and desired-state checks", positive_float, HTTP))
    event_retention_days: float = setting(7.0, Setting(
        "drop this node's audit events older than this many days, checked every heartbeat (0: no age limit)",
        non_negative_float, HTTP))
    event_retention_rows: int = setting(100_000, Setting(
        "keep at most this many of this node's newest audit events (0: no cap); totals are kept",
        int_rule(0, INT64_MAX), HTTP))
    registry: str | None = setting_from(default_registry, Setting(
        "the fleet's OCI registry of engine bundles, oci://host[:port]/namespace: a cache miss pulls "
        f"the bundle from it before building (default: ${REGISTRY_ENV}; none)", registry_rule, CACHE,
        env=REGISTRY_ENV, env_help="the fleet's OCI registry of engine bundles (read when a config is built)",
        metavar="REF", show_default=False, doc_default="`$CACHESVC_REGISTRY` or none"))
    registry_insecure: bool = setting(False, Setting(
        "talk plain HTTP to --registry (loopback and tests); TLS otherwise", bool_rule, CACHE,
        action="store_true"))
    registry_push: bool = setting(False, Setting(
        "push every bundle this node builds (after its quality gate) to --registry", bool_rule, CACHE,
        action="store_true"))

    @property
    def registry_settings(self) -> RegistrySettings | None:
        """``--registry`` and its options for the cache (None: no registry)."""
        if self.registry is None:
            return None
        ref = parse_ref(self.registry)
        return RegistrySettings(ref, insecure=self.registry_insecure, push=self.registry_push)

    @property
    def node_name_resolved(self) -> str:
        """``--node-name``, or this machine's host name."""
        return self.node_name or socket.gethostname()


#: The groups by their ServeConfig attribute name.
SETTINGS_GROUPS: dict[str, type[Group]] = {
    "http": HttpSettings,
    "cache": CacheSettings,
    "build": BuildSettings,
    "serving": ServingSettings,
    "fleet": FleetSettings,
}
#: Every setting by name, and the group that holds it.
DECLARED: dict[str, Declared] = {d.name: d for g in SETTINGS_GROUPS.values() for d in declared(g)}
GROUP_OF: dict[str, str] = {d.name: g for g, cls in SETTINGS_GROUPS.items() for d in declared(cls)}
#: The cache options (``--cache-dir`` ...), which ``cachesvc`` also takes before a command.
CACHE_OPTIONS = tuple(d.name for d in DECLARED.values() if d.spec.section == CACHE)

#: Every ``CACHESVC_*`` variable cachesvc reads (the test suite's own variables are not cachesvc's
#: and are not declared here): the settings' own, then two test hooks.
ENVIRONMENT: tuple[EnvVar, ...] = (
    *(
        EnvVar(d.spec.env, d.spec.env_default, d.spec.env_help or d.spec.help,
               flag=None if d.spec.section is None else d.flag, setting=d.name)
        for d in DECLARED.values()
        if d.spec.env is not None
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
        "test only: SIGKILL the process at the named crash point (see cachesvc.cache.crashpoints, "
        "which reads it itself: it sits below every other module)",
    ),
)
_ENV_BY_NAME = {var.name: var for var in ENVIRONMENT}


def field_default(name: str) -> Any:
    """The fixed default of a setting (what ``--help`` shows)."""
    return DECLARED[name].default


def flag_for(name: str) -> str:
    """The CLI flag of a setting (``max_batch_size`` -> ``--max-batch-size``); for a setting
    without a flag, its environment variable (``prefill_chunk`` -> ``CACHESVC_PREFILL_CHUNK``)."""
    item = DECLARED.get(name)
    return item.flag if item is not None else "--" + name.replace("_", "-")
