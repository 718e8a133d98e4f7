"""``cachesvc demo-checkpoint``: a random-weight checkpoint to try the cache with."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from inference.demo import ARCHS as DEMO_ARCHS
from inference.demo import SIZES as DEMO_SIZES


def cmd_demo_checkpoint(args: argparse.Namespace) -> int:
    from inference.demo import write_demo_checkpoint

    out = write_demo_checkpoint(
        Path(args.dir), arch=args.arch, size=args.size, dtype=args.dtype, seed=args.seed
    )
    print(f"wrote a {args.size} {args.arch} {args.dtype} demo checkpoint with RANDOM weights to {out}")
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``demo-checkpoint DIR``."""
    p = sub.add_parser("demo-checkpoint", help="write a random-weight demo checkpoint", allow_abbrev=False)
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=DEMO_ARCHS, default="qwen2")
    p.add_argument("--size", choices=DEMO_SIZES, default="tiny")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_checkpoint)
