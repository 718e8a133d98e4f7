"""Registry references and tags: malformed input gets one clear line naming the problem."""

from __future__ import annotations

import pytest

from cachesvc.cache.registry import parse_ref
from cachesvc.cache.registry.artifact import readable_tag, safe_relpath
from cachesvc.cache.registry.reference import TAG_RE
from cachesvc.errors import ConfigError


def test_a_full_reference_parses() -> None:
    ref = parse_ref("oci://registry.example:5000/team/engines:abc-1")
    assert (ref.host, ref.repository, ref.tag) == ("registry.example:5000", "team/engines", "abc-1")
    assert str(ref) == "oci://registry.example:5000/team/engines:abc-1"
    assert str(ref.namespace) == "oci://registry.example:5000/team/engines"
    assert parse_ref("oci://[::1]:5000/ns").host == "[::1]:5000"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "got nothing"),
        ("https://host/ns", "must start with oci://"),
        ("oci://host", "names no namespace"),
        ("oci://host/", "names no namespace"),
        ("oci://ho_st/ns", "is not a host name"),
        ("oci://host:99999/ns", "is not a TCP port"),
        ("oci://host:port/ns", "is not a TCP port"),
        ("oci://host/Upper/Case", "not a valid OCI repository name"),
        ("oci://host/ns/../x", "not a valid OCI repository name"),
        ("oci://host/ns:bad/tag", "not a valid OCI repository name"),
        ("oci://host/ns:-tag", "is not a valid OCI tag"),
    ],
)
def test_malformed_references_get_one_clear_line(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_ref(text)
    message = str(info.value)
    assert message.startswith("registry: ") and says in message and "\n" not in message


def test_a_namespace_only_field_refuses_a_tag() -> None:
    with pytest.raises(ConfigError, match="not a tag"):
        parse_ref("oci://host/ns:t", allow_tag=False)


@pytest.mark.parametrize(
    "model",
    ["HuggingFaceTB/SmolLM2-135M-Instruct", "/srv/models/llama fp32/", "/x/SmolLM2.Q4_1.gguf", "..", "-x-"],
)
def test_readable_tags_fit_the_tag_grammar(model: str) -> None:
    tag = readable_tag(model, "i4096-b1-kv8192-none-onnxruntime-int4-0123456789ab" + "-x" * 60)
    assert TAG_RE.match(tag) and len(tag) <= 128
    assert readable_tag("org/SmolLM2-135M", "p-int4-abc").startswith("SmolLM2-135M-p-int4")


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a\\b", "manifest.json", ""]
)
def test_unsafe_layer_paths_are_refused(path: str) -> None:
    assert not safe_relpath(path)


def test_safe_layer_paths_pass() -> None:
    assert safe_relpath("model.onnx") and safe_relpath("tokenizer/vocab.json")


def test_the_registry_setting_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachesvc.settings.config import ServeConfig
    from cachesvc.settings.groups import REGISTRY_ENV

    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    assert ServeConfig().fleet.registry_settings is None
    monkeypatch.setenv(REGISTRY_ENV, "oci://127.0.0.1:5000/fleet/b")
    settings = ServeConfig().fleet.registry_settings
    assert settings is not None and settings.ref is not None and settings.ref.repository == "fleet/b"
    assert not settings.insecure and not settings.push
    flagged = ServeConfig.from_mapping(
        {"registry": "oci://h:1/x", "registry_insecure": True, "registry_push": True}
    )
    assert flagged.fleet.registry_settings == type(settings)(
        parse_ref("oci://h:1/x"), insecure=True, push=True
    )
    monkeypatch.setenv(REGISTRY_ENV, "oci://h/ns:tag")
    with pytest.raises(ConfigError, match="must name a namespace, not a tag"):
        ServeConfig()
