"""Real full disks for the disk-full scenarios: a small tmpfs mounted for a test (root only)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(mount: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``mount`` (made when missing) for the ``with`` block;
    the test is skipped where it cannot be mounted (not root, or no permission)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; run the suite as root (CI does) to cover disk-full")
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path) -> Path:
    """Write zeros to ``path`` until its filesystem is full; the file (delete it to make room)."""
    with path.open("wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return path
