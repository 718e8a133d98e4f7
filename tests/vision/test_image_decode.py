"""Image bytes from a request: what is decoded, converted, and refused (with what message)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from inference.images.decode import ImageInputError, data_url_bytes, decode_image
from tests.vision.conftest import random_image


def encoded(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "I;16"), ("JPEG", "RGB"),
                                           ("JPEG", "CMYK"), ("GIF", "P"), ("WEBP", "RGB"), ("BMP", "L")])
def test_formats_and_modes_decode(fmt: str, mode: str) -> None:
    image = random_image(1, (20, 12), "L" if mode == "I;16" else mode)
    if mode == "I;16":
        image = image.convert("I;16")
    decoded = decode_image(data_url_bytes(data_url(encoded(image, fmt))))
    assert decoded.size == (20, 12)


@pytest.mark.parametrize(("url", "message"), [
    ("https://example.com/cat.png", "not a data: URL"),
    ("data:image/png,rawbytes", "without ;base64"),
    ("data:text/plain;base64,aGVsbG8=", "of text/plain, not an image"),
    ("data:image/png;base64,@@@@", "not valid base64"),
])
def test_bad_data_urls(url: str, message: str) -> None:
    with pytest.raises(ImageInputError, match=message):
        data_url_bytes(url)


def test_the_byte_cap_applies_before_decoding() -> None:
    url = data_url(b"x" * 3000)
    assert len(data_url_bytes(url, max_bytes=3000)) == 3000
    with pytest.raises(ImageInputError, match="at most 2000 bytes"):
        data_url_bytes(url, max_bytes=2000)


def test_not_an_image_truncated_and_empty() -> None:
    with pytest.raises(ImageInputError, match="not an image in a supported format"):
        decode_image(b"%PDF-1.4 not a picture")
    png = encoded(random_image(2, (64, 64)))
    with pytest.raises(ImageInputError, match="truncated or corrupt"):
        decode_image(png[: len(png) // 2])
    with pytest.raises(ImageInputError, match="empty"):
        decode_image(b"")
    tiff = encoded(random_image(3, (8, 8)), "TIFF")  # a real image of a format we do not decode
    with pytest.raises(ImageInputError, match="supported format"):
        decode_image(tiff)


def test_decompression_bombs_are_refused_from_the_header() -> None:
    """A small file of a huge image: refused by its header's size, before its pixels exist."""
    bomb = encoded(Image.new("1", (9000, 4000)))  # over our limit, under Pillow's own
    assert len(bomb) < 100_000
    with pytest.raises(ImageInputError, match="9000x4000 pixels; one image may have at most"):
        decode_image(bomb)
    huge = encoded(Image.new("1", (20000, 10000)))  # over Pillow's limit too: its error, our words
    with pytest.raises(ImageInputError, match="too large: at most"):
        decode_image(huge)
    with pytest.raises(ImageInputError, match="at most 100 pixels"):
        decode_image(encoded(random_image(4, (11, 10))), max_pixels=100)


def test_animated_images_are_refused() -> None:
    frames = [random_image(i, (8, 8), "P") for i in range(3)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageInputError, match="animated"):
        decode_image(out.getvalue())


def test_animated_webp_and_png_are_refused_too() -> None:
    frames = [random_image(i, (8, 8)) for i in range(3)]
    for fmt in ("WEBP", "PNG"):
        out = io.BytesIO()
        frames[0].save(out, format=fmt, save_all=True, append_images=frames[1:])
        with pytest.raises(ImageInputError, match="is animated; send one frame"):
            decode_image(out.getvalue())
    one = io.BytesIO()
    frames[0].save(one, format="GIF")  # a still GIF is fine
    assert decode_image(one.getvalue()).size == (8, 8)


def test_sixteen_bit_greyscale_is_scaled_to_eight_bits_not_clipped() -> None:
    """Pillow's (and transformers') conversion clips 16-bit values to 255: a white image. Ours
    keeps the high byte, as Pillow reads 16-bit RGB PNGs."""
    import numpy as np

    from inference.images.preprocess import to_rgb

    values = np.random.default_rng(3).integers(0, 65536, (12, 20)).astype(np.uint16)
    decoded = decode_image(encoded(Image.fromarray(values)))
    assert decoded.mode == "I;16"
    rgb = np.asarray(to_rgb(decoded))
    assert rgb.shape == (12, 20, 3) and (rgb == (values >> 8).astype(np.uint8)[:, :, None]).all()
    assert np.asarray(decoded.convert("RGB")).mean() > 250  # what a plain conversion would have made


def test_transparency_is_composited_onto_white() -> None:
    import numpy as np

    from inference.images.preprocess import to_rgb

    palette = Image.new("P", (4, 2))
    palette.putpalette([255, 0, 0, 0, 0, 255])
    palette.putpixel((0, 0), 1)
    decoded = decode_image(encoded(palette, transparency=0))  # index 0 (red) transparent
    rgb = np.asarray(to_rgb(decoded))
    assert rgb[0, 0].tolist() == [0, 0, 255] and rgb[1, 1].tolist() == [255, 255, 255]
    la = decode_image(encoded(Image.new("LA", (2, 2), (0, 0))))
    assert np.asarray(to_rgb(la)).tolist() == [[[255, 255, 255]] * 2] * 2
    cmyk = decode_image(encoded(Image.new("CMYK", (2, 2), (0, 255, 255, 0)), "JPEG"))
    assert cmyk.mode == "CMYK" and to_rgb(cmyk).mode == "RGB"


def test_preprocessing_refuses_what_would_blow_up_or_it_cannot_take() -> None:
    from inference.images.preprocess import ClipPreprocess

    llava = ClipPreprocess.from_config({"size": {"shortest_edge": 336}, "crop_size": 336})
    refused = "1x8192 pixels; resized for this model it would be 336x2752512"
    with pytest.raises(ImageInputError, match=refused):
        llava(decode_image(encoded(Image.new("RGB", (1, 8192)))))
    assert llava(decode_image(encoded(Image.new("RGB", (8, 512))))).shape == (3, 336, 336)
    rgb_only = ClipPreprocess.from_config({"do_convert_rgb": False, "crop_size": 32,
                                           "size": {"shortest_edge": 32}})
    with pytest.raises(ImageInputError, match="is a L image; this model's image processor takes RGB"):
        rgb_only(random_image(1, (40, 40), "L"))
