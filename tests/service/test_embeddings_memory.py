"""What one ``/v1/embeddings`` request may cost in memory, through a real ``cachesvc serve
--task embed`` process: SmolLM2-135M (its GGUF) at ``--max-input-len 1024``, the peak (VmHWM,
reset through ``/proc/<pid>/clear_refs`` before each request) and the resident set (VmRSS) read
from ``/proc``.

The policy (``inference/runtime/embedding_batches.py``): a run holds at most ``max_input_len``
padded tokens, so a request of many long inputs (the shape the limits allow: 2,048 inputs,
300,000 tokens) costs what one longest input costs, which the model's memory figure reserves
(``memory_bytes`` = weights + working memory, what ``--memory-budget-gb`` counts); and the
memory goes back after the request. An embedding model has no context-reuse record pool, so its
estimate before a load has none either."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.service.conftest import MODEL, run_cli, running_server

MiB = 1 << 20
#: The bundle's max_input_len, and the length of each long input (just under it).
MAX_LEN = 1024
LONG = 1000
#: Long inputs in the worst-shaped request: one batch of them (the old plan) takes ~8x the
#: working memory of one.
MANY = 8
#: What the HTTP side of a request (body, token lists, response) may add to the engine's peak.
REQUEST_SLACK = 64 * MiB
#: How close to its resident set before the request the process must come back, within...
RETURN_SLACK = 96 * MiB
IDLE_SECONDS = 10.0


def _vm(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of ``pid`` in bytes."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    """Start VmHWM again from the current resident set (Linux >= 4.0; our own child)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _engine_meta(cache: Path) -> dict[str, Any]:
    (path,) = cache.glob("engines/*/*/engine.json")
    meta: dict[str, Any] = json.loads(path.read_text())
    return meta


def _long_input(i: int) -> list[int]:
    return [100 + (i * 7 + j) % 5000 for j in range(LONG)]


@pytest.fixture(scope="module")
def embed_cache(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("embed-memory")
    # Built by its own process: the server only loads, so its peak before a request is its own.
    done = run_cli(cache, "prepare", str(smollm2_gguf), "--task", "embed", "--max-input-len", str(MAX_LEN),
                   "--max-kv-cache-capacity", str(MAX_LEN), timeout=600)
    assert done.returncode == 0, done.stderr
    return cache


def test_many_long_inputs_peak_within_the_models_memory_figure_and_memory_returns(
        smollm2_gguf: Path, embed_cache: Path, log_dir: Path) -> None:
    meta = _engine_meta(embed_cache)
    with running_server(smollm2_gguf, embed_cache, log_dir, "--task", "embed",
                        "--max-input-len", str(MAX_LEN), "--max-kv-cache-capacity", str(MAX_LEN)) as server:
        pid = server.pid
        # What the memory budget counts for this model beyond its weights.
        reserve = int(server.health()["capabilities"]["memory_bytes"]) - int(meta["weight_bytes"])
        client = server.client(timeout=300)
        client.embeddings.create(model=MODEL, input="warm up")
        before = _vm(pid)

        _reset_peak(pid)
        one = client.embeddings.create(model=MODEL, input=[_long_input(0)])
        one_peak = _vm(pid)["VmHWM"] - before["VmRSS"]

        _reset_peak(pid)
        many = client.embeddings.create(model=MODEL, input=[_long_input(i) for i in range(MANY)])
        many_peak = _vm(pid)["VmHWM"] - before["VmRSS"]
        after = _vm(pid)["VmRSS"]

        deadline = time.monotonic() + IDLE_SECONDS
        while _vm(pid)["VmRSS"] > before["VmRSS"] + RETURN_SLACK and time.monotonic() < deadline:
            time.sleep(0.5)
        idle = _vm(pid)["VmRSS"]
        figures = (f"reserve {reserve / MiB:.0f} MiB; before {before['VmRSS'] / MiB:.0f} MiB; peak growth: "
                   f"1 x {LONG} {one_peak / MiB:.0f} MiB, {MANY} x {LONG} {many_peak / MiB:.0f} MiB; "
                   f"RSS after {after / MiB:.0f} MiB, idle {idle / MiB:.0f} MiB")
        print(figures)
        # The same input gives the same vector alone and among others.
        assert len(many.data) == MANY
        assert max(abs(a - b) for a, b in zip(many.data[0].embedding, one.data[0].embedding,
                                              strict=True)) < 1e-5
        assert reserve > 0, figures
        assert many_peak <= reserve + REQUEST_SLACK, figures
        assert idle <= before["VmRSS"] + RETURN_SLACK, figures


def test_an_embedding_models_estimate_has_no_context_record_pool(
        demo_dir: Path, tmp_path: Path, log_dir: Path) -> None:
    # The tiny model with its working memory is a few MB; the default record pool (512 MiB,
    # counted for text models) alone is more than this budget.
    done = run_cli(tmp_path, "prepare", str(demo_dir), "--task", "embed", "--max-input-len", "64",
                   "--max-kv-cache-capacity", "128")
    assert done.returncode == 0, done.stderr
    with running_server(None, tmp_path, log_dir, "--memory-budget-gb", "0.1") as server:
        try:
            resp = server.client().embeddings.create(model="demo-tiny", input="hello")
        except openai.APIStatusError as exc:
            pytest.fail(f"{exc.status_code}: {exc.body}")
        assert len(resp.data) == 1
