"""What every backend's bundle holds besides its engine: the shared file names and helpers.

A builder writes into an existing, empty directory; copies the tokenizer files the runtime and
the OpenAI server read; hashes its engine files for ``engine.json``; and writes ``engine.json``
last, so its presence marks the bundle's files as complete.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from inference.builder.errors import BuildInputError

ENGINE_FORMAT_VERSION = 2
ENGINE_FILE = "engine.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def check_build_dirs(checkpoint_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """The two directories as paths, once the checkpoint exists and the output is empty."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if not checkpoint_dir.is_dir():
        raise BuildInputError(f"checkpoint directory {checkpoint_dir} does not exist")
    if not out_dir.is_dir() or any(out_dir.iterdir()):
        raise BuildInputError(f"output directory {out_dir} must exist and be empty")
    return checkpoint_dir, out_dir


def copy_tokenizer_files(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files the checkpoint has; return their names."""
    copied: list[str] = []
    for name in TOKENIZER_FILES:
        src = checkpoint_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            copied.append(name)
    return copied


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def onnx_weight_bytes(model_path: Path) -> int:
    """Bytes an ONNX graph loads: its own file plus every external data file it references
    (a file shared with another graph counts in full: it is mapped in full)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    locations = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    folder = Path(model_path).parent
    return Path(model_path).stat().st_size + sum((folder / name).stat().st_size for name in sorted(locations))


def memory_fields(*, weight_bytes: int, kv_bytes_per_token: int, capacity: int, slots: int) -> dict[str, int]:
    """``engine.json``'s memory estimate for the model pool: weights, KV bytes per position, and
    their sum with KV at full capacity for ``slots`` sequences (the bundle's max_batch_size)."""
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "memory_bytes": weight_bytes + kv_bytes_per_token * capacity * slots,
    }
