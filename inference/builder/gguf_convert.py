"""GGUF file -> Hugging Face-style checkpoint directory (config, tokenizer, the GGUF itself).

``convert_gguf`` writes what the rest of the builder reads from any checkpoint directory:

* ``config.json`` / ``generation_config.json`` from the metadata (each family's ``gguf_config``, and
  the rope tensors ``rope_freqs`` / ``rope_factors_long/short`` as rope scaling);
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``special_tokens_map.json`` (see
  ``gguf_tokenizer``);
* ``model.gguf``: a plain copy of the file, or, with ``link`` (a file the cache itself
  downloaded), a second name of it (a hard link: one copy on disk; a copy where the filesystem
  cannot link). The weights stay in their own types (a Q4_1 file stays 4-bit on disk); the
  builder reads them through ``gguf_reader.GgufCheckpoint``, which dequantizes one tensor at a
  time and undoes llama.cpp's Q/K row permutation, and an ``int4`` build takes the Q4 blocks
  from it as they are.

Every check the builder's reader would make (a readable, complete file, a supported
architecture, tensor names and types) runs here first, so anything that cannot be built
faithfully raises ``BuildInputError`` naming the problem before the file is copied.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.builder.gguf_reader import GGUF_FILE, gguf_config, open_gguf, read_gguf_header, tensor_plan
from inference.builder.gguf_tokenizer import write_tokenizer_files

#: Bump whenever the converted files change for the same GGUF. gguf-2: the GGUF is kept as
#: ``model.gguf`` (gguf-1 wrote every tensor dequantized to float32 into ``model.safetensors``).
CONVERTER_VERSION = "gguf-2"

Progress = Callable[[str, float], None]


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None, *,
                 link: bool = False) -> dict[str, Any]:
    """Convert ``gguf_path`` into the existing, empty directory ``out_dir``; return the config.
    ``link``: hard-link the GGUF instead of copying it where the filesystem allows (only for a
    file the caller owns: the two names then share one inode, its permissions included).

    Raises ``BuildInputError`` for a truncated file, an unsupported architecture or tensor
    type, or a file without a tokenizer; the caller discards ``out_dir`` on any error.
    """
    report = progress or (lambda stage, fraction: None)
    out_dir = Path(out_dir)
    header = read_gguf_header(gguf_path)
    config = gguf_config(header)
    tensor_plan(header, config)  # what GgufCheckpoint checks: names, types, complete data
    # The tokenizer before the copy: it is cheap, and a file without one fails early.
    write_tokenizer_files(open_gguf(gguf_path), out_dir)
    report("copy", 0.0)
    _place_synced(Path(gguf_path), out_dir / GGUF_FILE, link)
    report("copy", 1.0)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                  if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    return config


def _place_synced(src: Path, dst: Path, link: bool) -> None:
    """Make the new file ``dst`` hold ``src`` (a hard link with ``link`` where possible, else a
    copy) and flush it to disk."""
    if link:
        try:
            os.link(src, dst)
        except OSError:  # another filesystem, or one without hard links: copy instead
            link = False
    if not link:
        shutil.copyfile(src, dst)  # sendfile on Linux: no user-space buffer of the whole file
    with dst.open("rb") as fh:
        os.fsync(fh.fileno())
