"""Image bytes a request sends -> a decoded Pillow image, within limits, or one clear error.

Limits, checked in this order so that no work is spent on what will be refused: the encoded size
(a ``data:`` URL's base64 length says its byte count before anything is decoded: ``MAX_IMAGE_BYTES``),
the format (Pillow's decoders for PNG, JPEG, WebP, GIF and BMP only: no rarely used decoder sees
request bytes), the pixel count read from the header before the pixels are decoded
(``MAX_IMAGE_PIXELS``: a decompression bomb, a small file of a huge image, is refused without being
expanded), one frame (an animated GIF/PNG/WebP is refused: which frame the user meant is unknown),
then the pixels themselves (a truncated or corrupt file fails here). Colour modes are converted,
not refused: CMYK, 16-bit, greyscale and palette images become RGB and transparency is
composited onto white (:func:`inference.images.preprocess.to_rgb`, as transformers does, except
that 16-bit greyscale is scaled to 8 bits where transformers' conversion clips it to white). The
preprocessing refuses an image whose resize for the model would exceed ``MAX_IMAGE_PIXELS`` (a
1 x 8192 strip resized to a 336-pixel shortest edge: 2.75 M pixels long).

Callers run :func:`decode_image` in a worker thread: decoding takes milliseconds to seconds.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

from PIL import Image, UnidentifiedImageError

#: Bytes of one encoded image (OpenAI's limit for an image input is 20 MB).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Pixels of one image (a 8192 x 4096 panorama fits; Pillow's own bomb limit is 89.5 M).
MAX_IMAGE_PIXELS = 8192 * 4096
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(
    r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.ASCII)


class ImageInputError(ValueError):
    """An image a request sent cannot be used; the message says why and what to send instead."""


def check_data_url(url: str, *, max_bytes: int = MAX_IMAGE_BYTES) -> int:
    """Where a base64 ``data:`` URL's payload starts, once its header and size (over
    ``max_bytes``: refused before decoding) are checked; cheap, for the event loop."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageInputError("is not a data: URL (data:image/png;base64,...)")
    if match["b64"] is None:
        raise ImageInputError("is a data: URL without ;base64: send the image base64-encoded")
    mime = (match["mime"] or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageInputError(f"is a data: URL of {mime}, not an image")
    # 4 base64 characters carry 3 bytes: the size is known before decoding.
    size = (len(url) - match.end()) // 4 * 3
    if size > max_bytes:
        raise ImageInputError(f"holds about {size} bytes; one image may have at most {max_bytes} bytes: "
                              "send a smaller or more compressed image")
    return match.end()


def data_url_bytes(url: str, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a base64 ``data:`` URL (:func:`check_data_url` first)."""
    start = check_data_url(url, max_bytes=max_bytes)
    try:
        return base64.b64decode(url[start:], validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("is not valid base64") from None


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS,
                 max_bytes: int = MAX_IMAGE_BYTES) -> Image.Image:
    """The decoded image of ``data`` (``ImageInputError`` saying what is wrong with it)."""
    if len(data) > max_bytes:
        raise ImageInputError(f"has {len(data)} bytes; one image may have at most {max_bytes} bytes")
    if not data:
        raise ImageInputError("is empty")
    # No warnings.catch_warnings() here: it swaps process-wide state and this runs in worker
    # threads. Pillow warns past its own limit (89 M pixels) and raises past twice that; ours,
    # lower, is checked from the header below, before any pixel is decoded.
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageInputError(f"is not an image in a supported format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError:
        raise ImageInputError(f"is too large: at most {max_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageInputError(f"cannot be read as an image: {exc}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageInputError("has no pixels")
    if width * height > max_pixels:
        raise ImageInputError(f"is {width}x{height} pixels; one image may have at most {max_pixels} "
                              "pixels: send a smaller image")
    if getattr(image, "n_frames", 1) > 1:
        raise ImageInputError("is animated; send one frame as a still image")
    try:
        image.load()
    except Image.DecompressionBombError:
        raise ImageInputError(f"is too large: at most {max_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageInputError(f"is truncated or corrupt: {exc}") from None
    return image
