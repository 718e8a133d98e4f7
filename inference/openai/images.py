"""Image parts of a chat request: which parts are images, their placeholders in the prompt, the
bundle's image-token limits, and the images as the scheduler takes them (read, hashed, decoded
and preprocessed off the event loop).

An image reaches the model as the chat template's image placeholder (LLaVA: one ``<image>``
token), which is expanded here to the vision model's ``tokens_per_image`` copies; the prefill
replaces those positions' embeddings with the image's feature rows. Each image is known by the
digest of its bytes (:mod:`inference.image_features`): an image the model's feature cache holds
is neither decoded nor encoded again, and context reuse keys its rows by that digest. The
encoding itself waits for the scheduler, which knows which rows the reused prefix covers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inference.build_profile import MAX_IMAGES_PER_REQUEST
from inference.image_decode import ImageInputError, decode_image
from inference.image_features import ImageFeatureCache, PromptImage, PromptImages, image_digest
from inference.media import MediaPolicy, check_url, read_url
from inference.openai.errors import ContextLengthExceededError, InvalidRequestError
from inference.openai.protocol import ChatMessage
from inference.runtime.protocol import VisionModel

__all__ = ["MAX_IMAGES_PER_REQUEST", "ImagePart", "check_expanded_length", "check_image_tokens",
           "check_parts", "expand_placeholders", "image_parts", "prompt_images", "refuse_text_only"]


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


def expand_placeholders(ids: Sequence[int], vision: VisionModel, n_images: int,
                        param: str = "messages") -> tuple[list[int], np.ndarray]:
    """The prompt with each image token repeated ``tokens_per_image`` times, and the positions of
    every image row (ascending): where the images' features go (:class:`PromptImages`)."""
    token, per = vision.image_token_id, vision.tokens_per_image
    found = sum(1 for t in ids if t == token)
    if found != n_images:
        raise InvalidRequestError(
            f"the rendered prompt has {found} image placeholders for {n_images} images: the model's chat "
            "template must place one per image part, and the text may not contain the image token itself",
            param=param)
    out: list[int] = []
    positions: list[int] = []
    for t in ids:
        if t == token:
            positions.extend(range(len(out), len(out) + per))
            out.extend([token] * per)
        else:
            out.append(t)
    return out, np.asarray(positions, dtype=np.int64)


def check_expanded_length(n_ids: int, n_images: int, per_image: int, limit: int) -> None:
    """Refuse, before any image is decoded, a prompt whose image tokens cannot fit the input limit."""
    total = n_ids + n_images * (per_image - 1)
    if total > limit:
        raise ContextLengthExceededError(
            f"the prompt takes {total} tokens with its {n_images} image(s) ({per_image} tokens each); this "
            f"model accepts at most {limit} input tokens: send fewer images or less text", param="messages")


def check_image_tokens(parts: Sequence[ImagePart], vision: VisionModel, n_ids: int, limit: int) -> None:
    """Refuse, before any image is read, images over the bundle's image-token limits (one image:
    ``max_image_tokens_per_image``; all of them: ``max_image_tokens``), each a 400 naming the
    first image part over it, then a prompt whose image tokens and text exceed ``limit``."""
    per, total = vision.max_image_tokens_per_image, vision.max_image_tokens
    tokens = vision.tokens_per_image
    running = 0
    for part in parts:
        if tokens > per:
            raise InvalidRequestError(
                f"{part.param} takes {tokens} image tokens; this model accepts at most {per} per image "
                "(its bundle's max_image_tokens_per_image): send a smaller image, or rebuild the model "
                "with a larger --max-image-tokens-per-image", param=part.param)
        running += tokens
        if running > total:
            raise InvalidRequestError(
                f"{part.param}: the images up to this one take {running} image tokens ({tokens} each); "
                f"this model accepts at most {total} image tokens a request (its bundle's "
                "max_image_tokens): send fewer images, or rebuild the model with a larger "
                "--max-image-tokens", param=part.param)
    check_expanded_length(n_ids, len(parts), tokens, limit)


def _prompt_images(vision: VisionModel, parts: Sequence[ImagePart], positions: np.ndarray,
                   policy: MediaPolicy, cache: ImageFeatureCache | None) -> list[PromptImage]:
    """Each part read and hashed; its features from ``cache``, else decoded and preprocessed
    (what is wrong with an image is a 400 naming its part, here, before the request queues)."""
    per = vision.tokens_per_image
    out: list[PromptImage] = []
    seen: dict[bytes, PromptImage] = {}  # the same image twice in one request: read once
    for k, part in enumerate(parts):
        rows = positions[k * per:(k + 1) * per]
        try:
            data = read_url(part.url, policy)
            digest = image_digest(data)
            if digest in seen:
                features, pixels = seen[digest].features, seen[digest].pixels
            else:
                features = cache.get(digest) if cache is not None else None
                pixels = None if features is not None else vision.pixels(decode_image(data))
        except ImageInputError as exc:
            raise InvalidRequestError(f"{part.param} {exc}", param=part.param) from None
        image = PromptImage(digest=digest, positions=rows, param=part.param, pixels=pixels, features=features)
        seen.setdefault(digest, image)
        out.append(image)
    return out


async def prompt_images(vision: VisionModel, parts: Sequence[ImagePart], positions: np.ndarray,
                        policy: MediaPolicy, cache: ImageFeatureCache | None = None) -> PromptImages:
    """Read (base64, a local file or a fetch), hash, decode and preprocess the images in a worker
    thread (the model's feature ``cache`` first): the prompt's images for the scheduler, which
    has the features it needs encoded."""
    images = await asyncio.to_thread(_prompt_images, vision, parts, positions, policy, cache)
    return PromptImages(images, vision, cache)
