"""One image through a vision-language bundle's vision side, on this machine: decode, preprocess
(Pillow + numpy) and encode (the fp32 vision graph), and what the build of that graph costs.

``--family llava`` (default): a random LLaVA checkpoint with LLaVA 1.5's vision tower (CLIP
ViT-L/14 at 336 pixels, 576 image tokens, projector to 4096) and a one-layer language model (only
the projector's width matters here); per image (a 640x480 PNG) the decode, preprocess and encode
milliseconds, best of ``--rounds``, for one image and for ``--batch`` images in one encode.

``--family smolvlm``: a random SmolVLM checkpoint with SmolVLM2-500M-Video-Instruct's vision
config (SigLIP base patch16 at 512 pixels: width 768, 12 layers, 12 heads; scale_factor 4, so 64
image tokens a tile; the same tower as SmolVLM-256M/500M-Instruct's) and its image processor
(images resized to 2048 pixels, 512-pixel tiles), with a one-layer language model as wide as
500M's (960); the 640x480 PNG becomes 4x3 tiles plus the global image (13 frames, 832 image
tokens): decode, preprocess, and encode of one tile and of the whole image.

    PYTHONPATH=. .venv/bin/python bench/vision_encode.py [--family llava|smolvlm] [--rounds 3]
        [--batch 2] [--threads N]

``--quick`` (CI): the tests' tiny tower, one round; its figures mean nothing. Random weights: the
time of a real tower of the same shape, not its answers (no real vision model can be had
offline). Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.builder import EngineBuildSpec, build_bundle  # noqa: E402
from inference.images.decode import decode_image  # noqa: E402
from inference.runtime.onnxruntime_loader import load_ort_engine  # noqa: E402
from inference.runtime.protocol import ImageEngine  # noqa: E402
from tests.vision.checkpoints import (  # noqa: E402
    LLAVA_15_TEXT,
    LLAVA_15_VISION,
    SMOLVLM_500M_TEXT,
    SMOLVLM_500M_VISION,
    write_tiny_idefics3,
    write_tiny_llava,
)


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _best(rounds: int, run: object) -> float:
    assert callable(run)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def _build(ckpt: Path, out: Path, tokens: int) -> float:
    out.mkdir()
    started = time.perf_counter()
    build_bundle(ckpt, out, EngineBuildSpec(max_input_len=tokens + 64, max_kv_cache_capacity=tokens + 128,
                                            max_batch_size=1))
    return time.perf_counter() - started


def _llava(args: argparse.Namespace, work: Path, rounds: int) -> None:
    started = time.perf_counter()
    ckpt = write_tiny_llava(work / "ckpt", vision=None if args.quick else LLAVA_15_VISION,
                            text=None if args.quick else LLAVA_15_TEXT)
    written = time.perf_counter() - started
    out = work / "bundle"
    built = _build(ckpt, out, 16 if args.quick else 576)
    engine = load_ort_engine(out, max_slots=1, threads=args.threads)
    assert isinstance(engine, ImageEngine) and engine.vision is not None
    vision = engine.vision
    graph_bytes = sum(p.stat().st_size for p in out.glob("model.vision.onnx*"))
    print(f"checkpoint written in {written:.1f} s; bundle built in {built:.1f} s; vision graph "
          f"{graph_bytes / 1e6:.1f} MB (fp32), {vision.tokens_per_image} tokens an image")
    data = _png(640, 480, 0)
    image = decode_image(data)
    prepared = vision.prepare(image)
    decode_ms = _best(rounds, lambda: decode_image(data))
    pre_ms = _best(rounds, lambda: vision.prepare(image))
    one_ms = _best(rounds, lambda: vision.features([prepared]))
    many_ms = _best(rounds, lambda: vision.features([prepared] * args.batch))
    print(f"640x480 PNG: decode {decode_ms:.1f} ms, preprocess {pre_ms:.1f} ms, encode {one_ms:.1f} ms "
          f"(one image), {many_ms / args.batch:.1f} ms an image ({args.batch} in one encode)")
    engine.close()


def _smolvlm(args: argparse.Namespace, work: Path, rounds: int) -> None:
    from inference.runtime.vision_idefics3 import TiledVisionEncoder

    started = time.perf_counter()
    if args.quick:
        ckpt = write_tiny_idefics3(work / "ckpt", family="smolvlm")
    else:
        ckpt = write_tiny_idefics3(work / "ckpt", family="smolvlm", vision=SMOLVLM_500M_VISION,
                                   text=SMOLVLM_500M_TEXT, scale_factor=4, longest_edge=2048)
    written = time.perf_counter() - started
    out = work / "bundle"
    built = _build(ckpt, out, 160 if args.quick else 1200)
    engine = load_ort_engine(out, max_slots=1, threads=args.threads)
    assert isinstance(engine, ImageEngine) and isinstance(engine.vision, TiledVisionEncoder)
    vision = engine.vision
    graph_bytes = sum(p.stat().st_size for p in out.glob("model.vision.onnx*"))
    print(f"checkpoint written in {written:.1f} s; bundle built in {built:.1f} s; vision graph "
          f"{graph_bytes / 1e6:.1f} MB (fp32), {vision.tokens_per_tile} tokens a "
          f"{vision.image_size}-pixel tile")
    data = _png(640, 480, 0)
    image = decode_image(data)
    prepared = vision.prepare(image)
    frames = prepared.inputs["pixel_values"]
    decode_ms = _best(rounds, lambda: decode_image(data))
    pre_ms = _best(rounds, lambda: vision.prepare(image))
    tile_ms = _best(rounds, lambda: vision.encode(frames[:1]))
    image_ms = _best(rounds, lambda: vision.features([prepared]))
    print(f"640x480 PNG -> {len(frames) - 1} tiles + global ({len(prepared.tokens)} prompt tokens, "
          f"{prepared.rows} image tokens): decode {decode_ms:.1f} ms, preprocess {pre_ms:.1f} ms, "
          f"encode one tile {tile_ms:.1f} ms, the whole image {image_ms:.1f} ms "
          f"({image_ms / len(frames):.1f} ms a frame)")
    engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--family", choices=("llava", "smolvlm"), default="llava",
                        help="LLaVA 1.5's CLIP-L/336, or SmolVLM's SigLIP-B/16 at 512 with image tiles")
    parser.add_argument("--quick", action="store_true", help="the tests' tiny tower, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="llava: images in one encode (second figure)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-vision-") as tmp:
        (_llava if args.family == "llava" else _smolvlm)(args, Path(tmp), rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
