"""Bundle locks, leases and publishing across REAL processes.

Each child runs ``python -c`` against the repository on PYTHONPATH, takes a lock, prints
``ready`` and holds it until its stdin closes (or it is SIGKILLed). The parent reads the
child's stdout for readiness instead of sleeping.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachesvc.cache.store import BundleLocks, BundleStore, CacheLayout, read_manifest, verify_bundle
from cachesvc.errors import LockTimeoutError

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLE_ID = "0123456789abcdef-0123456789ab"
RELPATH = Path("engines/0123456789abcdef/i4096-b1-kv8192-none-onnxruntime-fp32-0123456789ab")
WAIT = 20.0  # generous: the machine is shared; only reached when something is wrong

HOLDER = r"""
import sys
from pathlib import Path
from cachesvc.errors import LockTimeoutError
from cachesvc.cache.store import BundleLocks

locks_dir, mode, bundle_id, timeout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
locks = BundleLocks(Path(locks_dir))
wait = None if timeout == "none" else float(timeout)
try:
    cm = locks.lease(bundle_id, timeout=wait) if mode == "lease" else locks.exclusive(bundle_id, timeout=wait)
    with cm:
        print("ready", flush=True)
        sys.stdin.read()
except LockTimeoutError as exc:
    print("timeout", exc, flush=True)
    sys.exit(3)
print("released", flush=True)
"""


class Child:
    """A child process with a background reader, so the parent can wait for a line with a timeout."""

    def __init__(self, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            **(extra_env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, word: str, timeout: float = WAIT) -> str:
        """Wait for the next line and check it starts with ``word``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"child {self.pid} printed nothing within {timeout}s (expected {word!r})")
        if not line.startswith(word):
            err = self.proc.stderr.read() if line == "<eof>" and self.proc.stderr else ""
            pytest.fail(f"child {self.pid} printed {line!r}, expected {word!r}\n{err}")
        return line

    def finish(self) -> None:
        """Close stdin: the child releases its lock and exits."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=WAIT)


@pytest.fixture()
def spawn() -> Iterator[list[Child]]:
    children: list[Child] = []
    yield children
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(timeout=WAIT)
        for stream in (child.proc.stdin, child.proc.stdout, child.proc.stderr):
            if stream is not None:
                stream.close()


def _holder(
    spawn: list[Child], locks_dir: Path, mode: str, timeout: str = "none", bundle_id: str = BUNDLE_ID
) -> Child:
    child = Child(["-c", HOLDER, str(locks_dir), mode, bundle_id, timeout])
    spawn.append(child)
    return child


def test_child_lease_blocks_exclusive_until_the_child_is_killed(tmp_path: Path, spawn: list[Child]) -> None:
    locks = BundleLocks(tmp_path)
    child = _holder(spawn, tmp_path, "lease")
    child.expect("ready")

    assert locks.is_locked(BUNDLE_ID)
    with locks.try_exclusive(BUNDLE_ID) as got:
        assert got is False
    holders = locks.holders(BUNDLE_ID)
    assert [h["pid"] for h in holders] == [child.pid]
    record = locks.holders_dir(BUNDLE_ID) / f"{holders[0]['host']}-{child.pid}.json"
    assert record.is_file()

    child.kill()  # no chance to clean up: the kernel drops the lock, the record goes stale
    assert not locks.is_locked(BUNDLE_ID)
    with locks.try_exclusive(BUNDLE_ID) as got:
        assert got is True
    assert record.is_file()
    assert locks.holders(BUNDLE_ID) == []
    assert not record.exists()  # the stale record was deleted


def test_two_children_hold_leases_at_once(tmp_path: Path, spawn: list[Child]) -> None:
    locks = BundleLocks(tmp_path)
    first = _holder(spawn, tmp_path, "lease")
    first.expect("ready")
    second = _holder(spawn, tmp_path, "lease", timeout="5")  # would time out if leases excluded
    second.expect("ready")
    with locks.lease(BUNDLE_ID, timeout=0) as mine:  # and the parent can join them
        assert mine.held
        assert sorted(h["pid"] for h in locks.holders(BUNDLE_ID)) == sorted(
            [first.pid, second.pid, os.getpid()]
        )

    first.finish()
    first.expect("released")
    assert locks.is_locked(BUNDLE_ID)  # the second lease still holds
    assert [h["pid"] for h in locks.holders(BUNDLE_ID)] == [second.pid]
    second.finish()
    second.expect("released")
    assert not locks.is_locked(BUNDLE_ID)
    assert locks.holders(BUNDLE_ID) == []


def test_exclusive_waits_for_the_lease_holder_and_logs(
    tmp_path: Path, spawn: list[Child], caplog: pytest.LogCaptureFixture
) -> None:
    locks = BundleLocks(tmp_path, log_interval=0.1)
    child = _holder(spawn, tmp_path, "lease")
    child.expect("ready")
    acquired = threading.Event()
    released_at: list[float] = []
    acquired_at: list[float] = []
    errors: list[BaseException] = []

    def take() -> None:
        try:
            with locks.exclusive(BUNDLE_ID, timeout=WAIT):
                acquired_at.append(time.monotonic())
                acquired.set()
        except BaseException as exc:
            errors.append(exc)
            acquired.set()

    caplog.set_level(logging.INFO, logger="cachesvc.store")
    waiter = threading.Thread(target=take)
    waiter.start()
    assert not acquired.wait(0.5), "exclusive lock granted while a lease was held"
    released_at.append(time.monotonic())
    child.finish()
    child.expect("released")
    assert acquired.wait(WAIT)
    waiter.join(WAIT)
    assert not errors
    assert acquired_at[0] >= released_at[0]
    waiting = [r.getMessage() for r in caplog.records if r.name == "cachesvc.store"]
    assert any(f"waiting for lock on {BUNDLE_ID} (held by another process)" in m for m in waiting)


def test_exclusive_with_timeout_raises(tmp_path: Path, spawn: list[Child]) -> None:
    locks = BundleLocks(tmp_path)
    child = _holder(spawn, tmp_path, "lease")
    child.expect("ready")
    start = time.monotonic()
    with pytest.raises(LockTimeoutError) as info, locks.exclusive(BUNDLE_ID, timeout=0.3):
        pytest.fail("exclusive lock granted while a lease was held")
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 5
    message = str(info.value)
    assert BUNDLE_ID in message and f"pid {child.pid}" in message and "0.3s" in message


def test_child_build_blocks_leases(tmp_path: Path, spawn: list[Child]) -> None:
    locks = BundleLocks(tmp_path)
    builder = _holder(spawn, tmp_path, "exclusive")
    builder.expect("ready")
    with pytest.raises(LockTimeoutError, match="shared lock"):
        locks.lease(BUNDLE_ID, timeout=0.2)
    assert locks.holders(BUNDLE_ID) == []  # no record left by the failed attempt
    other = _holder(spawn, tmp_path, "lease", timeout="0.2")
    other.expect("timeout")
    assert other.proc.wait(timeout=WAIT) == 3
    builder.finish()
    builder.expect("released")
    with locks.lease(BUNDLE_ID, timeout=WAIT) as lease:
        assert lease.held


ENSURE = r"""
import sys, time
from pathlib import Path
from cachesvc.cache.store import CacheLayout

start = Path(sys.argv[2])
while not start.exists():  # start together to make the race real
    time.sleep(0.001)
for _ in range(20):
    CacheLayout(Path(sys.argv[1])).ensure()
print("ok", flush=True)
"""


def test_ensure_is_safe_when_processes_race(tmp_path: Path, spawn: list[Child]) -> None:
    root = tmp_path / "cache"
    go = tmp_path / "go"
    children = [Child(["-c", ENSURE, str(root), str(go)]) for _ in range(4)]
    spawn.extend(children)
    time.sleep(0.3)  # let them start up and spin on the go file
    go.touch()
    for child in children:
        child.expect("ok")
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".locks", ".staging", ".trash", "CACHEDIR.TAG", "checkpoints", "engines"]
    )
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55\n")


PUBLISHER = r"""
import os, sys
from pathlib import Path
from cachesvc.cache.profiles import BundleKey
from cachesvc.cache.store import BundleStore, CacheLayout

store = BundleStore(CacheLayout(Path(sys.argv[1])))
bundle_id, relpath, tag = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
with store.locks.exclusive(bundle_id):
    staging = store.new_staging_dir(bundle_id)
    for i in range(200):
        (staging / f"part-{i:03d}.bin").write_bytes(os.urandom(4096))
    (staging / "tag.txt").write_text(tag)
    print("ready", flush=True)
    key = BundleKey(id=bundle_id, checkpoint_digest="c" * 64, draft_digest=None, profile={},
                    name=relpath.name, backend="onnxruntime", relpath=relpath)
    store.publish(staging, key, versions={}, engine={})
print("done", flush=True)
"""


@pytest.mark.parametrize(
    ("point", "expect"),
    [("publish:staged", "old"), ("publish:moved-aside", None), ("publish:renamed", "new")],
)
def test_killed_publish_leaves_the_old_bundle_or_the_new_one(
    tmp_path: Path, spawn: list[Child], point: str, expect: str | None
) -> None:
    """A publish replacing a bundle, killed at each named step: before the rename the old bundle
    is intact, after it the new one is whole; in the one window between moving the old one aside
    and renaming the new one in there is no bundle at all, never half of one."""
    root = tmp_path / "cache"
    store = BundleStore(CacheLayout(root))
    store.layout.ensure()
    old = Child(["-c", PUBLISHER, str(root), BUNDLE_ID, str(RELPATH), "old"])
    spawn.append(old)
    old.expect("ready")
    old.expect("done")

    new = Child(["-c", PUBLISHER, str(root), BUNDLE_ID, str(RELPATH), "new"], {"CACHESVC_CRASH_AT": point})
    spawn.append(new)
    new.expect("ready")
    assert new.proc.wait(WAIT) == -signal.SIGKILL

    final = root / RELPATH
    if expect is None:
        assert not final.exists()
        assert len(list(store.layout.trash.iterdir())) == 1  # the old one, waiting for deletion
    else:
        manifest = read_manifest(final)
        assert verify_bundle(final, manifest).ok
        assert (final / "tag.txt").read_text() == expect
    assert not store.locks.is_locked(BUNDLE_ID)
    store.empty_trash()
    for _bundle_id, path in store.staging_dirs():
        store.remove_staging(path)
    assert list(store.layout.trash.iterdir()) == [] and list(store.layout.staging.iterdir()) == []
