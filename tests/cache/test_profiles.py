"""Build profiles: fields added after bundles existed keep every older bundle's id."""

from __future__ import annotations

import pytest

from cachesvc.cache.profiles import BuildOptions, ProfileRequest
from cachesvc.errors import ConfigError

#: The profile digest of a default build before task, pooling and lora existed (bundle ids
#: derive from it: a change here would rebuild every cached bundle).
DEFAULT_DIGEST_BEFORE_TASKS = "4835e6369565e2b750423e8035d39d9afcee38a703a1bee767d5353af8c8ff4c"


def test_new_fields_at_their_defaults_leave_the_dict_and_the_digest_alone() -> None:
    options = BuildOptions(builder_version="ort-4")
    assert options.digest == DEFAULT_DIGEST_BEFORE_TASKS
    assert {"task", "pooling", "lora"}.isdisjoint(options.to_dict())
    assert BuildOptions.from_dict(options.to_dict()) == options
    embed = BuildOptions(builder_version="ort-4", task="embed", pooling="last")
    lora = BuildOptions(builder_version="ort-4", lora=True)
    assert len({options.digest, embed.digest, lora.digest}) == 3
    assert embed.to_dict()["task"] == "embed" and BuildOptions.from_dict(embed.to_dict()) == embed
    assert "embedlast" in embed.name and "lora" in lora.name


@pytest.mark.parametrize(("fields", "field"), [
    ({"task": "embed"}, "pooling"),
    ({"pooling": "last"}, "pooling"),
    ({"task": "embed", "pooling": "last", "precision": "int8", "cpu_class": "amx"}, "task"),
    ({"lora": True, "task": "embed", "pooling": "last"}, "lora"),
])
def test_profiles_that_cannot_be_built_are_refused(fields: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        BuildOptions(**fields)  # type: ignore[arg-type]
    assert info.value.field == field


def test_a_request_for_pooling_needs_task_embed() -> None:
    with pytest.raises(ConfigError, match="applies only to task 'embed'"):
        ProfileRequest(pooling="mean")


def test_kernels_is_part_of_a_quantized_cpu_profile_only() -> None:
    base = BuildOptions(precision="int4", cpu_class="avx2")
    # auto is left out of the dict, so every bundle built before --kernels keeps its id
    assert "kernels" not in base.to_dict() and base.digest == BuildOptions.from_dict(base.to_dict()).digest
    fast = BuildOptions(precision="int4", cpu_class="avx2", kernels="fast")
    assert fast.to_dict()["kernels"] == "fast" and fast.digest != base.digest
    assert "-kfast-int4-" in fast.name and "-kexact-" in BuildOptions(
        precision="int8", cpu_class="avx2", kernels="exact").name
    with pytest.raises(ConfigError, match="kernels: applies only to int8/int4 bundles of the onnxruntime"):
        BuildOptions(precision="fp32", kernels="fast")
    with pytest.raises(ConfigError, match="kernels"):
        BuildOptions(precision="int4", cpu_class="avx2", kernels="turbo")
    with pytest.raises(ConfigError, match="kernels"):
        ProfileRequest(kernels="turbo")


def test_kv_cache_dtype_keys_a_cpu_generate_profile_and_keeps_old_ids_at_fp32() -> None:
    base = BuildOptions()
    assert "kv_cache_dtype" not in base.to_dict()
    half = BuildOptions(kv_cache_dtype="fp16")
    assert half.to_dict()["kv_cache_dtype"] == "fp16" and half.digest != base.digest
    assert "-kvfp16-fp32-" in half.name and BuildOptions.from_dict(half.to_dict()) == half
    quantized = BuildOptions(precision="int4", cpu_class="avx2", kv_cache_dtype="fp16")
    assert quantized.digest != BuildOptions(precision="int4", cpu_class="avx2").digest
    with pytest.raises(ConfigError, match="kv_cache_dtype: fp16 applies only to generate bundles"):
        BuildOptions(backend="tensorrt", precision="fp16", device_arch="sm90", kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        BuildOptions(task="embed", pooling="last", kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of fp32, fp16"):
        ProfileRequest(kv_cache_dtype="q8_0")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ProfileRequest(backend="tensorrt", kv_cache_dtype="fp16")


def test_image_token_limits_key_a_profile_only_when_set_and_are_checked() -> None:
    base = BuildOptions()
    assert not {"max_image_tokens", "max_image_tokens_per_image"} & base.to_dict().keys()
    limited = BuildOptions(max_image_tokens=1152, max_image_tokens_per_image=576)
    assert limited.to_dict()["max_image_tokens"] == 1152 and limited.digest != base.digest
    assert "-img1152-imgp576-fp32-" in limited.name and BuildOptions.from_dict(limited.to_dict()) == limited
    assert BuildOptions(max_image_tokens=1152).digest != limited.digest
    assert ProfileRequest(max_image_tokens=64).max_image_tokens == 64
    for kwargs, message in (
        ({"max_image_tokens": 0}, "max_image_tokens: must be a positive integer"),
        ({"max_image_tokens": True}, "max_image_tokens: must be a positive integer"),
        ({"max_image_tokens_per_image": 5000},
         r"max_image_tokens_per_image: \(5000\) must not exceed max_input_len"),
        ({"max_image_tokens": 64, "max_image_tokens_per_image": 128},
         r"max_image_tokens_per_image: \(128\) must not exceed max_image_tokens \(64\)"),
    ):
        with pytest.raises(ConfigError, match=message):
            ProfileRequest(**kwargs)
        with pytest.raises(ConfigError, match=message):
            BuildOptions(**kwargs)
