"""A tiny Gemma 3 served by a real ``cachesvc serve`` process whose prefill chunks (8 tokens) are
half an image: the official ``openai`` client sends an image and gets transformers' greedy
answer, and ``/tokenize`` counts the processor's tokens (newlines and image markers included)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import MODEL, ServerProcess, running_server
from tests.vision.conftest import random_image
from tests.vision.gemma3_checkpoints import write_tiny_gemma3

N_TOKENS = 8
IMAGE = random_image(11, (40, 36))
TEXT = "What is this?"


def _png_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-serve"), seed=1)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(checkpoint, tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("log"),
                        "--max-input-len", "96", "--max-kv-cache-capacity", "160",
                        env={"CACHESVC_PREFILL_CHUNK": "8"}) as s:
        yield s


def _expected(checkpoint: Path) -> tuple[str, int]:
    """transformers' greedy answer (text as the server decodes it) and its prompt's token count."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = tf.AutoProcessor.from_pretrained(checkpoint)
    parts: list[dict[str, Any]] = [{"type": "text", "text": TEXT}, {"type": "image"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    inputs = processor(images=[IMAGE], text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    visible = [int(t) for t in out[0, n:] if int(t) not in eos_ids]
    return str(load_tokenizer(checkpoint).decode(visible)), n


def test_one_image_gets_transformers_answer(server: ServerProcess, checkpoint: Path) -> None:
    expected, prompt_tokens = _expected(checkpoint)
    content: list[Any] = [{"type": "text", "text": TEXT},
                          {"type": "image_url", "image_url": {"url": _png_url(IMAGE)}}]
    done = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=N_TOKENS, temperature=0)
    assert expected and done.choices[0].message.content == expected
    assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    with server.http() as h:  # /tokenize counts the image's tokens as the chat turn runs them
        counted = h.post("/tokenize", json=body).json()
    assert counted["count"] == prompt_tokens, counted
