"""Fixtures shared by every suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.databases import PG_URL_ENV, catalog_backend, pg_server_url


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once on SQLite and once on PostgreSQL (the catalog suites use this)."""
    kind = str(request.param)
    if kind == "postgresql" and pg_server_url() is None:
        pytest.skip(f"no PostgreSQL server configured ({PG_URL_ENV} unset; .ci/run starts one)")
    with catalog_backend(kind):
        yield kind


# -- tiers -----------------------------------------------------------------------------------------
# Folders sort tests by the module area they test (tests/README.md); the tier is a marker, given
# here per file so that no test body carries it. `pytest -m unit`, `-m "not e2e and not slow"` ...
# A test file missing from this table is reported by tests/docs/test_layout.py.

TIER_MARKERS = ("unit", "integration", "e2e", "reliability")

TIERS: dict[str, tuple[str, ...]] = {
    "admin/test_adapters.py": ("integration",),
    "admin/test_api_docs.py": ("e2e",),
    "admin/test_auth.py": ("integration",),
    "admin/test_build_progress.py": ("e2e",),
    "admin/test_builds.py": ("integration",),
    "admin/test_checkpoints_rm.py": ("integration",),
    "admin/test_cli.py": ("integration",),
    "admin/test_cli_errors.py": ("integration",),
    "admin/test_leases.py": ("integration",),
    "admin/test_list_cache.py": ("integration",),
    "admin/test_models.py": ("integration",),
    "admin/test_routes.py": ("integration",),
    "admin/test_schema_fuzz.py": ("reliability", "slow"),
    "admin/test_unsupported_family.py": ("integration",),
    "admin/test_stats_metrics.py": ("integration",),
    "cache/test_adapters.py": ("integration",),
    "cache/test_catalog.py": ("unit",),
    "cache/test_catalog_file_liveness.py": ("reliability",),
    "cache/test_checkpoints.py": ("unit",),
    "cache/test_concurrent_prepare.py": ("reliability",),
    "cache/test_context_folder_link.py": ("reliability",),
    "cache/test_context_records_disk_full.py": ("reliability",),
    "cache/test_context_records.py": ("integration",),
    "cache/test_corrupt_bundles.py": ("integration",),
    "cache/test_corruption.py": ("reliability", "slow"),
    "cache/test_cpu_class_stale.py": ("integration",),
    "cache/test_crash_builds.py": ("reliability",),
    "cache/test_disk_full.py": ("reliability",),
    "cache/test_manager.py": ("integration",),
    "cache/test_phantom_rows.py": ("integration",),
    "cache/test_profiles.py": ("unit",),
    "cache/test_real_builder.py": ("integration",),
    "cache/test_reconcile_safety.py": ("integration",),
    "cache/test_store.py": ("unit",),
    "cache/test_store_locks.py": ("integration",),
    "docs/test_code_layout.py": ("unit",),
    "docs/test_configuration_table.py": ("unit",),
    "docs/test_docs_links.py": ("unit",),
    "docs/test_layout.py": ("unit",),
    "engine/test_build_errors.py": ("integration",),
    "engine/test_bundle.py": ("integration",),
    "engine/test_config_conventions.py": ("integration",),
    "engine/test_context_records_on_disk.py": ("unit",),
    "engine/test_context_restart.py": ("integration",),
    "engine/test_context_reuse.py": ("integration",),
    "engine/test_cpu_classes.py": ("unit",),
    "engine/test_demo.py": ("unit",),
    "engine/test_embedding_batches.py": ("unit",),
    "engine/test_embeddings.py": ("integration",),
    "engine/test_extend.py": ("integration",),
    "engine/test_families.py": ("unit",),
    "engine/test_family_variants.py": ("integration",),
    "engine/test_gemma4.py": ("integration",),
    "engine/test_moe.py": ("integration",),
    "engine/test_rope_scaling.py": ("integration",),
    "engine/test_int8.py": ("integration",),
    "engine/test_kernel_plans.py": ("integration",),
    "engine/test_kv_cache.py": ("integration",),
    "engine/test_kv_fp16.py": ("integration",),
    "engine/test_fusions.py": ("unit",),
    "engine/test_two_term.py": ("integration",),
    "engine/test_family_serving_features.py": ("integration",),
    "engine/test_lora.py": ("integration",),
    "engine/test_parity.py": ("integration",),
    "fleet/test_concurrency.py": ("integration",),
    "fleet/test_dashboard.py": ("e2e",),
    "fleet/test_fleet_e2e.py": ("e2e",),
    "fleet/test_nodes.py": ("integration",),
    "fleet/test_own_rows.py": ("integration",),
    "gguf/test_conversion_leftovers.py": ("reliability",),
    "gguf/test_default_model.py": ("integration", "slow"),
    "gguf/test_families.py": ("integration",),
    "gguf/test_precision.py": ("integration", "slow"),
    "gguf/test_real_model.py": ("integration", "slow"),
    "gguf/test_serve.py": ("e2e", "slow"),
    "gguf/test_structured_real.py": ("integration", "slow"),
    "gguf/test_written.py": ("integration",),
    "registry/test_admin_routes.py": ("integration",),
    "registry/test_artifact.py": ("unit",),
    "registry/test_auth.py": ("integration",),
    "registry/test_cli.py": ("integration",),
    "registry/test_crash_pull.py": ("reliability",),
    "registry/test_fleet_share.py": ("integration",),
    "registry/test_machine_class.py": ("unit",),
    "registry/test_push_pull.py": ("integration",),
    "registry/test_refs.py": ("unit",),
    "registry/test_two_nodes_e2e.py": ("e2e", "slow"),
    "registry/test_untrusted.py": ("reliability",),
    "service/test_admission.py": ("e2e",),
    "service/test_api_real_model.py": ("e2e", "slow"),
    "service/test_api_surface.py": ("e2e",),
    "service/test_browser_requests.py": ("integration",),
    "service/test_build_requests.py": ("integration",),
    "service/test_catalog_file_outage.py": ("reliability",),
    "service/test_catalog_outage.py": ("reliability",),
    "service/test_config.py": ("unit",),
    "service/test_context_reuse.py": ("e2e",),
    "service/test_context_survives_restart.py": ("e2e",),
    "service/test_embeddings.py": ("e2e",),
    "service/test_embeddings_memory.py": ("reliability", "slow"),
    "service/test_event_loop.py": ("integration",),
    "service/test_event_retention.py": ("reliability",),
    "service/test_families_served.py": ("e2e",),
    "service/test_lifecycle.py": ("e2e",),
    "service/test_lora_foreign.py": ("reliability",),
    "service/test_lora_paths.py": ("reliability",),
    "service/test_lora_serve.py": ("e2e",),
    "service/test_one_node_per_dir.py": ("reliability", "slow"),
    "service/test_openai.py": ("e2e",),
    "service/test_overload.py": ("reliability",),
    "service/test_parsers.py": ("e2e",),
    "service/test_pool.py": ("e2e",),
    "service/test_prompt_lists.py": ("e2e",),
    "service/test_real_model.py": ("e2e", "slow"),
    "service/test_registries.py": ("unit",),
    "service/test_remove_during_build.py": ("e2e", "slow"),
    "service/test_request_bodies.py": ("integration",),
    "service/test_request_edges.py": ("e2e",),
    "service/test_request_fields.py": ("e2e",),
    "service/test_settings_env.py": ("unit",),
    "service/test_shutdown.py": ("e2e",),
    "service/test_wiring.py": ("e2e",),
    "serving/test_choices.py": ("unit",),
    "serving/test_generation.py": ("unit",),
    "serving/test_http.py": ("integration",),
    "serving/test_live.py": ("integration",),
    "serving/test_nullable.py": ("unit",),
    "serving/test_parsers.py": ("unit",),
    "serving/test_pool_seams.py": ("unit",),
    "serving/test_sampling.py": ("unit",),
    "serving/test_scheduler_guard.py": ("unit",),
    "serving/test_structured.py": ("unit",),
    "serving/test_tokenizer.py": ("unit",),
    "speculative/test_bundles.py": ("integration",),
    "speculative/test_real_model.py": ("integration", "slow"),
    "speculative/test_serve.py": ("e2e",),
    "speculative/test_speculative.py": ("unit",),
    "trt/test_fake.py": ("unit",),
    "trt/test_gpu.py": ("integration",),
    "trt/test_selection.py": ("unit",),
    "trt/test_stale.py": ("integration",),
    "trt/test_trt_engine.py": ("integration",),
    "vision/test_llava.py": ("integration",),
    "vision/test_gemma3.py": ("integration",),
    "vision/test_preprocess.py": ("integration",),
    "vision/test_image_decode.py": ("unit",),
    "vision/test_serve.py": ("e2e",),
    "vision/test_gemma3_serve.py": ("e2e",),
    "vision/test_registry.py": ("unit",),
    "vision/test_qwen2_5_vl.py": ("integration",),
    "vision/test_qwen2_5_vl_serve.py": ("e2e",),
    "vision/test_image_parts.py": ("unit",),
    "vision/test_image_features.py": ("unit",),
    "vision/test_image_reuse.py": ("integration",),
    "vision/test_bad_images.py": ("e2e",),
    "vision/test_idefics3.py": ("integration",),
    "vision/test_idefics3_preprocess.py": ("integration",),
    "vision/test_serve_idefics3.py": ("e2e",),
}

TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with the tiers of its file (``TIERS``)."""
    for item in items:
        try:
            rel = item.path.resolve().relative_to(TESTS_DIR).as_posix()
        except ValueError:
            continue
        for tier in TIERS.get(rel, ()):
            item.add_marker(getattr(pytest.mark, tier))
