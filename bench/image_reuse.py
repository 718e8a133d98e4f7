"""Time to first token of image requests through a real ``cachesvc serve``: a new image (cold),
the same image and text again (context reuse over the image rows: nothing encoded, nothing
prefilled but the last token), and the same image behind another system prompt (the KV diverges
before the image: the image-feature cache spares its decode and encode).

    PYTHONPATH=. .venv/bin/python bench/image_reuse.py [--rounds 5] [--llava15]

``--quick`` (CI): the tiny model, one round; its figures mean nothing.

Default: the tests' tiny LLaVA (CLIP 32 px / patch 8: 16 image tokens). ``--llava15``: LLaVA 1.5's
vision tower (CLIP ViT-L/14 at 336 px: 576 image tokens, projector to 4096) with a one-layer
language model, as ``bench/vision_encode.py``: the encode there is seconds, so what reuse saves
shows. Random weights (no real vision model can be had offline); the official openai client,
streaming, one request at a time; median of ``--rounds``. Not a test: the figures depend on the
machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.service.conftest import MODEL, ServerProcess, running_server  # noqa: E402
from tests.vision.checkpoints import LLAVA_15_TEXT, LLAVA_15_VISION, write_tiny_llava  # noqa: E402

TEXT = "Describe this picture in detail, then list every object you can see in it."


def _png(seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _ttft(server: ServerProcess, url: str, system: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens the server reused."""
    messages: list[Any] = [{"role": "system", "content": system},
                           {"role": "user", "content": [{"type": "text", "text": TEXT},
                                                        {"type": "image_url", "image_url": {"url": url}}]}]
    start = time.perf_counter()
    first: float | None = None
    cached = 0
    stream = server.client(timeout=600).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens or 0)
    assert first is not None
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--llava15", action="store_true", help="LLaVA 1.5's vision tower (576 image tokens)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round (CI)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.llava15 = 1, False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        big = args.llava15
        checkpoint = write_tiny_llava(root / "llava", seed=3, vision=LLAVA_15_VISION if big else None,
                                      text=LLAVA_15_TEXT if big else None)
        limits = ["--max-input-len", "1024", "--max-kv-cache-capacity", "1280"] if args.llava15 else []
        (root / "log").mkdir()
        started = time.perf_counter()
        with running_server(checkpoint, root / "cache", root / "log", *limits) as server:
            print(f"server up (bundle built) in {time.perf_counter() - started:.1f} s")
            _ttft(server, _png(10_000), "warm up")
            rows: dict[str, list[float]] = {"cold (new image)": [], "same image and text": [],
                                            "same image, another system prompt": []}
            reused: dict[str, list[int]] = {k: [] for k in rows}
            for r in range(args.rounds):
                url = _png(r)
                for case, system in zip(rows, ("Be brief.", "Be brief.", f"Be precise, round {r}."),
                                        strict=True):
                    seconds, cached = _ttft(server, url, system)
                    rows[case].append(seconds)
                    reused[case].append(cached)
            health = server.health()
        print(f"{'case':<36} {'median TTFT':>12} {'reused tokens':>14}")
        for case, times in rows.items():
            ms = statistics.median(times) * 1000
            print(f"{case:<36} {ms:>9.1f} ms {statistics.median(reused[case]):>14}")
        images = health.get("image_cache", {})
        print("image cache:", {k: images.get(k) for k in ("lookups", "hits", "encodes", "entries", "bytes")})
        entries = images.get("entries") or 1
        print(f"bytes per cached image: {images.get('bytes', 0) // entries}")


if __name__ == "__main__":
    main()
