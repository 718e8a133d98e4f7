"""LoRA adapters in the cache: digest, convert once, rows, size, LRU eviction with bundles, pins,
leases, removal and reconcile. Real catalog (SQLite and PostgreSQL), real files, real PEFT
adapters of a tiny transformers model."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import onnxruntime as ort
import pytest

from cachesvc.cache.adapters import resolve_adapter
from cachesvc.cache.catalog import utcnow
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.store import CacheLayout, adapter_lock_key
from cachesvc.errors import CheckpointError, HubUnreachableError, LeasedError, NotFoundError, PinnedError
from tests.support.adapters import write_adapter, write_base
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.databases import catalog_url_for

pytestmark = pytest.mark.usefixtures("catalog_db")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A base model, two adapters of it, and an adapter of a model with other shapes."""
    root = tmp_path_factory.mktemp("lora")
    base = write_base(root / "base")
    other = write_base(root / "other", hidden_size=32, intermediate_size=96)
    return {
        "base": base,
        "a": write_adapter(base, root / "adapter-a", seed=1),
        "b": write_adapter(base, root / "adapter-b", seed=2, rank=2, targets=["q_proj", "v_proj"]),
        "foreign": write_adapter(other, root / "adapter-foreign", seed=3),
    }


def open_manager(cache: Path, cap: int = 10**12) -> CacheManager:
    return CacheManager.open(
        cache, catalog_url=catalog_url_for(cache), max_size_bytes=cap,
        builders={"onnxruntime": FileBuilder(files=2, file_size=1024)}, offline=True,
    )


def test_digest_is_stable_across_copies_and_changes_with_the_weights(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    first = resolve_adapter(str(models["a"]), layout)
    assert resolve_adapter(str(models["a"]), layout) == first
    copy = shutil.copytree(models["a"], tmp_path / "copy")
    moved = resolve_adapter(str(copy), layout)
    assert moved.digest == first.digest and moved.path == copy.resolve() and moved.id == first.digest[:16]
    assert resolve_adapter(str(models["b"]), layout).digest != first.digest
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 99}))
    assert resolve_adapter(str(copy), layout).digest != first.digest


def test_refusals_are_one_line(tmp_path: Path, models: dict[str, Path]) -> None:
    m = open_manager(tmp_path / "cache")
    base = str(models["base"])
    not_peft = make_checkpoint(tmp_path / "ckpt")
    dora = shutil.copytree(models["a"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    no_weights = shutil.copytree(models["a"], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    cases = {
        str(not_peft): "adapter_config.json",
        str(dora): "DoRA",
        str(no_weights): "adapter_model.safetensors",
        str(tmp_path / "missing"): "no such adapter directory",
        "not an id!": "neither an existing directory",
        str(models["foreign"]): "do not fit the base model",
    }
    for source, needle in cases.items():
        with pytest.raises(CheckpointError) as err:
            m.adapters.prepare(source, models["base"])
        assert needle in str(err.value) and "\n" not in str(err.value), source
    with pytest.raises(HubUnreachableError):
        m.add_adapter("org/no-such-adapter", base)
    assert m.adapters.list() == [] and not m.layout.adapters.exists()


def test_prepare_converts_once_and_counts_in_the_cache_size(tmp_path: Path, models: dict[str, Path]) -> None:
    m = open_manager(tmp_path / "cache")
    before = m.queries.stats().size_bytes
    info = m.adapters.prepare(str(models["a"]), models["base"])
    assert info.path == m.layout.root / "adapters" / info.id / "adapter.onnx_adapter" and info.path.is_file()
    assert info.rank == 4 and len(info.targets) == 7 and info.size_bytes == info.path.stat().st_size > 0
    params = ort.AdapterFormat.read_adapter(str(info.path)).get_parameters()
    assert len(params) == 2 * 7 * 2  # A and B of seven projections in two layers
    stamp = info.path.stat().st_mtime_ns
    again = m.adapters.prepare(str(models["a"]), models["base"])
    assert (again.id, again.path, again.size_bytes) == (info.id, info.path, info.size_bytes)
    assert again.last_used_at >= info.last_used_at and info.path.stat().st_mtime_ns == stamp
    assert [e.kind for e in m.catalog.events.recent()].count("adapter_add") == 1
    assert [p.name for p in info.path.parent.iterdir()] == ["adapter.onnx_adapter"]  # no temp files
    assert m.queries.stats().size_bytes == before + info.size_bytes
    assert m.evictor.total_size() == info.size_bytes
    assert m.adapters.get(info.id) == m.adapters.get(info.digest[:10]) == m.adapters.get(str(models["a"]))
    with pytest.raises(NotFoundError):
        m.adapters.get("0" * 16)
    # The same adapter for a model with other shapes is refused, even though it is cached.
    other = write_base(tmp_path / "other", hidden_size=32, intermediate_size=96)
    with pytest.raises(CheckpointError, match="do not fit"):
        m.adapters.prepare(str(models["a"]), other)


def test_lru_eviction_takes_adapters_with_bundles_and_keeps_pinned_and_leased(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    m = open_manager(tmp_path / "cache")
    ckpts = [make_checkpoint(tmp_path / f"ckpt{i}", seed=i) for i in range(2)]
    old_bundle = m.prepare(str(ckpts[0]), ProfileRequest()).bundle_id
    new_bundle = m.prepare(str(ckpts[1]), ProfileRequest()).bundle_id
    a = m.adapters.prepare(str(models["a"]), models["base"])
    b = m.adapters.prepare(str(models["b"]), models["base"])
    now = utcnow()
    m.catalog.bundles.touch(old_bundle, now - timedelta(hours=4))
    m.catalog.adapters.touch(a.id, now - timedelta(hours=3))
    m.catalog.adapters.touch(b.id, now - timedelta(hours=2))
    m.catalog.bundles.touch(new_bundle, now - timedelta(hours=1))
    total = m.evictor.total_size()
    bundle_size = m.catalog.bundles.require(old_bundle).size_bytes
    plan = m.evictor.prune(total - bundle_size - 1, dry_run=True).plan
    assert [(e.bundle_id, e.kind) for e in plan.evict] == [(old_bundle, "bundle"), (a.id, "adapter")]
    m.adapters.set_pinned(a.id, True)
    plan = m.evictor.prune(total - bundle_size - 1, dry_run=True).plan
    assert [(e.bundle_id, e.kind) for e in plan.evict] == [(old_bundle, "bundle"), (b.id, "adapter")]
    assert [(s.bundle_id, s.reason, s.kind) for s in plan.skipped] == [(a.id, "pinned", "adapter")]
    lease = m.adapters.lease(b.id)
    try:
        # The leased adapter is skipped and the next least recently used item goes instead.
        result = m.evictor.prune(total - bundle_size - 1)
        assert list(result.evicted) == [old_bundle, new_bundle]
        assert [(s.bundle_id, s.reason, s.kind) for s in result.skipped] == [
            (a.id, "pinned", "adapter"), (b.id, "leased", "adapter")
        ]
        assert b.path.is_file() and a.path.is_file()
        with pytest.raises(LeasedError):
            m.adapters.remove(b.id)
    finally:
        lease.release()
    assert m.evictor.total_size() == a.size_bytes + b.size_bytes
    result = m.evictor.prune(a.size_bytes)
    assert list(result.evicted) == [b.id] and not b.path.exists() and a.path.is_file()
    assert result.total_after == a.size_bytes and m.catalog.adapters.get(b.id) is None
    removed = m.catalog.events.recent(kind="adapter_rm")
    assert [(e.reason, e.bytes) for e in removed] == [("lru", b.size_bytes)]
    # Clearing the cache keeps the pinned adapter; unpinned, it goes.
    m.evictor.clear()
    assert m.adapters.list()[0].id == a.id
    m.adapters.set_pinned(a.id, False)
    assert a.id in m.evictor.clear().evicted and m.adapters.list() == []


def test_remove_is_refused_while_pinned_then_deletes_row_and_file(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    m = open_manager(tmp_path / "cache")
    a = m.adapters.prepare(str(models["a"]), models["base"])
    m.adapters.set_pinned(a.id, True)
    with pytest.raises(PinnedError):
        m.adapters.remove(a.id)
    assert a.path.is_file()
    m.adapters.set_pinned(a.id, False)
    assert m.adapters.remove(a.id) == a.size_bytes
    assert not a.path.parent.exists() and m.adapters.list() == []
    assert [e.reason for e in m.catalog.events.recent(kind="adapter_rm")] == ["manual"]
    assert [e.kind for e in m.catalog.events.recent()][:3] == ["adapter_rm", "adapter_unpin", "adapter_pin"]
    with pytest.raises(NotFoundError):
        m.adapters.remove(a.id)
    # Converted again on the next prepare.
    assert m.adapters.prepare(str(models["a"]), models["base"]).path.is_file()


def test_reconcile_forgets_rows_without_files_removes_dead_conversions_keeps_files_without_rows(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    m = open_manager(tmp_path / "cache")
    a = m.adapters.prepare(str(models["a"]), models["base"])
    b = m.adapters.prepare(str(models["b"]), models["base"])
    a.path.unlink()
    dead = m.layout.adapters / ("d" * 16)  # a conversion that died before its rename
    dead.mkdir()
    (dead / ".adapter.onnx_adapter.abcdef.tmp").write_bytes(b"half")
    unknown = m.layout.adapters / ("f" * 16)  # converted, its row lost with the catalog: kept
    unknown.mkdir()
    (unknown / "adapter.onnx_adapter").write_bytes(b"x" * 10)
    leftover = b.path.with_name(".adapter.onnx_adapter.123456.tmp")
    leftover.write_bytes(b"half")
    foreign = m.layout.adapters / "notes"
    foreign.mkdir()
    report = m.reconciler.reconcile()
    assert report.adapters_forgotten == (a.id,)
    assert set(report.adapter_files_removed) == {a.id, "d" * 16}
    assert not dead.exists() and not leftover.exists() and foreign.is_dir() and b.path.is_file()
    assert (unknown / "adapter.onnx_adapter").read_bytes() == b"x" * 10
    assert [x.id for x in m.adapters.list()] == [b.id]
    removed = m.catalog.events.recent(kind="adapter_rm")
    assert [(e.reason, e.detail) for e in removed] == [("stale", "file vanished")]
    # A folder whose lock is held (being converted or in use) is left alone.
    held = m.layout.adapters / ("e" * 16)
    held.mkdir()
    lease = m.store.locks.lease(adapter_lock_key("e" * 16))
    try:
        assert m.reconciler.reconcile().adapter_files_removed == ()
        assert held.is_dir()
    finally:
        lease.release()
    assert m.reconciler.reconcile().adapter_files_removed == ("e" * 16,)


def test_prepare_hits_after_a_reopen_and_recovers_a_vanished_file(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    cache = tmp_path / "cache"
    a = open_manager(cache).adapters.prepare(str(models["a"]), models["base"])
    m = open_manager(cache)
    assert m.adapters.prepare(str(models["a"]), models["base"]).created_at == a.created_at
    a.path.unlink()
    again = m.adapters.prepare(str(models["a"]), models["base"])
    assert again.path.is_file() and again.id == a.id
    assert [e.kind for e in m.catalog.events.recent()].count("adapter_add") == 2


def test_the_weights_file_name_is_peft_s() -> None:
    from cachesvc.cache import adapters
    from inference.builder import lora

    assert adapters.ADAPTER_WEIGHTS == lora.ADAPTER_WEIGHTS
