"""Small GGUF files written by the ``gguf`` package: round trips against the safetensors path,
the reader's values and raw blocks, the cache's conversion (once, atomically, listed), and one
clear error for bad files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from cachesvc.cache.checkpoints import remove_checkpoint_files, resolve_checkpoint
from cachesvc.cache.gguf_checkpoints import gguf_digest
from cachesvc.cli import main as cli_main
from cachesvc.errors import CheckpointError
from inference.builder import gguf_convert
from inference.builder.checkpoint_reader import open_checkpoint
from inference.builder.gguf_convert import convert_gguf
from inference.builder.gguf_reader import (
    GGUF_FILE,
    MAX_KEPT_ARRAY,
    ROPE_TENSORS,
    GgufCheckpoint,
    gguf_config,
    open_gguf,
    read_gguf_header,
    tensor_plan,
)
from inference.builder.kernel_plan import PROJECTION_GROUPS
from inference.builder.quantized import BLOCK, GgufBlocks
from inference.builder.safetensors_reader import SafetensorsCheckpoint
from inference.cpu_class import cpu_class
from inference.runtime.onnxruntime_loader import load_engine
from inference.serving.tokenizer import load_tokenizer
from tests.gguf.ggufs import FAMILIES, TYPES, write_pair, write_raw_gguf
from tests.support.gate_rule import check_gate_choice

PROMPT = [5, 77, 123, 9, 300, 41, 250, 17]

SmallGguf = Callable[[str, str], tuple[Path, Path]]


def _prefill(bundle: Path) -> np.ndarray:
    engine = load_engine(bundle, threads=1)
    try:
        return engine.prefill(0, PROMPT)
    finally:
        engine.close()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_weights_equal_the_reference(small_gguf: SmallGguf, family: str, qtype: str,
                                               tmp_path: Path) -> None:
    path, reference = small_gguf(family, qtype)
    config = convert_gguf(path, tmp_path)
    ours, ref = open_checkpoint(tmp_path), SafetensorsCheckpoint(reference)
    assert isinstance(ours, GgufCheckpoint)
    ref_names = set(ref.names()) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(ours.names()) == ref_names
    # The reference is gguf's dequantize(quantize(w)) with the Q/K rows unpermuted by the test's
    # own code: exactly what gguf-1 stored in model.safetensors.
    for name in ref_names:
        np.testing.assert_array_equal(ours.get_f32(name), ref.get_f32(name), err_msg=name)
        assert ours.shape(name) == ref.shape(name), name
    ref_config = json.loads((reference / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert config[key] == ref_config[key], key
    assert config["head_dim"] == (ref_config.get("head_dim") or 16)
    assert config["model_type"] == family
    # The weights stay as the file has them: a byte-for-byte copy, no float32 expansion.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == [GGUF_FILE]
    assert (tmp_path / GGUF_FILE).read_bytes() == path.read_bytes()
    assert ours.source_dtypes() == ({"F32", qtype} if qtype != "F32" else {"F32"})


def assert_header_matches_gguf_reader(path: Path) -> None:
    """Our header parser reads what the gguf package's reader reads (scalars, short numeric
    arrays, tensor table)."""
    reader, header = open_gguf(path), read_gguf_header(path)
    kept: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if not f.types or name.startswith("GGUF."):
            continue
        if f.types[0] != gguf.GGUFValueType.ARRAY:
            kept[name] = f.contents()
        elif (len(f.types) == 2 and f.types[1] not in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
              and len(f.data) <= MAX_KEPT_ARRAY):
            kept[name] = tuple(f.contents())
    assert header.metadata == kept
    assert [(t.name, t.dims, t.type_id, t.start) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))
        for t in reader.tensors
    ]
    plan = tensor_plan(header, gguf_config(header))
    # A 3-D expert tensor is planned as one slice per expert, back to back: together, its bytes.
    planned: dict[str, int] = {}
    for p in plan:
        planned[p.source] = planned.get(p.source, 0) + p.rows * p.row_bytes
    # The rope tensors become config.json's rope scaling, not weights.
    assert planned == {t.name: int(t.n_bytes) for t in reader.tensors if t.name not in ROPE_TENSORS}
    starts = {t.name: t.start for t in header.tensors}
    assert all(p.start >= starts[p.source] for p in plan)


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q5_1", "Q4_1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_header_parser_agrees_with_the_gguf_package(small_gguf: SmallGguf, family: str, qtype: str) -> None:
    assert_header_matches_gguf_reader(small_gguf(family, qtype)[0])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "F16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_raw_blocks_are_the_files_rows_in_hf_order(small_gguf: SmallGguf, family: str, qtype: str,
                                                   tmp_path: Path) -> None:
    path, reference = small_gguf(family, qtype)
    convert_gguf(path, tmp_path)
    ckpt = GgufCheckpoint(tmp_path)
    weights = [n for n in ckpt.names() if len(ckpt.shape(n)) == 2]
    for name in weights:
        raw = ckpt.blocks(name)
        if qtype not in ("Q4_0", "Q4_1", "Q8_0"):
            assert raw is None, name
            continue
        assert raw is not None and raw.type_name == qtype, name
        n, k = ckpt.shape(name)
        assert raw.rows.dtype == np.uint8 and raw.rows.shape == (n, k // 32 * gguf.GGML_QUANT_SIZES[
            gguf.GGMLQuantizationType[qtype]][1]), name
        # Whole rows moved (llama's Q/K), blocks untouched: dequantizing them gives the weight.
        values = gguf.quants.dequantize(np.asarray(raw.rows), gguf.GGMLQuantizationType[qtype])
        np.testing.assert_array_equal(values.reshape(n, k), ckpt.get_f32(name), err_msg=name)
    assert all(ckpt.blocks(n) is None for n in ckpt.names() if len(ckpt.shape(n)) == 1)  # F32 norms
    ref = SafetensorsCheckpoint(reference)
    assert all(ref.blocks(n) is None for n in ref.names())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_takes_the_q4_blocks_of_the_reader(small_gguf: SmallGguf, qtype: str, tmp_path: Path) -> None:
    """int4's weights from the file's blocks decode to the reader's float32 values (llama: Q/K permuted)."""
    path, _ = small_gguf("llama", qtype)
    convert_gguf(path, tmp_path)
    ckpt = GgufCheckpoint(tmp_path)
    source = GgufBlocks(ckpt)
    for name in (n for n in ckpt.names() if n.startswith("model.layers.") and n.endswith("proj.weight")):
        n, k = ckpt.shape(name)
        q = source.get(name, n, k)
        assert q is not None, name
        codes = np.stack([q.codes & 0x0F, q.codes >> 4], axis=-1).reshape(n, k // BLOCK, BLOCK)
        # Both with the default zero point 8; Q4_1's d*q + m as d*(q - 8) + (m + 8d).
        w = (codes.astype(np.float32) - 8.0) * q.scales.reshape(n, k // BLOCK, 1)
        if q.block_min is not None:
            w = w + q.block_min.reshape(n, k // BLOCK, 1)
        np.testing.assert_allclose(w.reshape(n, k), ckpt.get_f32(name), rtol=1e-6, atol=1e-6, err_msg=name)
        eight = source.get_8bit(name, n, k)  # exact for Q4_0 only
        assert (eight is not None) == (qtype == "Q4_0")
        if eight is not None:
            w8 = (eight.codes.astype(np.float32) - 128.0) * eight.scales[..., None]
            np.testing.assert_array_equal(w8.reshape(n, k), ckpt.get_f32(name))
    assert source.get("lm_head.weight", 1, BLOCK) is None  # tied: not in the file, so no blocks


def test_q8_0_blocks_are_the_8bit_tables_as_they_are(small_gguf: SmallGguf, tmp_path: Path) -> None:
    from inference.builder.quantized import quantize_8bit

    path, _ = small_gguf("qwen2", "Q8_0")
    convert_gguf(path, tmp_path)
    ckpt = GgufCheckpoint(tmp_path)
    source = GgufBlocks(ckpt)
    name = "model.layers.0.mlp.up_proj.weight"
    n, k = ckpt.shape(name)
    own = source.get_8bit(name, n, k)
    assert own is not None
    again = quantize_8bit(ckpt.get_f32(name))  # re-quantizing Q8_0's values gives its codes back
    np.testing.assert_array_equal(own.codes, again.codes)
    np.testing.assert_array_equal(own.scales, again.scales)


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_the_safetensors_path(
    small_gguf: SmallGguf, bundle_of: Callable[..., Path], family: str, qtype: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path, reference = small_gguf(family, qtype)
    converted = tmp_path_factory.mktemp("converted")
    convert_gguf(path, converted)
    a, b = load_engine(bundle_of(converted), threads=1), load_engine(bundle_of(reference), threads=1)
    try:
        np.testing.assert_allclose(a.prefill(0, PROMPT), b.prefill(0, PROMPT), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(a.decode([0], [3])[0], b.decode([0], [3])[0], atol=1e-4, rtol=1e-4)
    finally:
        a.close()
        b.close()


def _converted_qwen2(small_gguf: SmallGguf, qtype: str, factory: pytest.TempPathFactory) -> Path:
    """The small qwen2 GGUF of ``qtype`` converted into a checkpoint directory."""
    path, _ = small_gguf("qwen2", qtype)
    converted = factory.mktemp("converted")
    convert_gguf(path, converted)
    return converted


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_from_gguf_blocks_matches_the_dequantized_weights(
    small_gguf: SmallGguf, bundle_of: Callable[..., Path], qtype: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import onnx

    converted = _converted_qwen2(small_gguf, qtype, tmp_path_factory)
    # The exact plan (float32 compute); what the gate picks at auto: the test below.
    int4, fp32 = bundle_of(converted, precision="int4", kernels="exact"), bundle_of(converted)
    graph = onnx.load(str(int4 / "model.ort.onnx"), load_external_data=False).graph
    layers = [n for n in graph.node if n.op_type == "MatMulNBits"
              and next(a.i for a in n.attribute if a.name == "bits") == 4 and ".hi." not in n.input[1]
              and ".lo." not in n.input[1]]
    assert len(layers) == 2 * 4  # per layer: q+k+v fused, o, gate+up fused, down
    assert all(next(a.i for a in n.attribute if a.name == "accuracy_level") == 0 for n in layers)
    x, y = _prefill(fp32), _prefill(int4)
    # The layers' codes are the file's, computed in float32. The tied embedding is 8-bit:
    # Q4_0's d*(q - 8) is exact there (fp32's logits to rounding, but for the tail of a
    # VNNI/AMX lm_head), Q4_1's d*q + m is re-quantized (close, not equal).
    assert int(x.argmax()) == int(y.argmax())
    top = np.argsort(-x)[:8]
    exact = qtype == "Q4_0"
    np.testing.assert_allclose(x[top], y[top], rtol=1e-4, atol=1e-4 if exact else 0.1)
    agreement = json.loads((int4 / "engine.json").read_text())["quality"]["greedy_agreement"]
    assert agreement == 1.0 if exact else agreement >= 0.9


def test_q4_1_block_sums_by_a_product_or_by_a_sum_give_the_same_logits(
    small_gguf: SmallGguf, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import onnx

    from inference.builder import EngineBuildSpec, build_bundle, quantized

    converted = _converted_qwen2(small_gguf, "Q4_1", tmp_path_factory)
    spec = EngineBuildSpec(precision="int4", kernels="exact", max_kv_cache_capacity=256, max_input_len=64)
    logits: list[np.ndarray] = []
    kinds: list[tuple[int, list[str]]] = []
    for limit in (quantized.BLOCK_SUM_MATRIX_MAX_K, 0):  # small K: one product; 0: reshape + sum
        monkeypatch.setattr(quantized, "BLOCK_SUM_MATRIX_MAX_K", limit)
        out = tmp_path_factory.mktemp("q4_1-sums")
        build_bundle(converted, out, spec)
        graph = onnx.load(str(out / "model.ort.onnx"), load_external_data=False).graph
        matrices = [t.name for t in graph.initializer if t.name.startswith("q4_block_sum_matrix")]
        kinds.append((sum(n.op_type == "ReduceSum" for n in graph.node), matrices))
        logits.append(_prefill(out))
    (sums, matrices), (sums_then, matrices_then) = kinds
    assert matrices and not matrices_then and sums < sums_then, kinds
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_on_the_4bit_grid_auto_publishes_the_fastest_plan_that_answers_like_fp32(
    small_gguf: SmallGguf, bundle_of: Callable[..., Path], qtype: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # A checkpoint whose weights sit on the 4-bit grid (the file's own blocks): the layers'
    # weights are fp32's, so what the gate judges is the kernels alone.
    import onnx

    bundle = bundle_of(_converted_qwen2(small_gguf, qtype, tmp_path_factory), precision="int4")
    meta = json.loads((bundle / "engine.json").read_text())
    chosen = check_gate_choice(meta)
    print(f"int4 ({qtype} blocks) at auto on {cpu_class()}: {meta['quality']['candidates']}")
    graph = onnx.load(str(bundle / "model.ort.onnx"), load_external_data=False).graph
    levels = {next(a.i for a in n.attribute if a.name == "accuracy_level") for n in graph.node
              if n.op_type == "MatMulNBits" and ".layers." in n.input[1]}
    assert levels == {4 if group in chosen["int8_groups"] else 0 for group in PROJECTION_GROUPS}


def test_int4_of_a_float_checkpoint_quantizes_it_and_the_gate_judges(
    bundle_of: Callable[..., Path], tmp_path: Path
) -> None:
    from inference.builder import EngineBuildSpec, build_bundle
    from inference.builder.quality import QualityGateError

    # The plain rope of the measurement below (the family's tiny llama3 rope spreads its 4-bit
    # error differently: a cosine of 0.89 instead of 0.97).
    _, reference = write_pair("llama", "F32", tmp_path / "pair", rope_parameters=None)
    spec = EngineBuildSpec(precision="int4", max_kv_cache_capacity=256, max_input_len=64)
    loose = tmp_path / "loose"
    loose.mkdir()
    meta = build_bundle(reference, loose, spec, min_agreement=0.0)
    x, y = _prefill(bundle_of(reference)), _prefill(loose)
    # Random weights are the worst case for 4 bits (measured 0.97 here; SmolLM2's own 4-bit
    # blocks are exact): close, but greedy decoding drifts, and the gate says so.
    assert float(x @ y / np.linalg.norm(x) / np.linalg.norm(y)) > 0.95
    assert meta["quality"]["greedy_agreement"] < 0.9
    strict = tmp_path / "strict"
    strict.mkdir()
    with pytest.raises(QualityGateError, match=r"^the int4 build failed the quality gate on this CPU"):
        build_bundle(reference, strict, spec)
    assert not (strict / "engine.json").exists()


def test_tokenizer_matches_transformers(small_gguf: SmallGguf, tmp_path: Path) -> None:
    import transformers as tf

    path, _ = small_gguf("qwen2", "F32")
    convert_gguf(path, tmp_path)
    ours = load_tokenizer(tmp_path)
    theirs = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ("Hello world", "  spaces\tand\nnewlines  ", "ünïcode 你好 🤗", "x = f(1, 2)  # call",
                 "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text, add_special_tokens=True) == theirs(text).input_ids, text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def _tokenizer_of_gguf(path: Path, model: str, tokens: list[str], types: list[int], out: Path,
                       fields: dict[str, Any]) -> Any:
    """Our tokenizer of a GGUF holding a vocabulary (tokenizer model ``model``; ``fields``: the
    writer's ``add_<name>`` calls) and a token_embd: written, converted into ``out``, loaded."""
    from inference.builder.gguf_tokenizer import write_tokenizer_files

    writer = gguf.GGUFWriter(path, model)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.mkdir()
    write_tokenizer_files(open_gguf(path), out)
    return load_tokenizer(out)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    """A llama-type (SentencePiece BPE, byte fallback, merges from scores) vocabulary."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests.gguf.ggufs import CORPUS

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer_tok.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=600, show_progress=False))
    pieces = [t for t, _ in sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    ours = _tokenizer_of_gguf(path, "llama", tokens, types, tmp_path / "tok",
                              {"token_scores": scores, "bos_token_id": 1, "eos_token_id": 2,
                               "unk_token_id": 0})
    theirs = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("Hello world", "the cache  holds   bundles", "ünïcode 你好 🤗 (byte fallback)", " leading",
                 "numbers 12345 and code: f(x)=x**2"):
        expected = theirs(text).input_ids
        assert ours.encode(text, add_special_tokens=True) == expected, text
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True), text


def test_gemma4_tokenizer_model_matches_the_checkpoints(tmp_path: Path) -> None:
    """A ``gemma4`` tokenizer model (what llama.cpp's converter writes for Gemma 4: SentencePiece-
    style BPE with merges, spaces as U+2581, byte fallback, no space prefix) encodes and decodes
    as the tokenizer.json it was converted from."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from tests.gguf.ggufs import CORPUS

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    theirs = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    theirs.normalizer = normalizers.Replace(" ", "\u2581")
    theirs.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                        decoders.Fuse()])
    theirs.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                    show_progress=False))
    tokens = [t for t, _ in sorted(theirs.get_vocab().items(), key=lambda kv: kv[1])]
    pairs = json.loads(theirs.to_str())["model"]["merges"]
    merges = [" ".join(m) if not isinstance(m, str) else m for m in pairs]
    types = [3] * 4 + [6] * 256 + [1] * (len(tokens) - 260)
    ours = _tokenizer_of_gguf(tmp_path / "gemma4.gguf", "gemma4", tokens, types, tmp_path / "tok",
                              {"token_merges": merges, "bos_token_id": 2, "eos_token_id": 1,
                               "add_space_prefix": False})
    for text in ("Hello world", "the cache  holds   bundles",
                 "\u00fcn\u00efcode \u4f60\u597d \U0001f917 (byte fallback)", " leading",
                 "two\nlines\n\nand code: f(x)=x**2"):
        expected = theirs.encode(text).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=False), text


# --------------------------------------------------------------------------- the cache


def _cache_leftovers(checkpoints: Path) -> list[str]:
    root = checkpoints / "gguf"
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name != ".locks")


def test_converted_once_then_a_hit_without_reading_tensors(
    small_gguf: SmallGguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = small_gguf("llama", "Q4_0")
    checkpoints = tmp_path / "checkpoints"
    first = resolve_checkpoint(str(path), checkpoints)
    assert first.path.parent == checkpoints / "gguf"
    assert first.path.name.startswith(gguf_digest(path)[:16])
    assert _cache_leftovers(checkpoints) == [first.path.name]  # no staging left

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", refuse)
    # Same file elsewhere, and the directory holding it: the same conversion, found.
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    for model in (str(copy), str(copy.parent)):
        again = resolve_checkpoint(model, checkpoints)
        assert (again.path, again.digest) == (first.path, first.digest)


def test_checkpoints_ls_lists_the_conversion(small_gguf: SmallGguf, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = small_gguf("qwen3", "Q8_0")
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(path), "--cache-dir", str(cache), "--max-kv-cache-capacity", "256",
                     "--max-input-len", "64", "--json"]) == 0
    capsys.readouterr()
    assert cli_main(["checkpoints", "ls", "--cache-dir", str(cache), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    rows = rows if isinstance(rows, list) else rows.get("checkpoints", rows)
    assert any(str(cache / "checkpoints" / "gguf") in str(r.get("path")) and r.get("source") == str(path)
               for r in rows), rows


def test_hub_file_offline_from_the_hf_cache(small_gguf: SmallGguf, tmp_path: Path) -> None:
    import hashlib

    path, _ = small_gguf("mistral", "F16")
    checkpoints = tmp_path / "checkpoints"
    commit = "b" * 40
    repo = checkpoints / "models--org--tiny-GGUF"
    blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(path.read_bytes())
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "tiny.F16.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    r = resolve_checkpoint("org/tiny-GGUF/tiny.F16.gguf", checkpoints, offline=True)
    assert r.revision == commit
    assert r.path == resolve_checkpoint(str(path), checkpoints).path
    # The download is the cache's own: the converted checkpoint is a second name of it, not a
    # second copy. A user's file is copied, never linked.
    assert os.path.samefile(r.path / "model.gguf", blob)
    local = resolve_checkpoint(str(path), tmp_path / "elsewhere")
    assert not os.path.samefile(local.path / "model.gguf", path) and path.stat().st_nlink == 1
    # Removing the converted checkpoint frees its own files only: the GGUF's bytes stay the
    # download's.
    others = sum(f.stat().st_size for f in r.path.iterdir() if f.name != "model.gguf")
    assert remove_checkpoint_files(checkpoints, tmp_path / "trash", r.path) == others
    assert not r.path.exists() and blob.read_bytes() == path.read_bytes() and blob.stat().st_nlink == 1
    with pytest.raises(CheckpointError, match="not in the local cache"):
        resolve_checkpoint("org/tiny-GGUF/other.gguf", checkpoints, offline=True)


def test_a_directory_with_two_ggufs_is_ambiguous(small_gguf: SmallGguf, tmp_path: Path) -> None:
    path, _ = small_gguf("llama", "F32")
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"2 \.gguf files"):
        resolve_checkpoint(str(tmp_path), tmp_path / "checkpoints")


# --------------------------------------------------------------------------- bad files


def _tiny_tensors() -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]:
    return {"token_embd.weight": (np.zeros((16, 32), np.float32), None)}


def _bad_files(small_gguf: SmallGguf, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    good, _ = small_gguf("llama", "Q4_0")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(good.read_bytes()[:2000])
    unknown_arch = write_raw_gguf(tmp_path / "arch.gguf", "rwkv7", _tiny_tensors())
    with_tok, _ = small_gguf("qwen2", "F32")
    iq = gguf.GGMLQuantizationType.IQ4_NL
    unsupported = tmp_path / "type.gguf"
    # A qwen2 file whose one tensor is IQ4_NL (raw bytes of the right size).
    reader = open_gguf(with_tok)
    writer = gguf.GGUFWriter(unsupported, "qwen2")
    for field in reader.fields.values():
        if field.name.startswith(("qwen2.", "tokenizer.")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    block, size = gguf.GGML_QUANT_SIZES[iq]
    writer.add_tensor("token_embd.weight", np.zeros((384, 64 // block * size), np.uint8), raw_dtype=iq)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    no_tokenizer, _ = write_pair("qwen2", "F32", tmp_path / "no-tokenizer", with_tokenizer=False)
    return {
        "truncated": (truncated, "truncated"),
        "header-cut": (header_cut, "truncated"),
        "unknown-arch": (unknown_arch, "unsupported model family 'rwkv7'"),
        "unsupported-type": (unsupported, "IQ4_NL"),
        "no-tokenizer": (no_tokenizer, "no tokenizer"),
    }


def test_bad_files_give_one_clear_error_and_leave_nothing(
    small_gguf: SmallGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = _bad_files(small_gguf, tmp_path / "files")
    for name, (path, message) in cases.items():
        checkpoints = tmp_path / name / "checkpoints"
        with pytest.raises(CheckpointError, match=message) as info:
            resolve_checkpoint(str(path), checkpoints)
        assert "Traceback" not in str(info.value)
        assert _cache_leftovers(checkpoints) == [], name
    # The command line: exit status 2 and the message, nothing published.
    path, message = cases["unknown-arch"]
    cache = tmp_path / "cli-cache"
    assert cli_main(["prepare", str(path), "--cache-dir", str(cache)]) == 2
    assert "rwkv7" in capsys.readouterr().err
    assert _cache_leftovers(cache / "checkpoints") == []


def test_concurrent_resolves_convert_once(small_gguf: SmallGguf, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two resolves at once: one converts under the lock, the other waits and finds the result."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    path, _ = small_gguf("qwen2", "Q4_1")
    calls: list[int] = []
    real = gguf_convert.convert_gguf
    started = threading.Event()

    def slow_convert(*args: object, **kwargs: object) -> object:
        calls.append(1)
        started.set()
        threading.Event().wait(0.5)  # hold the lock long enough for the other resolve to queue up
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow_convert)
    checkpoints = tmp_path / "checkpoints"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(resolve_checkpoint, str(path), checkpoints)
        started.wait(10)
        second = pool.submit(resolve_checkpoint, str(path), checkpoints)
        results = [first.result(), second.result()]
    assert len(calls) == 1
    assert results[0].path == results[1].path
    assert _cache_leftovers(checkpoints) == [results[0].path.name]


def test_a_file_changed_while_it_is_copied_is_not_published(
    small_gguf: SmallGguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy must be the file the key was computed from; a writer racing the copy is refused."""
    path, _ = small_gguf("qwen2", "Q8_0")
    real = gguf_convert.convert_gguf

    def racing_convert(gguf_path: Path, out_dir: Path, *, link: bool) -> object:
        config = real(gguf_path, out_dir, link=link)
        with (out_dir / GGUF_FILE).open("r+b") as fh:  # as if the source grew a byte mid-copy
            fh.seek(0, os.SEEK_END)
            fh.write(b"\0")
        return config

    monkeypatch.setattr(gguf_convert, "convert_gguf", racing_convert)
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match="changed while it was being converted"):
        resolve_checkpoint(str(path), checkpoints)
    assert _cache_leftovers(checkpoints) == []


def test_a_file_that_cannot_be_linked_is_copied(small_gguf: SmallGguf, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``link`` on a filesystem without hard links (or across filesystems) falls back to a copy."""
    import errno

    path, _ = small_gguf("llama", "Q4_0")

    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(gguf_convert.os, "link", cross_device)
    out = tmp_path / "out"
    out.mkdir()
    gguf_convert.convert_gguf(path, out, link=True)
    assert (out / GGUF_FILE).read_bytes() == path.read_bytes()
    assert not os.path.samefile(out / GGUF_FILE, path) and path.stat().st_nlink == 1
