"""A tiny LLaVA served by a real ``cachesvc serve`` process: the official ``openai`` client sends
``image_url`` parts as ``data:`` URLs and gets transformers' greedy answer; bad images are 400s
naming the field."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image

from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import MODEL, ServerProcess, running_server
from tests.vision.checkpoints import write_tiny_llava
from tests.vision.conftest import random_image

N_TOKENS = 8
IMAGES = [random_image(11, (40, 36)), random_image(12, (30, 52))]


def png_url(image: Image.Image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llava(tmp_path_factory.mktemp("llava-serve"), seed=5)


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served directory of local media: IMAGES[0] as a file, a link pointing out of it."""
    root = tmp_path_factory.mktemp("media")
    IMAGES[0].save(root / "first.png")
    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    IMAGES[1].save(outside)
    (root / "escape.png").symlink_to(outside)
    return root


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A loopback HTTP server of IMAGES[0] (``/first.png``), a redirect to it, one off the
    allowed hosts, and a 404."""
    import http.server
    import threading

    png = io.BytesIO()
    IMAGES[0].save(png, format="PNG")
    body = png.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/first.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path.removeprefix("/to"))
                self.end_headers()
            elif self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://example.com/cat.png")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint: Path, media: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(checkpoint, tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("log"),
                        "--max-input-len", "96", "--max-kv-cache-capacity", "160",
                        "--allowed-local-media-path", str(media),
                        "--allowed-media-domains", "127.0.0.1") as s:
        yield s


def _expected(checkpoint: Path, images: Sequence[Image.Image], text: str) -> tuple[str, int]:
    """transformers' greedy answer (text as the server decodes it) and its prompt's token count."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = tf.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = tf.AutoProcessor.from_pretrained(checkpoint)
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}, *([{"type": "image"}] * len(images))]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    inputs = processor(images=list(images), text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    visible = [int(t) for t in out[0, n:] if int(t) not in eos_ids]
    return str(load_tokenizer(checkpoint).decode(visible)), n


def _ask(server: ServerProcess, text: str, urls: Sequence[str]) -> Any:
    content: list[Any] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=N_TOKENS, temperature=0)


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    error: dict[str, Any] = exc.response.json()["error"]
    return error


def test_one_image_gets_transformers_answer(server: ServerProcess, checkpoint: Path) -> None:
    expected, prompt_tokens = _expected(checkpoint, IMAGES[:1], "What is this?")
    done = _ask(server, "What is this?", [png_url(IMAGES[0])])
    assert done.choices[0].message.content == expected
    assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": png_url(IMAGES[0])}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    with server.http() as h:  # /tokenize counts the image tokens as the chat turn runs them
        counted = h.post("/tokenize", json=body).json()
    assert counted["count"] == prompt_tokens, counted


def test_two_images_in_either_order(server: ServerProcess, checkpoint: Path) -> None:
    """The same text with the images swapped: each answer is transformers' for its order (the
    second request never reuses the first one's KV, whose prompt ids are the same)."""
    forward = _ask(server, "Which differs?", [png_url(IMAGES[0]), png_url(IMAGES[1], "JPEG")])
    backward = _ask(server, "Which differs?", [png_url(IMAGES[1], "JPEG"), png_url(IMAGES[0])])
    jpeg = Image.open(io.BytesIO(base64.b64decode(png_url(IMAGES[1], "JPEG").split(",", 1)[1])))
    text = "Which differs?"
    assert forward.choices[0].message.content == _expected(checkpoint, [IMAGES[0], jpeg], text)[0]
    assert backward.choices[0].message.content == _expected(checkpoint, [jpeg, IMAGES[0]], text)[0]
    assert forward.choices[0].message.content != backward.choices[0].message.content


@pytest.mark.parametrize(("url", "message"), [
    ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image"),
    (png_url(random_image(3, (64, 64)))[:200], "not valid base64|truncated or corrupt"),
    ("https://example.com/cat.png", "not fetch from"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
])
def test_bad_images_are_400s_naming_the_field(server: ServerProcess, url: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server, "Hi", [png_url(IMAGES[0]), url])
    err = _error(info.value)
    assert err["param"] == "messages[0].content[2].image_url.url", err
    assert re.search(message, err["message"]), err


def test_a_local_file_and_a_fetched_url_answer_as_the_inline_image(
        server: ServerProcess, checkpoint: Path, media: Path, image_host: str) -> None:
    """file:// under --allowed-local-media-path and http:// of --allowed-media-domains (a redirect
    on the allowed host followed) give the data: URL's answer."""
    inline = _ask(server, "What is this?", [png_url(IMAGES[0])]).choices[0].message.content
    assert inline == _expected(checkpoint, IMAGES[:1], "What is this?")[0]
    for url in ((media / "first.png").as_uri(), f"{image_host}/first.png", f"{image_host}/to/first.png"):
        assert _ask(server, "What is this?", [url]).choices[0].message.content == inline, url


def test_media_urls_off_limits_are_400s_naming_the_field(
        server: ServerProcess, media: Path, image_host: str, tmp_path: Path) -> None:
    """A symlink out of the media directory, a file outside it, a missing file, a host not
    allowed (also as a redirect's target), a 404: one line each naming the part."""
    outside = tmp_path / "outside.png"
    IMAGES[0].save(outside)
    for url, message in (((media / "escape.png").as_uri(), "outside the allowed media directory"),
                         (outside.as_uri(), "outside the allowed media directory"),
                         ((media / "nope.png").as_uri(), "does not exist"),
                         ("http://localhost:1/cat.png", "host 'localhost'"),
                         (f"{image_host}/away", "host 'example.com'"),
                         (f"{image_host}/missing.png", "HTTP 404")):
        with pytest.raises(openai.BadRequestError) as info:
            _ask(server, "Hi", [png_url(IMAGES[0]), url])
        err = _error(info.value)
        assert err["param"] == "messages[0].content[2].image_url.url", (url, err)
        assert message in err["message"], (url, err)


def test_too_many_image_tokens_is_a_context_error(server: ServerProcess) -> None:
    """96 input tokens hold five 16-token images, not six."""
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server, "Hi", [png_url(IMAGES[0])] * 6)
    err = _error(info.value)
    assert err["param"] == "messages" and "6 image(s) (16 tokens each)" in err["message"], err


def _b64(image: Image.Image) -> str:
    return png_url(image).split(",", 1)[1]


def test_anthropic_image_blocks(server: ServerProcess, checkpoint: Path) -> None:
    expected, prompt_tokens = _expected(checkpoint, IMAGES[:1], "Describe.")
    image_block: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                     "data": _b64(IMAGES[0])}}
    done = server.anthropic_client().messages.create(
        model=MODEL, max_tokens=N_TOKENS, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe."}, image_block]}])
    assert done.content[0].type == "text" and done.content[0].text == expected
    # Anthropic's input_tokens leave out what was read from the cache (an earlier test sent this image).
    assert done.usage.input_tokens + (done.usage.cache_read_input_tokens or 0) == prompt_tokens
    turn: Any = [{"role": "user", "content": [{"type": "text", "text": "Describe."}, image_block]}]
    counted = server.anthropic_client().messages.count_tokens(model=MODEL, messages=turn)
    assert counted.input_tokens == prompt_tokens
    bad: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(b"GIF89a not really").decode()}}
    with pytest.raises(anthropic.BadRequestError) as info:
        server.anthropic_client().messages.create(
            model=MODEL, max_tokens=N_TOKENS, system="Be brief.",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Describe."}, bad]}])
    err = info.value.response.json()["error"]
    assert "messages[0].content[1].source.data" in err["message"] and "not an image" in err["message"], err


def test_responses_input_image(server: ServerProcess, checkpoint: Path) -> None:
    expected, _ = _expected(checkpoint, IMAGES[1:], "Describe.")
    content: Any = [{"type": "input_text", "text": "Describe."},
                    {"type": "input_image", "image_url": png_url(IMAGES[1]), "detail": "auto"}]
    done = server.client().responses.create(
        model=MODEL, max_output_tokens=N_TOKENS, temperature=0, input=[{"role": "user", "content": content}])
    assert done.output_text == expected
    content[1]["image_url"] = "data:image/png;base64,AAAA"
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(model=MODEL, max_output_tokens=N_TOKENS,
                                         input=[{"role": "user", "content": content}])
    err = _error(info.value)
    assert err["param"] == "input[0].content[1].image_url" and "not an image" in err["message"], err


def _cached(done: Any) -> int:
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    return int(done.usage.prompt_tokens_details.cached_tokens or 0)


def _image_start(server: ServerProcess, text: str, url: str) -> int:
    """Where the image's rows start in the prompt (/tokenize: the first of 16 equal ids)."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    with server.http() as h:
        ids = h.post("/tokenize", json=body).json()["tokens"]
    image = max(set(ids), key=ids.count)
    assert ids.count(image) == 16
    return int(ids.index(image))


def test_the_same_image_reuses_its_context_and_another_image_does_not(
        server: ServerProcess, checkpoint: Path) -> None:
    """Context reuse covers the image content (its digest keys the image rows): the same image and
    text twice reuse the whole prompt and give transformers' answer, with one encode (/health:
    the feature cache's counters and the tokens reused); the same text behind another image
    reuses at most the text before the image and gives transformers' answer for that image."""
    text = "Tell me everything you see here, in detail, and then some more words about it. " * 2
    image, other = random_image(31, (48, 40)), random_image(32, (40, 48))  # no other test sends them
    start = server.health()
    first, second = (_ask(server, text, [png_url(image)]) for _ in range(2))
    expected, prompt_tokens = _expected(checkpoint, [image], text)
    assert first.choices[0].message.content == second.choices[0].message.content == expected
    assert _cached(second) >= prompt_tokens - 1  # image rows included: all but at most the last token
    end = server.health()
    images = {k: end["image_cache"][k] - start["image_cache"][k] for k in ("lookups", "hits", "encodes")}
    assert images == {"lookups": 2, "hits": 1, "encodes": 1}, images
    reused = end["context_cache"]["tokens_reused"] - start["context_cache"]["tokens_reused"]
    assert reused == _cached(first) + _cached(second)
    assert end["image_cache"]["entries"] >= 1 and end["image_cache"]["bytes"] >= 16 * 64 * 4
    third = _ask(server, text, [png_url(other)])
    assert third.choices[0].message.content == _expected(checkpoint, [other], text)[0] != expected
    assert _cached(third) <= _image_start(server, text, png_url(other))
    with server.http() as h:
        metrics = h.get("/metrics").text
    encodes = re.search(r'^cachesvc_image_cache_encodes_total\{model="[^"]+"\} (\S+)$', metrics, re.M)
    assert encodes is not None and float(encodes.group(1)) == server.health()["image_cache"]["encodes"]


def test_models_and_health_say_the_model_takes_images(server: ServerProcess) -> None:
    card = server.client().models.retrieve(MODEL)
    assert card.model_extra is not None and card.model_extra["input_modalities"] == ["text", "image"]
    assert server.health()["capabilities"]["images"] is True
