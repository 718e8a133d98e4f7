"""Every ``CACHESVC_*`` variable is read in the settings' declarations module, and nowhere else.

The source of ``cachesvc`` and ``inference`` is scanned: an environment read (``os.environ``,
``os.getenv``) outside :mod:`cachesvc.settings.groups` may only name a variable that is not ours (such as
``HF_HUB_OFFLINE``) by a literal; a ``CACHESVC_*`` name as a whole string literal appears only in
that module; every ``CACHESVC_*`` name the source mentions is declared in
:data:`cachesvc.settings.groups.ENVIRONMENT`. The one exception is the crash-test hook of
:mod:`cachesvc.cache.crashpoints`, which sits below every module and reads ``CACHESVC_CRASH_AT`` itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cachesvc.cache import crashpoints
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import ConfigError
from cachesvc.serving.entry import open_cache
from cachesvc.settings.config import ServeConfig
from cachesvc.settings.groups import ENVIRONMENT

REPO = Path(__file__).resolve().parents[2]
CONFIG = "cachesvc/settings/groups.py"
#: Modules allowed to read one CACHESVC_ variable themselves, and which (with the reason above).
EXCEPTIONS = {"cachesvc/cache/crashpoints.py": crashpoints.ENV_VAR}
_NAME = re.compile(r"CACHESVC_[A-Z0-9_]+")


def _sources() -> list[tuple[str, str]]:
    files = sorted([*(REPO / "cachesvc").rglob("*.py"), *(REPO / "inference").rglob("*.py")])
    assert len(files) > 50
    return [(str(f.relative_to(REPO)), f.read_text()) for f in files]


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return True
    return isinstance(node, ast.Name) and node.id == "environ"


def _env_reads(tree: ast.AST) -> list[tuple[int, ast.expr | None]]:
    """(line, key expression, None when not one) of every environment access in ``tree``."""
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    reads: list[tuple[int, ast.expr | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            ):
                reads.append((node.lineno, node.args[0] if node.args else None))
        if not _is_environ(node):
            continue
        parent = parents.get(id(node))
        key: ast.expr | None = None
        if isinstance(parent, ast.Subscript) and parent.value is node:
            key = parent.slice  # os.environ["X"]
        elif isinstance(parent, ast.Attribute):
            call = parents.get(id(parent))
            if isinstance(call, ast.Call) and call.func is parent and call.args:
                key = call.args[0]  # os.environ.get("X")
        reads.append((getattr(node, "lineno", 0), key))  # anything else: the whole environment
    return reads


def test_every_cachesvc_variable_is_read_only_in_the_config_module() -> None:
    offences: list[str] = []
    for path, text in _sources():
        if path == CONFIG:
            continue
        tree = ast.parse(text, path)
        for line, key in _env_reads(tree):
            literal = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
            if literal is not None and not literal.startswith("CACHESVC_"):
                continue  # another program's variable (HF_HUB_OFFLINE)
            if path in EXCEPTIONS and (literal is None or literal == EXCEPTIONS[path]):
                continue
            offences.append(f"{path}:{line}: reads the environment ({literal or 'by a name'})")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and _NAME.fullmatch(node.value)
                and EXCEPTIONS.get(path) != node.value
            ):
                offences.append(f"{path}:{node.lineno}: names {node.value} (declare and read it in {CONFIG})")
    assert not offences, "\n".join(offences)


def test_the_scan_finds_what_it_forbids() -> None:
    """The scan is not vacuous: each way of reading a variable is caught."""
    for code in (
        'import os\nos.environ.get("CACHESVC_X")',
        'import os\nos.getenv("CACHESVC_X", "1")',
        'import os\nos.environ["CACHESVC_X"]',
        "import os\nNAME = 'CACHESVC_X'\nos.environ.get(NAME)",
        "from os import environ\nenv = dict(environ)",
    ):
        tree = ast.parse(code)
        assert _env_reads(tree), code
    assert not _env_reads(ast.parse('x = {"environment": 1}\nprint("os.environ")'))


def test_every_cachesvc_variable_in_the_source_is_declared() -> None:
    declared = {var.name for var in ENVIRONMENT}
    mentioned = {(name, path) for path, text in _sources() for name in _NAME.findall(text)}
    undeclared = sorted(f"{path}: {name}" for name, path in mentioned if name not in declared)
    assert not undeclared, "\n".join(undeclared)
    assert declared <= {name for name, _ in mentioned}, "a declared variable nothing mentions"


def test_the_gpu_switch_reaches_the_cache_through_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CACHESVC_DISABLE_GPU is read once, by the config, and handed to the cache."""
    monkeypatch.setenv("CACHESVC_DISABLE_GPU", "1")
    manager = open_cache(ServeConfig(cache_dir=tmp_path / "cache"))
    try:
        assert manager.gpu_disabled and "tensorrt" not in manager.builders
        with pytest.raises(ConfigError, match="the GPU is disabled by CACHESVC_DISABLE_GPU"):
            manager.build_options(ProfileRequest(backend="tensorrt"))
    finally:
        manager.close()
    monkeypatch.delenv("CACHESVC_DISABLE_GPU")
    manager = open_cache(ServeConfig(cache_dir=tmp_path / "cache"))
    try:
        assert not manager.gpu_disabled
    finally:
        manager.close()
