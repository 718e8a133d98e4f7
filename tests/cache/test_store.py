"""Disk store: layout, manifests, publish/remove/scan, in-process lock semantics.

Real files under tmp_path throughout; cross-process lock behaviour is in
tests/cache/test_store_locks.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from cachesvc.cache.profiles import LAYOUT_VERSION, BundleKey
from cachesvc.cache.store import (
    CACHEDIR_TAG_SIGNATURE,
    MANIFEST_NAME,
    BundleLocks,
    BundleStore,
    CacheLayout,
    FileEntry,
    Manifest,
    Mismatch,
    dir_size,
    hash_files,
    read_manifest,
    verify_bundle,
)
from cachesvc.errors import CorruptBundleError, LockTimeoutError

BUNDLE_ID = "0123456789abcdef-0123456789ab"
RELPATH = Path("engines/0123456789abcdef/i4096-b1-kv8192-none-onnxruntime-fp32-0123456789ab")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture()
def store(tmp_path: Path) -> BundleStore:
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o755)
    layout = CacheLayout(root)
    layout.ensure()
    return BundleStore(layout)


def _stage(store: BundleStore, files: dict[str, bytes], bundle_id: str = BUNDLE_ID) -> Path:
    staging = store.new_staging_dir(bundle_id)
    for rel, data in files.items():
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return staging


def _publish(
    store: BundleStore, staging: Path, relpath: Path = RELPATH, bundle_id: str = BUNDLE_ID
) -> Manifest:
    key = BundleKey(
        id=bundle_id,
        checkpoint_digest="c" * 64,
        draft_digest=None,
        profile={"backend": "onnxruntime", "max_input_len": 4096},
        name=Path(relpath).name,
        backend="onnxruntime",
        relpath=Path(relpath),
    )
    return store.publish(
        staging,
        key,
        versions={"builder": "1.0", "onnxruntime": "1.20"},
        engine={"graph": "model.onnx", "layers": 2},
    )


FILES = {
    "model.onnx": os.urandom(3000),
    "engine.json": b'{"layers": 2}',
    "tokenizer/tokenizer.json": b'{"model": {}}',
    "empty.bin": b"",
}


# -- layout -----------------------------------------------------------------------------------


def test_ensure_creates_tree_and_cachedir_tag(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "a" / "cache")
    layout.ensure()
    for path in (layout.engines, layout.checkpoints, layout.staging, layout.locks, layout.trash):
        assert path.is_dir(), path
        assert path.parent == layout.root
    assert layout.staging.name == ".staging" and layout.locks.name == ".locks"
    lines = (layout.root / "CACHEDIR.TAG").read_text().splitlines()
    assert lines[0] == "Signature: 8a477f597d28d172789f06886806bc55" == CACHEDIR_TAG_SIGNATURE
    assert lines[1].startswith("#") and "cachesvc" in lines[1]
    before = (layout.root / "CACHEDIR.TAG").stat().st_mtime_ns
    layout.ensure()  # idempotent: nothing rewritten, no temp files left
    assert (layout.root / "CACHEDIR.TAG").stat().st_mtime_ns == before
    assert sorted(p.name for p in layout.root.iterdir()) == sorted(
        [".locks", ".staging", ".trash", "CACHEDIR.TAG", "checkpoints", "engines"]
    )


def test_ensure_rewrites_a_tag_with_the_wrong_signature(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    (tmp_path / "CACHEDIR.TAG").write_text("garbage\n")
    layout.ensure()
    assert (tmp_path / "CACHEDIR.TAG").read_text().startswith(CACHEDIR_TAG_SIGNATURE + "\n")


def test_ensure_dirs_take_the_root_mode(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o750)
    old = os.umask(0o077)  # a restrictive umask must not decide the cache's modes
    try:
        CacheLayout(root).ensure()
    finally:
        os.umask(old)
    assert _mode(root / "engines") == 0o750
    assert _mode(root / ".locks") == 0o750
    assert _mode(root / "CACHEDIR.TAG") == 0o640


def test_layout_accepts_str_root(tmp_path: Path) -> None:
    layout = CacheLayout(str(tmp_path))  # type: ignore[arg-type]
    assert layout.engines == tmp_path / "engines"


@pytest.mark.parametrize(
    ("relpath", "fragment"),
    [("/etc/passwd", "absolute"), ("engines/../../x", ".."), ("..", ".."), ("", "empty"), (".", "empty")],
)
def test_bundle_dir_rejects_escapes(tmp_path: Path, relpath: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        CacheLayout(tmp_path).bundle_dir(Path(relpath))


def test_bundle_dir_joins_relative_paths(tmp_path: Path) -> None:
    assert CacheLayout(tmp_path).bundle_dir(RELPATH) == tmp_path / RELPATH
    assert CacheLayout(tmp_path).bundle_dir(str(RELPATH)) == tmp_path / RELPATH


# -- publish ----------------------------------------------------------------------------------


def test_publish_moves_staging_into_place_with_a_full_manifest(store: BundleStore) -> None:
    staging = _stage(store, FILES)
    manifest = _publish(store, staging)
    final = store.layout.root / RELPATH
    assert final.is_dir() and not staging.exists()
    assert list(store.layout.staging.iterdir()) == []
    assert list(store.layout.trash.iterdir()) == []
    assert read_manifest(final) == manifest
    expected = {rel: (len(data), hashlib.sha256(data).hexdigest()) for rel, data in FILES.items()}
    assert {e.path: (e.size, e.sha256) for e in manifest.files} == expected
    assert [e.path for e in manifest.files] == sorted(FILES)
    assert manifest.size_bytes == sum(len(d) for d in FILES.values())  # manifest.json not counted
    assert manifest.file_count == len(FILES)
    assert manifest.layout_version == LAYOUT_VERSION
    assert manifest.bundle_id == BUNDLE_ID and manifest.engine == {"graph": "model.onnx", "layers": 2}
    assert verify_bundle(final).ok
    # No temp manifest or other stray file made it into the bundle.
    assert sorted(p.name for p in final.iterdir()) == sorted(
        ["model.onnx", "engine.json", "tokenizer", "empty.bin", MANIFEST_NAME]
    )


@pytest.mark.parametrize(
    ("root_mode", "dir_mode", "file_mode"), [(0o755, 0o755, 0o644), (0o770, 0o770, 0o660)]
)
def test_publish_permissions_follow_the_root(
    tmp_path: Path, root_mode: int, dir_mode: int, file_mode: int
) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, root_mode)
    store = BundleStore(CacheLayout(root))
    store.layout.ensure()
    staging = _stage(store, FILES)
    assert _mode(staging) == 0o700  # mkdtemp's private mode: must not leak into the cache
    os.chmod(staging / "model.onnx", 0o700)  # exec bits must be dropped too
    os.chmod(staging / "engine.json", 0o600)
    os.chmod(staging / "tokenizer", 0o700)
    _publish(store, staging)
    final = root / RELPATH
    assert _mode(final) == dir_mode
    assert _mode(final.parent) == dir_mode  # engines/<d16>, created by publish
    assert _mode(final / "tokenizer") == dir_mode
    for rel in [*FILES, MANIFEST_NAME]:
        assert _mode(final / rel) == file_mode, rel


def test_publish_replaces_an_existing_directory(store: BundleStore) -> None:
    _publish(store, _stage(store, {"old.bin": b"old", "model.onnx": b"stale"}))
    final = store.layout.root / RELPATH
    (final / "model.onnx").write_bytes(b"corrupted")
    manifest = _publish(store, _stage(store, FILES))
    assert sorted(p.name for p in final.iterdir()) == sorted(
        [*{r.split("/")[0] for r in FILES}, MANIFEST_NAME]
    )
    assert (final / "model.onnx").read_bytes() == FILES["model.onnx"]
    assert read_manifest(final) == manifest
    assert verify_bundle(final).ok
    assert list(store.layout.trash.iterdir()) == []


def test_publish_refuses_symlinks_and_foreign_staging(store: BundleStore, tmp_path: Path) -> None:
    staging = _stage(store, {"a.bin": b"a"})
    (staging / "link").symlink_to(tmp_path)
    with pytest.raises(CorruptBundleError, match="symlink"):
        _publish(store, staging)
    assert not (store.layout.root / RELPATH).exists()

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(ValueError, match="staging"):
        _publish(store, outside)


@pytest.mark.parametrize("relpath", ["checkpoints", "engines/x", "engines/a/b/c", ".locks/a/b"])
def test_publish_and_remove_only_touch_bundle_paths(store: BundleStore, relpath: str) -> None:
    staging = _stage(store, {"a.bin": b"a"})
    with pytest.raises(ValueError, match="engines/<model-digest16>/<profile-name>"):
        _publish(store, staging, Path(relpath))
    with pytest.raises(ValueError, match="engines/<model-digest16>/<profile-name>"):
        store.remove(Path(relpath))
    assert store.layout.checkpoints.is_dir()


def test_new_staging_dir_is_unique_and_validates_the_id(store: BundleStore) -> None:
    a, b = store.new_staging_dir(BUNDLE_ID), store.new_staging_dir(BUNDLE_ID)
    assert a != b and a.parent == b.parent == store.layout.staging
    assert a.name.startswith(BUNDLE_ID + ".")
    for bad in ("", "../x", "a/b", "a.b", "-x"):
        with pytest.raises(ValueError, match="invalid bundle id"):
            store.new_staging_dir(bad)


# -- manifest ---------------------------------------------------------------------------------


def _manifest_dict() -> dict[str, Any]:
    return {
        "layout_version": LAYOUT_VERSION,
        "bundle_id": BUNDLE_ID,
        "checkpoint_digest": "c" * 64,
        "draft_digest": None,
        "profile": {"backend": "onnxruntime"},
        "backend": "onnxruntime",
        "versions": {"builder": "1.0"},
        "engine": {"layers": 2},
        "files": [{"path": "a/b.bin", "size": 3, "sha256": "a" * 64}],
        "created_at": "2026-01-02T03:04:05+00:00",
    }


def test_manifest_round_trip() -> None:
    manifest = Manifest(
        layout_version=LAYOUT_VERSION,
        bundle_id=BUNDLE_ID,
        checkpoint_digest="c" * 64,
        draft_digest="d" * 64,
        profile={"x": [1, 2]},
        backend="tensorrt",
        versions={"tensorrt": "10.0"},
        engine={"nested": {"k": "v"}},
        files=(FileEntry("a.bin", 1, "1" * 64), FileEntry("z/b.bin", 0, "2" * 64)),
        created_at="2026-01-02T03:04:05+00:00",
    )
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.to_json() == manifest.to_json()
    assert (again.size_bytes, again.file_count) == (1, 2)
    assert Manifest.from_json(json.dumps(_manifest_dict()).encode()).files == (
        FileEntry("a/b.bin", 3, "a" * 64),
    )


@pytest.mark.parametrize("key", sorted(_manifest_dict()))
def test_manifest_missing_key_is_named(key: str) -> None:
    data = _manifest_dict()
    del data[key]
    with pytest.raises(CorruptBundleError, match=f"missing key '{key}'"):
        Manifest.from_json(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("layout_version", "1"),
        ("layout_version", True),
        ("bundle_id", 7),
        ("checkpoint_digest", None),
        ("draft_digest", 5),
        ("profile", []),
        ("backend", {"a": 1}),
        ("versions", "1.0"),
        ("engine", "x"),
        ("files", {}),
        ("created_at", 12),
    ],
)
def test_manifest_wrong_type_is_named(key: str, value: object) -> None:
    data = _manifest_dict()
    data[key] = value
    with pytest.raises(CorruptBundleError, match=f"key '{key}' must be"):
        Manifest.from_json(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d["files"][0].pop("size"), "missing key 'files[0].size'"),
        (lambda d: d["files"][0].update(size="3"), "key 'files[0].size' must be int"),
        (lambda d: d["files"][0].update(size=-1), "files[0].size' must be >= 0"),
        (lambda d: d["files"][0].update(sha256="xyz"), "files[0].sha256"),
        (lambda d: d["files"][0].update(path="../../etc/passwd"), "files[0].path"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "files[0].path"),
        (lambda d: d["files"].append(dict(d["files"][0])), "repeats"),
        (lambda d: d["versions"].update(onnx=1), "versions.onnx"),
        (lambda d: d.update(extra=1), "unknown key 'extra'"),
        (lambda d: d.update(layout_version=LAYOUT_VERSION + 1), "layout_version"),
        (lambda d: d.update(created_at="yesterday"), "created_at"),
        (lambda d: d.update(created_at="2026-01-02T03:04:05"), "created_at"),
    ],
)
def test_manifest_nested_strictness(mutate: Any, fragment: str) -> None:
    data = _manifest_dict()
    mutate(data)
    with pytest.raises(CorruptBundleError) as info:
        Manifest.from_json(json.dumps(data).encode())
    assert fragment in str(info.value)


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_manifest_not_an_object(raw: bytes) -> None:
    with pytest.raises(CorruptBundleError, match=MANIFEST_NAME):
        Manifest.from_json(raw)


def test_read_manifest_missing_or_invalid(tmp_path: Path) -> None:
    with pytest.raises(CorruptBundleError, match="missing"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{}")
    with pytest.raises(CorruptBundleError, match=str(tmp_path)):
        read_manifest(tmp_path)


def test_hash_files_skips_only_the_top_manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("ignored")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / MANIFEST_NAME).write_bytes(b"kept")
    big = os.urandom(2 * 1024 * 1024 + 17)  # spans several 1 MiB chunks
    (tmp_path / "big.bin").write_bytes(big)
    entries = hash_files(tmp_path)
    assert [(e.path, e.size, e.sha256) for e in entries] == [
        ("big.bin", len(big), hashlib.sha256(big).hexdigest()),
        (f"sub/{MANIFEST_NAME}", 4, hashlib.sha256(b"kept").hexdigest()),
    ]
    assert all(e.sample_sha256 for e in entries)


# -- verify -----------------------------------------------------------------------------------


@pytest.fixture()
def published(store: BundleStore) -> Path:
    _publish(store, _stage(store, FILES))
    return store.layout.root / RELPATH


def test_verify_ok(published: Path) -> None:
    report = verify_bundle(published)
    assert report.ok and report.mismatches == ()
    assert report.files_checked == len(FILES)
    assert report.bytes_checked == sum(len(d) for d in FILES.values())


def test_verify_catches_a_bit_flip(published: Path) -> None:
    data = bytearray((published / "model.onnx").read_bytes())
    data[1234] ^= 0x01
    (published / "model.onnx").write_bytes(bytes(data))
    report = verify_bundle(published)
    assert not report.ok
    assert report.mismatches == (Mismatch("model.onnx", "sha256"),)


def test_verify_catches_truncation_missing_and_extra(published: Path) -> None:
    with (published / "model.onnx").open("r+b") as fh:
        fh.truncate(100)
    (published / "tokenizer" / "tokenizer.json").unlink()
    (published / "tokenizer" / "extra.txt").write_text("surprise")
    report = verify_bundle(published, read_manifest(published))
    assert set(report.mismatches) == {
        Mismatch("model.onnx", "size"),
        Mismatch("tokenizer/tokenizer.json", "missing"),
        Mismatch("tokenizer/extra.txt", "unexpected"),
    }
    assert not report.ok
    assert report.files_checked == len(FILES)


def test_verify_treats_a_swapped_in_symlink_as_missing(published: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside.json"
    target.write_bytes(FILES["engine.json"])
    (published / "engine.json").unlink()
    (published / "engine.json").symlink_to(target)
    assert verify_bundle(published).mismatches == (Mismatch("engine.json", "missing"),)


# -- remove, trash ----------------------------------------------------------------------------


def test_remove_is_idempotent_and_cleans_the_parent(store: BundleStore, published: Path) -> None:
    sibling_rel = RELPATH.parent / "other-profile"
    _publish(store, _stage(store, {"x": b"x"}, "0123456789abcdef-ffffffffffff"), sibling_rel)
    store.remove(RELPATH)
    assert not published.exists()
    assert published.parent.is_dir()  # the sibling still lives there
    store.remove(sibling_rel)
    assert not published.parent.exists()  # empty engines/<d16> removed
    assert store.layout.engines.is_dir()
    assert list(store.layout.trash.iterdir()) == []
    store.remove(RELPATH)  # already gone: no error


def test_remove_hides_the_bundle_even_when_deletion_fails(
    store: BundleStore, published: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_rmtree(*args: object, **kwargs: object) -> None:
        raise PermissionError("simulated: cannot delete")

    monkeypatch.setattr(shutil, "rmtree", broken_rmtree)
    store.remove(RELPATH)
    assert not published.exists()  # gone from view at once (renamed)
    leftovers = list(store.layout.trash.iterdir())
    assert len(leftovers) == 1 and (leftovers[0] / "model.onnx").is_file()
    monkeypatch.undo()
    assert store.empty_trash() == 1
    assert list(store.layout.trash.iterdir()) == []


def test_remove_does_not_follow_symlinks_out_of_the_cache(store: BundleStore, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("keep")
    staging = _stage(store, {"a.bin": b"a"})
    _publish(store, staging)
    (store.layout.root / RELPATH / "escape").symlink_to(precious)
    store.remove(RELPATH)
    assert (precious / "keep.txt").read_text() == "keep"
    link_rel = RELPATH.parent / "linked"
    (store.layout.root / link_rel).parent.mkdir(exist_ok=True)  # removed with the last bundle
    (store.layout.root / link_rel).symlink_to(precious)
    store.remove(link_rel)
    assert (precious / "keep.txt").read_text() == "keep"
    assert not os.path.lexists(store.layout.root / link_rel)


# -- scan, staging ----------------------------------------------------------------------------


def test_scan_reports_valid_and_broken_bundles(store: BundleStore, published: Path, tmp_path: Path) -> None:
    no_manifest = store.layout.engines / "fedcba9876543210" / "half-built"
    no_manifest.mkdir(parents=True)
    (no_manifest / "model.onnx").write_bytes(b"x")
    bad_manifest = store.layout.engines / "fedcba9876543210" / "bad"
    bad_manifest.mkdir()
    (bad_manifest / MANIFEST_NAME).write_text('{"layout_version": 1}')
    (store.layout.engines / "fedcba9876543210" / "stray-file").write_text("x")
    (store.layout.engines / "fedcba9876543210" / "link").symlink_to(tmp_path)

    found = {s.relpath: s for s in store.scan()}
    assert set(found) == {
        RELPATH,
        Path("engines/fedcba9876543210/half-built"),
        Path("engines/fedcba9876543210/bad"),
        Path("engines/fedcba9876543210/link"),
    }
    good = found[RELPATH]
    assert good.error is None and good.manifest is not None and good.manifest.bundle_id == BUNDLE_ID
    assert good.path == published
    half = found[Path("engines/fedcba9876543210/half-built")]
    assert half.manifest is None and half.error is not None and "missing" in half.error
    bad = found[Path("engines/fedcba9876543210/bad")]
    assert bad.manifest is None and bad.error is not None and "bundle_id" in bad.error
    assert found[Path("engines/fedcba9876543210/link")].error is not None


def test_scan_of_an_empty_or_missing_cache(tmp_path: Path) -> None:
    assert BundleStore(CacheLayout(tmp_path / "nothing")).scan() == []


def test_staging_dirs_parse_ids(store: BundleStore) -> None:
    a = store.new_staging_dir(BUNDLE_ID)
    b = store.new_staging_dir("fedcba9876543210-abcdefabcdef")
    (store.layout.staging / "no-dot").mkdir()
    (store.layout.staging / "file.abc").write_text("x")
    assert sorted(store.staging_dirs()) == sorted([(BUNDLE_ID, a), ("fedcba9876543210-abcdefabcdef", b)])
    (a / "partial.bin").write_bytes(b"x")
    store.remove_staging(a)
    store.remove_staging(a)  # idempotent
    assert store.staging_dirs() == [("fedcba9876543210-abcdefabcdef", b)]
    with pytest.raises(ValueError, match="not a staging dir"):
        store.remove_staging(store.layout.engines)


def test_dir_size_counts_regular_files(store: BundleStore, published: Path) -> None:
    manifest_size = (published / MANIFEST_NAME).stat().st_size
    assert dir_size(published) == sum(len(d) for d in FILES.values()) + manifest_size
    assert dir_size(published / "nope") == 0


# -- locks within one process -----------------------------------------------------------------


def test_two_bundle_locks_in_one_process_conflict(tmp_path: Path) -> None:
    a, b = BundleLocks(tmp_path / "locks"), BundleLocks(tmp_path / "locks")
    assert not a.is_locked(BUNDLE_ID)
    with a.lease(BUNDLE_ID) as lease:
        assert lease.held and lease.bundle_id == BUNDLE_ID
        assert b.is_locked(BUNDLE_ID) and a.is_locked(BUNDLE_ID)
        with b.try_exclusive(BUNDLE_ID) as got:
            assert got is False
        with (
            pytest.raises(LockTimeoutError, match=f"pid {os.getpid()}"),
            b.exclusive(BUNDLE_ID, timeout=0.05),
        ):
            pass
        with b.lease(BUNDLE_ID, timeout=0) as second:  # shared + shared is fine
            assert second.held
    assert not lease.held
    lease.release()  # idempotent
    with b.try_exclusive(BUNDLE_ID) as got:
        assert got is True
        assert a.is_locked(BUNDLE_ID)
        with pytest.raises(LockTimeoutError, match="shared lock"):
            a.lease(BUNDLE_ID, timeout=0.05)
    assert not a.is_locked(BUNDLE_ID)


def test_holder_record_outlives_one_of_two_leases_in_a_process(tmp_path: Path) -> None:
    locks = BundleLocks(tmp_path)
    first = locks.lease(BUNDLE_ID)
    second = BundleLocks(tmp_path).lease(BUNDLE_ID)
    records = locks.holders(BUNDLE_ID)
    assert [r["pid"] for r in records] == [os.getpid()]
    assert set(records[0]) == {"pid", "host", "since"}
    first.release()
    assert [r["pid"] for r in locks.holders(BUNDLE_ID)] == [os.getpid()]
    second.release()
    assert locks.holders(BUNDLE_ID) == []
    assert list(locks.holders_dir(BUNDLE_ID).iterdir()) == []


def test_lock_arguments_are_validated(tmp_path: Path) -> None:
    locks = BundleLocks(tmp_path)
    with pytest.raises(ValueError, match="invalid bundle id"):
        locks.is_locked("../etc")
    with pytest.raises(ValueError, match="timeout"):
        locks.lease(BUNDLE_ID, timeout=-1)
