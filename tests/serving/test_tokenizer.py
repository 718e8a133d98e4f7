"""Tokenizer loading and chat templates rendered in the jinja2 sandbox."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inference.serving.tokenizer import ChatTemplateError, Tokenizer, TokenizerError, load_tokenizer


def _copy(demo_dir: Path, dst: Path, **config_changes: object) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo_dir / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_demo_template_renders_chatml_with_tools(tokenizer: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert "get_weather" in text and "Weather in Paris?" in text
    no_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_eos_ids_and_hidden_tokens(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end in tokenizer.eos_token_ids
    think = tokenizer.token_to_id("<think>")
    assert think is not None and think not in tokenizer.hidden_token_ids


def test_sandbox_blocks_unsafe_attribute_access(demo_dir: Path, tmp_path: Path) -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = load_tokenizer(_copy(demo_dir, tmp_path / "t", chat_template=evil))
    with pytest.raises(ChatTemplateError, match=r"unsafe|access"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    mutate = "{% set _ = messages.append({'role': 'x'}) %}ok"
    tok2 = load_tokenizer(_copy(demo_dir, tmp_path / "t2", chat_template=mutate))
    with pytest.raises(ChatTemplateError):
        tok2.apply_chat_template([{"role": "user", "content": "hi"}])


def test_transformers_helpers_available(demo_dir: Path, tmp_path: Path) -> None:
    tpl = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ messages[0].content | tojson }}|{{ bos_token or '' }}{{ eos_token }}"
    )
    tok = load_tokenizer(_copy(demo_dir, tmp_path / "t", chat_template=tpl))
    assert tok.apply_chat_template([{"role": "user", "content": 'é"x'}]) == '"é\\"x"|<|im_end|>'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "s"}])


def test_named_templates_and_jinja_file(demo_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    tok = load_tokenizer(_copy(demo_dir, tmp_path / "n", chat_template=named))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T"
    d = _copy(demo_dir, tmp_path / "j", chat_template=None)
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_tokenizer(d).apply_chat_template(msgs) == "J1"


def test_missing_template_and_bad_files(demo_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(_copy(demo_dir, tmp_path / "t", chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    bad = _copy(demo_dir, tmp_path / "bad", chat_template=42)
    with pytest.raises(TokenizerError, match="chat_template"):
        load_tokenizer(bad)
