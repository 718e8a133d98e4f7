"""A quantized bundle is keyed by the CPU class that built it: moved to a machine of another
class (a shared cache directory, a fleet's shared catalog), it is stale, refused at load and
evicted first; fp32 bundles run anywhere. Also: a quantized build that fails the quality gate
publishes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import inference.cpu_class as cpu
from cachesvc.cache.builders import OnnxRuntimeBuilder
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cli import main as cli_main
from cachesvc.errors import QualityGateError
from inference.demo import write_demo_checkpoint
from inference.runtime import load_engine
from inference.runtime.errors import EngineLoadError

AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n"
AMX_CPUINFO = (
    "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_vnni amx_tile amx_int8\n"
)
SMALL: dict[str, Any] = {"max_input_len": 64, "max_kv_cache_capacity": 256}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("classes") / "demo", arch="llama", size="tiny")


@pytest.fixture
def another_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """After it is called, this process reads its CPU class as another machine's: a plain AVX2
    one's, or an AMX one's where this machine is plain AVX2 (the class of the machine the tests
    run on is whatever it is: never assumed)."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(AMX_CPUINFO if cpu.cpu_class() == "avx2" else AVX2_CPUINFO)

    def move() -> str:
        monkeypatch.setattr(cpu, "_CPUINFO", fake)
        monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
        cpu.cpu_class.cache_clear()
        return cpu.cpu_class()

    yield move  # type: ignore[misc]
    cpu.cpu_class.cache_clear()


def test_a_bundle_built_for_another_cpu_class_is_stale_refused_and_evicted_first(
    demo: Path, tmp_path: Path, another_machine: object, capsys: pytest.CaptureFixture[str]
) -> None:
    here = cpu.cpu_class()
    # Random demo weights: what is tested is the keying, not how well they survive 8 bits.
    builders = {"onnxruntime": OnnxRuntimeBuilder(min_agreement=0.0)}
    manager = CacheManager.open(tmp_path / "cache", max_size_bytes=10**12, builders=builders)
    try:
        fp32 = manager.prepare(str(demo), ProfileRequest(precision="fp32", **SMALL))
        int8 = manager.prepare(str(demo), ProfileRequest(precision="int8", **SMALL))  # used last
        info = manager.catalog.bundles.require(int8.bundle_id)
        assert info.profile["cpu_class"] == here and f"-{here.replace('-', '')}-int8-" in info.profile_name
        assert manager.catalog.bundles.require(fp32.bundle_id).profile["cpu_class"] is None
        # The gate's figures are shown with the bundle (GET /admin/bundles/{id} returns this detail).
        detail = manager.queries.bundle_detail(int8.bundle_id)
        assert detail.manifest is not None
        quality = detail.manifest["engine"]["quality"]
        assert quality["cpu_class"] == here and quality["prompts"] == 8
        assert cli_main(["bundles", "show", int8.bundle_id, "--cache-dir", str(tmp_path / "cache")]) == 0
        shown = capsys.readouterr().out
        assert f"greedy agreement {quality['greedy_agreement']} with fp32" in shown
        assert f"CPU class {here}" in shown
        for c in quality["candidates"]:  # each plan the gate tried, with its verdict
            assert f"plan {c['plan']}" in shown
            assert ("no faster than the exact plan" in shown) >= c["slower_than_exact"]
            if "exact_decode_tok_s" in c:  # a two-term plan, weighed against the exact plan
                how = "side by side" if c["side_by_side"] else "timed apart"
                assert f"(exact plan {how}: {c['exact_decode_tok_s']} / " in shown

        moved_to = another_machine()  # type: ignore[operator]
        print(f"built on CPU class {here}, moved to {moved_to}")
        assert moved_to in ("avx2", "amx") and moved_to != here
        report = manager.reconciler.reconcile()
        assert report.stale == (int8.bundle_id,)  # fp32 runs the same float kernels everywhere
        assert manager.catalog.bundles.require(int8.bundle_id).state == "stale"
        with pytest.raises(EngineLoadError, match=f"built for CPU class {here} but this CPU is {moved_to}"):
            load_engine(int8.bundle_dir, threads=1)
        engine = load_engine(fp32.bundle_dir, threads=1)
        engine.close()
        # Stale first, although it was used last: planned before the LRU order.
        sizes = {b.id: b.size_bytes for b in manager.queries.list_bundles(limit=10).items}
        plan = manager.evictor.prune(sum(sizes.values()) - 1, dry_run=True)
        assert plan.evicted == (int8.bundle_id,)
        # Asking for int8 here keys (and builds) this class's own bundle beside it.
        again = manager.prepare(str(demo), ProfileRequest(precision="int8", **SMALL))
        assert again.bundle_id != int8.bundle_id and again.built
    finally:
        manager.close()


def test_a_quantized_build_that_fails_the_gate_publishes_nothing(demo: Path, tmp_path: Path) -> None:
    # A bad kernel choice forced (int8 activations in every layer) and exact agreement asked.
    builders = {"onnxruntime": OnnxRuntimeBuilder(min_agreement=1.0, accuracy_level=4)}
    manager = CacheManager.open(tmp_path / "cache", max_size_bytes=10**12, builders=builders)
    try:
        with pytest.raises(QualityGateError, match=r"^the int8 build failed the quality gate on this CPU"):
            manager.prepare(str(demo), ProfileRequest(precision="int8", **SMALL))
        assert manager.queries.list_bundles(state="ready", limit=10).items == ()
        assert list((tmp_path / "cache" / "engines").rglob("engine.json")) == []
        assert list((tmp_path / "cache" / ".staging").iterdir()) == []
    finally:
        manager.close()
