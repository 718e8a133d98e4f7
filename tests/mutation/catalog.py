"""The mutations: each breaks one safety-critical behaviour the way a plausible bug would.

Every entry names the tests that must catch it. Keep the test lists short (the check runs in
CI): the point is that *these* tests notice, not that the whole suite does.
"""

from __future__ import annotations

from tests.mutation.engine import Mutation

MANAGER = "tests/cache/test_manager.py"
ADAPTERS = "tests/cache/test_adapters.py"
LIVE = "tests/serving/test_live.py"
STALE = (
    "tests/trt/test_stale.py::"
    "test_another_gpu_flags_stale_never_serves_evicts_first_and_the_gpu_back_restores[sqlite]"
)

CPU_CLASS = (
    "tests/cache/test_cpu_class_stale.py::"
    "test_a_bundle_built_for_another_cpu_class_is_stale_refused_and_evicted_first"
)

MUTATIONS: tuple[Mutation, ...] = (
    # -- atomic publish and crash safety --------------------------------------------------
    Mutation(
        name="publish-file-by-file",
        why="publish moves files one by one instead of one os.replace of the directory",
        path="cachesvc/store/bundles.py",
        function="BundleStore.publish",
        find=r"os\.replace\(staging, final\)",
        replace=(
            "final.mkdir(); [os.replace(p, final / p.name) for p in sorted(staging.iterdir())]; "
            "staging.rmdir()"
        ),
        tests=(f"{MANAGER}::test_sigkill_mid_build_leaves_nothing_half_written[sqlite-first-move]",),
    ),
    Mutation(
        name="failed-build-keeps-staging",
        why="a failed build leaves its staging directory behind",
        path="cachesvc/manager.py",
        function="CacheManager._build_locked",
        find=r"self\.store\.remove_staging\(staging\)",
        replace="pass",
        tests=(f"{MANAGER}::test_build_failure_publishes_nothing",),
    ),
    Mutation(
        name="reconcile-takes-running-staging",
        why="reconcile removes the staging dir of a build another process is running",
        path="cachesvc/reconcile.py",
        function="Reconciler.reconcile",
        find=r"if got:  # no build holds it",
        replace="if True:  # no build holds it",
        tests=(f"{MANAGER}::test_reconcile_leaves_a_running_build_alone",),
    ),
    Mutation(
        name="build-ignores-free-space",
        why="a build or GGUF conversion larger than the free disk starts anyway (and fails part way)",
        path="cachesvc/store/space.py",
        function="require_free",
        find=r"if needed > free:",
        replace="if False:",
        tests=(
            "tests/cache/test_disk_full.py::test_a_build_larger_than_the_free_space_is_refused_before_it_starts",
            "tests/cache/test_disk_full.py::test_a_gguf_larger_than_the_free_space_is_refused_before_it_is_copied",
        ),
    ),
    Mutation(
        name="killed-conversion-leaves-no-failure",
        why="reconcile removes a killed GGUF conversion's staging without a build_failed event",
        path="cachesvc/reconcile.py",
        function="Reconciler.reconcile",
        find=r'"build_failed", model=orphan\.source',
        replace='"reconcile", model=orphan.source',
        tests=(
            "tests/gguf/test_conversion_leftovers.py::"
            "test_a_killed_conversion_leaves_a_build_failed_event_as_a_killed_build_does",
        ),
    ),
    # -- leases, pins and eviction --------------------------------------------------------
    Mutation(
        name="plan-ignores-leases",
        why="eviction planning does not look at lease locks",
        path="cachesvc/eviction.py",
        function="Evictor.plan",
        find=r"elif self\.store\.locks\.is_locked\(lock\):",
        replace="elif False:",
        tests=(f"{MANAGER}::test_leased_and_pinned_bundles_survive_prune",),
    ),
    Mutation(
        name="pinned-adapter-evicted",
        why="eviction planning drops the pin of LoRA adapters (a pinned adapter is planned out)",
        path="cachesvc/eviction.py",
        function="Evictor._lru_rows",
        find=r"\(row, False, \"adapter\"\) for row in",
        replace='((*row[:3], False, row[4]), False, "adapter") for row in',
        tests=(f"{ADAPTERS}::test_lru_eviction_takes_adapters_with_bundles_and_keeps_pinned_and_leased[sqlite]",),
    ),
    Mutation(
        name="adapter-plan-ignores-leases",
        why="eviction planning checks a LoRA adapter's lease under the bundle lock name, not the adapter's",
        path="cachesvc/eviction.py",
        function="Evictor.plan",
        find=r"lock = adapter_lock_key\(bid\) if kind == \"adapter\" else bid",
        replace="lock = bid",
        tests=(f"{ADAPTERS}::test_lru_eviction_takes_adapters_with_bundles_and_keeps_pinned_and_leased[sqlite]",),
    ),
    Mutation(
        name="execute-ignores-leases",
        why="executing a plan does not re-check the lock at delete time",
        path="cachesvc/eviction.py",
        function="Evictor.execute",
        find=r"if not got:",
        replace="if False:",
        tests=(f"{MANAGER}::test_a_bundle_leased_after_planning_is_skipped_at_execution",),
    ),
    Mutation(
        name="execute-ignores-pins",
        why="executing a plan does not re-check pins",
        path="cachesvc/eviction.py",
        function="Evictor.execute",
        find=r"if info\.pinned:",
        replace="if False:",
        tests=(f"{MANAGER}::test_a_bundle_pinned_after_planning_is_skipped_at_execution",),
    ),
    Mutation(
        name="remove-ignores-leases",
        why="evicting one bundle by hand ignores the lease of a serving process",
        path="cachesvc/eviction.py",
        function="Evictor.remove",
        find=r"if not got:",
        replace="if False:",
        tests=("tests/admin/test_leases.py",),
    ),
    Mutation(
        name="stale-not-first",
        why="eviction plans stale bundles (built for another GPU) after the LRU ready ones, not first",
        path="cachesvc/eviction.py",
        function="Evictor.plan",
        find=r"chain\(self\._stale_rows\(\), self\._lru_rows\(\)\)",
        replace="chain(self._lru_rows(), self._stale_rows())",
        tests=(STALE,),
    ),
    Mutation(
        name="stale-never-flagged",
        why="reconcile leaves a TensorRT bundle for another GPU ready (served, then refused at load)",
        path="cachesvc/reconcile.py",
        function="Reconciler._recheck_environment",
        find=r'if why is not None and info\.state == "ready":',
        replace="if False:",
        tests=(STALE,),
    ),
    Mutation(
        name="cpu-class-never-stale",
        why="a quantized bundle built for another CPU class runs here (its int8 kernels unchecked)",
        path="inference/cpu_class.py",
        function="cpu_class_mismatch",
        find=r"if built_for is None or built_for == cpu_class\(\):",
        replace="if True:",
        tests=(CPU_CLASS,),
    ),
    Mutation(
        name="quality-gate-never-fails",
        why="a quantized build that answers unlike fp32 is published anyway",
        path="inference/builder/quality.py",
        function="run_gate",
        find=r"if agreement < threshold:",
        replace="if False:",
        tests=(f"{CPU_CLASS.split('::')[0]}::test_a_quantized_build_that_fails_the_gate_publishes_nothing",),
    ),
    Mutation(
        name="all-bundles-every-node",
        why="the catalog's all_bundles drops its node filter: reconcile and the stale-first "
        "eviction see other nodes' rows (on a shared catalog)",
        path="cachesvc/catalog/bundles.py",
        function="BundleTable.all_bundles",
        find=r"\.where\(BundleRow\.node == self\.node\)",
        replace="",
        tests=("tests/fleet/test_own_rows.py",),
    ),
    # -- corrupt bundles ------------------------------------------------------------------
    Mutation(
        name="lease-corrupt-bundle",
        why="a bundle marked corrupt can still be leased (and so served)",
        path="cachesvc/manager.py",
        function="CacheManager.lease",
        find=r'if info\.state != "ready":',
        replace="if False:",
        tests=(
            f"{MANAGER}::test_bit_flip_caught_by_verify_and_never_served",
            # The load check refuses changed files too; this one's files are intact.
            "tests/cache/test_corrupt_bundles.py::test_the_row_state_alone_refuses_a_lease",
        ),
    ),
    Mutation(
        name="verify-ignores-content",
        why="verify compares sizes only, so a flipped byte passes",
        path="cachesvc/store/manifest.py",
        function="_full_digest",
        find=r'None if digest == entry\.sha256 else "sha256"',
        replace="None",
        tests=(f"{MANAGER}::test_bit_flip_caught_by_verify_and_never_served",),
    ),
    Mutation(
        name="hit-skips-quick-check",
        why="a cache hit or an engine load takes a bundle whose sampled bytes no longer match its "
        "manifest (the quick check always passes)",
        path="cachesvc/verification.py",
        function="BundleVerifier.load_check",
        find=r"return detail",
        replace="return None",
        tests=(
            "tests/cache/test_corrupt_bundles.py::test_a_hit_with_flipped_sampled_bytes_is_rebuilt_not_served",
            "tests/cache/test_corrupt_bundles.py::"
            "test_an_unloaded_model_with_a_flipped_byte_is_refused_at_load_and_rebuilt",
        ),
    ),
    Mutation(
        name="foreign-root-adopted",
        why="a non-empty directory that never was a cache is taken over as one",
        path="cachesvc/store/layout.py",
        function="CacheLayout.ensure",
        find=r"if foreign:",
        replace="if False:",
        tests=("tests/cache/test_reconcile_safety.py::test_a_non_empty_directory_without_cachedir_tag_is_refused",),
    ),
    Mutation(
        name="reconcile-deletes-unknown-dirs",
        why="reconcile deletes a directory without a manifest instead of moving it to quarantine",
        path="cachesvc/reconcile.py",
        function="Reconciler.reconcile",
        find=r"moved = self\.store\.quarantine\(scanned\.relpath\)",
        replace="moved = self.store.remove(scanned.relpath)",
        tests=("tests/cache/test_reconcile_safety.py::test_reconcile_quarantines_unknown_directories",),
    ),
    Mutation(
        name="digest-skips-weight-samples",
        why="the checkpoint digest stops sampling weight bytes, so changed weights hit the old bundle",
        path="cachesvc/checkpoints.py",
        function="_samples",
        find=r"for off in sample_offsets\(length, SAMPLE_BYTES\)",
        replace="for off in (0, 0, 0)",
        tests=("tests/cache/test_checkpoints.py::test_digest_changes_when_a_sampled_weight_byte_changes",),
    ),
    # -- keys on the real app -------------------------------------------------------------
    Mutation(
        name="app-drops-admin-key",
        why="create_app mounts the admin routes without --admin-api-key",
        path="cachesvc/app.py",
        function="create_app",
        find=r"admin_router\(admin_api_key=config\.admin_api_key",
        replace="admin_router(admin_api_key=None",
        tests=("tests/admin/test_auth.py",),
    ),
    Mutation(
        name="app-drops-metrics-key",
        why="create_app mounts /metrics without --admin-api-key",
        path="cachesvc/app.py",
        function="create_app",
        find=r"metrics_route\(metrics, admin_api_key=config\.admin_api_key\)",
        replace="metrics_route(metrics, admin_api_key=None)",
        tests=("tests/admin/test_auth.py",),
    ),
    Mutation(
        name="admin-guard-open-to-all",
        why="without an admin key, remote clients get in too",
        path="cachesvc/http/auth.py",
        function="admin_guard.guard",
        find=r"if not is_loopback\(client\.host if client else None\):",
        replace="if False:",
        tests=("tests/admin/test_auth.py::test_without_admin_key_only_loopback_clients_get_in",),
    ),
    Mutation(
        name="serve-drops-completion-key",
        why="cachesvc serve builds the OpenAI server without --api-key",
        path="cachesvc/app.py",
        function="create_app",
        find=r"openai_router\(pool, api_key=config\.api_key\)",
        replace="openai_router(pool, api_key=None)",
        tests=("tests/service/test_openai.py::test_missing_or_wrong_api_key_is_401",),
    ),
    Mutation(
        name="serving-metrics-unwired",
        why="serve does not hand the metrics observer to the scheduler (no TTFT, tokens, queue depth)",
        path="cachesvc/server.py",
        function="load_startup_runtime",
        find=r"observer = metrics\.serving\.for_model\(config\.served_name\)",
        replace="observer = None",
        tests=("tests/service/test_wiring.py::test_serving_metrics_move_with_a_real_request",),
    ),
    Mutation(
        name="drain-skipped",
        why="SIGTERM goes straight to uvicorn's shutdown: no drain, new requests are refused",
        path="cachesvc/server.py",
        function="_Server.handle_exit",
        find=r"sig in \(signal\.SIGTERM, signal\.SIGINT\)",
        replace="False",
        tests=("tests/service/test_real_model.py::test_sigterm_drains_a_real_generation_and_releases_the_lease",),
    ),
    Mutation(
        name="admin-accepts-foreign-origin",
        why="a web page on another origin can drive the admin API (CSRF)",
        path="cachesvc/http/auth.py",
        function="_check_browser_rules",
        find=r"if origin is not None:",
        replace="if False:",
        tests=("tests/service/test_browser_requests.py::test_admin_refuses_a_foreign_origin",),
    ),
    # -- admission ------------------------------------------------------------------------
    Mutation(
        name="no-queue-cap",
        why="the scheduler admits every request (no 429 when the queue is full)",
        path="inference/scheduler.py",
        function="Scheduler.submit",
        find=r">= self\.max_batch_size \+ self\.max_queued_requests",
        replace=">= 10**9",
        tests=(f"{LIVE}::test_queue_full_gives_429_with_retry_after",),
    ),
    Mutation(
        name="no-retry-after",
        why="a 429 goes out without Retry-After",
        path="inference/openai/errors.py",
        function="ServerOverloadedError.__init__",
        find=r'headers=\{"Retry-After": str\(retry_after\)\}',
        replace="headers={}",
        tests=(f"{LIVE}::test_queue_full_gives_429_with_retry_after",),
    ),
    Mutation(
        name="queue-timeout-ignored",
        why="a request waits in the queue forever instead of 429 after --queue-timeout",
        path="inference/scheduler.py",
        function="Scheduler._admit_locked",
        find=r"now - req\.arrival > self\.queue_timeout",
        replace="False",
        tests=(f"{LIVE}::test_queue_timeout_gives_429",),
    ),
    # -- engine parity and context reuse ---------------------------------------------------
    Mutation(
        name="kv-length-off-by-one",
        why="the in-place engine tells attention one position too many (every token attends to a gap)",
        path="inference/runtime/onnxruntime_engine.py",
        function="GqaEngine._run",
        find=r"seqlens = \(past \+ new - 1\)",
        replace="seqlens = (past + new)",
        tests=("tests/engine/test_parity.py::test_inplace_engine_logits_match_transformers",),
    ),
    Mutation(
        name="context-records-unsalted",
        why="prefix records are keyed by tokens alone, so one model's KV can serve another",
        path="inference/context_cache.py",
        function="PrefixStore._seed",
        find=r"prev = self\._salt",
        replace='prev = b""',
        tests=("tests/engine/test_context_reuse.py::test_records_are_namespaced_by_bundle",),
    ),
    Mutation(
        name="unloaded-adapter-kills-the-scheduler",
        why="a queued request whose LoRA adapter was unloaded crashes the scheduler thread (every "
        "request then fails) instead of failing alone",
        path="inference/scheduler.py",
        function="Scheduler._admit_locked",
        find=r"except ValueError as exc:  # unloaded after the request was queued",
        replace="except KeyError as exc:",
        tests=("tests/engine/test_lora.py::test_a_request_whose_adapter_is_unloaded_while_it_waits_fails_alone",),
    ),
    Mutation(
        name="slot-choice-ignores-cache-prompt",
        why="a cache_prompt=false request may take the slot holding a cached prefix (and wipe it)",
        path="inference/scheduler.py",
        function="Scheduler._pick_slot",
        find=r"if self\._store is None or not req\.cache_prompt:",
        replace="if self._store is None:",
        tests=(
            "tests/engine/test_context_reuse.py::"
            "test_cache_prompt_false_never_takes_a_slot_holding_a_cached_prefix",
        ),
    ),
    Mutation(
        name="slot-reuse-ignores-cache-salt",
        why="a request resumes from a slot another tenant's salt left: the TTFT side channel is open",
        path="inference/scheduler.py",
        function="Scheduler._prepare",
        find=r"if self\._slot_owner\[slot\] != run\.req\.kv_owner:",
        replace="if False:",
        tests=("tests/engine/test_context_reuse.py::test_cache_salt_separates_slots_and_records",),
    ),
    Mutation(
        name="cache-salt-not-in-the-chain",
        why="salted requests' records are keyed as unsalted ones, so any tenant finds them",
        path="inference/context_cache.py",
        function="PrefixStore._seed",
        find=r"if cache_salt is not None:",
        replace="if False:",
        tests=("tests/engine/test_context_reuse.py::test_salted_block_keys_differ_per_salt_and_from_unsalted",),
    ),
    Mutation(
        name="context-disk-checksum-unchecked",
        why="a damaged context record on disk is handed to the engine (wrong KV, wrong answers)",
        path="inference/context_disk.py",
        function="decode",
        find=r"if digest\.digest\(\) != bytes\(view\[head_end:tok_start\]\):",
        replace="if False:",
        tests=("tests/engine/test_context_records_on_disk.py::test_a_damaged_record_is_dropped_and_never_used",),
    ),
    Mutation(
        name="context-disk-cap-ignored",
        why="context records on disk grow past --context-cache-disk-bytes",
        path="inference/context_disk.py",
        function="DiskRecords._evict_locked",
        find=r"while self\._index and self\._bytes \+ incoming > self\.max_bytes:",
        replace="while False:",
        tests=("tests/engine/test_context_records_on_disk.py::test_the_cap_holds_lru_across_a_restart",),
    ),
    Mutation(
        name="context-records-outlive-their-bundle",
        why="an evicted bundle's context records stay on disk (counted in the size, never freed)",
        path="cachesvc/eviction.py",
        function="Evictor.execute",
        find=r"self\.store\.layout\.remove_context\(item\.bundle_id\)",
        replace="pass",
        tests=(
            "tests/cache/test_context_records.py::"
            "test_records_count_in_the_size_and_go_with_their_bundle[sqlite]",
        ),
    ),
    Mutation(
        name="lora-kv-shared-across-adapters",
        why="context records made with one LoRA adapter are reused by a sequence of another (wrong KV)",
        path="inference/context_cache.py",
        function="PrefixStore._seed",
        find=r"if adapter is not None:",
        replace="if False:",
        tests=("tests/engine/test_lora.py::"
               "test_scheduler_runs_each_request_with_its_adapter_and_never_shares_their_kv",),
    ),
    Mutation(
        name="lora-adapter-not-bound",
        why="a request naming a LoRA adapter runs the base weights (the adapter is silently ignored)",
        path="inference/runtime/onnxruntime_engine.py",
        function="GqaEngine._run",
        find=r"values = \{\} if adapter is None else self\._adapters\[adapter\]",
        replace="values = {}",
        tests=("tests/engine/test_lora.py::test_adapter_greedy_tokens_match_peft",),
    ),
    Mutation(
        name="embeddings-pooled-over-padding",
        why="mean pooling counts the left padding of a batch: vectors depend on the other inputs",
        path="inference/builder/graph.py",
        function="_DecoderBuilder.pool",
        find=r"em\.op1\(\"Mul\", \[h, mask\]\)",
        replace="h",
        tests=("tests/engine/test_embeddings.py::test_embeddings_match_transformers",),
    ),
    # -- request checks and sampling ------------------------------------------------------
    Mutation(
        name="max-tokens-past-context",
        why="max_tokens beyond the context left is accepted (and cut short or overflows the KV)",
        path="inference/openai/handle.py",
        function="ModelHandle.plan",
        find=r"if max_tokens is not None and max_tokens > room:",
        replace="if False:",
        tests=("tests/serving/test_http.py::test_errors",),
    ),
    Mutation(
        name="prompt-past-input-limit",
        why="a prompt longer than max_input_len is accepted",
        path="inference/openai/handle.py",
        function="ModelHandle.plan",
        find=r"if n > opts\.max_input_len:",
        replace="if False:",
        tests=("tests/serving/test_http.py::test_prompt_over_the_input_limit_after_tokenizing",),
    ),
    Mutation(
        name="greedy-ignores-logit-bias",
        why="greedy decoding takes the argmax of the raw logits, ignoring logit_bias and penalties",
        path="inference/sampling.py",
        function="Sampler.sample",
        find=r"token = int\(np\.argmax\(x\)\)",
        replace="token = int(np.argmax(raw))",
        tests=("tests/serving/test_sampling.py::test_logit_bias_forces_and_bans_tokens",),
    ),
)
