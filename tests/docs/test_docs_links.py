"""The README and docs/ name only what exists: repository files, links, `cachesvc` commands and flags.

Paths are read from code spans, fenced blocks and link targets; a path counts when its first part
is a top-level entry of the repository (``cachesvc/``, ``tests/``, ``bench/``, ``README.md``, ...),
so cache-directory names such as ``checkpoints/gguf/`` are not mistaken for files here. Commands
are every ``cachesvc ...`` in code, walked through the real argparse parser of ``cachesvc.cli``:
each subcommand and each ``--flag`` must be one the parser knows.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachesvc.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "tests" / "README.md", *(ROOT / "docs").glob("*.md")])
TOP_LEVEL = {p.name for p in ROOT.iterdir() if not p.name.startswith(".git")} - {".venv", "build"}

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
COMMAND = re.compile(r"(?:^|[\s/(])cachesvc((?:[ \t]+[^\s&;#`]+)+)")
ALTERNATIVES = re.compile(r"\\?\|")


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans of a markdown text."""
    blocks = FENCE.findall(text)
    rest = FENCE.sub("", text)
    return blocks + SPAN.findall(rest)


def _path_tokens(code: str) -> Iterator[str]:
    for raw in re.split(r"[\s,;=]+", code):
        token = raw.strip("()[]{}'\"`:;,.").split("::")[0]
        if "/" not in token and token not in TOP_LEVEL:
            continue
        if any(ch in token for ch in "*<>{}$…|") or token.startswith(("http", "/", "~")):
            continue
        first = token.split("/")[0]
        if first in TOP_LEVEL and not first.endswith(".py"):
            yield token


def _exists(token: str) -> bool:
    """A file or folder of the repository; ``pkg/module.Name`` (a name in a module) counts too."""
    if (ROOT / token.rstrip("/")).exists():
        return True
    folder, _, last = token.rpartition("/")
    module = last.split(".")[0]
    return bool(folder and module) and (ROOT / folder / f"{module}.py").is_file()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _doc_id(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


def test_the_docs_are_found() -> None:
    names = {_doc_id(d) for d in DOCS}
    assert {"README.md", "tests/README.md", "docs/architecture.md", "docs/cache.md"} <= names
    assert len(list(_commands(ROOT / "README.md"))) >= 10  # the command check reads the README


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_named_repository_file_exists(doc: Path) -> None:
    text = doc.read_text()
    named = {token for code in _code(text) for token in _path_tokens(code)}
    missing = sorted(token for token in named if not _exists(token))
    assert not missing, f"{_doc_id(doc)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_link_resolves(doc: Path) -> None:
    text = FENCE.sub("", doc.read_text())
    broken = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        bad_anchor = dest.exists() and anchor and dest.suffix == ".md" and anchor not in _anchors(dest)
        if not dest.exists() or bad_anchor:
            broken.append(target)
    assert not broken, f"{_doc_id(doc)} has broken links: {broken}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_command(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """What in ``cachesvc WORDS`` the parser does not know: subcommands and flags."""
    errors: list[str] = []
    current, path = parser, "cachesvc"
    for raw in words:
        word = raw.strip("[]()\\,.:")
        if not word or word in {"…", "...", "|"}:
            continue
        options = [w for w in ALTERNATIVES.split(word) if w]
        if word.startswith("-"):
            for option in options:
                flag = option.split("=")[0].strip("[]")
                if flag.startswith("--") and flag not in current._option_string_actions:
                    errors.append(f"{path} has no flag {flag}")
            continue
        subs = _subcommands(current)
        if not subs or not re.fullmatch(r"[a-z][a-z0-9-]*(?:\|[a-z][a-z0-9-]*)*", word.replace("\\", "")):
            continue  # a value: a model, a path, an id, a placeholder
        unknown = [o for o in options if o not in subs]
        if unknown:
            errors.append(f"{path} has no command {'|'.join(unknown)}")
            return errors
        current, path = subs[options[0]], f"{path} {options[0]}"
    return errors


def _commands(doc: Path) -> Iterator[list[str]]:
    for code in _code(doc.read_text()):
        for line in code.replace("\\\n", " ").splitlines():
            for match in COMMAND.finditer(line):
                words = match.group(1).split()
                # A shell pipe ends the command; `a|b` inside a word lists alternatives.
                yield words[: words.index("|")] if "|" in words else words


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_cachesvc_command_and_flag_exists(doc: Path) -> None:
    parser = build_parser()
    errors = sorted({e for words in _commands(doc) for e in check_command(words, parser)})
    assert not errors, f"{_doc_id(doc)}: {errors}"


def test_the_command_check_catches_unknown_commands_and_flags() -> None:
    parser = build_parser()
    assert check_command(["bundles", "ls", "--json", "--sort", "size"], parser) == []
    assert check_command(["--cache-dir", "DIR", "prune", "--dry-run"], parser) == []
    assert check_command(["serve|prepare", "MODEL", "--gguf-file", "NAME"], parser) == []
    assert check_command(["bundles", "frobnicate"], parser) == ["cachesvc bundles has no command frobnicate"]
    assert check_command(["prune", "--no-such-flag"], parser) == ["cachesvc prune has no flag --no-such-flag"]


def test_the_path_check_sees_missing_files(tmp_path: Path) -> None:
    tokens = list(_path_tokens("PYTHONPATH=. python bench/no_such_bench.py --quick; see tests/cache/"))
    assert tokens == ["bench/no_such_bench.py", "tests/cache/"]
    assert not _exists(tokens[0])
    assert _exists("inference/serving/sampling.Sampler") and not _exists("inference/serving/sampling.Nope/x")
