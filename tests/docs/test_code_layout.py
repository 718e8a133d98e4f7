"""cachesvc/ and inference/ keep the folders that show their floors (docs/architecture.md, "Layers").

The module map of the move is ``scripts/relayout.py``: the tree follows it (no module left at an
old path, no import, dotted name or path naming one), its rewriting replays on code that still
uses the old names (a branch merged after the move), and a second run changes nothing. Modules
stay under 800 lines and functions under 100.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100


def _relayout() -> ModuleType:
    spec = importlib.util.spec_from_file_location("relayout", ROOT / "scripts" / "relayout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("relayout", module)
    spec.loader.exec_module(module)
    return module


relayout: Any = _relayout()


def _rewrite(text: str, where: str = "tests/x.py") -> tuple[str, Any]:
    report = relayout.Report()
    resolver = relayout.Resolver(ROOT, report)
    return relayout.rewrite(text, resolver, where, python=where.endswith(".py")), report


def test_no_module_over_800_lines_and_no_function_over_100() -> None:
    long_modules, long_functions = [], []
    for path in sorted(p for package in ("cachesvc", "inference") for p in (ROOT / package).rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {size} lines")
    assert not long_modules, f"split by job (at most {MAX_MODULE_LINES} lines): {long_modules}"
    assert not long_functions, f"split by job (at most {MAX_FUNCTION_LINES} lines): {long_functions}"


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_the_tree_follows_the_relayout_map() -> None:
    report = relayout.run(ROOT, dry_run=True)
    assert not report.problems, report.problems
    assert not report.moved, f"run python scripts/relayout.py: {report.moved}"
    assert not report.rewritten, f"run python scripts/relayout.py: {sorted(report.rewritten)}"


def test_old_imports_follow_their_modules() -> None:
    old = (
        "from cachesvc.manager import CacheManager\n"
        "from cachesvc import crashpoints, errors\n"
        "from cachesvc.store.space import human_size\n"
        "import cachesvc.app, cachesvc.server\n"
        "from cachesvc.catalog import session as catalog_session\n"
        "if TYPE_CHECKING:\n"
        "    from cachesvc.config import (\n"
        "        DECLARED,  # a comment\n"
        "        ServeConfig,\n"
        "    )\n"
    )
    new, report = _rewrite(old)
    assert new == (
        "from cachesvc.cache.manager import CacheManager\n"
        "from cachesvc.cache import crashpoints\nfrom cachesvc import errors\n"
        "from cachesvc.cache.store.space import human_size\n"
        "import cachesvc.serving.app, cachesvc.serving.server\n"
        "from cachesvc.cache.catalog import session as catalog_session\n"
        "if TYPE_CHECKING:\n"
        "    from cachesvc.settings.groups import DECLARED\n"
        "    from cachesvc.settings.config import ServeConfig\n"
    )
    assert not report.warnings


def test_names_of_a_split_module_go_to_their_new_homes() -> None:
    new, report = _rewrite(
        "from cachesvc.cli import human_size, main, table, _short_model\n"
        "from cachesvc.http.serving import AliasRequest\n"
        "code = 'from cachesvc.config import REGISTRY_ENV, ServeConfig\\n'\n"
    )
    assert new == (
        "from cachesvc.cache.store.space import human_size\n"
        "from cachesvc.cli import main\n"
        "from cachesvc.cli.output import table, short_model as _short_model\n"
        "from cachesvc.http.admin.models import AliasRequest\n"
        "code = 'from cachesvc.settings.groups import REGISTRY_ENV; "
        "from cachesvc.settings.config import ServeConfig\\n'\n"
    )
    assert not report.warnings
    _, report = _rewrite("from cachesvc import config\n")
    assert any("split module cachesvc.config" in w for w in report.warnings)


def test_dotted_names_and_paths_follow_but_logger_names_stay() -> None:
    new, _ = _rewrite(
        'mock.patch("cachesvc.manager.CacheManager.open")\n'
        'log = logging.getLogger("cachesvc.manager")\n'
        'caplog.at_level(logging.WARNING, logger="cachesvc.default_model")\n'
        'path="cachesvc/reconcile.py", other="cachesvc/store/space.py"\n'
        "EXCEPTIONS = {'cachesvc/crashpoints.py': 1}\n"
    )
    assert new == (
        'mock.patch("cachesvc.cache.manager.CacheManager.open")\n'
        'log = logging.getLogger("cachesvc.manager")\n'
        'caplog.at_level(logging.WARNING, logger="cachesvc.default_model")\n'
        'path="cachesvc/cache/reconcile.py", other="cachesvc/cache/store/space.py"\n'
        "EXCEPTIONS = {'cachesvc/cache/crashpoints.py': 1}\n"
    )
    doc, _ = _rewrite(
        "See `cachesvc/catalog/` and `cachesvc/http/admin.py`, `cachesvc/records.UNLOAD_REASONS`,\n"
        ":mod:`cachesvc.entry`, `cachesvc/http/dashboard/page.js`, `cachesvc/cli/parser.py`.\n",
        "docs/x.md",
    )
    assert doc == (
        "See `cachesvc/cache/catalog/` and `cachesvc/http/admin/`, `cachesvc/cache/records.UNLOAD_REASONS`,\n"
        ":mod:`cachesvc.serving.entry`, `cachesvc/http/dashboard/page.js`, `cachesvc/cli/parser.py`.\n"
    )


def test_inference_names_and_paths_follow_but_its_logger_names_stay() -> None:
    new, report = _rewrite(
        "from inference.scheduler import GenerationRequest, Scheduler\n"
        "from inference import image_decode, errors\n"
        'mock.patch("inference.model_pool.ModelPool.acquire")\n'
        'log = logging.getLogger("inference.scheduler")\n'
        'path="inference/serving_errors.py", data="inference/data/corpus.txt"\n'
    )
    assert new == (
        "from inference.serving.scheduler import GenerationRequest, Scheduler\n"
        "from inference.images import decode as image_decode\nfrom inference import errors\n"
        'mock.patch("inference.serving.model_pool.ModelPool.acquire")\n'
        'log = logging.getLogger("inference.scheduler")\n'
        'path="inference/serving/errors.py", data="inference/data/corpus.txt"\n'
    )
    assert not report.warnings


def test_a_second_rewrite_changes_nothing() -> None:
    text = (
        "from cachesvc.cli import build_parser\nimport cachesvc.http.admin\n"
        "from cachesvc.http.admin.router import admin_router\n"
        'x = "cachesvc/http/fleet.py", "cachesvc.config.ServeConfig"\n'
    )
    once, _ = _rewrite(text)
    twice, _ = _rewrite(once)
    assert once != text
    assert twice == once


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_tree_on_the_old_paths_is_moved_and_a_second_run_is_a_no_op(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    files = {
        "cachesvc/__init__.py": "",
        "cachesvc/errors.py": "",
        "cachesvc/manager.py": "from cachesvc.store.layout import CacheLayout\n",
        "cachesvc/store/__init__.py": "",
        "cachesvc/store/layout.py": "class CacheLayout: ...\n",
        "cachesvc/store/added_by_a_branch.py": "from cachesvc.records import BundleInfo\n",
        "tests/test_x.py": "from cachesvc.manager import CacheManager\n",
        "docs/x.md": "`cachesvc/store/layout.py`\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    git("init", "-q")
    git("add", "-A")

    report = relayout.run(tmp_path, dry_run=False)
    assert not report.problems, report.problems
    assert (tmp_path / "cachesvc/cache/manager.py").read_text() == (
        "from cachesvc.cache.store.layout import CacheLayout\n"
    )
    assert (tmp_path / "cachesvc/cache/store/added_by_a_branch.py").read_text() == (
        "from cachesvc.cache.records import BundleInfo\n"
    )
    assert (tmp_path / "cachesvc/cache/__init__.py").is_file()
    assert not (tmp_path / "cachesvc/store").exists()
    assert (tmp_path / "tests/test_x.py").read_text() == "from cachesvc.cache.manager import CacheManager\n"
    assert (tmp_path / "docs/x.md").read_text() == "`cachesvc/cache/store/layout.py`\n"

    again = relayout.run(tmp_path, dry_run=False)
    assert (again.moved, again.rewritten, again.problems) == ([], {}, [])

    (tmp_path / "cachesvc/cli.py").write_text("def main() -> int: ...\n")
    assert any("cachesvc/cli.py is back" in p for p in relayout.run(tmp_path, dry_run=True).problems)
