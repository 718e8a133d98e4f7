"""The record of issue 32's move of ``cachesvc/`` into folders that show its layers, and the tool
that replays it on any tree.

The map below is the record: every module that left its place (``MOVES``: old module or package
-> new one, files moved whole with ``git mv``) and every module that was split by hand
(``SPLITS``: where each of its names lives now). Run on a tree, the script

1. ``git mv``\\ s each file of ``MOVES`` still at its old path (a package: each of its files,
   including files another branch added there) and creates the new packages' ``__init__.py``;
2. rewrites every reference to an old module across the repository's code and docs: import
   statements (``from cachesvc import manager``, ``from cachesvc.config import A, B`` split into
   one statement per new home), dotted names anywhere (``import cachesvc.app``,
   ``mock.patch("cachesvc.manager.X")``, ``:mod:`cachesvc.records```, the import-linter
   contracts), and repository paths (``cachesvc/manager.py``, ``cachesvc/catalog/``, the paths of
   ``tests/mutation/catalog.py``), then sorts the imports of the Python files it changed
   (``ruff check --select I --fix``, when ruff is found);
3. stops with a message (exit 1) where it cannot help: a split module back at its old path (a
   merge brought changes to it: port them by hand to the names' new homes, which it lists), a
   file that would overwrite another, a module of ``cachesvc/`` top level the map does not know.

It is idempotent: a second run on a moved tree changes nothing. That is why it exists: after a
branch that still uses the old paths is merged, run it again and that branch's new imports,
patches, docs and paths follow the move::

    git merge other-branch            # resolve conflicts as usual (moved files follow by rename)
    python scripts/relayout.py        # moves what the merge left behind, rewrites old names
    python scripts/relayout.py --check   # exit 1 while anything would still change

Logger names are not module paths: ``getLogger("cachesvc.manager")``, ``logger="..."`` and
``record.name == "..."`` keep their strings (log output stays the same). ``--dry-run`` prints
what would change without writing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Old module or package -> its new dotted name (the file or folder moved whole).
MOVES: dict[str, str] = {
    # the serving process: `cachesvc serve` and what it wires
    "cachesvc.server": "cachesvc.serving.server",
    "cachesvc.app": "cachesvc.serving.app",
    "cachesvc.default_model": "cachesvc.serving.default_model",
    "cachesvc.model_loading": "cachesvc.serving.model_loading",
    "cachesvc.bundle_watch": "cachesvc.serving.bundle_watch",
    "cachesvc.entry": "cachesvc.serving.entry",
    "cachesvc.served_models": "cachesvc.serving.served_models",
    "cachesvc.build_progress": "cachesvc.serving.build_progress",
    # the cache core: the manager, its sections and what they stand on
    "cachesvc.manager": "cachesvc.cache.manager",
    "cachesvc.queries": "cachesvc.cache.queries",
    "cachesvc.reconcile": "cachesvc.cache.reconcile",
    "cachesvc.eviction": "cachesvc.cache.eviction",
    "cachesvc.verification": "cachesvc.cache.verification",
    "cachesvc.bundle_leases": "cachesvc.cache.bundle_leases",
    "cachesvc.build_jobs": "cachesvc.cache.build_jobs",
    "cachesvc.adapters": "cachesvc.cache.adapters",
    "cachesvc.registry": "cachesvc.cache.registry",
    "cachesvc.builders": "cachesvc.cache.builders",
    "cachesvc.checkpoints": "cachesvc.cache.checkpoints",
    "cachesvc.catalog": "cachesvc.cache.catalog",
    "cachesvc.gguf_checkpoints": "cachesvc.cache.gguf_checkpoints",
    "cachesvc.store": "cachesvc.cache.store",
    "cachesvc.hub_errors": "cachesvc.cache.hub_errors",
    "cachesvc.profiles": "cachesvc.cache.profiles",
    "cachesvc.records": "cachesvc.cache.records",
    "cachesvc.fleet_records": "cachesvc.cache.fleet_records",
    "cachesvc.model_names": "cachesvc.cache.model_names",
    "cachesvc.crashpoints": "cachesvc.cache.crashpoints",
    # the admin HTTP API by resource
    "cachesvc.http.fleet": "cachesvc.http.admin.fleet",
    # inference/: serving a model (the scheduler, the engine client, the model pool and what a
    # request runs through), between the OpenAI surfaces (openai/) and the engines (runtime/)
    "inference.scheduler": "inference.serving.scheduler",
    "inference.requests": "inference.serving.requests",
    "inference.engine_client": "inference.serving.engine_client",
    "inference.generation_spec": "inference.serving.generation_spec",
    "inference.generation": "inference.serving.generation",
    "inference.sampling": "inference.serving.sampling",
    "inference.speculative": "inference.serving.speculative",
    "inference.structured": "inference.serving.structured",
    "inference.context_cache": "inference.serving.context_cache",
    "inference.context_disk": "inference.serving.context_disk",
    "inference.model_pool": "inference.serving.model_pool",
    "inference.model_source": "inference.serving.model_source",
    "inference.serving_errors": "inference.serving.errors",
    "inference.tokenizer": "inference.serving.tokenizer",
    # inference/: images, from the request's bytes to the features a prompt carries
    "inference.media": "inference.images.media",
    "inference.image_decode": "inference.images.decode",
    "inference.image_preprocess": "inference.images.preprocess",
    "inference.image_features": "inference.images.features",
    "inference.image_gemma3": "inference.images.gemma3",
    "inference.image_idefics3": "inference.images.idefics3",
    "inference.image_qwen2_5_vl": "inference.images.qwen2_5_vl",
}


@dataclass(frozen=True)
class Split:
    """A module split by hand: ``default`` is what its bare name means now, ``names`` the new
    home of each of its top-level names (``module`` or ``module:new_name`` when renamed), and
    ``path`` what a path to its old file becomes."""

    default: str
    path: str
    names: dict[str, str] = field(default_factory=dict)


def _homes(module: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, module)


SPLITS: dict[str, Split] = {
    "cachesvc.cli": Split(
        default="cachesvc.cli",  # now the package: its bare name stays (python -m cachesvc.cli)
        path="cachesvc/cli/",
        names={
            "main": "cachesvc.cli",
            **_homes("cachesvc.cli.console", "_BAD_INPUT"),
            **_homes("cachesvc.cli.parser", "build_parser", "_OneLineParser", "_cache_options"),
            **_homes("cachesvc.cli.output", "human_time", "table", "to_jsonable", "emit_json", "bundle_json"),
            "_short_model": "cachesvc.cli.output:short_model",
            "human_size": "cachesvc.cache.store.space",
            "CliError": "cachesvc.cli.args",
            "_cache_config": "cachesvc.cli.args:cache_config",
            "_manager": "cachesvc.cli.args:open_manager",
            **_homes("cachesvc.cli.serve", "cmd_prepare", "cmd_serve", "_serve_config"),
            **_homes(
                "cachesvc.cli.bundles",
                "cmd_bundles_ls", "cmd_bundles_show", "_quality_line", "_candidate_line", "cmd_bundles_rm",
                "_pin_command", "cmd_bundles_pin", "cmd_bundles_unpin", "cmd_bundles_verify",
                "cmd_bundles_push", "cmd_bundles_pull",
            ),
            **_homes("cachesvc.cli.whole_cache", "_print_eviction", "cmd_prune", "cmd_clear",
                     "cmd_reconcile", "cmd_stats"),
            "_add_cache_commands": "cachesvc.cli.whole_cache:add_commands",
            **_homes("cachesvc.cli.registry", "cmd_registry_ls"),
            **_homes("cachesvc.cli.checkpoints", "cmd_checkpoints_ls", "cmd_checkpoints_rm"),
            **_homes("cachesvc.cli.adapters", "cmd_adapters_ls", "cmd_adapters_add", "_adapter_pin_command",
                     "cmd_adapters_pin", "cmd_adapters_unpin", "cmd_adapters_rm"),
            **_homes("cachesvc.cli.models", "cmd_models_ls", "cmd_models_alias", "cmd_models_unalias"),
            **_homes("cachesvc.cli.db", "cmd_db_repair", "cmd_db"),
            **_homes("cachesvc.cli.fleet", "cmd_fleet_status"),
            **_homes("cachesvc.cli.demo", "cmd_demo_checkpoint"),
        },
    ),
    "cachesvc.http.admin": Split(
        default="cachesvc.http.admin",  # now the package: its bare name stays
        path="cachesvc/http/admin/",
        names={
            **_homes("cachesvc.http.admin.router", "admin_router", "drop_stale_options_handlers",
                     "_reject_bad_json"),
            **_homes("cachesvc.http.admin.params", "Manager", "Pool", "ModelRoots", "BUNDLE_ID_PATTERN",
                     "BundleId", "Limit", "NodeFilter", "StrictBody"),
            **_homes("cachesvc.http.admin.bundles", "_PageCache", "_LIST_CACHE", "BundleController", "named"),
            **_homes("cachesvc.http.admin.builds", "BuildId", "PullId", "BuildController", "PullController",
                     "_profile"),
            **_homes("cachesvc.http.admin.cache", "_eviction_body", "CacheController"),
            **_homes("cachesvc.http.admin.stats", "_utc", "get_stats", "list_events"),
            **_homes("cachesvc.http.admin.checkpoints", "list_checkpoints", "CheckpointId",
                     "remove_checkpoint"),
            **_homes("cachesvc.http.admin.adapters", "AdapterId", "AdapterController"),
        },
    ),
    "cachesvc.http.serving": Split(
        default="cachesvc.http.admin.router",
        path="cachesvc/http/admin/",
        names={
            **_homes("cachesvc.http.admin.router", "_openai_problem", "_serving_problem", "lora_router",
                     "serving_router"),
            **_homes("cachesvc.http.admin.params", "Manager", "Pool", "StrictBody"),
            **_homes("cachesvc.http.admin.engines", "KeepAlive", "BundleId", "EngineOut", "EngineList",
                     "PreloadRequest", "UnloadOut", "_iso", "_engine", "EngineController"),
            **_homes("cachesvc.http.admin.models", "ModelName", "AliasRequest", "AliasOut",
                     "ModelController"),
            **_homes("cachesvc.http.admin.loras", "LoraLoader", "Loras", "_loras", "_LORA_NAME",
                     "LoadLoraRequest", "UnloadLoraRequest", "LoraLoadedOut", "load_lora_adapter",
                     "unload_lora_adapter"),
        },
    ),
    # config.py went to settings/ and its declarations to a module of their own
    "cachesvc.config": Split(
        default="cachesvc.settings.config",
        path="cachesvc/settings/config.py",
        names={
            **_homes(
                "cachesvc.settings.groups",
                "LOG_LEVELS", "DEFAULT_MAX_LORAS", "CACHE_DIR_ENV", "SHUTDOWN_GRACE_ENV", "PREFILL_CHUNK_ENV",
                "DISABLE_GPU_ENV", "REGISTRY_ENV", "ENGINE_FACTORY_ENV", "CACHE", "BUILD", "RUNTIME", "HTTP",
                "POOL", "_URL_PASSWORD_RE", "_mask_key", "_mask_url", "env_value", "engine_factory_spec",
                "default_cache_dir", "default_registry", "registry_rule", "_env_setting", "HttpSettings",
                "CacheSettings", "_TREE", "BuildSettings", "_CONTEXT_CACHE_FIELDS", "ServingSettings",
                "FleetSettings", "SETTINGS_GROUPS", "DECLARED", "GROUP_OF", "CACHE_OPTIONS", "ENVIRONMENT",
                "_ENV_BY_NAME", "field_default", "flag_for",
            ),
            **_homes("cachesvc.settings.config", "settings_table", "_FIELD_FLAGS", "cli_message",
                     "ServeConfig", "add_build_arguments", "add_serve_arguments", "add_cache_flags"),
            "lora_module_pairs": "cachesvc.settings.rules",
            "SpeculativeConfig": "cachesvc.settings.speculative",
        },
    ),
}

#: The new packages, with the docstring of their ``__init__.py`` when the script creates it.
NEW_PACKAGES: dict[str, str] = {
    "cachesvc/serving": "The serving process: ``cachesvc serve``, the app it runs, the models it loads.",
    "cachesvc/cache": "The cache core: the manager, its sections, the catalog, the store and the registry.",
    "cachesvc/http/admin": "The admin REST API (mounted at ``/admin``): one module per resource.",
    "inference/serving": ("Serving a model: the scheduler, the engine client, the model pool and what a "
                          "request runs\nthrough (sampling, structured output, speculation, the context "
                          "cache)."),
    "inference/images": ("Images: the request's media, decoding, each family's preprocessing, the prompt's "
                         "features."),
}

#: The packages the map moves modules of.
PACKAGES = ("cachesvc", "inference")

#: Top-level modules of ``cachesvc/`` and ``inference/`` that stay where they are.
STAYS = {
    "cachesvc/__init__.py", "cachesvc/errors.py",
    # inference/: the package's errors, the build vocabulary and the machine, shared by every floor
    "inference/__init__.py", "inference/errors.py", "inference/build_profile.py", "inference/cpu_class.py",
    "inference/cuda_device.py", "inference/trt_logging.py", "inference/demo.py",
}

#: Where references are rewritten (files tracked or not ignored by git).
SCOPE = ("cachesvc", "inference", "tests", "bench", "migrations", "scripts", "docs", ".ci",
         "README.md", "pyproject.toml", "alembic.ini")
#: Not rewritten: the record itself and its test name old modules on purpose.
SKIP = {"scripts/relayout.py", "tests/docs/test_code_layout.py"}

_CHAIN = re.compile(r"(?<![\w.])(?:cachesvc|inference)(?:\.\w+)+")
_PATH = re.compile(r"(?<![\w./-])(cachesvc|inference)((?:/\w+)+)(?:\.(\w+))?")
_FROM_IMPORT = re.compile(
    r"(?<![\w.])from[ \t]+(?P<mod>(?:cachesvc|inference)(?:\.\w+)*)[ \t]+import[ \t]+"
    r"(?P<names>\((?:[^)])*\)|[\w \t,]*\w)"
)
_LOGGER_CONTEXT = re.compile(r"(getLogger\(|logger\s*=|\.name\s*[=!]=|\bname\s*=)\s*$")


class Problem(Exception):
    """Something the script cannot do for you."""


@dataclass
class Report:
    moved: list[tuple[str, str]] = field(default_factory=list)
    rewritten: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)


# --- names --------------------------------------------------------------------------------------


def new_modules(root: Path) -> set[str]:
    """Every module and package of the tree as it is now, plus every new home the map names."""
    found = set()
    for path in (p for package in PACKAGES for p in (root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    found |= set(MOVES.values())
    for split in SPLITS.values():
        found |= {home.split(":")[0] for home in split.names.values()}
    return found


class Resolver:
    """Old dotted names -> new ones."""

    def __init__(self, root: Path, report: Report) -> None:
        self.modules = new_modules(root)
        self.report = report

    def resolve(self, chain: str, where: str = "") -> str:
        """``chain`` (``cachesvc.x.y.Name``) with its old module replaced; unchanged if not old."""
        parts = chain.split(".")
        for i in range(len(parts), 1, -1):
            prefix = ".".join(parts[:i])
            rest = parts[i:]
            if prefix in SPLITS:
                return self._split(prefix, rest, chain, where)
            if prefix in MOVES:
                return ".".join([MOVES[prefix], *rest])
        return chain

    def _split(self, prefix: str, rest: list[str], chain: str, where: str) -> str:
        split = SPLITS[prefix]
        if not rest:
            return split.default
        if f"{prefix}.{rest[0]}" in self.modules:
            return chain  # already a module of the new package (cachesvc.cli.parser)
        home = split.names.get(rest[0])
        if home is None:
            self.report.warn(f"{where}: {prefix}.{rest[0]} is not in the map of {prefix}; "
                             f"pointed at {split.default}: check it")
            home = split.default
        module, _, renamed = home.partition(":")
        return ".".join([module, renamed or rest[0], *rest[1:]])

    def import_name(self, mod: str, name: str, where: str) -> tuple[str, str]:
        """``from mod import name`` -> (module to import from, name there): a name of a moved
        module, a name of a split module (its new home), or a moved module itself."""
        full = f"{mod}.{name}"
        resolved = self.resolve(full, where)
        if full in SPLITS and resolved != full:
            self.report.warn(f"{where}: imports the split module {full} as an object ({name}): "
                             f"check the names it reads (now {resolved})")
        module, _, new_name = resolved.rpartition(".")
        return module, new_name


# --- rewriting ---------------------------------------------------------------------------------


_IMPORT_ITEM = re.compile(r"^(\w+)(?:\s+as\s+(\w+))?$")


def _split_names(text: str) -> list[tuple[str, str]] | None:
    """``a, b as c`` (or a parenthesised list with comments) -> [(name, local name)]; None when
    it is not an import list (prose that reads ``from cachesvc import ...``)."""
    body = re.sub(r"#[^\n]*", "", text.strip().removeprefix("(").removesuffix(")"))
    items = []
    for raw in body.split(","):
        if not raw.strip():
            continue
        match = _IMPORT_ITEM.match(raw.strip())
        if match is None:
            return None
        items.append((match.group(1), match.group(2) or match.group(1)))
    return items


def rewrite_imports(text: str, resolver: Resolver, where: str) -> str:
    """``from cachesvc... import ...`` statements whose names moved, one per new home."""

    def one(match: re.Match[str]) -> str:
        mod, names_text = match.group("mod"), match.group("names")
        items = _split_names(names_text)
        if not items:
            return match.group(0)
        homes: dict[str, list[str]] = {}
        renamed = False
        for name, local in items:
            module, new_name = resolver.import_name(mod, name, where)
            renamed = renamed or new_name != name
            homes.setdefault(module, []).append(f"{new_name} as {local}" if new_name != local else new_name)
        if len(homes) == 1 and not renamed:
            # One home, same names: only the module changes (or nothing); the names keep their layout.
            return match.group(0).replace(mod, next(iter(homes)), 1)
        line_start = text.rfind("\n", 0, match.start()) + 1
        before = text[line_start : match.start()]
        joiner = "\n" + before if before.strip() == "" else "; "
        return joiner.join(f"from {module} import {', '.join(names)}" for module, names in homes.items())

    return _FROM_IMPORT.sub(one, text)


def _is_logger_name(text: str, start: int, end: int) -> bool:
    """The chain is a whole string literal given as a logger name."""
    if start == 0 or end >= len(text) or text[start - 1] not in "\"'" or text[end] != text[start - 1]:
        return False
    return bool(_LOGGER_CONTEXT.search(text[max(0, start - 60) : start - 1]))


def rewrite_chains(text: str, resolver: Resolver, where: str) -> str:
    def one(match: re.Match[str]) -> str:
        chain = match.group(0)
        if _is_logger_name(text, match.start(), match.end()):
            return chain
        return resolver.resolve(chain, where)

    return _CHAIN.sub(one, text)


def rewrite_paths(text: str, resolver: Resolver, where: str) -> str:
    def one(match: re.Match[str]) -> str:
        dotted = match.group(1) + match.group(2).replace("/", ".")
        suffix = match.group(3)
        if suffix == "py":
            if dotted in SPLITS:
                return SPLITS[dotted].path
            new = resolver.resolve(dotted, where)
            return new.replace(".", "/") + ".py"
        if suffix is not None:  # cachesvc/records.UNLOAD_REASONS, cachesvc/http/dashboard/page.js
            new = resolver.resolve(f"{dotted}.{suffix}", where)
            if new == f"{dotted}.{suffix}":
                return match.group(0)
            module, _, name = new.rpartition(".")
            return f"{module.replace('.', '/')}.{name}"
        if dotted in SPLITS:
            return match.group(0)  # the folder of the new package (cachesvc/cli, cachesvc/http/admin)
        return resolver.resolve(dotted, where).replace(".", "/")

    return _PATH.sub(one, text)


def rewrite(text: str, resolver: Resolver, where: str, python: bool) -> str:
    if python or where.endswith((".md", ".toml")):
        text = rewrite_imports(text, resolver, where)
    text = rewrite_chains(text, resolver, where)
    return rewrite_paths(text, resolver, where)


# --- files -------------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def scope_files(root: Path) -> Iterator[Path]:
    listed = _git(root, "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCOPE)
    for rel in sorted(set(listed.splitlines())):
        if rel in SKIP or not (root / rel).is_file():
            continue
        yield root / rel


def _module_path(root: Path, dotted: str) -> tuple[Path, Path]:
    """(file, folder) a dotted name can live in."""
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py"), base


def move_files(root: Path, report: Report, dry_run: bool) -> None:
    for old, new in MOVES.items():
        old_file, old_dir = _module_path(root, old)
        new_file, new_dir = _module_path(root, new)
        pairs: list[tuple[Path, Path]] = []
        if old_file.is_file():
            pairs.append((old_file, new_file))
        if old_dir.is_dir():
            old_rel = str(old_dir.relative_to(root))
            tracked = _git(root, "ls-files", "--", old_rel).splitlines()
            pairs += [(root / rel, new_dir / Path(rel).relative_to(old_rel)) for rel in tracked]
            untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", old_rel).splitlines()
            for rel in untracked:
                report.problems.append(f"{rel}: untracked, in a moved folder; move it to {new_dir} by hand")
        incoming = {dst for _, dst in pairs}
        for src, dst in pairs:
            if dst.exists():
                report.problems.append(f"{src.relative_to(root)} is still there but {dst.relative_to(root)} "
                                       "exists too: merge the two by hand")
                continue
            report.moved.append((str(src.relative_to(root)), str(dst.relative_to(root))))
            if dry_run:
                continue
            _ensure_package(root, dst.parent, incoming, report)
            _git(root, "mv", str(src.relative_to(root)), str(dst.relative_to(root)))
        if old_dir.is_dir() and not dry_run:
            _remove_leftovers(old_dir)


def _ensure_package(root: Path, folder: Path, incoming: set[Path], report: Report) -> None:
    """``folder`` and its parents up to ``cachesvc/`` (``inference/``) are packages (an
    ``__init__.py`` about to be moved in counts)."""
    folder.mkdir(parents=True, exist_ok=True)
    for pkg in [folder, *folder.parents]:
        if pkg == root or not any(pkg.is_relative_to(root / package) for package in PACKAGES):
            break
        init = pkg / "__init__.py"
        if not init.exists() and init not in incoming:
            rel = str(pkg.relative_to(root))
            doc = NEW_PACKAGES.get(rel, f"The {pkg.name} package.")
            init.write_text(f'"""{doc}"""\n')
            _git(root, "add", str(init.relative_to(root)))
            report.moved.append(("(new)", str(init.relative_to(root))))


def _remove_leftovers(folder: Path) -> None:
    """An old package folder emptied by the move: its caches and empty folders go."""
    for cache in sorted(folder.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache, ignore_errors=True)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def check_tree(root: Path, report: Report) -> None:
    for old, split in SPLITS.items():
        old_file, _ = _module_path(root, old)
        if old_file.is_file():
            homes = sorted({h.split(":")[0] for h in split.names.values()})
            report.problems.append(
                f"{old_file.relative_to(root)} is back (a merge brought changes to it?): port them by hand "
                f"to where its names live now ({', '.join(homes)}; the map in scripts/relayout.py) "
                "and delete it"
            )
    known = {str(_module_path(root, old)[0].relative_to(root)) for old in [*MOVES, *SPLITS]}
    for path in sorted(p for package in PACKAGES for p in (root / package).glob("*.py")):
        rel = str(path.relative_to(root))
        if rel not in STAYS and rel not in known:
            report.problems.append(f"{rel}: a top-level module the map does not know; give it a floor "
                                   "(MOVES in scripts/relayout.py) or list it in STAYS")


def rewrite_files(root: Path, report: Report, dry_run: bool) -> list[Path]:
    resolver = Resolver(root, report)
    changed: list[Path] = []
    for path in scope_files(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = str(path.relative_to(root))
        new = rewrite(text, resolver, rel, python=path.suffix == ".py")
        if new != text:
            report.rewritten[rel] = sum(
                a != b for a, b in zip(text.splitlines(), new.splitlines(), strict=False)
            ) or 1
            changed.append(path)
            if not dry_run:
                path.write_text(new)
    return changed


def sort_imports(root: Path, files: list[Path], report: Report) -> None:
    python = [str(p.relative_to(root)) for p in files if p.suffix == ".py"]
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not python:
        return
    if not Path(ruff).is_file():
        report.warn("ruff not found: sort the imports of the rewritten files (ruff check --select I --fix)")
        return
    subprocess.run([ruff, "check", "--select", "I", "--fix", "--quiet", *python], cwd=root, check=False)


def run(root: Path, *, dry_run: bool) -> Report:
    report = Report()
    move_files(root, report, dry_run)
    changed = rewrite_files(root, report, dry_run)
    if not dry_run:
        sort_imports(root, changed, report)
    check_tree(root, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    parser.add_argument("--check", action="store_true", help="--dry-run; exit 1 if anything would change")
    args = parser.parse_args(argv)
    dry = args.dry_run or args.check
    report = run(args.root.resolve(), dry_run=dry)
    verb = "would move" if dry else "moved"
    for src, dst in report.moved:
        print(f"{verb} {src} -> {dst}")
    for rel, lines in report.rewritten.items():
        print(f"{'would rewrite' if dry else 'rewrote'} {rel} ({lines} lines)")
    for text in report.warnings:
        print(f"warning: {text}", file=sys.stderr)
    for text in report.problems:
        print(f"problem: {text}", file=sys.stderr)
    if not (report.moved or report.rewritten):
        print("nothing to move or rewrite: the tree follows the map")
    if report.problems:
        return 1
    return 1 if args.check and (report.moved or report.rewritten) else 0


if __name__ == "__main__":
    sys.exit(main())
