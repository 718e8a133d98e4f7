"""Demo checkpoints: transformers must load what inference.demo writes, and it must be deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

import inference.demo as demo
from inference.demo import (
    ADDED_TOKENS,
    ARCHS,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    demo_tokenizer,
    write_demo_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_TEXT = "The café's naïve owner in 東京 said おはよう 🙂 and wrote `x = 3.14 * r ** 2`.\n"
_EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phi": "PhiForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "ministral": "MinistralForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "arcee": "ArceeForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo")
    return {arch: write_demo_checkpoint(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoints: dict[str, Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(checkpoints["qwen2"])


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def _logits(path: Path, text: str = SAMPLE_TEXT) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([demo_tokenizer().encode(text).ids])
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------------------------------------
# Loading in transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_each_arch_and_gives_finite_logits(
    checkpoints: dict[str, Path], arch: str
) -> None:
    path = checkpoints[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == _EXPECTED_CLASS[arch]
    assert model.dtype == torch.float32
    ids = demo_tokenizer().encode(SAMPLE_TEXT).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), TOKENIZER_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    # Random weights with std 0.2 must give spread-out logits, or greedy comparisons prove nothing.
    assert logits[0, -1].std() > 0.5

    # Whatever tokenizer class transformers picks for the model type, it must encode like ours.
    hf = AutoTokenizer.from_pretrained(path)
    assert hf(SAMPLE_TEXT, add_special_tokens=True)["input_ids"] == ids


def test_family_specific_tensors(checkpoints: dict[str, Path]) -> None:
    qwen2 = load_file(checkpoints["qwen2"] / "model.safetensors")
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    llama = load_file(checkpoints["llama"] / "model.safetensors")
    assert not any(name.endswith(".bias") for name in llama)
    assert "lm_head.weight" not in llama  # tied

    qwen3 = load_file(checkpoints["qwen3"] / "model.safetensors")
    config = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    # head_dim is explicit and differs from hidden / heads, as in real Qwen3 models.
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (
        config["head_dim"] * config["num_attention_heads"],
        config["hidden_size"],
    )
    assert torch.equal(qwen3["model.layers.1.self_attn.k_norm.weight"], torch.ones(config["head_dim"]))


@pytest.mark.parametrize("arch", ARCHS)
def test_config_follows_hub_convention(checkpoints: dict[str, Path], arch: str) -> None:
    config = json.loads((checkpoints[arch] / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["architectures"] == [_EXPECTED_CLASS[arch]]
    assert config["torch_dtype"] == config["dtype"] == "float32"
    # (Gemma 4's proportional rope has only transformers 5's per-layer-type form)
    assert isinstance(config["rope_theta"] if "rope_theta" in config
                      else config["rope_parameters"]["full_attention"]["rope_theta"], float)
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == TOKENIZER_VOCAB_SIZE
    tok = demo_tokenizer()
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")
    generation = json.loads((checkpoints[arch] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert generation["pad_token_id"] == tok.token_to_id("<|endoftext|>")


def test_bf16_holds_the_fp32_weights_rounded(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    bf16_dir = write_demo_checkpoint(tmp_path / "bf16", arch="qwen2", dtype="bf16")
    header_len = int.from_bytes((bf16_dir / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((bf16_dir / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert header["__metadata__"] == {"format": "pt"}
    assert (8 + header_len) % 8 == 0
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}

    fp32 = load_file(checkpoints["qwen2"] / "model.safetensors")
    bf16 = load_file(bf16_dir / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    for name, tensor in fp32.items():
        assert bf16[name].dtype == torch.bfloat16
        # torch rounds to nearest even too, so this is bit-exact.
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name

    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    assert model.dtype == torch.bfloat16
    assert json.loads((bf16_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bf16_rounding_is_round_to_nearest_even() -> None:
    # 1 + 2^-8 is exactly halfway between two bf16 values: ties go to the even one (1.0);
    # 1 + 3 * 2^-8 is halfway too and rounds up to the even 1 + 2^-6.
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.5, 1e-40, np.inf, np.nan], dtype=np.float32)
    bits = demo._to_bf16_bits(values)
    back = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert back[:5].tolist() == [1.0, 1 + 2**-6, -2.5, float(torch.tensor(1e-40).to(torch.bfloat16)), np.inf]
    assert np.isnan(back[5])


def test_untied_checkpoint_has_its_own_lm_head(tmp_path: Path) -> None:
    path = write_demo_checkpoint(tmp_path / "untied", arch="llama", tied=False)
    weights = load_file(path / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False


def test_sharded_checkpoint_loads_like_a_single_file(
    tmp_path: Path, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 0.5b fp32 model is split at ~1 GB; a small limit exercises the same path on a tiny model.
    monkeypatch.setattr(demo, "_MAX_SHARD_BYTES", 200_000)
    path = write_demo_checkpoint(tmp_path / "sharded", arch="mistral")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for shard in shards for t in load_file(path / shard).values()
    )
    assert torch.equal(_logits(path), _logits(checkpoints["mistral"]))

    # Rewriting into the same directory unsharded leaves no stale shards behind.
    monkeypatch.undo()
    write_demo_checkpoint(path, arch="mistral")
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]


def test_rows_beyond_the_tokenizer_are_zero_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The 0.5b embedding has 151936 rows for 1024 tokens; the live/zero boundary may fall
    # inside a generation block, which a 3-row block with the boundary at row 7 reproduces.
    monkeypatch.setattr(demo, "_CHUNK_ELEMENTS", 12)
    spec = demo._TensorSpec("model.embed_tokens.weight", (10, 4), "normal", live_rows=7)
    values = np.concatenate(list(demo._tensor_chunks(spec, 0.02, seed=0))).reshape(10, 4)
    assert (values[7:] == 0).all()
    assert (values[:7] != 0).all()


def test_half_billion_shape_matches_qwen25_05b() -> None:
    shape = demo._shape("qwen2", "0.5b")
    ids = demo._token_ids(demo_tokenizer())
    config = demo._config("qwen2", shape, dtype="bf16", tied=True, ids=ids, size="0.5b")
    specs = demo._tensor_specs(config, live_vocab=TOKENIZER_VOCAB_SIZE)
    assert sum(s.numel for s in specs) == 494_032_768  # Qwen2.5-0.5B's parameter count
    assert len(demo._plan_shards(specs, 4)) == 2
    assert len(demo._plan_shards(specs, 2)) == 1
    assert config["vocab_size"] == 151936
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert config["max_position_embeddings"] == 32768
    assert (config["hidden_size"], config["num_hidden_layers"]) == (896, 24)
    assert config["intermediate_size"] == 4864
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)


# ---------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize(
    "text",
    [
        SAMPLE_TEXT,
        "Crème brûlée, jalapeño, smörgåsbord, Straße",
        "東京都 안녕하세요 доброе утро καλημέρα",
        "emoji 🙂👋🏽🧑‍💻 and flags 🇵🇹",
        "  leading spaces\ttabs\r\nand CRLF  ",
        "",
    ],
)
def test_hf_tokenizer_round_trips_text(hf_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert hf_tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=80))
def test_byte_level_bpe_round_trips_any_text_up_to_nfc(text: str) -> None:
    tokenizer = demo_tokenizer()
    # Like Qwen2's tokenizer, input is NFC-normalised first; everything else survives.
    expected = unicodedata.normalize("NFC", text)
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == expected


def test_decomposed_accents_are_composed(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    composed = hf_tokenizer("café", add_special_tokens=False)["input_ids"]
    assert hf_tokenizer("cafe\u0301", add_special_tokens=False)["input_ids"] == composed


def test_multibyte_text_uses_learned_merges() -> None:
    tokenizer = demo_tokenizer()
    # Trained on a corpus with these words: fewer tokens than UTF-8 bytes proves the merges.
    for word in ("café", "naïve", "東京", " 🙂", " Straße"):
        assert len(tokenizer.encode(word).ids) < len(word.encode("utf-8")), word


def test_special_and_added_tokens_are_single_ids(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer = demo_tokenizer()
    assert tokenizer.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    seen = set()
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None
        seen.add(token_id)
        assert hf_tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"] == [
            tokenizer.token_to_id("a"),
            token_id,
            tokenizer.token_to_id("b"),
        ]
    assert len(seen) == len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    assert hf_tokenizer.bos_token is None
    # Reasoning/tool markers are not special: they survive skip_special_tokens, as parsers need.
    ids = hf_tokenizer("<think>hm</think><|im_end|>", add_special_tokens=False)["input_ids"]
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "<think>hm</think>"


# ---------------------------------------------------------------------------------------------
# Chat template


def test_chat_template_system_user_with_generation_prompt(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there 🙂"}]
    text = _render(hf_tokenizer, messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = _render(hf_tokenizer, messages, add_generation_prompt=False)
    assert text.startswith(without) and not without.endswith("<|im_start|>assistant\n")
    # No system message: a default one is inserted, as Qwen2.5's template does.
    text = _render(hf_tokenizer, messages[1:], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")


def test_chat_template_with_tools_and_tool_calls(hf_tokenizer: PreTrainedTokenizerBase) -> None:
    tool: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Lisbon and Tōkyō?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                # OpenAI clients send arguments as a JSON string, hub examples as an object.
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tōkyō"}}},
            ],
        },
        {"role": "tool", "content": "18 °C, sunny"},
        {"role": "tool", "content": "9 °C, rain"},
        {"role": "assistant", "content": "Lisbon is sunny; Tōkyō is rainy."},
    ]
    text = _render(hf_tokenizer, messages, tools=[tool], add_generation_prompt=True)

    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou check the weather.\n\n# Tools")
    tools_block = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools_block) == tool

    calls = [json.loads(chunk.split("\n</tool_call>")[0]) for chunk in text.split("<tool_call>\n")[2:]]
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Lisbon"}},
        {"name": "get_weather", "arguments": {"city": "Tōkyō"}},
    ]
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n18 °C, sunny\n</tool_response>\n"
        "<tool_response>\n9 °C, rain\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>assistant\nLisbon is sunny; Tōkyō is rainy.<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without tools there is no tools block.
    plain = _render(hf_tokenizer, messages[:2])
    assert "<tools>" not in plain


# ---------------------------------------------------------------------------------------------
# Determinism


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    again = _files(write_demo_checkpoint(tmp_path / "again", arch="qwen3"))
    assert again == _files(checkpoints["qwen3"])

    other = write_demo_checkpoint(tmp_path / "other", arch="qwen3", seed=1)
    assert _files(other)["tokenizer.json"] == again["tokenizer.json"]
    assert _files(other)["config.json"] == again["config.json"]
    first = load_file(checkpoints["qwen3"] / "model.safetensors")
    second = load_file(other / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert torch.equal(first["model.norm.weight"], second["model.norm.weight"])  # norms are 1.0


def test_cli_in_a_fresh_process_writes_identical_files(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    # A new process retrains the tokenizer, so this also shows that training is deterministic.
    result = subprocess.run(
        [sys.executable, "-m", "inference.demo", str(tmp_path / "cli"), "--arch", "llama", "--seed", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "llama" in result.stdout
    assert _files(tmp_path / "cli") == _files(checkpoints["llama"])


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"arch": "Qwen2"}, "arch"),
        ({"size": "7b"}, "size"),
        ({"dtype": "fp16"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"tied": "yes"}, "tied"),
    ],
)
def test_bad_options_raise_value_error_naming_the_option(
    tmp_path: Path, kwargs: dict[str, Any], option: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{option} must be"):
        write_demo_checkpoint(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_out_dir_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_demo_checkpoint(target)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--arch", "gpt2"], "--arch"),
        (["--size", "1b"], "--size"),
        (["--dtype", "int8"], "--dtype"),
        (["--seed", "-3"], "--seed"),
        (["--seed", "abc"], "--seed"),
    ],
)
def test_cli_errors_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main([str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
