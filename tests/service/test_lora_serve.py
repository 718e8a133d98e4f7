"""LoRA adapters through a real ``cachesvc serve --lora-modules`` and the official ``openai`` SDK:
an adapter's name answers with the adapter (greedy tokens as transformers + peft pick them), the
base name without it, ``/v1/models`` lists the adapter with its parent, and the adapter is kept
in the cache (``cachesvc adapters ls``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import peft
import pytest
import torch
import transformers as tf

from tests.service.conftest import (
    API_KEY,
    ServerProcess,
    cachesvc_command,
    child_env,
    run_cli,
    running_server,
)
from tests.support.adapters import write_adapter
from tests.support.net import free_port

BASE = "demo-base"
ADAPTER = "demo-sql"
PROMPT = "Once upon a time in a cache far away"


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the adapters lie: the server's --allowed-model-roots (with the base model's dir)."""
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def adapter_dir(demo_dir: Path, adapters_root: Path) -> Path:
    return write_adapter(demo_dir, adapters_root / "adapter", seed=7)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-cache")


@pytest.fixture(scope="module")
def server(demo_dir: Path, adapter_dir: Path, adapters_root: Path, cache: Path,
           log_dir: Path) -> Iterator[ServerProcess]:
    with running_server(demo_dir, cache, log_dir, "--served-model-name", BASE, "--lora-modules",
                        f"{ADAPTER}={adapter_dir}", "--max-input-len", "64", "--max-kv-cache-capacity", "128",
                        "--allowed-model-roots", f"{adapters_root},{demo_dir}", api_key=API_KEY) as s:
        yield s


def _reference_text(model: Any, tok: Any, ids: list[int]) -> str:
    """transformers' greedy continuation of ``ids`` (8 tokens, up to EOS), as text."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    new: list[int] = []
    for t in out[0, len(ids):].tolist():
        if t in eos_ids:
            break
        new.append(int(t))
    return str(tok.decode(new, skip_special_tokens=True))


def test_adapter_name_runs_the_adapter_and_base_name_does_not(server: ServerProcess, demo_dir: Path,
                                                             adapter_dir: Path) -> None:
    client = server.client()
    tok = tf.AutoTokenizer.from_pretrained(demo_dir)
    ids = [int(t) for t in tok(PROMPT)["input_ids"]]
    got = {name: client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0)
           for name in (BASE, ADAPTER)}
    assert got[ADAPTER].model == ADAPTER
    base_model = tf.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    tuned_model = peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32), adapter_dir).eval()
    assert got[BASE].choices[0].text == _reference_text(base_model, tok, ids)
    assert got[ADAPTER].choices[0].text == _reference_text(tuned_model, tok, ids)
    assert got[BASE].choices[0].text != got[ADAPTER].choices[0].text


def test_models_list_the_adapter_with_its_parent(server: ServerProcess) -> None:
    cards = {m.id: m for m in server.client().models.list().data}
    assert ADAPTER in cards and BASE in cards
    assert (cards[ADAPTER].model_extra or {}).get("parent") == BASE
    assert (cards[BASE].model_extra or {}).get("parent") is None


def test_the_adapter_is_kept_in_the_cache(server: ServerProcess, cache: Path) -> None:
    out = run_cli(cache, "adapters", "ls", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1 and rows[0]["rank"] == 4


def test_an_adapter_of_another_model_stops_the_start_in_one_line(demo_dir: Path, tmp_path: Path,
                                                                 adapter_dir: Path) -> None:
    """An adapter that does not fit the base model (another hidden size) or is not an adapter at
    all: ``serve`` exits non-zero with one line naming it, before anything listens."""
    other = tmp_path / "other"  # the demo's tokenizer over a smaller model
    vocab = tf.AutoConfig.from_pretrained(demo_dir).vocab_size
    tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(other)
    for f in demo_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, other / f.name)
    for bad, words in ((str(other), "adapter_config.json"), (str(adapter_dir), None)):
        base = other if words is None else demo_dir
        proc = subprocess.run(
            [*cachesvc_command(), "serve", str(base), "--cache-dir", str(tmp_path / "cache"),
             "--lora-modules", f"x={bad}", "--port", str(free_port()), "--host", "127.0.0.1"],
            capture_output=True, text=True, env=child_env(), timeout=120, check=False)
        assert proc.returncode != 0
        assert (words or "an adapter of another model?") in proc.stderr, proc.stderr[-2000:]


def test_adapters_load_and_unload_at_run_time(server: ServerProcess, demo_dir: Path,
                                              adapters_root: Path) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: a new name answers with
    its adapter at once, is listed with its parent, and is gone after the unload."""
    second = write_adapter(demo_dir, adapters_root / "second", seed=11)
    client = server.client()
    tok = tf.AutoTokenizer.from_pretrained(demo_dir)
    ids = [int(t) for t in tok(PROMPT)["input_ids"]]
    with server.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "demo-rt", "lora_path": str(second)})
        assert r.status_code == 200, r.text
        assert r.json()["parent"] == BASE and r.json()["rank"] == 4
        taken = h.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": str(second)})
        assert taken.status_code == 409 and "already served" in taken.text
        missing = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(demo_dir)})
        assert missing.status_code == 400 and "adapter_config.json" in missing.text
        cards = {m.id: m for m in client.models.list().data}
        assert (cards["demo-rt"].model_extra or {}).get("parent") == BASE
        assert "x" not in cards  # a refused load serves nothing
        got = client.completions.create(model="demo-rt", prompt=ids, max_tokens=8, temperature=0)
        tuned = peft.PeftModel.from_pretrained(
            tf.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32), second).eval()
        assert got.choices[0].text == _reference_text(tuned, tok, ids)
        gone = h.post("/v1/unload_lora_adapter", json={"lora_name": "demo-rt"})
        assert gone.status_code == 200, gone.text
        again = h.post("/v1/unload_lora_adapter", json={"lora_name": "demo-rt"})
        assert again.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="demo-rt", prompt=ids, max_tokens=2)


def test_unloading_a_lora_modules_name_lets_go_of_its_adapter(
        demo_dir: Path, adapter_dir: Path, tmp_path: Path, log_dir: Path) -> None:
    """An adapter loaded at start (``--lora-modules``) and unloaded at run time is no longer
    leased: the cache may remove it then (it stayed "in use" until the server stopped)."""
    flags = ("--lora-modules", f"{ADAPTER}={adapter_dir}", "--max-input-len", "64",
             "--max-kv-cache-capacity", "128")
    with running_server(demo_dir, tmp_path / "cache", log_dir, *flags) as server, server.http() as h:
        (row,) = h.get("/admin/lora-adapters").json()["items"]
        busy = h.delete(f"/admin/lora-adapters/{row['id']}")
        assert busy.status_code == 409, busy.text  # served: leased
        gone = h.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
        assert gone.status_code == 200, gone.text
        removed = h.delete(f"/admin/lora-adapters/{row['id']}")
        assert removed.status_code == 200, removed.text
        assert h.get("/admin/lora-adapters").json()["items"] == []
