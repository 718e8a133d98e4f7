"""Bad image input through a real ``cachesvc serve`` of a tiny LLaVA built with
``--max-image-tokens 32`` (two images a request), with the official ``openai`` and ``anthropic``
clients: what is refused is a 400 naming the image's field and what to send instead (never a 500),
and what is converted (16-bit, CMYK, palette with transparency) answers as the image it becomes."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from tests.service.conftest import MODEL, ServerProcess, running_server
from tests.vision.checkpoints import write_tiny_llava
from tests.vision.conftest import random_image

N_TOKENS = 6
OPENAI_FIELD = "messages[0].content[1].image_url.url"
ANTHROPIC_FIELD = "messages[0].content[1].source.data"


def encoded(image: Image.Image, fmt: str = "PNG", **save: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def url_of(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _animated(fmt: str) -> bytes:
    frames = [random_image(i, (16, 16)) for i in range(3)]
    return encoded(frames[0], fmt, save_all=True, append_images=frames[1:])


def _corrupt_png() -> bytes:
    data = bytearray(encoded(random_image(4, (64, 64))))
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


#: (case, bytes, MIME type, what the message says)
REFUSED: list[tuple[str, bytes, str, str]] = [
    ("not-an-image", b"%PDF-1.4 not a picture at all", "image/png", "is not an image in a supported format"),
    ("truncated", encoded(random_image(3, (64, 64)))[:300], "image/png", "truncated or corrupt"),
    ("corrupt", _corrupt_png(), "image/png", "truncated or corrupt"),
    ("tiff", encoded(random_image(5, (8, 8)), "TIFF"), "image/tiff", "supported format .*PNG, JPEG, WEBP"),
    ("bomb", encoded(Image.new("1", (9000, 4000))), "image/png",
     "9000x4000 pixels; one image may have at most"),
    ("animated-gif", _animated("GIF"), "image/gif", "is animated; send one frame"),
    ("animated-webp", _animated("WEBP"), "image/webp", "is animated; send one frame"),
    ("animated-png", _animated("PNG"), "image/png", "is animated; send one frame"),
    ("strip", encoded(Image.new("RGB", (1, 40000))), "image/png",
     "1x40000 pixels; resized .* less extreme aspect"),
]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    with (root / "huge.png").open("wb") as fh:  # over the 20 MiB cap by its size (sparse: no disk)
        fh.truncate(21 * 1024 * 1024)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, media: Path) -> Iterator[ServerProcess]:
    checkpoint = write_tiny_llava(tmp_path_factory.mktemp("llava-bad"), seed=9)
    with running_server(checkpoint, tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("log"),
                        "--max-input-len", "96", "--max-kv-cache-capacity", "160",
                        "--max-image-tokens", "32", "--allowed-local-media-path", str(media)) as s:
        yield s


def _ask(server: ServerProcess, *urls: str) -> Any:
    content: list[Any] = [{"type": "text", "text": "What is it?"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=N_TOKENS, temperature=0)


def _openai_error(server: ServerProcess, *urls: str) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server, *urls)
    error: dict[str, Any] = info.value.response.json()["error"]
    return error


def _anthropic_error(server: ServerProcess, *blocks: Any) -> str:
    with pytest.raises(anthropic.BadRequestError) as info:
        server.anthropic_client().messages.create(
            model=MODEL, max_tokens=N_TOKENS,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, *blocks]}])
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    message: str = body["error"]["message"]
    return message


def _block(data: bytes, mime: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": mime,
                                        "data": base64.b64encode(data).decode()}}


@pytest.mark.parametrize(("case", "data", "mime", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_images_are_400s_naming_the_field(server: ServerProcess, case: str, data: bytes, mime: str,
                                                  message: str) -> None:
    error = _openai_error(server, url_of(data, mime))
    assert error["param"] == OPENAI_FIELD and error["type"] == "invalid_request_error", error
    assert re.search(message, error["message"]), error
    text = _anthropic_error(server, _block(data, mime))
    assert ANTHROPIC_FIELD in text and re.search(message, text), text


def test_the_byte_cap_applies_before_reading(server: ServerProcess, media: Path) -> None:
    error = _openai_error(server, (media / "huge.png").as_uri())
    assert error["param"] == OPENAI_FIELD and "images are accepted up to 20971520 bytes" in error["message"]
    source = {"type": "image", "source": {"type": "url", "url": (media / "huge.png").as_uri()}}
    assert "messages[0].content[1].source.url" in _anthropic_error(server, source)


def test_image_tokens_over_the_profile_are_a_400_naming_the_part(server: ServerProcess) -> None:
    """The bundle takes 32 image tokens a request (16 an image): two images pass, three do not."""
    png = url_of(encoded(random_image(6, (20, 20))))
    assert _ask(server, png, png).choices[0].finish_reason in ("length", "stop")
    error = _openai_error(server, png, png, png)
    assert error["param"] == "messages[0].content[3].image_url.url", error
    over = "take 48 image tokens (16 each); this model accepts at most 32 image tokens a request"
    assert over in error["message"]
    assert "--max-image-tokens" in error["message"]
    block = _block(encoded(random_image(6, (20, 20))), "image/png")
    text = _anthropic_error(server, block, block, block)
    assert "messages[0].content[3].source.data" in text and "at most 32 image tokens" in text, text


def test_too_many_images_are_refused_before_any_is_read(server: ServerProcess) -> None:
    png = url_of(encoded(random_image(7, (8, 8))))
    error = _openai_error(server, *[png] * 17)
    assert error["param"] == "messages[0].content[17].image_url.url" and "at most 16" in error["message"]


def _same_answer(server: ServerProcess, sent: bytes, mime: str, seen_as: Image.Image) -> None:
    """``sent`` answers as the RGB image ``seen_as`` sent as a PNG (what it is converted to)."""
    got = _ask(server, url_of(sent, mime)).choices[0].message.content
    assert got == _ask(server, url_of(encoded(seen_as))).choices[0].message.content
    other = _ask(server, url_of(encoded(random_image(99, seen_as.size)))).choices[0].message.content
    assert got != other  # the image decides this model's answer: equal answers mean equal pixels


def test_sixteen_bit_greyscale_answers_as_its_high_byte(server: ServerProcess) -> None:
    values = np.random.default_rng(8).integers(0, 65536, (36, 40)).astype(np.uint16)
    high = Image.fromarray((values >> 8).astype(np.uint8), "L").convert("RGB")
    _same_answer(server, encoded(Image.fromarray(values)), "image/png", high)


def test_cmyk_jpeg_answers_as_its_rgb_conversion(server: ServerProcess) -> None:
    jpeg = encoded(random_image(10, (40, 36), "CMYK"), "JPEG")
    decoded = Image.open(io.BytesIO(jpeg))
    assert decoded.mode == "CMYK"
    _same_answer(server, jpeg, "image/jpeg", decoded.convert("RGB"))


def test_palette_with_transparency_answers_as_composited_onto_white(server: ServerProcess) -> None:
    palette = random_image(11, (40, 36), "P")
    png = encoded(palette, transparency=int(np.asarray(palette)[0, 0]))
    decoded = Image.open(io.BytesIO(png)).convert("RGBA")
    background = Image.new("RGBA", decoded.size, (255, 255, 255, 255))
    white = Image.alpha_composite(background, decoded).convert("RGB")
    assert np.asarray(white).tolist() != np.asarray(palette.convert("RGB")).tolist()  # transparency mattered
    _same_answer(server, png, "image/png", white)
