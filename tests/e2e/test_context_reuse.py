"""``--enable-context-reuse`` on a real server: same greedy text, counters in /health and
/metrics, ``cache_prompt: false`` opts out."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import MODEL, running_server, serve_args


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_reuse_on_a_real_server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> None:
    args = serve_args(
        enable_context_reuse=True,
        context_cache_max_records=32,
        max_batch_size=2,
        max_input_len=256,
        max_kv_cache_capacity=512,
    )
    with running_server(demo_dir, cache_dir, log_dir, *args) as server:
        health = server.health()
        assert health["capabilities"]["context_reuse"] is True
        client = server.client()
        prompt = "The quick brown fox jumps over the lazy dog. " * 12  # well over one 64-token block

        def complete(**extra: object) -> str:
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra or None
            )
            return out.choices[0].text

        cold = complete()
        assert server.health()["context_cache"]["tokens_reused"] == 0
        assert complete() == cold
        stats = server.health()["context_cache"]
        assert stats["hits"] == 1 and stats["tokens_reused"] > 64 and stats["records"] >= 1
        assert stats["bytes"] > 0 and stats["max_records"] == 32
        assert complete(cache_prompt=False) == cold
        assert server.health()["context_cache"]["lookups"] == stats["lookups"]
        with server.http() as h:
            text = h.get("/metrics").text
        assert _metric(text, "cachesvc_context_cache_hits_total") == 1
        assert _metric(text, "cachesvc_context_cache_tokens_reused_total") == stats["tokens_reused"]
        assert _metric(text, "cachesvc_context_cache_bytes") == stats["bytes"]
