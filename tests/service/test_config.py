"""Launch configuration: defaults, every rule (valid and invalid) through from_mapping and argparse."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.errors import ConfigError
from cachesvc.settings.config import ServeConfig, add_build_arguments, add_serve_arguments
from cachesvc.settings.groups import CACHE_DIR_ENV, DECLARED, ENVIRONMENT, GROUP_OF, SETTINGS_GROUPS, flag_for
from cachesvc.settings.speculative import SpeculativeConfig

# Written out from the brief on purpose (not read back from the module), so a changed default fails.
EXPECTED_DEFAULTS: dict[str, Any] = {
    "model": None,
    "registry": None,
    "registry_insecure": False,
    "registry_push": False,
    "host": "0.0.0.0",
    "port": 8000,
    "served_model_name": None,
    "api_key": None,
    "reasoning_parser": "auto",
    "tool_call_parser": "auto",
    "enable_auto_tool_choice": False,
    "max_queued_requests": 16,
    "queue_timeout": 600.0,
    "max_schema_bytes": 262144,
    "max_schema_properties": 2048,
    "grammar_compile_timeout": 10.0,
    "max_loaded_models": 3,
    "memory_budget_gb": None,
    "keep_alive": 300.0,
    "allowed_local_media_path": None,
    "allowed_media_domains": None,
    "log_level": "info",
    "engine_cache_max_size_gb": 50.0,
    "clear_engine_cache": False,
    "max_input_len": 4096,
    "max_batch_size": 4,
    "max_kv_cache_capacity": 8192,
    "draft_top_k": None,
    "draft_step": None,
    "verify_tree_size": None,
    "speculative_config": None,
    "enable_context_reuse": True,
    "context_cache_max_records": 1024,
    "context_cache_recurrent_snapshot_pool_bytes": 0,
    "context_cache_partial_kv_snapshot_pool_bytes": 0,
    "context_cache_disk_bytes": 1 << 30,
    "image_feature_cache_bytes": 64 << 20,
    "catalog_url": None,
    "node_name": None,
    "heartbeat_seconds": 5.0,
    "event_retention_days": 7.0,
    "event_retention_rows": 100_000,
    "admin_api_key": None,
    "allowed_hosts": None,
    "allowed_model_roots": None,
    "cors_allowed_origins": None,
    "backend": "auto",
    "precision": "auto",
    "kernels": "auto",
    "kv_cache_dtype": "fp32",
    "max_image_tokens": None,
    "max_image_tokens_per_image": None,
    "task": "generate",
    "pooling": None,
    "enable_lora": False,
    "lora_modules": (),
    "max_loras": 4,
}
# Settings without a flag, defaulted from the environment (unset here).
ENV_DEFAULTS: dict[str, Any] = {
    "gpu_disabled": False,
    "prefill_chunk": 256,
    "shutdown_grace_seconds": 30.0,
}
#: Compatibility flags that would change nothing: refused when given (see test_no_effect_*).
NO_EFFECT_ARGV: list[tuple[list[str], str]] = [
    (["--draft-top-k=2"], "--draft-top-k"),
    (["--verify-tree-size=16"], "--verify-tree-size"),
    (["--context-cache-recurrent-snapshot-pool-bytes=11"], "--context-cache-recurrent-snapshot-pool-bytes"),
    (["--draft-step=2"], "--draft-step"),
    (["--draft-step=2", "--speculative-config", '{"method": "mtp"}'], "--draft-step"),
    (["--draft-step=5", "--speculative-config", '{"method": "dflash", "model": "d"}'], "--draft-step"),
]
CONTEXT_FIELDS = (
    "context_cache_max_records",
    "context_cache_recurrent_snapshot_pool_bytes",
    "context_cache_partial_kv_snapshot_pool_bytes",
    "context_cache_disk_bytes",
)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    for var in ENVIRONMENT:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    # Wide help output: argparse wraps at hyphens otherwise, splitting flag names in help text.
    monkeypatch.setenv("COLUMNS", "1000")
    return home


def serve_parser(*, include_http: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachesvc serve")
    add_serve_arguments(parser, include_http=include_http)
    return parser


def from_argv(argv: list[str], parser: argparse.ArgumentParser | None = None) -> ServeConfig:
    return ServeConfig.from_namespace((parser or serve_parser()).parse_args(argv))


def setting(config: ServeConfig, name: str) -> Any:
    """The value of the setting ``name`` (read from its group)."""
    return getattr(getattr(config, GROUP_OF[name]), name)


def error_line(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    """argparse's error line without the prefix; the usage above it names every flag and would match
    anything, so tests look at this line only."""
    prefix = f"{prog}: error: "
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(prefix)]
    return line.removeprefix(prefix)


def argv_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The error text for argv: argparse's error (exit 2) or the ConfigError from from_namespace."""
    parser = serve_parser()
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        return error_line(capsys, "cachesvc serve")
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_namespace(namespace)
    return str(info.value)


def assert_config_error(exc: ConfigError, flag: str) -> None:
    assert exc.field == flag
    assert str(exc).startswith(f"{flag}: ")
    assert exc.detail


# --- defaults ------------------------------------------------------------------------------------


def test_every_field_has_an_expected_default() -> None:
    names = set(DECLARED)
    assert names == set(EXPECTED_DEFAULTS) | set(ENV_DEFAULTS) | {"cache_dir"}


@pytest.mark.parametrize("build", ["direct", "mapping", "argv"])
def test_defaults(build: str, _isolated_env: Path) -> None:
    config = {
        "direct": ServeConfig,
        "mapping": lambda: ServeConfig.from_mapping({}),
        "argv": lambda: from_argv([]),
    }[build]()
    for name, expected in {**EXPECTED_DEFAULTS, **ENV_DEFAULTS}.items():
        value = setting(config, name)
        assert value == expected and type(value) is type(expected), name
    assert config.cache.cache_dir == _isolated_env / ".cache" / "cachesvc"


def test_help_names_every_flag_and_shows_defaults() -> None:
    text = serve_parser().format_help()
    for name, default in EXPECTED_DEFAULTS.items():
        flag = flag_for(name)
        assert flag in text, flag
        if default is not None and not isinstance(default, bool | tuple):
            assert f"(default: {default})" in text, flag
    assert "(default: $CACHESVC_CACHE_DIR or ~/.cache/cachesvc)" in text
    assert "(default: sqlite:///<cache-dir>/catalog.sqlite3)" in text
    assert "(default: the model argument, or 'demo')" in text


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "from-env"))
    assert ServeConfig().cache.cache_dir == tmp_path / "from-env"
    assert from_argv([]).cache.cache_dir == tmp_path / "from-env"
    # The flag beats the environment.
    assert from_argv([f"--cache-dir={tmp_path / 'flag'}"]).cache.cache_dir == tmp_path / "flag"


def test_cache_dir_environment_is_expanded_and_blank_means_unset(
    monkeypatch: pytest.MonkeyPatch, _isolated_env: Path
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, "~/envcache")
    assert ServeConfig().cache.cache_dir == _isolated_env / "envcache"
    monkeypatch.setenv(CACHE_DIR_ENV, "  ")
    assert ServeConfig().cache.cache_dir == _isolated_env / ".cache" / "cachesvc"


@pytest.mark.parametrize("build", ["mapping", "argv", "direct"])
def test_cache_dir_expands_user(build: str, _isolated_env: Path) -> None:
    config = {
        "mapping": lambda: ServeConfig.from_mapping({"cache_dir": "~/c"}),
        "argv": lambda: from_argv(["--cache-dir", "~/c"]),
        "direct": lambda: ServeConfig(cache_dir=Path("~/c")),
    }[build]()
    assert config.cache.cache_dir == _isolated_env / "c"
    assert isinstance(config.cache.cache_dir, Path)


# --- every rule, valid ---------------------------------------------------------------------------

# (field, argv text, expected value); a mapping passes the expected value itself.
VALID: list[tuple[str, str, Any]] = [
    ("model", "org/model", "org/model"),
    ("model", "/ckpt/dir", "/ckpt/dir"),
    ("host", "127.0.0.1", "127.0.0.1"),
    ("host", "::", "::"),
    ("port", "1", 1),
    ("port", "65535", 65535),
    ("served_model_name", "my-model", "my-model"),
    ("api_key", "sk-123", "sk-123"),
    *[("reasoning_parser", v, v) for v in ("auto", "none", "qwen3", "deepseek_r1", "nemotron")],
    *[("tool_call_parser", v, v) for v in ("auto", "none", "generic", "hermes", "qwen3_xml")],
    ("max_queued_requests", "0", 0),
    ("max_queued_requests", "1000", 1000),
    ("queue_timeout", "0.5", 0.5),
    ("queue_timeout", "1e-3", 0.001),
    *[("log_level", v, v) for v in ("debug", "info", "warning", "error")],
    ("cache_dir", "/var/cache/x", Path("/var/cache/x")),
    ("engine_cache_max_size_gb", "0.001", 0.001),
    ("engine_cache_max_size_gb", "2000", 2000.0),
    ("max_input_len", "1", 1),
    ("max_input_len", "8192", 8192),
    ("max_batch_size", "64", 64),
    ("max_kv_cache_capacity", "4096", 4096),
    ("max_kv_cache_capacity", "131072", 131072),
    ("catalog_url", "sqlite:////var/lib/cachesvc/c.db", "sqlite:////var/lib/cachesvc/c.db"),
    ("catalog_url", "postgresql+psycopg://u@db:5432/cache", "postgresql+psycopg://u@db:5432/cache"),
    ("admin_api_key", "admin-secret", "admin-secret"),
    *[("backend", v, v) for v in ("auto", "onnxruntime", "tensorrt")],
    *[("precision", v, v) for v in ("auto", "fp32", "fp16", "int8")],
]


def _argv_for(name: str, text: str) -> list[str]:
    return [text] if name == "model" else [f"{flag_for(name)}={text}"]


@pytest.mark.parametrize(("name", "text", "expected"), VALID)
def test_valid_value_via_argv(name: str, text: str, expected: Any) -> None:
    value = setting(from_argv(_argv_for(name, text)), name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("name", "text", "expected"), VALID)
def test_valid_value_via_mapping(name: str, text: str, expected: Any) -> None:
    assert setting(ServeConfig.from_mapping({name: expected}), name) == expected


@pytest.mark.parametrize("flag", ["--enable-auto-tool-choice", "--clear-engine-cache"])
def test_bool_flags(flag: str) -> None:
    name = flag[2:].replace("-", "_")
    assert setting(from_argv([flag]), name) is True
    assert setting(from_argv([]), name) is False
    assert setting(ServeConfig.from_mapping({name: True}), name) is True


def test_context_reuse_is_on_by_default_and_both_spellings_parse() -> None:
    assert from_argv([]).serving.enable_context_reuse is True
    assert ServeConfig().serving.enable_context_reuse is True
    # The replaced server's opt-in flag keeps working (a no-op now), the new one opts out.
    assert from_argv(["--enable-context-reuse"]).serving.enable_context_reuse is True
    assert from_argv(["--no-enable-context-reuse"]).serving.enable_context_reuse is False
    assert ServeConfig.from_mapping({"enable-context-reuse": False}).serving.enable_context_reuse is False
    help_text = serve_parser().format_help()
    assert "--no-enable-context-reuse" in help_text and "llama-server" in help_text


def test_help_says_where_the_serving_defaults_differ_and_why() -> None:
    text = " ".join(serve_parser().format_help().split())
    assert "4, not the replaced server's 1" in text and "(default: 4)" in text
    assert "The replaced server kept it off" in text and "cache_salt" in text
    assert "0 = 512 MiB" in text


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("context_cache_max_records", 0),
        ("context_cache_max_records", 2**31 - 1),
        ("context_cache_recurrent_snapshot_pool_bytes", 0),
        ("context_cache_partial_kv_snapshot_pool_bytes", 1 << 30),
        ("context_cache_partial_kv_snapshot_pool_bytes", 2**63 - 1),
    ],
)
def test_context_cache_values_with_reuse(name: str, value: int) -> None:
    assert setting(from_argv(["--enable-context-reuse", f"{flag_for(name)}={value}"]), name) == value
    config = ServeConfig.from_mapping({"enable_context_reuse": True, name: value})
    assert setting(config, name) == value


def test_mapping_converts_only_unambiguous_types() -> None:
    config = ServeConfig.from_mapping({"max_batch_size": 4.0, "queue_timeout": 5, "cache_dir": "/x"})
    assert config.build.max_batch_size == 4 and type(config.build.max_batch_size) is int
    assert config.serving.queue_timeout == 5.0 and type(config.serving.queue_timeout) is float
    assert config.cache.cache_dir == Path("/x")
    # None for cache_dir means "the default", as it does on the command line.
    assert ServeConfig.from_mapping({"cache_dir": None}).cache.cache_dir == ServeConfig().cache.cache_dir


def test_direct_construction_normalises_floats() -> None:
    config = ServeConfig(queue_timeout=5, engine_cache_max_size_gb=2)
    assert type(config.serving.queue_timeout) is float
    assert type(config.cache.engine_cache_max_size_gb) is float


# --- every rule, invalid -------------------------------------------------------------------------

# (field, argv text); the error must name the flag.
INVALID_ARGV: list[tuple[str, str]] = [
    ("model", " "),
    ("host", ""),
    ("port", "0"),
    ("port", "65536"),
    ("port", "-1"),
    ("port", "http"),
    ("port", "80.5"),
    ("served_model_name", ""),
    ("api_key", ""),
    ("reasoning_parser", "deepseek"),
    ("reasoning_parser", "AUTO"),
    ("tool_call_parser", "json"),
    # Parser names other servers know but this one cannot parse: refused at flag validation,
    # before any build (serving would refuse them too).
    ("tool_call_parser", "openai"),
    ("tool_call_parser", "nemotron"),
    ("max_queued_requests", "-1"),
    ("max_queued_requests", "many"),
    ("queue_timeout", "0"),
    ("queue_timeout", "-5"),
    ("queue_timeout", "nan"),
    ("queue_timeout", "inf"),
    ("queue_timeout", "soon"),
    ("allowed_local_media_path", " "),
    ("log_level", "trace"),
    ("cache_dir", ""),
    ("engine_cache_max_size_gb", "0"),
    ("engine_cache_max_size_gb", "-1"),
    ("engine_cache_max_size_gb", "NaN"),
    ("engine_cache_max_size_gb", "-inf"),
    ("engine_cache_max_size_gb", "1e400"),
    ("max_input_len", "0"),
    ("max_input_len", "1.5"),
    ("max_batch_size", "0"),
    ("max_batch_size", "-2"),
    ("max_kv_cache_capacity", "0"),
    ("max_kv_cache_capacity", "big"),
    ("draft_top_k", "0"),
    ("draft_step", "-1"),
    ("verify_tree_size", "0"),
    ("verify_tree_size", "2.0"),
    ("speculative_config", "eagle3"),
    ("speculative_config", "{}"),
    ("catalog_url", "catalog.sqlite3"),
    ("catalog_url", ""),
    ("admin_api_key", ""),
    ("backend", "cuda"),
    ("precision", "fp8"),
]


@pytest.mark.parametrize(("name", "text"), INVALID_ARGV)
def test_invalid_value_via_argv_names_the_flag(
    name: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = argv_error(_argv_for(name, text), capsys)
    flag = flag_for(name)
    assert message.startswith((f"argument {flag}: ", f"{flag}: ")), message


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("context_cache_max_records", "-1"),
        ("context_cache_max_records", str(2**31)),
        ("context_cache_recurrent_snapshot_pool_bytes", "-1"),
        ("context_cache_recurrent_snapshot_pool_bytes", str(2**63)),
        ("context_cache_partial_kv_snapshot_pool_bytes", "-1"),
        ("context_cache_partial_kv_snapshot_pool_bytes", str(2**63)),
        ("context_cache_partial_kv_snapshot_pool_bytes", "lots"),
    ],
)
def test_invalid_context_cache_value_via_argv(
    name: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = argv_error(["--enable-context-reuse", f"{flag_for(name)}={text}"], capsys)
    assert flag_for(name) in message
    assert "--enable-context-reuse" not in message  # the range rule fires, not the dependency rule


# (field, value) passed through from_mapping.
INVALID_MAPPING: list[tuple[str, Any]] = [
    ("model", ""),
    ("model", 3),
    ("host", ""),
    ("host", None),
    ("host", 8080),
    ("port", 0),
    ("port", 65536),
    ("port", True),
    ("port", "8000"),
    ("port", 8000.5),
    ("port", None),
    ("served_model_name", "  "),
    ("api_key", ""),
    ("api_key", 123),
    ("reasoning_parser", "bogus"),
    ("reasoning_parser", None),
    ("tool_call_parser", "Hermes"),
    ("enable_auto_tool_choice", "yes"),
    ("enable_auto_tool_choice", 1),
    ("max_queued_requests", -1),
    ("max_queued_requests", False),
    ("queue_timeout", 0),
    ("queue_timeout", -1.0),
    ("queue_timeout", math.nan),
    ("queue_timeout", math.inf),
    ("queue_timeout", "600"),
    ("queue_timeout", True),
    ("queue_timeout", None),
    ("allowed_local_media_path", ""),
    ("log_level", "INFO"),
    ("cache_dir", ""),
    ("cache_dir", 5),
    ("engine_cache_max_size_gb", 0.0),
    ("engine_cache_max_size_gb", -math.inf),
    ("clear_engine_cache", "false"),
    ("max_input_len", 0),
    ("max_input_len", 1.5),
    ("max_input_len", "4096"),
    ("max_batch_size", True),
    ("max_batch_size", -1),
    ("max_batch_size", None),
    ("max_kv_cache_capacity", 0),
    ("draft_top_k", 0),
    ("draft_top_k", True),
    ("draft_step", 2.5),
    ("verify_tree_size", -3),
    ("speculative_config", 7),
    ("speculative_config", ["eagle3"]),
    ("speculative_config", "not json"),
    ("enable_context_reuse", None),
    ("catalog_url", "nope"),
    ("catalog_url", 5),
    ("admin_api_key", " "),
    ("backend", "cpu"),
    ("precision", "fp8"),
    ("precision", None),
]


@pytest.mark.parametrize(("name", "value"), INVALID_MAPPING)
def test_invalid_value_via_mapping_names_the_flag(name: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({name: value})
    assert_config_error(info.value, flag_for(name))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("context_cache_max_records", -1),
        ("context_cache_max_records", 2**31),
        ("context_cache_max_records", True),
        ("context_cache_recurrent_snapshot_pool_bytes", -1),
        ("context_cache_recurrent_snapshot_pool_bytes", 2**63),
        ("context_cache_partial_kv_snapshot_pool_bytes", 2**63),
        ("context_cache_partial_kv_snapshot_pool_bytes", 1.5),
    ],
)
def test_invalid_context_cache_value_via_mapping(name: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"enable_context_reuse": True, name: value})
    assert_config_error(info.value, flag_for(name))
    assert "--enable-context-reuse" not in str(info.value)


def test_error_message_shape() -> None:
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"max_batch_size": 0})
    assert str(info.value) == "--max-batch-size: must be a positive integer, got 0"


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError) as info:
        ServeConfig(port=0)
    assert_config_error(info.value, "--port")
    with pytest.raises(ConfigError) as info:
        ServeConfig(speculative_config='{"method": "mtp"}')
    assert_config_error(info.value, "--speculative-config")
    assert "SpeculativeConfig.parse" in str(info.value)


@settings(max_examples=60, deadline=None)
@given(port=st.integers(min_value=-(2**70), max_value=2**70))
def test_port_range_property(port: int) -> None:
    if 1 <= port <= 65535:
        assert ServeConfig(port=port).http.port == port
    else:
        with pytest.raises(ConfigError, match="--port"):
            ServeConfig(port=port)


@settings(max_examples=60, deadline=None)
@given(records=st.integers(min_value=-(2**40), max_value=2**40))
def test_context_records_range_property(records: int) -> None:
    if 0 <= records <= 2**31 - 1:
        config = ServeConfig(enable_context_reuse=True, context_cache_max_records=records)
        assert config.serving.context_cache_max_records == records
    else:
        with pytest.raises(ConfigError, match="--context-cache-max-records"):
            ServeConfig(enable_context_reuse=True, context_cache_max_records=records)


# --- rules across flags --------------------------------------------------------------------------


def test_max_input_len_must_fit_kv_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    ok = from_argv(["--max-input-len=4096", "--max-kv-cache-capacity=4096"])
    assert ok.build.max_input_len == ok.build.max_kv_cache_capacity == 4096
    message = argv_error(["--max-input-len=5000", "--max-kv-cache-capacity=4096"], capsys)
    assert message.startswith("--max-input-len: ") and "--max-kv-cache-capacity" in message
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"max_input_len": 8193})
    assert_config_error(info.value, "--max-input-len")
    assert "8193" in str(info.value) and "8192" in str(info.value)


@pytest.mark.parametrize("name", CONTEXT_FIELDS)
def test_context_cache_flags_need_context_reuse(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    changed = 7 if EXPECTED_DEFAULTS[name] != 7 else 8
    message = argv_error(["--no-enable-context-reuse", f"{flag_for(name)}={changed}"], capsys)
    assert message.startswith(f"{flag_for(name)}: ") and "--no-enable-context-reuse" in message
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"enable_context_reuse": False, name: changed})
    assert_config_error(info.value, flag_for(name))
    # Restating the default is not a change.
    off = ServeConfig.from_mapping({"enable_context_reuse": False, name: EXPECTED_DEFAULTS[name]})
    assert setting(off, name) == EXPECTED_DEFAULTS[name]
    if name == "context_cache_recurrent_snapshot_pool_bytes":
        return  # with reuse on it has no effect: refused (test_no_effect_flags_are_refused)
    # Reuse is on by default: the flag alone is fine, and so is it next to the old opt-in flag.
    assert setting(from_argv([f"{flag_for(name)}={changed}"]), name) == changed
    assert setting(from_argv(["--enable-context-reuse", f"{flag_for(name)}={changed}"]), name) == changed


# --- speculative config --------------------------------------------------------------------------

VALID_SPEC: list[tuple[str, SpeculativeConfig]] = [
    ('{"method": "mtp"}', SpeculativeConfig("mtp")),
    ('{"method": "mtp", "num_speculative_tokens": 2}', SpeculativeConfig("mtp", 2)),
    ('{"method": "mtp", "model": "org/mtp-head"}', SpeculativeConfig("mtp", model="org/mtp-head")),
    (
        '{"method": "eagle3", "model": "org/eagle", "num_speculative_tokens": 3}',
        SpeculativeConfig("eagle3", 3, "org/eagle"),
    ),
    ('{"model": "/d", "method": "dflash"}', SpeculativeConfig("dflash", model="/d")),
    (
        '{"method": "jetspec", "model": "j", "num_speculative_tokens": 1}',
        SpeculativeConfig("jetspec", 1, "j"),
    ),
    ('{"method": "dspark", "model": "d"}', SpeculativeConfig("dspark", model="d")),
    ('{"method": "ngram"}', SpeculativeConfig("ngram")),
    (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}',
        SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=3),
    ),
    ('{"method": "ngram", "prompt_lookup_max": 3}', SpeculativeConfig("ngram", prompt_lookup_max=3)),
    ('{"method": "draft_model", "model": "org/small"}', SpeculativeConfig("draft_model", model="org/small")),
]


@pytest.mark.parametrize(("text", "expected"), VALID_SPEC)
def test_valid_speculative_config(text: str, expected: SpeculativeConfig) -> None:
    assert SpeculativeConfig.parse(text) == expected
    assert SpeculativeConfig.parse(json.loads(text)) == expected
    assert ServeConfig.from_mapping({"speculative_config": text}).build.speculative_config == expected
    dashed = ServeConfig.from_mapping({"speculative-config": json.loads(text)})
    assert dashed.build.speculative_config == expected
    assert from_argv(["--speculative-config", text]).build.speculative_config == expected


# (text, a fragment the message must contain)
INVALID_SPEC: list[tuple[str, str]] = [
    ("eagle3", "invalid JSON"),
    ("{method: eagle3}", "invalid JSON"),
    ('["eagle3"]', "JSON object"),
    ('"eagle3"', "JSON object"),
    ("null", "JSON object"),
    ("{}", "'method' is required"),
    ('{"model": "m"}', "'method' is required"),
    ('{"method": "medusa", "model": "m"}', "'method' must be one of"),
    ('{"method": null, "model": "m"}', "'method' must be one of"),
    ('{"method": "eagle3"}', "needs a draft model"),
    ('{"method": "dflash", "num_speculative_tokens": 2}', "needs a draft model"),
    ('{"method": "eagle3", "model": ""}', "'model' must be a non-blank"),
    ('{"method": "mtp", "model": "   "}', "'model' must be a non-blank"),
    ('{"method": "eagle3", "model": 5}', "'model' must be a non-blank"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be a positive integer"),
    (
        '{"method": "mtp", "num_speculative_tokens": -1}',
        "'num_speculative_tokens' must be a positive integer",
    ),
    ('{"method": "mtp", "num_speculative_tokens": true}', "'num_speculative_tokens' must be a positive"),
    ('{"method": "mtp", "num_speculative_tokens": 2.0}', "'num_speculative_tokens' must be a positive"),
    ('{"method": "mtp", "num_speculative_tokens": "3"}', "'num_speculative_tokens' must be a positive"),
    ('{"method": "mtp", "draft_model": "x"}', "unknown key 'draft_model'"),
    ('{"method": "mtp", "method": "eagle3"}', "'method' appears more than once"),
    ('{"method": "draft_model"}', "needs a draft model"),
    ('{"method": "ngram", "model": "m"}', "uses no draft model"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "'prompt_lookup_min' must be a positive integer"),
    ('{"method": "ngram", "prompt_lookup_max": 2.5}', "'prompt_lookup_max' must be a positive integer"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"method": "draft_model", "model": "m", "prompt_lookup_max": 2}', "applies to method 'ngram' only"),
]


@pytest.mark.parametrize(("text", "fragment"), INVALID_SPEC)
def test_invalid_speculative_config(text: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse(text)
    assert_config_error(info.value, "--speculative-config")
    assert fragment in str(info.value)
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"speculative_config": text})
    assert_config_error(info.value, "--speculative-config")
    message = argv_error(["--speculative-config", text], capsys)
    assert "--speculative-config" in message and fragment in message


def test_speculative_config_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpeculativeConfig("eagle3")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig("mtp", num_speculative_tokens=True)


def _speculative_configs() -> st.SearchStrategy[SpeculativeConfig]:
    non_blank = st.text(min_size=1, max_size=40).filter(lambda s: bool(s.strip()))
    tokens = st.none() | st.integers(min_value=1, max_value=2**63)

    def for_method(method: str) -> st.SearchStrategy[SpeculativeConfig]:
        model = (st.none() | non_blank) if method == "mtp" else non_blank
        return st.builds(
            SpeculativeConfig, method=st.just(method), num_speculative_tokens=tokens, model=model
        )

    return st.sampled_from(["eagle3", "mtp", "dflash", "jetspec", "dspark"]).flatmap(for_method)


@settings(max_examples=150, deadline=None)
@given(spec=_speculative_configs())
def test_speculative_config_round_trip(spec: SpeculativeConfig) -> None:
    text = spec.to_json()
    assert SpeculativeConfig.parse(text) == spec
    assert SpeculativeConfig.parse(json.loads(text)) == spec
    assert ServeConfig.from_mapping({"speculative_config": text}).build.speculative_config == spec


@pytest.mark.parametrize(
    ("spec", "draft_step", "expected"),
    [
        (None, None, None),
        ('{"method": "eagle3", "model": "e", "num_speculative_tokens": 3}', None, 3),
        ('{"method": "mtp", "num_speculative_tokens": 2}', None, 2),
        ('{"method": "dflash", "model": "d", "num_speculative_tokens": 3}', None, None),
        ('{"method": "jetspec", "model": "j", "num_speculative_tokens": 3}', None, None),
        ('{"method": "ngram", "num_speculative_tokens": 3}', 5, 3),
        ('{"method": "ngram"}', 5, 5),
        ('{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}', None, 2),
    ],
)
def test_effective_draft_step(spec: str | None, draft_step: int | None, expected: int | None) -> None:
    argv = [] if spec is None else ["--speculative-config", spec]
    argv += [] if draft_step is None else [f"--draft-step={draft_step}"]
    config = from_argv(argv)
    assert config.build.effective_draft_step == expected
    assert config.build.draft_step == draft_step


# --- from_mapping keys, from_namespace, parsers -------------------------------------------------


def test_unknown_option_rejected_by_name() -> None:
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"port": 9000, "foo": 1})
    assert info.value.field == "foo"
    assert "unknown option 'foo'" in str(info.value)
    assert "known: " in str(info.value) and "max_batch_size" in str(info.value)


def test_unknown_option_suggests_the_close_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'max_batch_size'"):
        ServeConfig.from_mapping({"max-batch-sise": 2})


def test_dashed_and_flag_names_accepted() -> None:
    config = ServeConfig.from_mapping({"max-batch-size": 4, "--port": 9000, "log_level": "debug"})
    assert (config.build.max_batch_size, config.http.port, config.http.log_level) == (4, 9000, "debug")


def test_same_option_twice_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping({"max_batch_size": 2, "max-batch-size": 4})
    assert_config_error(info.value, "--max-batch-size")
    assert "given twice" in str(info.value)


def test_non_string_key_rejected() -> None:
    with pytest.raises(ConfigError, match="option names must be strings"):
        ServeConfig.from_mapping({1: "x"})  # type: ignore[dict-item]


def test_from_namespace_ignores_other_attributes() -> None:
    namespace = serve_parser().parse_args(["org/m", "--port=9001"])
    namespace.command = "serve"
    namespace.handler = print
    config = ServeConfig.from_namespace(namespace)
    assert (config.build.model, config.http.port) == ("org/m", 9001)


def test_full_command_line() -> None:
    config = from_argv(
        [
            "org/model",
            "--host=127.0.0.1",
            "--port=8123",
            "--served-model-name=m",
            "--api-key=k",
            "--admin-api-key=a",
            "--reasoning-parser=qwen3",
            "--tool-call-parser=hermes",
            "--enable-auto-tool-choice",
            "--max-queued-requests=3",
            "--queue-timeout=2.5",
            "--log-level=debug",
            "--cache-dir=/c",
            "--engine-cache-max-size-gb=1.5",
            "--clear-engine-cache",
            "--max-input-len=512",
            "--max-batch-size=4",
            "--max-kv-cache-capacity=1024",
            '--speculative-config={"method": "mtp"}',
            "--enable-context-reuse",
            "--context-cache-max-records=10",
            "--context-cache-recurrent-snapshot-pool-bytes=0",
            "--context-cache-partial-kv-snapshot-pool-bytes=12",
            "--catalog-url=sqlite:///x.db",
            "--backend=onnxruntime",
            "--precision=fp16",
        ]
    )
    assert config == ServeConfig(
        model="org/model",
        host="127.0.0.1",
        port=8123,
        served_model_name="m",
        api_key="k",
        admin_api_key="a",
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        max_queued_requests=3,
        queue_timeout=2.5,
        log_level="debug",
        cache_dir=Path("/c"),
        engine_cache_max_size_gb=1.5,
        clear_engine_cache=True,
        max_input_len=512,
        max_batch_size=4,
        max_kv_cache_capacity=1024,
        speculative_config=SpeculativeConfig("mtp"),
        enable_context_reuse=True,
        context_cache_max_records=10,
        context_cache_recurrent_snapshot_pool_bytes=0,
        context_cache_partial_kv_snapshot_pool_bytes=12,
        catalog_url="sqlite:///x.db",
        backend="onnxruntime",
        precision="fp16",
    )


def test_without_http_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = serve_parser(include_http=False)
    config = from_argv(["org/m", "--max-batch-size=2"], parser)
    assert (config.build.model, config.build.max_batch_size, config.http.port) == ("org/m", 2, 8000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--port=9000"])
    assert error_line(capsys, "cachesvc serve") == "unrecognized arguments: --port=9000"


def test_build_arguments_only(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="cachesvc prepare")
    parser.add_argument("model")
    add_build_arguments(parser)
    text = parser.format_help()
    for flag in (
        "--cache-dir",
        "--catalog-url",
        "--engine-cache-max-size-gb",
        "--backend",
        "--precision",
        "--max-input-len",
        "--max-batch-size",
        "--max-kv-cache-capacity",
        "--speculative-config",
        "--draft-top-k",
        "--draft-step",
        "--verify-tree-size",
    ):
        assert flag in text
    for flag in ("--port", "--api-key", "--enable-context-reuse", "--log-level"):
        assert flag not in text
    config = from_argv(["org/m", "--max-input-len=100", "--backend=tensorrt"], parser)
    assert (config.build.model, config.build.max_input_len, config.build.backend, config.http.port) == (
        "org/m",
        100,
        "tensorrt",
        8000,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["org/m", "--max-batch-size=0"])
    assert error_line(capsys, "cachesvc prepare").startswith("argument --max-batch-size: must be a positive")


# --- derived values ------------------------------------------------------------------------------


def test_catalog_url_resolved_default_opens_a_real_sqlite_file(tmp_path: Path) -> None:
    config = ServeConfig(cache_dir=tmp_path / "cache")
    assert config.cache.catalog_url_resolved == f"sqlite:///{tmp_path / 'cache' / 'catalog.sqlite3'}"
    (tmp_path / "cache").mkdir()
    engine = sqlalchemy.create_engine(config.cache.catalog_url_resolved)
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text("CREATE TABLE t (x INTEGER)"))
    engine.dispose()
    assert (tmp_path / "cache" / "catalog.sqlite3").is_file()


def test_catalog_url_resolved_explicit() -> None:
    url = "postgresql+psycopg://u@h/db"
    assert ServeConfig(catalog_url=url).cache.catalog_url_resolved == url


@pytest.mark.parametrize(
    ("gb", "expected"), [(50.0, 50_000_000_000), (0.5, 500_000_000), (1.5, 1_500_000_000), (3, 3_000_000_000)]
)
def test_engine_cache_max_size_bytes(gb: float, expected: int) -> None:
    assert ServeConfig(engine_cache_max_size_gb=gb).cache.engine_cache_max_size_bytes == expected


@pytest.mark.parametrize(
    ("model", "served", "expected"),
    [(None, None, "demo"), ("org/m", None, "org/m"), ("org/m", "alias", "alias"), (None, "alias", "alias")],
)
def test_served_name(model: str | None, served: str | None, expected: str) -> None:
    assert ServeConfig(model=model, served_model_name=served).served_name == expected


def test_profile_request() -> None:
    config = ServeConfig.from_mapping(
        {
            "backend": "onnxruntime",
            "precision": "int8",
            "max_input_len": 100,
            "max_batch_size": 2,
            "max_kv_cache_capacity": 200,
            "speculative_config": {"method": "eagle3", "model": "org/draft"},
        }
    )
    request = config.profile_request()
    assert (request.backend, request.precision) == ("onnxruntime", "int8")
    assert (request.max_input_len, request.max_batch_size, request.max_kv_cache_capacity) == (100, 2, 200)
    assert (request.speculative_method, request.draft_model) == ("eagle3", "org/draft")
    plain = ServeConfig().profile_request()
    assert (plain.speculative_method, plain.draft_model) == (None, None)


def test_frozen() -> None:
    config = ServeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.http.port = 1  # type: ignore[misc]
    spec = SpeculativeConfig("mtp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.method = "eagle3"  # type: ignore[misc]


def test_repr_masks_secrets() -> None:
    config = ServeConfig(
        api_key="sk-very-secret",
        admin_api_key="adm-very-secret",
        catalog_url="postgresql://user:pw-very-secret@db/cache",
    )
    text = repr(config)
    assert "very-secret" not in text
    assert "api_key='***'" in text and "postgresql://user:***@db/cache" in text
    assert "api_key=None" in repr(ServeConfig())


def test_admin_key_must_differ_from_api_key() -> None:
    with pytest.raises(ConfigError, match=r"--admin-api-key.*differ"):
        ServeConfig.from_mapping({"api_key": "same", "admin_api_key": "same"})
    cfg = ServeConfig.from_mapping({"api_key": "a", "admin_api_key": "b"})
    assert (cfg.http.api_key, cfg.http.admin_api_key) == ("a", "b")


def test_help_shows_real_defaults_never_none() -> None:
    """A flag whose parser default is None (so a value given before the command wins) still shows
    the real default; optional flags without one show no default at all."""
    text = serve_parser().format_help()
    assert "(default: None)" not in text
    assert f"(default: {ServeConfig().cache.engine_cache_max_size_gb})" in " ".join(text.split())


@pytest.mark.parametrize("method", ['{"method": "ngram"}', '{"method": "draft_model", "model": "d"}'])
@pytest.mark.parametrize("flag", ["--draft-top-k", "--verify-tree-size"])
def test_tree_flags_are_refused_for_chain_methods(method: str, flag: str) -> None:
    with pytest.raises(ConfigError, match="one chain") as info:
        from_argv(["--speculative-config", method, f"{flag}=2"])
    assert_config_error(info.value, flag)
    # No tree method decodes in this version: with one they are refused as having no effect.
    with pytest.raises(ConfigError, match="has no effect") as info:
        from_argv(["--speculative-config", '{"method": "mtp"}', f"{flag}=2"])
    assert_config_error(info.value, flag)


# --- flags accepted for compatibility that would change nothing ----------------------------------


@pytest.mark.parametrize(("argv", "flag"), NO_EFFECT_ARGV)
def test_no_effect_flags_are_refused(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    message = argv_error(argv, capsys)
    assert message.startswith(f"{flag}: has no effect in this version (")
    assert message.endswith(f"drop {flag}")
    name = flag[2:].replace("-", "_")
    value = 16
    with pytest.raises(ConfigError, match="has no effect") as info:
        ServeConfig.from_mapping({name: value})
    assert_config_error(info.value, flag)


def test_no_effect_flags_at_their_default_and_draft_step_with_a_chain_method_are_accepted() -> None:
    config = from_argv(["--context-cache-recurrent-snapshot-pool-bytes=0"])
    assert config.serving.context_cache_recurrent_snapshot_pool_bytes == 0
    for spec in ('{"method": "ngram"}', '{"method": "draft_model", "model": "d"}'):
        config = from_argv(["--speculative-config", spec, "--draft-step=4"])
        assert config.build.draft_step == config.build.effective_draft_step == 4
    # --help still documents them (CLI compatibility: the names parse, the refusal names them).
    text = serve_parser().format_help()
    for flag in ("--draft-top-k", "--draft-step", "--verify-tree-size",
                 "--context-cache-recurrent-snapshot-pool-bytes"):
        assert flag in text


# --- groups and the environment ------------------------------------------------------------------


def test_media_settings_give_the_image_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--allowed-local-media-path must be an existing directory; the hosts are lowered."""
    config = from_argv([f"--allowed-local-media-path={tmp_path}",
                        "--allowed-media-domains=Img.Example.com,h2"])
    policy = config.http.media_policy()
    assert (policy.local_root, policy.domains) == (tmp_path, ("img.example.com", "h2"))
    message = argv_error([f"--allowed-local-media-path={tmp_path / 'nope'}"], capsys)
    assert message.startswith("--allowed-local-media-path:") and "not an existing directory" in message
    assert from_argv([]).http.media_policy().local_root is None


def test_every_setting_is_in_exactly_one_group() -> None:
    assert [f.name for f in dataclasses.fields(ServeConfig)] == list(SETTINGS_GROUPS)
    seen: dict[str, str] = {}
    for group, cls in SETTINGS_GROUPS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in seen, f"{f.name} is in {seen[f.name]} and {group}"
            assert DECLARED[f.name].spec.help.strip(), f.name
            seen[f.name] = group
    assert seen == GROUP_OF
    expected = set(EXPECTED_DEFAULTS) | set(ENV_DEFAULTS) | {"cache_dir"}
    assert set(seen) == expected, f"not in any group: {sorted(expected - set(seen))}"


def test_group_views_carry_the_values() -> None:
    config = from_argv(["org/m", "--port=9001", "--keep-alive=5", "--node-name=n1", "--cache-dir=/c",
                        "--precision=fp32"])
    assert (config.http.port, config.serving.keep_alive, config.fleet.node_name) == (9001, 5.0, "n1")
    assert (config.cache.cache_dir, config.build.model) == (Path("/c"), "org/m")
    assert config.build.precision == "fp32"
    assert config.serving.prefill_chunk == 256 and config.serving.shutdown_grace_seconds == 30.0


@pytest.mark.parametrize(
    ("var", "text", "name", "expected"),
    [
        ("CACHESVC_PREFILL_CHUNK", "64", "prefill_chunk", 64),
        ("CACHESVC_SHUTDOWN_GRACE_SECONDS", "2.5", "shutdown_grace_seconds", 2.5),
        ("CACHESVC_SHUTDOWN_GRACE_SECONDS", "0", "shutdown_grace_seconds", 0.0),
        ("CACHESVC_DISABLE_GPU", "1", "gpu_disabled", True),
        ("CACHESVC_DISABLE_GPU", " ", "gpu_disabled", False),
        ("CACHESVC_PREFILL_CHUNK", "", "prefill_chunk", 256),
    ],
)
def test_settings_from_the_environment(
    var: str, text: str, name: str, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(var, text)
    for config in (ServeConfig(), ServeConfig.from_mapping({}), from_argv([])):
        assert setting(config, name) == expected
    # A value given in code wins over the environment; replace() keeps the value read once.
    other = {"prefill_chunk": 8, "shutdown_grace_seconds": 1.0, "gpu_disabled": not expected}[name]
    assert setting(ServeConfig.from_mapping({name: other}), name) == other
    # A setting by name goes to its group (mypy knows the groups only).
    assert setting(dataclasses.replace(ServeConfig(), port=1), name) == expected  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("var", "text", "fragment"),
    [
        ("CACHESVC_PREFILL_CHUNK", "abc", "must be a positive integer, got 'abc'"),
        ("CACHESVC_PREFILL_CHUNK", "0", "must be a positive integer, got 0"),
        ("CACHESVC_SHUTDOWN_GRACE_SECONDS", "soon", "must be seconds"),
        ("CACHESVC_SHUTDOWN_GRACE_SECONDS", "-1", "must be a finite number, 0 or more"),
    ],
)
def test_invalid_environment_names_the_variable(
    var: str, text: str, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ConfigError) as info:
        ServeConfig()
    assert info.value.field == var
    assert str(info.value).startswith(f"{var}: ") and fragment in str(info.value)


def test_every_variable_is_declared_with_a_default_and_help() -> None:
    names = [var.name for var in ENVIRONMENT]
    assert len(names) == len(set(names))
    fields = set(DECLARED)
    for var in ENVIRONMENT:
        assert var.name.startswith("CACHESVC_") and var.help.strip()
        assert var.setting is None or var.setting in fields
        if var.setting in ENV_DEFAULTS:
            assert flag_for(var.setting) == var.name
    # Settings with a flag and a variable: the cache root and the fleet's registry.
    both = {"cache_dir", "registry"}
    assert {var.setting for var in ENVIRONMENT if var.setting} == set(ENV_DEFAULTS) | both


# --- --task embed ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag", "words"), [
    (["--pooling", "mean"], "--pooling", "applies only with --task embed"),
    (["--task", "embed", "--precision", "int4"], "--precision", "builds fp32 only"),
    (["--task", "embed", "--backend", "tensorrt"], "--backend", "onnxruntime backend"),
    (["--task", "embed", "--speculative-config", '{"method": "ngram"}'], "--speculative-config",
     "generates none"),
])
def test_embed_flags_that_cannot_work_are_refused(argv: list[str], flag: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        from_argv(argv)
    assert_config_error(info.value, flag)


def test_task_embed_asks_for_an_embedding_profile() -> None:
    request = from_argv(["--task", "embed", "--pooling", "mean"]).profile_request()
    assert (request.task, request.pooling) == ("embed", "mean")
    assert ServeConfig().profile_request().task == "generate"


# --- LoRA -----------------------------------------------------------------------------------------


def test_lora_modules_parse_in_both_forms_and_imply_lora_bundles() -> None:
    config = from_argv(["--lora-modules", "sql=/adapters/sql", "--lora-modules",
                        '{"name": "chat", "path": "org/chat-lora"}'])
    assert config.serving.lora_modules == ("sql=/adapters/sql", "chat=org/chat-lora")
    assert config.profile_request().lora is True
    assert ServeConfig().profile_request().lora is False
    assert from_argv(["--enable-lora"]).profile_request().lora is True


@pytest.mark.parametrize(("argv", "flag", "words"), [
    (["--lora-modules", "nopath"], "--lora-modules", "is not NAME=PATH"),
    (["--lora-modules", "a=/x", "--lora-modules", "a=/y"], "--lora-modules", "twice"),
    (["--lora-modules", "=/x"], "--lora-modules", "must be 1-128"),
    (["--lora-modules", "a=/x", "--lora-modules", "b=/y", "--max-loras", "1"], "--lora-modules",
     "raise --max-loras"),
    (["--lora-modules", "a=/x", "--task", "embed"], "--lora-modules", "text models"),
    (["--enable-lora", "--backend", "tensorrt"], "--backend", "onnxruntime backend"),
    (["--lora-modules", '{"name": "a"}'], "--lora-modules", "needs string"),
])
def test_lora_flags_that_cannot_work_are_refused(argv: list[str], flag: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        from_argv(argv)
    assert_config_error(info.value, flag)
