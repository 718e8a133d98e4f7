"""Every copy of the profile and listing vocabularies derives from its one home.

The HTTP schema's ``Literal`` types have to be written out (type checkers read them as text),
and argparse keeps its own ``choices``: these tests fail when either drifts from the registry,
so ``prepare``, ``serve`` and ``POST /admin/builds`` keep asking for the same bundles.
"""

from __future__ import annotations

import argparse
from typing import get_args, get_type_hints

import pytest

from cachesvc.cache.profiles import BuildOptions, ProfileRequest
from cachesvc.cache.records import SORT_KEYS, SORT_ORDERS
from cachesvc.cli.parser import build_parser
from cachesvc.http import schemas
from cachesvc.settings import config
from inference import build_profile as reg
from inference.builder.spec import EngineBuildSpec
from inference.openai.reasoning import REASONING_PARSERS
from inference.openai.tool_parsers import TOOL_PARSERS


def _choices(parser: argparse.ArgumentParser, dest: str) -> tuple[str, ...]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                try:
                    return _choices(sub, dest)
                except LookupError:
                    continue
        elif action.dest == dest and action.choices is not None:
            return tuple(action.choices)
    raise LookupError(dest)


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    config.add_serve_arguments(parser)
    return parser


def test_http_build_request_literals_equal_the_registry() -> None:
    hints = get_type_hints(schemas.BuildRequest, include_extras=True)
    assert get_args(hints["backend"]) == reg.BACKEND_CHOICES
    assert get_args(hints["precision"]) == reg.PRECISION_CHOICES
    method = [a for a in get_args(hints["speculative_method"]) if a is not type(None)]
    assert get_args(method[0]) == reg.SPECULATIVE_METHODS
    assert get_args(hints["task"]) == reg.TASKS
    pooling = [a for a in get_args(hints["pooling"]) if a is not type(None)]
    assert get_args(pooling[0]) == reg.POOLING_METHODS
    assert get_args(hints["kernels"]) == reg.KERNEL_MODES
    assert get_args(hints["kv_cache_dtype"]) == reg.KV_CACHE_DTYPES
    assert get_args(schemas.BackendName) == reg.BACKENDS
    assert get_args(schemas.SortKey) == SORT_KEYS
    assert get_args(schemas.SortOrder) == SORT_ORDERS


def test_profile_defaults_are_the_registry_defaults_everywhere() -> None:
    expected = {name: default for name, (default, _) in reg.SHAPE_LIMITS.items()}
    request = schemas.BuildRequest(model="m")
    serve = config.ServeConfig()
    for name, value in expected.items():
        assert getattr(request, name) == value, f"BuildRequest.{name}"
        assert getattr(getattr(serve, config.GROUP_OF[name]), name) == value, f"ServeConfig.{name}"
        assert getattr(ProfileRequest(), name) == value, f"ProfileRequest.{name}"
        assert getattr(BuildOptions(), name) == value, f"BuildOptions.{name}"
        assert getattr(EngineBuildSpec(), name) == value, f"EngineBuildSpec.{name}"
    # The argparse defaults shown by --help are the same values.
    parsed = _serve_parser().parse_args([])
    for name, value in expected.items():
        assert getattr(parsed, name) == value


def test_http_limits_equal_the_registry_limits() -> None:
    hints = get_type_hints(schemas.BuildRequest, include_extras=True)
    for name, (_, upper) in reg.SHAPE_LIMITS.items():
        meta = [m for m in get_args(hints[name])[1:] if hasattr(m, "le")]
        assert meta and meta[0].le == upper and meta[0].ge == 1, name


def test_cli_choices_equal_the_registries() -> None:
    parser = _serve_parser()
    assert _choices(parser, "backend") == reg.BACKEND_CHOICES
    assert _choices(parser, "precision") == reg.PRECISION_CHOICES
    assert _choices(parser, "reasoning_parser") == ("auto", "none", *REASONING_PARSERS)
    assert _choices(parser, "tool_call_parser") == ("auto", "none", *TOOL_PARSERS)
    full = build_parser()
    assert _choices(full, "sort") == SORT_KEYS
    assert _choices(full, "order") == SORT_ORDERS


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_input_len": 0}, "max_input_len"),
        ({"max_batch_size": reg.MAX_BATCH_SIZE_LIMIT + 1}, "max_batch_size"),
        ({"max_input_len": 64, "max_kv_cache_capacity": 32}, "max_input_len"),
        ({"backend": "cuda"}, "backend"),
        ({"precision": "int3"}, "precision"),
    ],
)
def test_one_rule_gives_one_answer(kwargs: dict[str, object], field: str) -> None:
    """The registry's rule, the cache's profile and the launch config refuse the same values."""
    from cachesvc.errors import ConfigError

    with pytest.raises(ConfigError) as request_err:
        ProfileRequest(**kwargs)  # type: ignore[arg-type]
    assert request_err.value.field == field
    with pytest.raises(ConfigError) as config_err:
        config.ServeConfig(**kwargs)  # type: ignore[arg-type]
    assert config_err.value.field == config.flag_for(field)


def test_domain_errors_name_fields_and_the_cli_names_flags() -> None:
    from cachesvc.cache.builders import resolve_precision
    from cachesvc.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve_precision("fp16", "onnxruntime")
    assert err.value.field == "precision"
    assert config.cli_message(err.value).startswith("--precision: ")
    assert "tensorrt" in err.value.detail


def test_serve_config_fields_are_all_documented_flags() -> None:
    """Every launch setting is a flag, or a CACHESVC_ variable declared with its help."""
    flags = {a.dest for a in _serve_parser()._actions}
    variables = {v.setting for v in config.ENVIRONMENT if v.setting is not None}
    for name in config.DECLARED:
        assert name in flags or name in variables, f"--{name} has no flag and no variable"


def test_bundle_state_check_and_the_head_migration_list_every_bundle_state() -> None:
    import importlib

    from sqlalchemy import CheckConstraint

    from cachesvc.cache.catalog.models import Base
    from cachesvc.cache.records import BUNDLE_STATES

    check = next(
        c
        for c in Base.metadata.tables["bundles"].constraints
        if isinstance(c, CheckConstraint) and str(c.name).endswith("state")
    )
    listed = f"state IN ({', '.join(repr(s) for s in BUNDLE_STATES)})"
    assert str(check.sqltext) == listed
    head = importlib.import_module("migrations.versions.0004_stale_state")
    assert listed == head._NEW
    assert get_args(schemas.BundleState) == BUNDLE_STATES and "stale" in BUNDLE_STATES
