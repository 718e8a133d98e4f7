"""The chat side of image parts, in process: which parts are images, what is refused before any
decoding (and with which ``param``), and the placeholder expansion."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from inference.images.media import MediaPolicy
from inference.openai.errors import ContextLengthExceededError, InvalidRequestError
from inference.openai.images import (
    MAX_IMAGES_PER_REQUEST,
    check_expanded_length,
    check_image_tokens,
    check_parts,
    expand_placeholders,
    image_parts,
    refuse_text_only,
)
from inference.openai.protocol import ChatMessage, ContentPart, ImageUrl
from inference.runtime.protocol import PreparedImage

URL = "data:image/png;base64,iVBORw0KGgo="


@dataclass
class _Vision:
    image_token_id: int = 9
    placeholder_id: int = 9
    tokens_per_image: int | None = 3
    max_image_tokens: int = 48
    max_image_tokens_per_image: int = 3
    whole_images: bool = False

    def prompt_text(self, text: str) -> str:
        return text

    def fixed_tokens(self) -> tuple[int, ...]:
        return (self.image_token_id,) * 3

    def prepare(self, image: Any) -> PreparedImage:
        raise AssertionError("not decoded here")

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        raise AssertionError("not encoded here")


def _messages(*urls: str) -> list[ChatMessage]:
    parts = [ContentPart(type="text", text="look"),
             *(ContentPart(type="image_url", image_url=ImageUrl(url=u)) for u in urls)]
    return [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content=parts)]


def test_image_parts_are_found_in_order_with_their_fields() -> None:
    parts = image_parts(_messages(URL, URL + "A"))
    assert [(p.param, p.url) for p in parts] == [("messages[1].content[1].image_url.url", URL),
                                                 ("messages[1].content[2].image_url.url", URL + "A")]
    missing = [ChatMessage(role="user", content=[ContentPart(type="image_url")])]
    with pytest.raises(InvalidRequestError) as info:
        image_parts(missing)
    assert info.value.param == "messages[0].content[0].image_url"


def test_a_text_only_model_names_the_image_part() -> None:
    with pytest.raises(InvalidRequestError) as info:
        refuse_text_only(_messages(URL), "tiny")
    assert info.value.param == "messages[1].content[1].type"
    assert "is an image (image_url); model 'tiny' takes text only" in info.value.message


@pytest.mark.parametrize(("url", "message"), [
    ("http://127.0.0.1/cat.png", "fetches none .*--allowed-media-domains"),
    ("file:///etc/passwd", "reads no local files .*--allowed-local-media-path"),
    ("cat.png", "is not a data: URL"),
])
def test_urls_refused_before_decoding(url: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        check_parts(image_parts(_messages(URL, url)), MediaPolicy())
    assert info.value.param == "messages[1].content[2].image_url.url"


def test_too_many_images() -> None:
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_IMAGES_PER_REQUEST}") as info:
        check_parts(image_parts(_messages(*[URL] * (MAX_IMAGES_PER_REQUEST + 1))), MediaPolicy())
    assert info.value.param == f"messages[1].content[{MAX_IMAGES_PER_REQUEST + 1}].image_url.url"


def test_placeholders_expand_to_each_images_tokens() -> None:
    three = _Vision().fixed_tokens()
    ids, rows = expand_placeholders([1, 9, 2, 9, 3], _Vision(), [three, three])
    assert ids == [1, 9, 9, 9, 2, 9, 9, 9, 3]
    assert rows.tolist() == [1, 2, 3, 5, 6, 7]
    for found, images in (([1, 9, 2], 2), ([1, 9, 9], 1), ([1, 9], 0)):
        expected = f"has {found.count(9)} image placeholders for {images}"
        with pytest.raises(InvalidRequestError, match=expected):
            expand_placeholders(found, _Vision(), [three] * images)


def test_placeholders_expand_to_tokens_that_differ_per_image() -> None:
    """A tiling family: the template writes a placeholder (8) that becomes markers (5, 6) around
    each image's rows (9), as many as that image needs; the rows are only the image tokens."""
    tiling = _Vision(placeholder_id=8, tokens_per_image=None)
    ids, rows = expand_placeholders([1, 8, 2, 8], tiling, [(5, 9, 9, 6), (5, 9, 6)])
    assert ids == [1, 5, 9, 9, 6, 2, 5, 9, 6]
    assert rows.tolist() == [2, 3, 7]
    with pytest.raises(InvalidRequestError, match="may not contain the image tokens"):
        expand_placeholders([1, 8, 9], tiling, [(5, 9, 6)])


def test_a_placeholder_that_is_the_image_token_expands_once() -> None:
    """Idefics3 / SmolVLM: the template's ``<image>`` (9) is the image token itself, and each
    image's tokens hold markers (5, 6, 7) and many 9s: each placeholder of the rendered prompt
    is replaced once (the 9s it brings are rows, not placeholders); a 9 the text adds is one
    placeholder too many."""
    tiling = _Vision(tokens_per_image=None)
    first, second = (5, 7, 9, 9, 5, 6, 9, 9, 5), (5, 6, 9, 9, 5)
    ids, rows = expand_placeholders([1, 9, 2, 9, 3], tiling, [first, second])
    assert ids == [1, *first, 2, *second, 3]
    assert rows.tolist() == [3, 4, 7, 8, 13, 14]
    with pytest.raises(InvalidRequestError, match="has 3 image placeholders for 2 images"):
        expand_placeholders([1, 9, 2, 9, 9], tiling, [first, second])


def test_expanded_length_is_checked_before_decoding() -> None:
    three = (9, 9, 9)
    check_expanded_length(10, [three] * 2, 14)
    with pytest.raises(ContextLengthExceededError, match=r"takes 15 tokens with its 3 image.*3 tokens each"):
        check_expanded_length(9, [three] * 3, 14)
    with pytest.raises(ContextLengthExceededError, match=r"15 tokens with its 2 image.*3-5 tokens each"):
        check_expanded_length(9, [three, (9,) * 5], 14)


def test_image_token_limits_name_the_first_part_over_them() -> None:
    """The bundle's limits (engine.json vision: max_image_tokens, max_image_tokens_per_image) are
    checked before any image is read; each 400 names the part and the flag to rebuild with."""
    parts = image_parts(_messages(URL, URL, URL))
    three = [(9, 9, 9)] * 3
    check_image_tokens(parts, three, _Vision(max_image_tokens=9), 12, 100)
    with pytest.raises(InvalidRequestError, match="up to this one take 9 image tokens") as info:
        check_image_tokens(parts, three, _Vision(max_image_tokens=8), 12, 100)
    assert info.value.param == "messages[1].content[3].image_url.url"
    assert "at most 8 image tokens a request" in info.value.message
    assert "--max-image-tokens" in info.value.message
    over = "takes 3 image tokens; this model accepts at most 2 per image"
    with pytest.raises(InvalidRequestError, match=over) as info:
        check_image_tokens(parts, three, _Vision(max_image_tokens_per_image=2), 12, 100)
    assert info.value.param == "messages[1].content[1].image_url.url"
    assert "--max-image-tokens-per-image" in info.value.message
    with pytest.raises(ContextLengthExceededError):  # within the image limits, over the input limit
        check_image_tokens(parts, three, _Vision(), 12, 14)
    # Markers around an image's rows count toward the prompt, not toward the image tokens.
    marked = [(5, 9, 9, 6)] * 3
    check_image_tokens(parts, marked, _Vision(max_image_tokens=6, max_image_tokens_per_image=2), 12, 100)
