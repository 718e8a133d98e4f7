"""Checkpoints the builder cannot build get a clear error, and no complete-looking bundle."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from inference.builder import BuildInputError, EngineBuildSpec, build_bundle


def _build_fails(ckpt: Path, tmp_path: Path, match: str, spec: EngineBuildSpec | None = None) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildInputError, match=match):
        build_bundle(ckpt, out, spec or EngineBuildSpec(max_kv_cache_capacity=64, max_input_len=32))
    assert not (out / "engine.json").exists()


def _edit_config(ckpt: Path, **changes: object) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named_with_the_supported_list(
    hf_checkpoint: Callable[..., Path], copy_dir: Callable[[Path], Path], tmp_path: Path
) -> None:
    ckpt = copy_dir(hf_checkpoint("llama", "fp32", False))
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _build_fails(
        ckpt,
        tmp_path,
        r"unsupported model family 'GPT2LMHeadModel'; supported: llama, .*qwen3.* "
        r"\(see docs/model-families.md\)",
    )


LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("qwen2", {"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4, "factor": 4.0}},
         "unsupported rope scaling type 'bogus'; supported: default, linear, llama3, yarn, longrope, "
         "dynamic, factors"),
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
         "yarn rope scaling is missing the field 'factor'"),
        ("qwen2", {"hidden_act": "tanh"}, "unsupported hidden_act 'tanh'"),
        ("qwen2", {"layer_types": ["chunked_attention", "full_attention"]},
         r"unsupported layer type in layer_types \['chunked_attention', 'full_attention'\]"),
        ("qwen2", {"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ("phi3", {"partial_rotary_factor": 0.75, "rope_parameters": None},
         r"partial_rotary_factor 0.75 of head_dim 32 rotates 24 dimensions per head; the CPU engine "
         r"\(onnxruntime GroupQueryAttention\) needs rotary dimensions / 2 to be a multiple of 8"),
        ("phi3", {"rope_parameters": {**LONGROPE, "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}},
         r"longrope rope scaling field 'long_factor' has 7 values; the 16 rotary dimensions need 8"),
        ("phi3", {"rope_parameters": LONGROPE},
         "longrope rope scaling is missing the field 'short_factor'"),
    ],
)
def test_unsupported_config_fields(
    family: str,
    changes: dict[str, object],
    match: str,
    hf_checkpoint: Callable[..., Path],
    copy_dir: Callable[[Path], Path],
    tmp_path: Path,
) -> None:
    ckpt = copy_dir(hf_checkpoint(family, "fp32", family == "qwen2"))
    _edit_config(ckpt, **changes)
    _build_fails(ckpt, tmp_path, match)


@pytest.mark.parametrize(
    ("family", "tensor"),
    [
        ("qwen2", "model.layers.1.mlp.up_proj.weight"),
        ("qwen2", "model.layers.0.self_attn.q_proj.bias"),
        ("qwen3", "model.layers.1.self_attn.k_norm.weight"),
        ("mistral", "lm_head.weight"),
    ],
)
def test_missing_weight_is_named(
    family: str,
    tensor: str,
    hf_checkpoint: Callable[..., Path],
    copy_dir: Callable[[Path], Path],
    tmp_path: Path,
) -> None:
    ckpt = copy_dir(hf_checkpoint(family, "fp32", False))
    tensors = load_file(ckpt / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, ckpt / "model.safetensors")
    _build_fails(ckpt, tmp_path, f"missing weight '{re.escape(tensor)}'")


def test_shape_mismatch_names_tensor_expected_and_got(
    hf_checkpoint: Callable[..., Path], copy_dir: Callable[[Path], Path], tmp_path: Path
) -> None:
    ckpt = copy_dir(hf_checkpoint("qwen3", "fp32", False))
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    _build_fails(
        ckpt,
        tmp_path,
        r"'model.layers.0.self_attn.k_proj.weight' has shape \[32, 64\], "
        r"expected \[64, 64\]",
    )


@pytest.mark.parametrize("keep", [4, 0.5])
def test_truncated_safetensors_names_the_file(
    keep: float, hf_checkpoint: Callable[..., Path], copy_dir: Callable[[Path], Path], tmp_path: Path
) -> None:
    ckpt = copy_dir(hf_checkpoint("llama", "bf16", True))
    shard = ckpt / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: int(keep if keep >= 1 else len(data) * keep)])
    _build_fails(ckpt, tmp_path, r"model.safetensors is truncated")


def test_spec_rejects_fp16_and_bad_limits() -> None:
    with pytest.raises(BuildInputError, match="fp16' is for the tensorrt backend"):
        EngineBuildSpec(precision="fp16")
    with pytest.raises(BuildInputError, match=r"precision: must be one of .*got 'int3'"):
        EngineBuildSpec(precision="int3")
    with pytest.raises(BuildInputError, match="max_batch_size: must be a positive integer"):
        EngineBuildSpec(max_batch_size=0)
    with pytest.raises(BuildInputError, match="must not exceed max_kv_cache_capacity"):
        EngineBuildSpec(max_input_len=4096, max_kv_cache_capacity=1024)


def test_output_dir_must_be_empty(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    (tmp_path / "leftover").write_text("x")
    with pytest.raises(BuildInputError, match="must exist and be empty"):
        build_bundle(hf_checkpoint("llama", "fp32", False), tmp_path, EngineBuildSpec())


def test_directory_without_weights(tmp_path: Path, hf_checkpoint: Callable[..., Path]) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((hf_checkpoint("llama", "fp32", False) / "config.json").read_text())
    _build_fails(ckpt, tmp_path, "no safetensors weights")
