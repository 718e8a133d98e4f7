"""LoRA adapters on a LoRA-capable bundle against transformers + peft (greedy tokens, logits)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import torch

from inference.builder.errors import BuildInputError
from inference.builder.lora import LoraAdapterError, convert_peft_adapter
from inference.builder.model_config import load_model_config
from inference.families import family_by_name
from inference.runtime.onnxruntime_engine import GqaEngine
from tests.engine.conftest import FAMILIES, load_reference
from tests.support.adapters import write_adapter

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 13]
STEPS = 16


def peft_logits(checkpoint: Path, adapter: Path | None, tokens: list[int]) -> np.ndarray:
    """transformers (+ peft) logits ``[len(tokens), vocab]`` of one forward over ``tokens``."""
    model: Any = load_reference(checkpoint)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return np.asarray(model(input_ids=torch.tensor([tokens])).logits[0].numpy())


def assert_greedy_matches(checkpoint: Path, adapter: Path | None, prompt: list[int], got: list[int]) -> None:
    """``got`` is the reference's greedy continuation of ``prompt``: at every step the reference
    (teacher-forced on ``got``) picks the same token, or the two tokens tie within float noise."""
    logits = peft_logits(checkpoint, adapter, prompt + got[:-1])[len(prompt) - 1:]
    for step, (row, token) in enumerate(zip(logits, got, strict=True)):
        best = int(row.argmax())
        assert best == token or row[best] - row[token] < 1e-4, (
            f"step {step}: reference picks {best} ({row[best]:.5f}), engine {token} ({row[token]:.5f})")


def engine_of(bundle: Path, slots: int = 3) -> GqaEngine:
    meta = json.loads((bundle / "engine.json").read_text())
    return GqaEngine(bundle / meta["optimized_model"], meta, max_slots=slots, threads=1)


def greedy(engine: GqaEngine, slot: int, prompt: list[int], steps: int) -> list[int]:
    engine.reset(slot)
    row = engine.prefill(slot, prompt)
    out = [int(row.argmax())]
    for _ in range(steps - 1):
        out.append(int(engine.decode([slot], [out[-1]])[0].argmax()))
    return out


@pytest.fixture(scope="module")
def adapters(hf_checkpoint: Callable[..., Path],
             tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, int, str], Path] = {}

    def make(family: str, seed: int, **kw: Any) -> Path:
        key = (family, seed, json.dumps(kw, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp("adapter")
            cache[key] = write_adapter(hf_checkpoint(family), out, seed=seed, **kw)
        return cache[key]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_greedy_tokens_match_peft(family: str, hf_checkpoint: Callable[..., Path],
                                          built_bundle: Callable[..., Path], adapters: Callable[..., Path],
                                          tmp_path: Path) -> None:
    checkpoint = hf_checkpoint(family)
    bundle = built_bundle(checkpoint, lora=True)
    cfg = load_model_config(checkpoint)
    targets = list(family_by_name(family).lora_targets)  # every projection the family declares
    adapter = adapters(family, 1, targets=targets)
    info = convert_peft_adapter(adapter, cfg, tmp_path / "a.onnx_adapter")
    assert info.rank == 4 and info.targets == tuple(sorted(targets)) and info.layers == cfg.num_layers
    engine = engine_of(bundle)
    try:
        base = greedy(engine, 0, PROMPT, STEPS)
        engine.load_adapter("a", tmp_path / "a.onnx_adapter")
        engine.set_adapter(1, "a")
        tuned = greedy(engine, 1, PROMPT, STEPS)
    finally:
        engine.close()
    assert_greedy_matches(checkpoint, None, PROMPT, base)
    assert_greedy_matches(checkpoint, adapter, PROMPT, tuned)
    assert tuned != base  # the adapter matters on these weights


def test_mixed_adapters_in_one_decode(hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path],
                                      adapters: Callable[..., Path], tmp_path: Path) -> None:
    """Slots of two adapters and the base model decode together: each as it would alone."""
    checkpoint = hf_checkpoint("llama")
    cfg = load_model_config(checkpoint)
    qv_kw: dict[str, Any] = {"seed": 3, "targets": ["q_proj", "v_proj"], "rslora": True, "rank": 8}
    sources = {"all": adapters("llama", seed=2), "qv": adapters("llama", **qv_kw)}
    files = {name: tmp_path / f"{name}.onnx_adapter" for name in sources}
    for name, source in sources.items():
        convert_peft_adapter(source, cfg, files[name])
    engine = engine_of(built_bundle(checkpoint, lora=True))
    try:
        for name, path in files.items():
            engine.load_adapter(name, path)
        names: list[str | None] = [None, "all", "qv"]
        alone = []
        for slot, adapter in enumerate(names):
            engine.set_adapter(slot, adapter)
            alone.append(greedy(engine, slot, PROMPT, 6))
        for slot in range(3):
            engine.reset(slot)
            engine.prefill(slot, PROMPT)
        together: list[list[int]] = [[], [], []]
        last = [0, 0, 0]
        for slot in range(3):
            engine.reset(slot)
            row = engine.prefill(slot, PROMPT)
            last[slot] = int(row.argmax())
            together[slot].append(last[slot])
        for _ in range(5):
            rows = engine.decode([0, 1, 2], last)
            last = [int(r.argmax()) for r in rows]
            for slot in range(3):
                together[slot].append(last[slot])
        with pytest.raises(ValueError, match="in use by slot"):
            engine.unload_adapter("all")
    finally:
        engine.close()
    assert together == alone
    assert alone[0] != alone[1] and alone[0] != alone[2]
    assert_greedy_matches(checkpoint, sources["qv"], PROMPT, alone[2])


def test_bundle_without_lora_refuses_adapters(hf_checkpoint: Callable[..., Path],
                                              built_bundle: Callable[..., Path], tmp_path: Path) -> None:
    engine = engine_of(built_bundle(hf_checkpoint("llama")))
    try:
        with pytest.raises(ValueError, match="built without LoRA inputs"):
            engine.load_adapter("a", tmp_path / "missing")
    finally:
        engine.close()


def test_bad_adapters_refused_in_one_line(hf_checkpoint: Callable[..., Path], adapters: Callable[..., Path],
                                          tmp_path: Path) -> None:
    cfg = load_model_config(hf_checkpoint("llama"))
    with pytest.raises(LoraAdapterError, match=r"has no adapter_config\.json"):
        convert_peft_adapter(tmp_path, cfg, tmp_path / "x")
    qwen = adapters("qwen2", 1)
    other = load_model_config(hf_checkpoint("qwen3"))  # head_dim 32: other shapes
    foreign = r"made for Qwen2ForCausalLM \(qwen2\) but the base model is Qwen3ForCausalLM \(qwen3\)"
    with pytest.raises(LoraAdapterError, match=foreign):
        convert_peft_adapter(qwen, other, tmp_path / "x")
    undeclared = tmp_path / "undeclared"  # no family declared: judged by its shapes
    shutil.copytree(qwen, undeclared)
    config = json.loads((undeclared / "adapter_config.json").read_text())
    del config["auto_mapping"]
    (undeclared / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraAdapterError, match="do not fit the base model"):
        convert_peft_adapter(undeclared, other, tmp_path / "x")
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(LoraAdapterError, match="use_dora: DoRA adapters are not supported"):
        convert_peft_adapter(dora, cfg, tmp_path / "x")
    assert issubclass(LoraAdapterError, BuildInputError)


def test_lora_inputs_cost_nothing_without_an_adapter(hf_checkpoint: Callable[..., Path],
                                                     built_bundle: Callable[..., Path]) -> None:
    """A LoRA-capable bundle with no adapter active answers exactly like the plain one."""
    checkpoint = hf_checkpoint("qwen2")
    plain, capable = engine_of(built_bundle(checkpoint)), engine_of(built_bundle(checkpoint, lora=True))
    try:
        a, b = plain.prefill(0, PROMPT), capable.prefill(0, PROMPT)
    finally:
        plain.close()
        capable.close()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_scheduler_runs_each_request_with_its_adapter_and_never_shares_their_kv(
        hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path], adapters: Callable[..., Path],
        tmp_path: Path) -> None:
    """Through the scheduler with context reuse: a request names its adapter; the same prompt under
    another adapter (or none) reuses nothing of it, while the same adapter again reuses its KV."""
    from inference.serving.context_cache import PrefixStore
    from inference.serving.generation import GenerationState
    from inference.serving.sampling import Sampler, SamplingParams
    from inference.serving.scheduler import GenerationRequest, Scheduler
    from tests.support.scheduling import CollectingSink, IdTokens

    checkpoint = hf_checkpoint("qwen2")
    cfg = load_model_config(checkpoint)
    convert_peft_adapter(adapters("qwen2", 5), cfg, tmp_path / "a.onnx_adapter")
    bundle = built_bundle(checkpoint, lora=True, max_batch_size=4, max_kv_cache_capacity=512)
    engine = engine_of(bundle, slots=4)
    engine.load_adapter("a", tmp_path / "a.onnx_adapter")
    alone = greedy(engine, 0, PROMPT * 12, 6)  # the adapter-free answer, as a reference
    engine.set_adapter(1, "a")
    tuned = greedy(engine, 1, PROMPT * 12, 6)
    engine.set_adapter(1, None)
    store = PrefixStore("bundle:test", max_records=64, max_bytes=1 << 30)
    sched = Scheduler(engine, max_batch_size=4, max_queued_requests=16, queue_timeout=60,
                      context_cache=store, save_delay=0.0)
    sched.start()

    def run(adapter: str | None) -> list[int]:
        sink = CollectingSink()
        prompt = PROMPT * 12  # 144 tokens: two complete 64-token blocks
        state = GenerationState(IdTokens(), prompt_ids=prompt, max_new_tokens=6)  # type: ignore[arg-type]
        sampler = Sampler(SamplingParams(temperature=0.0), engine.info.vocab_size)
        sched.submit(GenerationRequest(prompt, sampler, state, sink, adapter=adapter))
        tokens = sink.tokens()
        # Its records in the store before the next request looks (they are made once idle).
        deadline = time.monotonic() + 30
        while sched.pending_record_saves and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not sched.pending_record_saves
        return tokens

    try:
        assert run("a") == tuned
        reused = store.stats().tokens_reused
        assert run(None) == alone
        assert store.stats().tokens_reused == reused  # the adapter's KV is not the base model's
        assert run("a") == tuned
        assert store.stats().tokens_reused > reused  # its own KV again
    finally:
        sched.stop()
        engine.close()
    assert tuned != alone


def test_a_request_whose_adapter_is_unloaded_while_it_waits_fails_alone(
        hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path], adapters: Callable[..., Path],
        tmp_path: Path) -> None:
    """Unloading is allowed while no running request uses the adapter; a queued one that names it
    then gets a clear error of its own (404 model_not_found over HTTP), and the scheduler goes on
    serving the others (it used to die on the engine's ValueError, failing every request)."""
    from inference.openai.errors import to_openai_error
    from inference.serving.generation import GenerationState
    from inference.serving.sampling import Sampler, SamplingParams
    from inference.serving.scheduler import AdapterUnloadedError, GenerationRequest, Scheduler
    from tests.support.scheduling import CollectingSink, IdTokens

    checkpoint = hf_checkpoint("qwen2")
    convert_peft_adapter(adapters("qwen2", 5), load_model_config(checkpoint), tmp_path / "a.onnx_adapter")
    bundle = built_bundle(checkpoint, lora=True, max_batch_size=2, max_kv_cache_capacity=512)
    engine = engine_of(bundle, slots=2)
    engine.load_adapter("a", tmp_path / "a.onnx_adapter")
    sched = Scheduler(engine, max_batch_size=2, max_queued_requests=4, queue_timeout=60)
    sched.start()

    def request(adapter: str | None) -> tuple[GenerationRequest, CollectingSink]:
        sink = CollectingSink()
        state = GenerationState(IdTokens(), prompt_ids=PROMPT, max_new_tokens=4)  # type: ignore[arg-type]
        sampler = Sampler(SamplingParams(temperature=0.0), engine.info.vocab_size)
        return GenerationRequest(PROMPT, sampler, state, sink, adapter=adapter), sink

    try:
        waiting, sink = request("a")
        with sched._cond:  # the scheduler thread cannot admit it until the adapter is gone
            sched.submit(waiting)
            engine.unload_adapter("a")  # no slot runs it yet: allowed
        with pytest.raises(AdapterUnloadedError, match="'a' was unloaded while this request waited") as info:
            sink.tokens()
        error = to_openai_error(info.value)
        assert (error.status_code, error.code, error.param) == (404, "model_not_found", "model")
        plain, plain_sink = request(None)
        sched.submit(plain)
        assert len(plain_sink.tokens()) == 4  # the scheduler still runs
        assert engine.slot_adapter(0) is None and engine.slot_adapter(1) is None
    finally:
        sched.stop()
        engine.close()
