"""Item 4: the cache never deletes what is not its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachesvc.errors import CacheError
from tests.admin.conftest import open_manager


def _precious(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    return path


def test_a_non_empty_directory_without_cachedir_tag_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "home"
    _precious(root / "engines" / "a" / "b")
    with pytest.raises(CacheError, match=r"CACHEDIR\.TAG"):
        open_manager(root)
    assert (root / "engines" / "a" / "b" / "thesis.tex").read_text() == "years of work"
    assert not (root / "CACHEDIR.TAG").exists()


def test_an_empty_or_new_directory_becomes_a_cache(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "new"):
        open_manager(root).close()
        assert (root / "CACHEDIR.TAG").exists()
        open_manager(root).close()  # and opens again


def test_a_process_that_tags_the_folder_while_another_looks_is_no_foreign_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight processes opening one new folder: one reads "no tag", then another writes the tag
    and makes its subfolders before the first lists the folder. The first must see a cache."""
    from cachesvc.cache.store import layout as layout_mod
    from cachesvc.cache.store.layout import CacheLayout

    root = tmp_path / "cache"
    root.mkdir()
    real = layout_mod._has_tag
    calls = 0

    def racing(path: Path) -> bool:
        nonlocal calls
        calls += 1
        seen = real(path)
        if calls == 1:  # the other process runs its whole ensure() right after this read
            monkeypatch.setattr(layout_mod, "_has_tag", real)
            CacheLayout(root).ensure()
            monkeypatch.setattr(layout_mod, "_has_tag", racing)
        return seen

    monkeypatch.setattr(layout_mod, "_has_tag", racing)
    CacheLayout(root).ensure()
    assert calls >= 2 and (root / "engines").is_dir()


def test_a_symlinked_trash_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    open_manager(root).close()
    target = _precious(tmp_path / "elsewhere")
    (root / ".trash").rmdir()
    os.symlink(target, root / ".trash")
    with pytest.raises(CacheError, match="symlink"):
        m = open_manager(root)
        try:
            m.reconciler.reconcile()
        finally:
            m.close()
    assert (target / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("sub", ["engines", ".staging", ".locks", "checkpoints"])
def test_symlinked_subfolders_are_refused(tmp_path: Path, sub: str) -> None:
    root = tmp_path / "cache"
    open_manager(root).close()
    target = _precious(tmp_path / "elsewhere")
    (root / sub).rmdir()
    os.symlink(target, root / sub)
    with pytest.raises(CacheError, match="symlink"):
        open_manager(root).close()
    assert (target / "thesis.tex").exists()


def test_reconcile_quarantines_unknown_directories(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    m = open_manager(root)
    try:
        _precious(root / "engines" / "aaaa" / "notabundle")
        report = m.reconciler.reconcile()
        assert "engines/aaaa/notabundle" in report.corrupt
        assert not (root / "engines" / "aaaa" / "notabundle").exists()
        kept = list((root / "quarantine").iterdir())
        assert len(kept) == 1 and (kept[0] / "thesis.tex").read_text() == "years of work"
    finally:
        m.close()
