"""``--enable-context-reuse`` on a real server: same greedy text, counters in /health and
/metrics (per model, for models loaded on demand too), ``cache_prompt: false`` opts out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.demo import write_demo_checkpoint
from tests.service.conftest import MODEL, run_cli, running_server, serve_args, settled_context_cache

PROFILE = {"max_batch_size": 2, "max_input_len": 256, "max_kv_cache_capacity": 512}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # well over one 64-token block


def _metric(text: str, name: str, model: str = MODEL) -> float:
    key = f'{name}{{model="{model}"}}'
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[1])
    raise AssertionError(f"{key} not in /metrics")


def test_reuse_on_a_real_server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> None:
    # Memory only: records that an earlier server of the session left on disk would count here.
    args = serve_args(enable_context_reuse=True, context_cache_max_records=32, context_cache_disk_bytes=0,
                      **PROFILE)
    with running_server(demo_dir, cache_dir, log_dir, *args) as server:
        health = server.health()
        assert health["capabilities"]["context_reuse"] is True
        client = server.client()
        prompt = PROMPT

        def complete(**extra: object) -> str:
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra or None
            )
            return out.choices[0].text

        cold = complete()
        assert server.health()["context_cache"]["tokens_reused"] == 0
        assert complete() == cold
        stats = settled_context_cache(server)  # the records are made once the server is idle
        assert stats["hits"] == 1 and stats["tokens_reused"] > 64 and stats["records"] >= 1
        assert stats["bytes"] > 0 and stats["max_records"] == 32
        assert complete(cache_prompt=False) == cold
        assert server.health()["context_cache"]["lookups"] == stats["lookups"]
        with server.http() as h:
            text = h.get("/metrics").text
        assert _metric(text, "cachesvc_context_cache_hits_total") == 1
        assert _metric(text, "cachesvc_context_cache_tokens_reused_total") == stats["tokens_reused"]
        assert _metric(text, "cachesvc_context_cache_bytes") == stats["bytes"]


def test_a_model_loaded_on_demand_has_its_own_counters(
    demo_dir: Path, cache_dir: Path, log_dir: Path, tmp_path: Path
) -> None:
    # A second checkpoint built with the server's profile: the pool loads it on first request.
    other = write_demo_checkpoint(tmp_path / "reuse-second", arch="qwen2", size="tiny", seed=11)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in PROFILE.items()]
    done = run_cli(cache_dir, "prepare", str(other), *flags, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # Memory only: records that an earlier server of the session left on disk would count here.
    args = serve_args(enable_context_reuse=True, context_cache_max_records=32, context_cache_disk_bytes=0,
                      **PROFILE)
    with running_server(demo_dir, cache_dir, log_dir, *args) as server:
        client = server.client()

        def complete(model: str) -> str:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
            return out.choices[0].text

        for _ in range(3):
            complete(MODEL)
        # Listed by its directory's name, and that name answers (loads it on demand).
        assert "reuse-second" in {m.id for m in client.models.list().data}
        for _ in range(2):
            complete("reuse-second")
        health = server.health()
        entries: dict[str, dict[str, Any]] = {
            name: entry for entry in health["models"] for name in entry["names"]
        }
        assert entries[MODEL]["context_cache"]["hits"] == 2, health
        assert entries["reuse-second"]["context_cache"]["hits"] == 1, health
        assert entries["reuse-second"]["context_cache"]["lookups"] == 2
        with server.http() as h:
            text = h.get("/metrics").text
        # One model's figures never replace another's.
        assert _metric(text, "cachesvc_context_cache_hits_total") == 2
        assert _metric(text, "cachesvc_context_cache_hits_total", "reuse-second") == 1
        assert _metric(text, "cachesvc_context_cache_lookups_total") == 3
        assert _metric(text, "cachesvc_context_cache_records", "reuse-second") >= 1


def test_defaults_reuse_context_and_cache_salt_separates_tenants(
    demo_dir: Path, cache_dir: Path, log_dir: Path
) -> None:
    # No reuse or batch flags: the serving defaults (4 slots, context reuse on).
    args = serve_args(max_input_len=256, max_kv_cache_capacity=512)
    with running_server(demo_dir, cache_dir, log_dir, *args) as server:
        caps = server.health()["capabilities"]
        assert caps["context_reuse"] is True and caps["max_batch_size"] == 4
        assert server.health()["context_cache"]["max_bytes"] == 512 << 20
        client = server.client()

        def reused(salt: str | None, *, chat: bool = False) -> int:
            before = server.health()["context_cache"]["tokens_reused"]
            extra = {"cache_salt": salt} if salt is not None else None
            if chat:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                    temperature=0, extra_body=extra,
                )
            else:
                client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra
                )
            after: int = server.health()["context_cache"]["tokens_reused"]
            return after - before

        assert reused("tenant-a") == 0
        assert reused("tenant-b") == 0  # tenant-a's prefix is not found without its salt
        assert reused(None) == 0  # nor by a request without a salt
        assert reused("tenant-a") > 64  # the same salt finds it
        assert reused("tenant-a", chat=True) == 0
        assert reused("tenant-a", chat=True) > 64  # chat: the same rule

        def reused_via(route: str, body: dict[str, Any]) -> int:
            before = server.health()["context_cache"]["tokens_reused"]
            with server.http(timeout=60) as h:
                r = h.post(route, json=body)
                assert r.status_code == 200, r.text
            after: int = server.health()["context_cache"]["tokens_reused"]
            return after - before

        # /v1/responses and /v1/messages run the chat path: their cache_salt is honoured too.
        messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
        responses = {"model": MODEL, "max_output_tokens": 2, "input": PROMPT}
        assert reused_via("/v1/messages", {**messages, "cache_salt": "tenant-c"}) == 0
        assert reused_via("/v1/messages", {**messages, "cache_salt": "tenant-c"}) > 64
        assert reused_via("/v1/responses", {**responses, "cache_salt": "tenant-d"}) == 0
        assert reused_via("/v1/responses", {**responses, "cache_salt": "tenant-d"}) > 64
        for route, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        ):
            with server.http() as h:
                stats = server.health()["context_cache"]
                r = h.post(route, json={**body, "cache_salt": ""})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "cache_salt"
                r = h.post(route, json={**body, "cache_salt": 7})
                assert r.status_code == 400 and "cache_salt" in r.text, r.text
                assert server.health()["context_cache"]["lookups"] == stats["lookups"]  # nothing ran
