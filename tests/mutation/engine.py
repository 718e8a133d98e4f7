"""Applying a mutation: find a function by its qualified name, rewrite one match inside it.

Locating code by function (parsed with :mod:`ast`) rather than by line number or whole-file
text keeps a mutation valid while the code around it moves; a pattern that no longer matches
inside its function is reported as stale, so the catalog cannot silently stop testing anything.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mutation:
    """One deliberate break: in ``function`` of ``path``, ``find`` (a regex) becomes ``replace``.

    ``tests`` are the pytest node ids or paths that must fail on the mutant.
    """

    name: str
    why: str
    path: str
    function: str
    find: str
    replace: str
    tests: tuple[str, ...]


class StaleMutation(Exception):
    """The mutation no longer applies: its function or its pattern is gone."""


def _find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    scope: list[ast.stmt] = list(tree.body)
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
            ),
            None,
        )
        if node is None:
            raise StaleMutation(f"no {part!r} on the way to {qualname!r}")
        scope = list(node.body)
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise StaleMutation(f"{qualname!r} is not a function")
    return node


def mutate_source(source: str, mutation: Mutation) -> str:
    """``source`` with ``mutation`` applied (exactly one match, inside its function)."""
    func = _find_function(ast.parse(source), mutation.function)
    lines = source.splitlines(keepends=True)
    start, end = func.lineno - 1, func.end_lineno or func.lineno
    body = "".join(lines[start:end])
    changed, count = re.subn(mutation.find, mutation.replace, body, count=1)
    if count == 0:
        raise StaleMutation(f"{mutation.find!r} not found in {mutation.function} ({mutation.path})")
    mutated = "".join(lines[:start]) + changed + "".join(lines[end:])
    ast.parse(mutated)  # a mutant must still be valid Python, or it tests nothing
    return mutated


def apply(root: Path, mutation: Mutation) -> str:
    """Write the mutant into the copy at ``root``; return the original text to restore."""
    path = root / mutation.path
    original = path.read_text()
    path.write_text(mutate_source(original, mutation))
    return original
