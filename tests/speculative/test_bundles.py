"""Speculative profiles through the real cache and the real CPU builder: ngram and draft_model
are built and recorded in engine.json, the draft checkpoint gets a cached bundle of its own, and
the methods that need engine-side draft heads are refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import ConfigError
from inference.demo import write_demo_checkpoint
from inference.runtime import load_engine
from inference.serving.speculative import DraftModelProposer, NgramProposer, proposer_factory
from tests.support.scheduling import SchedulerRunner

SHAPES: dict[str, Any] = {"max_input_len": 64, "max_kv_cache_capacity": 256, "max_batch_size": 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = write_demo_checkpoint(root / "target", arch="llama", size="tiny", seed=0)
    draft = write_demo_checkpoint(root / "draft", arch="llama", size="tiny", seed=1)
    return target, draft


@pytest.fixture
def manager(tmp_path: Path) -> CacheManager:
    return CacheManager.open(tmp_path / "cache", max_size_bytes=10**12)


def _meta(bundle: Path) -> dict[str, Any]:
    return dict(json.loads((bundle / "engine.json").read_text()))


def test_ngram_is_built_and_recorded(manager: CacheManager, checkpoints: tuple[Path, Path]) -> None:
    target, draft = checkpoints
    result = manager.prepare(str(target), ProfileRequest(speculative_method="ngram", **SHAPES))
    meta = _meta(result.bundle_dir)
    assert meta["speculative"] == {"method": "ngram"}
    assert result.draft_bundle_id is None and "-ngram-" in result.bundle_dir.name
    plain = manager.prepare(str(target), ProfileRequest(**SHAPES))
    assert plain.bundle_id != result.bundle_id and "speculative" not in _meta(plain.bundle_dir)
    engine = load_engine(result.bundle_dir, max_slots=2, threads=1)
    assert isinstance(proposer_factory(meta["speculative"], num_speculative_tokens=3)(engine), NgramProposer)
    with_draft = ProfileRequest(speculative_method="ngram", draft_model=str(draft), **SHAPES)
    with pytest.raises(ConfigError, match="uses no draft model"):
        manager.prepare(str(target), with_draft)


def test_draft_model_builds_and_caches_the_draft_bundle(
    manager: CacheManager, checkpoints: tuple[Path, Path]
) -> None:
    target, draft = checkpoints
    request = ProfileRequest(speculative_method="draft_model", draft_model=str(draft), **SHAPES)
    first = manager.prepare(str(target), request)
    assert first.built and first.draft_bundle_dir is not None and first.draft_bundle_id is not None
    meta = _meta(first.bundle_dir)
    digest = manager.resolve(str(draft)).digest
    assert meta["speculative"] == {"method": "draft_model", "draft_digest": digest}
    # The draft bundle is the draft checkpoint with the same profile minus speculation.
    alone = manager.prepare(str(draft), ProfileRequest(**SHAPES))
    assert not alone.built and alone.bundle_id == first.draft_bundle_id
    again = manager.prepare(str(target), request)
    assert not again.built and again.draft_bundle_id == first.draft_bundle_id
    assert {b.id for b in manager.queries.list_bundles().items} >= {first.bundle_id, first.draft_bundle_id}

    # What serving does with it: load both, make the proposer, decode; greedy output unchanged.
    engine = load_engine(first.bundle_dir, max_slots=2, threads=1)
    draft_engine = load_engine(first.draft_bundle_dir, max_slots=2, threads=1)
    factory = proposer_factory(meta["speculative"], num_speculative_tokens=3, draft_engine=draft_engine)
    assert isinstance(factory(engine), DraftModelProposer)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    with SchedulerRunner(engine, batch=2) as plain:
        want = plain.run(prompts, 16)
    with SchedulerRunner(engine, batch=2, proposer=factory) as runner:
        assert runner.run(prompts, 16) == want
        stats = runner.sched.speculative_stats
        assert stats is not None and stats.snapshot().steps > 0


@pytest.mark.parametrize("method", ["eagle3", "dflash", "jetspec", "dspark", "mtp"])
def test_engine_side_methods_are_refused_on_the_cpu(
    manager: CacheManager, checkpoints: tuple[Path, Path], method: str
) -> None:
    target, draft = checkpoints
    request = ProfileRequest(speculative_method=method, draft_model=str(draft), **SHAPES)
    with pytest.raises(ConfigError, match="draft heads or extra outputs") as info:
        manager.prepare(str(target), request)
    assert info.value.field == "speculative_method"
    assert "it runs ngram, draft_model" in str(info.value)
