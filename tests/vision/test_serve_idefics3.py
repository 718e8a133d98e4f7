"""A tiny SmolVLM (the hub's layout: ``preprocessor_config.json``, ``chat_template.json``) served
by a real ``cachesvc serve`` process: the official ``openai`` client sends images that are split
into tiles and gets transformers' greedy answer, with transformers' prompt token count; a
text-only request to it; too many image tokens as a context error."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import MODEL, ServerProcess, running_server
from tests.vision.checkpoints import write_tiny_idefics3
from tests.vision.conftest import random_image, smolvlm_inputs
from tests.vision.test_serve import png_url

N_TOKENS = 8
#: 3x3 tiles + global and 2x3 tiles + global at the checkpoint's 96 pixels.
IMAGES = [random_image(21, (40, 50)), random_image(22, (70, 30))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_idefics3(tmp_path_factory.mktemp("smolvlm-serve"), family="smolvlm", seed=6)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(checkpoint, tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("log"),
                        "--max-input-len", "192", "--max-kv-cache-capacity", "256") as s:
        yield s


def _expected(checkpoint: Path, images: Sequence[Image.Image], text: str) -> tuple[str, int]:
    """transformers' greedy answer (text as the server decodes it) and its prompt's token count."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = tf.SmolVLMForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}, *([{"type": "image"}] * len(images))]
    template = json.loads((checkpoint / "chat_template.json").read_text())["chat_template"]
    prompt = tf.AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": "user", "content": parts}], chat_template=template, add_generation_prompt=True,
        tokenize=False)
    raw = smolvlm_inputs(checkpoint, prompt, list(images))
    inputs = {"input_ids": torch.from_numpy(raw["input_ids"])}
    if images:
        inputs["pixel_values"] = torch.from_numpy(raw["pixel_values"])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    visible = [int(t) for t in out[0, n:] if int(t) not in eos_ids]
    return str(load_tokenizer(checkpoint).decode(visible)), n


def _ask(server: ServerProcess, text: str, urls: Sequence[str]) -> Any:
    content: list[Any] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=N_TOKENS, temperature=0)


def test_one_image_gets_transformers_answer(server: ServerProcess, checkpoint: Path) -> None:
    expected, prompt_tokens = _expected(checkpoint, IMAGES[:1], "What is this?")
    done = _ask(server, "What is this?", [png_url(IMAGES[0])])
    assert done.choices[0].message.content == expected
    assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": png_url(IMAGES[0])}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    with server.http() as h:  # /tokenize decodes the image to count its tiles' tokens
        counted = h.post("/tokenize", json=body).json()
    assert counted["count"] == prompt_tokens, counted


def test_two_images_of_different_tilings_in_either_order(server: ServerProcess, checkpoint: Path) -> None:
    text = "Which differs?"
    forward = _ask(server, text, [png_url(IMAGES[0]), png_url(IMAGES[1])])
    backward = _ask(server, text, [png_url(IMAGES[1]), png_url(IMAGES[0])])
    want_forward, n_forward = _expected(checkpoint, IMAGES, text)
    want_backward, n_backward = _expected(checkpoint, IMAGES[::-1], text)
    assert forward.choices[0].message.content == want_forward
    assert backward.choices[0].message.content == want_backward
    assert forward.usage is not None and forward.usage.prompt_tokens == n_forward == n_backward
    assert want_forward != want_backward


def test_a_text_only_request(server: ServerProcess, checkpoint: Path) -> None:
    """No image parts: nothing to expand, the text model's answer (the family's images take no
    fixed number of tokens, which a text-only prompt must not ask for)."""
    expected, prompt_tokens = _expected(checkpoint, [], "Say something.")
    done = _ask(server, "Say something.", [])
    assert done.choices[0].message.content == expected
    assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens


def test_too_many_image_tokens_is_a_context_error(server: ServerProcess) -> None:
    """192 input tokens hold two 3x3-tiled images (65 tokens each: 9 tiles of 4 image tokens and 2
    markers, the rows' newlines (the demo tokenizer writes \\n\\n as two) and the global image's 7), not
    three."""
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server, "Hi", [png_url(IMAGES[0])] * 3)
    err = info.value.response.json()["error"]
    assert err["param"] == "messages" and "3 image(s) (65 tokens each)" in err["message"], err
