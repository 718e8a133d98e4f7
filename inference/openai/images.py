"""Image parts of a chat request: which parts are images, their placeholders in the prompt, the
bundle's image-token limits, and the images as the scheduler takes them (read, hashed, decoded
and preprocessed off the event loop).

An image reaches the model as the chat template's image placeholder (LLaVA: one ``<image>``
token), which is replaced here by the image's tokens (:attr:`PreparedImage.tokens`: LLaVA's
``tokens_per_image`` image tokens; a tiling family's tile markers around its rows, as many as the
image's size asks); the prefill replaces the image tokens' embeddings with the image's feature
rows. Each image is known by the
digest of its bytes (:mod:`inference.images.features`): an image the model's feature cache holds
is neither decoded nor encoded again, and context reuse keys its rows by that digest. The
encoding itself waits for the scheduler, which knows which rows the reused prefix covers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inference.build_profile import MAX_IMAGES_PER_REQUEST
from inference.images.decode import ImageInputError, decode_image
from inference.images.features import ImageFeatureCache, PromptImage, PromptImages, image_digest
from inference.images.media import MediaPolicy, check_url, read_url
from inference.openai.errors import ContextLengthExceededError, InvalidRequestError
from inference.openai.protocol import ChatMessage
from inference.runtime.mrope import mrope_positions
from inference.runtime.protocol import VisionModel

__all__ = ["MAX_IMAGES_PER_REQUEST", "ImagePart", "check_expanded_length", "check_image_tokens",
           "check_parts", "expand_placeholders", "image_parts", "load_images", "prompt_images",
           "refuse_text_only"]


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
    does not read (:func:`inference.images.media.check_url`), and ``data:`` URLs whose header or size is
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
    prompt order), and the positions of every image row (ascending): where the images' features
    go (:class:`PromptImages`)."""
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


def _rows(vision: VisionModel, tokens: Sequence[int]) -> int:
    return sum(1 for t in tokens if t == vision.image_token_id)


def check_image_tokens(parts: Sequence[ImagePart], images: Sequence[Sequence[int]], vision: VisionModel,
                       n_ids: int, limit: int) -> None:
    """Refuse images over the bundle's image-token limits (one image: ``max_image_tokens_per_image``
    image tokens; all of them: ``max_image_tokens``), each a 400 naming the first image part over
    it, then a prompt whose image tokens and text exceed ``limit``. ``images``: each part's tokens
    (known before any image is read where the family's images all take the same)."""
    per, total = vision.max_image_tokens_per_image, vision.max_image_tokens
    running = 0
    for part, image in zip(parts, images, strict=True):
        tokens = _rows(vision, image)
        if tokens > per:
            raise InvalidRequestError(
                f"{part.param} takes {tokens} image tokens; this model accepts at most {per} per image "
                "(its bundle's max_image_tokens_per_image): send a smaller image, or rebuild the model "
                "with a larger --max-image-tokens-per-image", param=part.param)
        running += tokens
        if running > total:
            raise InvalidRequestError(
                f"{part.param}: the images up to this one take {running} image tokens ({tokens} "
                f"{'each' if vision.tokens_per_image is not None else 'this one'}); "
                f"this model accepts at most {total} image tokens a request (its bundle's "
                "max_image_tokens): send fewer images, or rebuild the model with a larger "
                "--max-image-tokens", param=part.param)
    check_expanded_length(n_ids, images, limit)


def _load(vision: VisionModel, parts: Sequence[ImagePart], policy: MediaPolicy,
          cache: ImageFeatureCache | None, decode_all: bool) -> list[PromptImage]:
    """Each part read and hashed; its features from ``cache``, else (or with ``decode_all``)
    decoded and prepared (what is wrong with an image is a 400 naming its part, here, before the
    request queues)."""
    out: list[PromptImage] = []
    seen: dict[bytes, PromptImage] = {}  # the same image twice in one request: read once
    for part in parts:
        try:
            data = read_url(part.url, policy)
            digest = image_digest(data)
            first = seen.get(digest)
            if first is not None:
                features, prepared = first.features, first.prepared
            else:
                features = cache.get(digest) if cache is not None else None
                prepared = (vision.prepare(decode_image(data)) if features is None or decode_all
                            else None)
        except (ImageInputError, ValueError) as exc:
            raise InvalidRequestError(f"{part.param} {exc}", param=part.param) from None
        tokens = prepared.tokens if prepared is not None else vision.fixed_tokens()
        grid = prepared.grid if prepared is not None else first.grid if first is not None else None
        image = PromptImage(digest=digest, tokens=tokens, param=part.param, prepared=prepared,
                            features=features, grid=grid)
        seen.setdefault(digest, image)
        out.append(image)
    return out


async def load_images(vision: VisionModel, parts: Sequence[ImagePart],
                      policy: MediaPolicy) -> list[PromptImage]:
    """Read, hash, decode and prepare every image in a worker thread, for a family whose images'
    tokens follow their size (the prompt cannot be counted without them)."""
    return await asyncio.to_thread(_load, vision, parts, policy, None, True)


async def prompt_images(vision: VisionModel, parts: Sequence[ImagePart], positions: np.ndarray,
                        policy: MediaPolicy, cache: ImageFeatureCache | None = None,
                        loaded: Sequence[PromptImage] | None = None,
                        prompt_length: int | None = None) -> PromptImages:
    """The prompt's images for the scheduler, which has the features it needs encoded: read
    (base64, a local file or a fetch), hashed, looked up in the model's feature ``cache``, decoded
    and preprocessed where missing, in a worker thread (``loaded``: images :func:`load_images`
    read already; only the cache is asked about them). ``positions``: every image row of the
    prompt (of ``prompt_length`` tokens), ascending (:func:`expand_placeholders`); where the
    images have grids (Qwen2.5-VL), the prompt's multimodal rotary positions come with them
    (:func:`inference.runtime.mrope.mrope_positions`)."""
    if loaded is None:
        images = await asyncio.to_thread(_load, vision, parts, policy, cache, False)
    else:
        images = list(loaded)
        if cache is not None:
            for image in images:
                if image.features is None:
                    image.features = cache.get(image.digest)
    at = 0
    for image in images:
        n = _rows(vision, image.tokens)
        image.positions = positions[at:at + n]
        at += n
    if at != len(positions):
        raise ValueError(f"{len(positions)} image rows in the prompt for images of {at} rows")
    grids = [image.grid for image in images]
    rope = None
    if images and prompt_length is not None and all(g is not None for g in grids):
        rope = mrope_positions(prompt_length, positions, [g for g in grids if g is not None])
    return PromptImages(images, vision, cache, rope=rope)
