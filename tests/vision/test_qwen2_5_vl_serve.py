"""A tiny Qwen2.5-VL served by a real ``cachesvc serve`` process: the official ``openai`` client
sends an ``image_url`` part as a ``data:`` URL and gets transformers' greedy answer (two choices of
it), with the prompt counted as transformers' processor counts it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import MODEL, ServerProcess, running_server
from tests.vision.conftest import random_image
from tests.vision.qwen_checkpoints import qwen_processor, write_tiny_qwen2_5_vl
from tests.vision.test_serve import png_url

N_TOKENS = 8
IMAGE = random_image(11, (52, 36))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl-serve"), seed=5)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(checkpoint, tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("log"),
                        "--max-input-len", "96", "--max-kv-cache-capacity", "160") as s:
        yield s


def _expected(checkpoint: Path, image: Image.Image, text: str) -> tuple[str, int]:
    """transformers' greedy answer (text as the server decodes it) and its prompt's token count."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = qwen_processor(checkpoint)
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}, {"type": "image"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    inputs = processor(images=[image], text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    visible = [int(t) for t in out[0, n:] if int(t) not in eos_ids]
    return str(load_tokenizer(checkpoint).decode(visible)), n


def test_one_image_gets_transformers_answer(server: ServerProcess, checkpoint: Path) -> None:
    expected, prompt_tokens = _expected(checkpoint, IMAGE, "What is this?")
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": png_url(IMAGE)}}]
    done = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=N_TOKENS, temperature=0, n=2)
    assert [c.message.content for c in done.choices] == [expected, expected]
    assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    with server.http() as h:  # /tokenize counts the image's tokens (its size sets them) as the turn runs them
        counted = h.post("/tokenize", json=body).json()
    assert counted["count"] == prompt_tokens, counted
    assert server.health()["capabilities"]["images"] is True


def test_the_same_image_twice_answers_alike_without_reusing_its_kv(server: ServerProcess,
                                                                   checkpoint: Path) -> None:
    """An M-RoPE prompt's positions follow its images' grids, and a restored context-reuse block
    does not keep them: such a request runs with cache_prompt off (no reuse, nothing left behind),
    and the same image and text sent again get transformers' answer again."""
    expected, _ = _expected(checkpoint, IMAGE, "Describe it briefly, please.")
    content = [{"type": "text", "text": "Describe it briefly, please."},
               {"type": "image_url", "image_url": {"url": png_url(IMAGE)}}]

    def ask() -> str | None:
        done = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            max_tokens=N_TOKENS, temperature=0)
        return done.choices[0].message.content

    before = server.health()["context_cache"]["tokens_reused"]
    assert [ask(), ask()] == [expected, expected]
    assert server.health()["context_cache"]["tokens_reused"] == before
