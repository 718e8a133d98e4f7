"""Image parts of a chat request: which parts are images, their placeholders in the prompt, and
their feature rows (decoded, preprocessed and encoded off the event loop).

An image reaches the model as the chat template's image placeholder (LLaVA: one ``<image>``
token), which is replaced here by the image's tokens (:attr:`PreparedImage.tokens`: LLaVA's
``tokens_per_image`` image tokens; a tiling family's tile markers around its rows); the prefill
replaces those positions' embeddings with the image's feature rows (:class:`ImageRows`). A request
with images never uses context reuse (its KV depends on the pixels, not only on the token ids)
and its KV is not kept for others: ``cache_prompt`` is off for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inference.image_decode import ImageInputError, decode_image
from inference.media import MediaPolicy, check_url, read_url
from inference.openai.errors import ContextLengthExceededError, InvalidRequestError
from inference.openai.protocol import ChatMessage
from inference.runtime.mrope import mrope_positions
from inference.runtime.protocol import ImageRows, PreparedImage, VisionModel

#: Image parts one request may carry (each is decoded and encoded before the request queues).
MAX_IMAGES_PER_REQUEST = 16


@dataclass(frozen=True)
class ImagePart:
    """One image part of a request: where it is (``param``) and its URL."""

    param: str
    url: str


def image_parts(messages: Sequence[ChatMessage]) -> list[ImagePart]:
    """The image parts of ``messages``, in prompt order."""
    out: list[ImagePart] = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            if part.image_url is None or not isinstance(part.image_url.url, str):
                raise InvalidRequestError(f"{where} has type 'image_url' but no image_url.url",
                                          param=f"{where}.image_url")
            out.append(ImagePart(param=f"{where}.image_url.url", url=part.image_url.url))
    return out


def refuse_text_only(messages: Sequence[ChatMessage], model: str) -> None:
    """400 naming the first image part, for a model without a vision side."""
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type == "image_url":
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}] is an image (image_url); model {model!r} takes text "
                        "only: send text parts ({'type': 'text', 'text': ...}) or use a vision-language "
                        "model",
                        param=f"messages[{i}].content[{j}].type")


def check_parts(parts: Sequence[ImagePart], policy: MediaPolicy) -> None:
    """Refuse, before any decoding (cheap: on the event loop), too many images, URLs this server
    does not read (:func:`inference.media.check_url`), and ``data:`` URLs whose header or size is
    wrong."""
    if len(parts) > MAX_IMAGES_PER_REQUEST:
        raise InvalidRequestError(f"the request has {len(parts)} images; at most {MAX_IMAGES_PER_REQUEST} "
                                  "are accepted", param=parts[MAX_IMAGES_PER_REQUEST].param)
    for part in parts:
        try:
            check_url(part.url, policy)
        except ImageInputError as exc:
            raise InvalidRequestError(f"{part.param} {exc}", param=part.param) from None


def expand_placeholders(ids: Sequence[int], vision: VisionModel, images: Sequence[Sequence[int]],
                        param: str = "messages") -> tuple[list[int], np.ndarray]:
    """The prompt with each image placeholder replaced by that image's tokens (``images``, in
    prompt order), and the positions of every image row (ascending): what :class:`ImageRows`
    needs besides the features."""
    placeholder, token = vision.placeholder_id, vision.image_token_id
    found = sum(1 for t in ids if t == placeholder)
    typed = placeholder != token and any(t == token for t in ids)
    if found != len(images) or typed:
        raise InvalidRequestError(
            f"the rendered prompt has {found} image placeholders for {len(images)} images: the model's chat "
            "template must place one per image part, and the text may not contain the image tokens "
            "themselves",
            param=param)
    out: list[int] = []
    positions: list[int] = []
    pending = iter(images)
    for t in ids:
        if t == placeholder:
            tokens = next(pending)
            positions.extend(len(out) + i for i, x in enumerate(tokens) if x == token)
            out.extend(tokens)
        else:
            out.append(t)
    return out, np.asarray(positions, dtype=np.int64)


def check_expanded_length(n_ids: int, images: Sequence[Sequence[int]], limit: int) -> None:
    """Refuse a prompt whose image tokens (``images``: each image's tokens) cannot fit the input limit."""
    total = n_ids + sum(len(tokens) - 1 for tokens in images)
    if total > limit:
        sizes = sorted({len(tokens) for tokens in images})
        each = f"{sizes[0]} tokens each" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} tokens each"
        raise ContextLengthExceededError(
            f"the prompt takes {total} tokens with its {len(images)} image(s) ({each}); this "
            f"model accepts at most {limit} input tokens: send fewer images or less text", param="messages")


def _prepare(vision: VisionModel, parts: Sequence[ImagePart], policy: MediaPolicy) -> list[PreparedImage]:
    out = []
    for part in parts:
        try:
            image = decode_image(read_url(part.url, policy))
            out.append(vision.prepare(image))
        except (ImageInputError, ValueError) as exc:
            raise InvalidRequestError(f"{part.param} {exc}", param=part.param) from None
    return out


async def prepare_images(vision: VisionModel, parts: Sequence[ImagePart],
                         policy: MediaPolicy) -> list[PreparedImage]:
    """Read (base64, a local file or a fetch), decode and preprocess the images in a worker
    thread; a part that is no usable image is a 400 naming it."""
    return await asyncio.to_thread(_prepare, vision, parts, policy)


def _features(vision: VisionModel, images: Sequence[PreparedImage]) -> np.ndarray:
    rows = vision.features(images)
    return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)


async def image_rows(vision: VisionModel, images: Sequence[PreparedImage],
                     positions: np.ndarray, prompt_length: int | None = None) -> ImageRows:
    """Encode the prepared images in a worker thread: their rows of the prompt (of
    ``prompt_length`` tokens), with the prompt's multimodal rotary positions where the images
    have grids (Qwen2.5-VL: :func:`inference.runtime.mrope.mrope_positions`)."""
    features = await asyncio.to_thread(_features, vision, images)
    grids = [im.grid for im in images]
    rope = None
    if images and prompt_length is not None and all(g is not None for g in grids):
        rope = mrope_positions(prompt_length, positions, [g for g in grids if g is not None])
    return ImageRows(positions=positions, features=np.ascontiguousarray(features, dtype=np.float32),
                     rope=rope)
