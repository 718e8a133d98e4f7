"""Run the curated mutation check: ``python -m tests.mutation [NAME ...] [--list]``.

The repository's files (those git tracks, plus untracked ones it does not ignore) are copied
once into a temporary directory; each mutation is applied there, its tests run with that copy
first on ``PYTHONPATH`` (child processes and the ``cachesvc`` console script inherit it), and
the file is restored. Outcomes: ``killed`` (the tests failed: good), ``SURVIVED`` (they
passed: the check fails), ``ERROR`` (pytest could not run the tests: a usage error, no tests
collected, a timeout; the check fails too, since a mutation that is not tested proves nothing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mutation.catalog import MUTATIONS
from tests.mutation.engine import Mutation, StaleMutation, apply

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Seconds one mutation's tests may take before the run counts as an error.
TIMEOUT = 600


def _copy_repo(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO_ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _run(root: Path, mutation: Mutation) -> tuple[str, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return "ERROR", time.monotonic() - started, f"timed out after {TIMEOUT} s"
    seconds = time.monotonic() - started
    tail = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode == 1:
        return "killed", seconds, tail
    if proc.returncode == 0:
        return "SURVIVED", seconds, tail
    return "ERROR", seconds, f"pytest exited {proc.returncode}\n{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__)
    parser.add_argument("names", nargs="*", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    if args.list:
        for m in selected:
            print(f"{m.name:32} {m.path}:{m.function}  {m.why}")
        return 0
    killed = 0
    with tempfile.TemporaryDirectory(prefix="cachesvc-mutants-") as tmp:
        root = Path(tmp)
        _copy_repo(root)
        for m in selected:
            try:
                original = apply(root, m)
            except StaleMutation as exc:
                print(f"ERROR    {m.name}: stale mutation: {exc}", flush=True)
                continue
            try:
                outcome, seconds, detail = _run(root, m)
            finally:
                (root / m.path).write_text(original)
            killed += outcome == "killed"
            print(f"{outcome:8} {m.name} ({seconds:.1f} s): {m.why}", flush=True)
            if outcome != "killed":
                print("  " + detail.replace("\n", "\n  "), flush=True)
    print(f"mutations: {killed} of {len(selected)} killed")
    return 0 if killed == len(selected) else 1


if __name__ == "__main__":
    sys.exit(main())
