"""Checkpoint identity digest and checkpoint resolution (local dirs and the HF hub cache).

Everything runs on real files under tmp_path; the hub is never contacted: offline tests use a
hand-built HF cache layout, and the unreachable test points the hub endpoint at a closed
loopback port.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from huggingface_hub import constants as hf_constants
from safetensors.numpy import save_file

from cachesvc.cache.checkpoints import (
    HUB_ALLOW_PATTERNS,
    MAX_METADATA_BYTES,
    SAMPLE_BYTES,
    ResolvedCheckpoint,
    checkpoint_digest,
    checkpoint_size,
    is_hub_id,
    resolve_checkpoint,
    select_hub_files,
)
from cachesvc.errors import CheckpointError, HubUnreachableError

# --------------------------------------------------------------------------- helpers

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}


def make_checkpoint(root: Path, *, seed: int = 0) -> Path:
    """A tiny HF-style checkpoint: config, tokenizer files and a real safetensors shard."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    rng = np.random.default_rng(seed)
    save_file(
        {
            "embed.weight": rng.standard_normal((128, 64), dtype=np.float32),
            "lm_head.weight": rng.standard_normal((128, 64), dtype=np.float32),
        },
        str(root / "model.safetensors"),
    )
    return root


def write_shard(path: Path, payload_len: int, *, header_len: int = 256, sparse: bool = False) -> None:
    """A safetensors file with one U8 tensor of ``payload_len`` bytes and a header padded to a fixed size."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [payload_len], "data_offsets": [0, payload_len]}}
    ).encode()
    assert len(header) <= header_len
    header = header.ljust(header_len, b" ")  # the safetensors format allows trailing spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        if sparse:
            f.truncate(8 + len(header) + payload_len)
        else:
            f.write(np.random.default_rng(1).integers(0, 256, payload_len, dtype=np.uint8).tobytes())


def payload_region(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    start = 8 + n
    return start, path.stat().st_size - start


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def counted_digest(path: Path) -> tuple[str, int, int]:
    """Digest plus (number of reads, bytes read)."""
    calls: list[int] = []
    digest = checkpoint_digest(path, read_counter=calls.append)
    return digest, len(calls), sum(calls)


def fake_hub_cache(cache_dir: Path, repo_id: str, source: Path, commit: str = "a" * 40) -> Path:
    """Lay ``source``'s files out the way huggingface_hub caches them: blobs + symlinked snapshot."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def hub_online(monkeypatch: pytest.MonkeyPatch) -> str:
    """Hub 'online' but pointing at a loopback port nobody listens on (fails fast, no network)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    # huggingface_hub reads its env vars at import; patch the constants it consults per call.
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_tests")  # no token lookups on disk
    return endpoint


# --------------------------------------------------------------------------- digest: stability


def test_digest_is_sha256_hex_and_deterministic(ckpt: Path) -> None:
    d = checkpoint_digest(ckpt)
    assert len(d) == 64 and int(d, 16) >= 0
    assert checkpoint_digest(ckpt) == d


def test_digest_independent_of_location_and_mtime(ckpt: Path, tmp_path: Path) -> None:
    original = checkpoint_digest(ckpt)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(ckpt, copy)
    for f in copy.iterdir():
        os.utime(f, (1_000_000, 1_000_000))
    assert checkpoint_digest(copy) == original
    moved = tmp_path / "moved"
    os.rename(copy, moved)
    os.utime(moved / "model.safetensors", (2_000_000_000, 2_000_000_000))
    assert checkpoint_digest(moved) == original


def test_digest_follows_symlinks_like_hf_snapshots(ckpt: Path, tmp_path: Path) -> None:
    snapshot = fake_hub_cache(tmp_path / "hub", "org/tiny", ckpt)
    assert (snapshot / "model.safetensors").is_symlink()
    assert checkpoint_digest(snapshot) == checkpoint_digest(ckpt)


def test_digest_ignores_hidden_dirs_and_non_checkpoint_files(ckpt: Path) -> None:
    before = checkpoint_digest(ckpt)
    (ckpt / ".git").mkdir()
    (ckpt / ".git" / "config.json").write_text("{}")
    (ckpt / ".cache" / "huggingface").mkdir(parents=True)
    (ckpt / ".cache" / "huggingface" / "x.safetensors").write_bytes(b"junk")
    (ckpt / "README.md").write_text("# hello")
    (ckpt / ".gitattributes").write_text("*.safetensors filter=lfs")
    assert checkpoint_digest(ckpt) == before


def test_digest_includes_subdirectories(ckpt: Path) -> None:
    before = checkpoint_digest(ckpt)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "extra.json").write_text("{}")
    assert checkpoint_digest(ckpt) != before


# --------------------------------------------------------------------------- digest: sensitivity


@pytest.mark.parametrize("which", ["start", "middle", "end", "end-last-byte"])
def test_digest_changes_when_a_sampled_weight_byte_changes(ckpt: Path, which: str) -> None:
    shard = ckpt / "model.safetensors"
    start, length = payload_region(shard)
    assert length > 4 * SAMPLE_BYTES  # samples must not overlap for this test to mean anything
    offset = {
        "start": start,
        "middle": start + (length - SAMPLE_BYTES) // 2,
        "end": start + length - SAMPLE_BYTES,
        "end-last-byte": start + length - 1,
    }[which]
    before = checkpoint_digest(ckpt)
    flip_byte(shard, offset)
    assert checkpoint_digest(ckpt) != before


def test_digest_unchanged_by_unsampled_weight_byte(ckpt: Path) -> None:
    """The bounded-read trade-off, on purpose: an in-place edit between samples is not seen."""
    shard = ckpt / "model.safetensors"
    start, length = payload_region(shard)
    middle = start + (length - SAMPLE_BYTES) // 2
    unsampled = start + SAMPLE_BYTES + 100
    assert unsampled + 1 < middle
    before = checkpoint_digest(ckpt)
    flip_byte(shard, unsampled)
    assert checkpoint_digest(ckpt) == before


def test_digest_changes_when_safetensors_header_changes(ckpt: Path) -> None:
    shard = ckpt / "model.safetensors"
    data = shard.read_bytes()
    start, _ = payload_region(shard)
    assert data[:start].count(b"lm_head") == 1
    # Same length, so only the header differs (not the size, not the payload samples).
    shard.write_bytes(data[:start].replace(b"lm_head", b"lm_hexd") + data[start:])
    before_size = shard.stat().st_size
    digest_after = checkpoint_digest(ckpt)
    shard.write_bytes(data)
    assert shard.stat().st_size == before_size
    assert checkpoint_digest(ckpt) != digest_after


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_digest_changes_when_a_metadata_file_changes(ckpt: Path, name: str) -> None:
    before = checkpoint_digest(ckpt)
    path = ckpt / name
    text = path.read_text()
    # Same size: only the content check can catch it.
    changed = text.replace("b", "x", 1)
    assert changed != text and len(changed) == len(text)
    path.write_text(changed)
    assert checkpoint_digest(ckpt) != before


@pytest.mark.parametrize(
    "old,new", [("model.safetensors", "model-00001.safetensors"), ("tokenizer.json", "tok.json")]
)
def test_digest_changes_when_a_file_is_renamed(ckpt: Path, old: str, new: str) -> None:
    before = checkpoint_digest(ckpt)
    os.rename(ckpt / old, ckpt / new)
    assert checkpoint_digest(ckpt) != before


def test_digest_changes_when_a_file_is_added_or_removed(ckpt: Path) -> None:
    before = checkpoint_digest(ckpt)
    (ckpt / "generation_config.json").write_text("{}")
    with_extra = checkpoint_digest(ckpt)
    assert with_extra != before
    (ckpt / "generation_config.json").unlink()
    assert checkpoint_digest(ckpt) == before


def test_framing_keeps_path_and_content_apart(tmp_path: Path) -> None:
    # Bytes moved between a file name and its neighbour's content must not collide.
    a = tmp_path / "a"
    a.mkdir()
    (a / "x.json").write_text("12")
    (a / "y.json").write_text("3")
    b = tmp_path / "b"
    b.mkdir()
    (b / "x.json").write_text("1")
    (b / "y.json").write_text("23")
    assert checkpoint_digest(a) != checkpoint_digest(b)


def test_other_weight_formats_are_sampled(tmp_path: Path) -> None:
    ckpt = tmp_path / "pt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "pytorch_model.bin").write_bytes(os.urandom(10_000))
    before, _reads, nbytes = counted_digest(ckpt)
    assert nbytes == 2 + 3 * SAMPLE_BYTES  # config.json + three samples
    flip_byte(ckpt / "pytorch_model.bin", 10_000 - 1)
    assert checkpoint_digest(ckpt) != before
    flip_byte(ckpt / "pytorch_model.bin", 5000 + SAMPLE_BYTES)  # past the middle sample
    assert checkpoint_digest(ckpt) != before


# --------------------------------------------------------------------------- digest: bounded reads


def test_10gb_shard_costs_the_same_reads_as_10mb(tmp_path: Path) -> None:
    small, big = tmp_path / "small", tmp_path / "big"
    for d, size, sparse in ((small, 10 * 2**20, False), (big, 10 * 2**30, True)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CONFIG))
        write_shard(d / "model.safetensors", size - 8 - 256, sparse=sparse)
    assert (big / "model.safetensors").stat().st_size == 10 * 2**30
    d_small, reads_small, bytes_small = counted_digest(small)
    d_big, reads_big, bytes_big = counted_digest(big)
    assert d_small != d_big
    assert (reads_big, bytes_big) == (reads_small, bytes_small)
    config_len = len(json.dumps(CONFIG))
    assert bytes_big == config_len + 8 + 256 + 3 * SAMPLE_BYTES


def test_oversized_metadata_file_is_rejected_without_reading(ckpt: Path) -> None:
    with open(ckpt / "huge.json", "wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)
    calls: list[int] = []
    with pytest.raises(CheckpointError, match=r"huge\.json.*MiB"):
        checkpoint_digest(ckpt, read_counter=calls.append)
    assert sum(calls) < 2**20


def test_truncated_safetensors_is_rejected(ckpt: Path) -> None:
    shard = ckpt / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(100)  # header length now points past the end of the file
    with pytest.raises(CheckpointError, match=r"not a valid safetensors file.*download it again"):
        checkpoint_digest(ckpt)


def test_broken_symlink_is_rejected(ckpt: Path) -> None:
    os.symlink(ckpt / "missing-blob", ckpt / "model-00002.safetensors")
    with pytest.raises(CheckpointError, match="broken symlink"):
        checkpoint_digest(ckpt)


def test_empty_dir_has_no_digest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint files"):
        checkpoint_digest(tmp_path)


def test_checkpoint_size_counts_checkpoint_files_only(ckpt: Path) -> None:
    (ckpt / "README.md").write_text("ignored")
    files = [p for p in ckpt.iterdir() if p.suffix in (".json", ".safetensors")]
    assert checkpoint_size(ckpt) == (sum(p.stat().st_size for p in files), len(files))


def _converted_gguf_dir(root: Path) -> Path:
    """A converted GGUF checkpoint's shape: config and tokenizer files next to ``model.gguf``."""
    import gguf

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer.json").write_text("{}")
    writer = gguf.GGUFWriter(root / "model.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((128, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return root


def test_a_converted_ggufs_model_gguf_is_its_weights(tmp_path: Path) -> None:
    from cachesvc.cache.gguf_checkpoints import CONVERTED_GGUF_FILE, gguf_digest
    from inference.builder.gguf_reader import GGUF_FILE

    assert CONVERTED_GGUF_FILE == GGUF_FILE  # one name on both sides
    d = _converted_gguf_dir(tmp_path / "gguf-2")
    gguf_file = d / "model.gguf"
    files = [gguf_file, d / "config.json", d / "tokenizer.json"]
    assert checkpoint_size(d) == (sum(p.stat().st_size for p in files), 3)
    before, _, nbytes = counted_digest(d)
    gguf_reads: list[int] = []
    gguf_digest(gguf_file, read_counter=gguf_reads.append)
    # The GGUF costs its header and three samples, never its tensors.
    assert nbytes == len(json.dumps(CONFIG)) + 2 + sum(gguf_reads)
    assert sum(gguf_reads) < 1024 < 128 * 64 * 4 < gguf_file.stat().st_size
    # Another .gguf next to it is not read by a build, so it is not part of the identity.
    (d / "other.Q4_0.gguf").write_bytes(gguf_file.read_bytes())
    assert checkpoint_digest(d) == before
    flip_byte(gguf_file, gguf_file.stat().st_size - 1)  # the last data sample
    assert checkpoint_digest(d) != before
    r = resolve_checkpoint(str(d), tmp_path / "cache")
    assert (r.digest, r.file_count) == (checkpoint_digest(d), 3)


# --------------------------------------------------------------------------- resolve: local


def test_resolve_local_directory(ckpt: Path, tmp_path: Path) -> None:
    r = resolve_checkpoint(str(ckpt), tmp_path / "cache")
    assert isinstance(r, ResolvedCheckpoint)
    assert r.source == str(ckpt)
    assert r.path == ckpt.resolve() and r.path.is_absolute()
    assert r.digest == checkpoint_digest(ckpt)
    assert (r.size_bytes, r.file_count) == checkpoint_size(ckpt)
    assert r.file_count == 4 and r.revision is None
    assert not (tmp_path / "cache").exists()  # local checkpoints never touch the hub cache


def test_resolve_relative_and_home_paths(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("./ckpt", tmp_path / "c").path == ckpt.resolve()
    assert resolve_checkpoint("ckpt", tmp_path / "c").path == ckpt.resolve()  # exists: a path, not an id
    monkeypatch.setenv("HOME", str(tmp_path))
    r = resolve_checkpoint("~/ckpt", tmp_path / "c")
    assert r.path == ckpt.resolve() and r.source == "~/ckpt"


def test_resolve_rejects_onnx_export(tmp_path: Path) -> None:
    d = tmp_path / "onnx-export"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.onnx").write_bytes(b"\x08\x07")
    with pytest.raises(CheckpointError, match=r"ONNX export.*original Hugging Face checkpoint"):
        resolve_checkpoint(str(d), tmp_path / "cache")


@pytest.mark.parametrize("marker", ["manifest", "engine"])
def test_resolve_rejects_built_bundle(ckpt: Path, tmp_path: Path, marker: str) -> None:
    if marker == "manifest":
        (ckpt / "manifest.json").write_text(json.dumps({"layout_version": 1, "files": []}))
    else:
        (ckpt / "engine.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"already a built engine bundle.*cachesvc bundles show"):
        resolve_checkpoint(str(ckpt), tmp_path / "cache")


def test_a_manifest_json_without_layout_version_is_not_a_bundle(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "manifest.json").write_text(json.dumps({"something": "else"}))
    assert resolve_checkpoint(str(ckpt), tmp_path / "cache").file_count == 5


def test_resolve_rejects_dir_without_weights(tmp_path: Path) -> None:
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no weight files \(\.safetensors, \.bin, \.pt, \.pth\)"):
        resolve_checkpoint(str(d), tmp_path / "cache")


def test_resolve_rejects_dir_without_config(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        resolve_checkpoint(str(ckpt), tmp_path / "cache")


@pytest.mark.parametrize("arg", ["/definitely/not/here", "./not-here", "../not-here", "~/not-here-xyz"])
def test_resolve_missing_path(arg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_checkpoint(arg, tmp_path / "cache")


def test_resolve_file_is_not_a_directory(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_checkpoint(str(ckpt / "config.json"), tmp_path / "cache")


def test_resolve_rejects_revision_for_local_dir(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="Hugging Face model ids only"):
        resolve_checkpoint(str(ckpt), tmp_path / "cache", revision="main")


@pytest.mark.parametrize(
    "bad", ["org/name/extra", "bad id", "a--b", "-lead", "trail.", "org/na..me", "", "x" * 97]
)
def test_resolve_rejects_bad_hub_ids(bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"model id|model is empty") as e:
        resolve_checkpoint(bad, tmp_path / "cache")
    assert not isinstance(e.value, HubUnreachableError)


@pytest.mark.parametrize("good", ["gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.2-1B", "a_b/c_d"])
def test_hub_id_syntax_accepts_real_ids(good: str) -> None:
    assert is_hub_id(good)


# --------------------------------------------------------------------------- resolve: hub


def test_offline_with_empty_cache(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"org/tiny is not in the local cache.*offline.*HF_HUB_OFFLINE=0"
    ):
        resolve_checkpoint("org/tiny", tmp_path / "cache", offline=True)


def test_offline_defaults_to_hf_hub_offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://127.0.0.1:9")  # if it went online, it would fail
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="offline mode is on"):
        resolve_checkpoint("org/tiny", tmp_path / "cache")


def test_offline_resolves_from_hf_cache_layout(ckpt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = fake_hub_cache(cache, "org/tiny", ckpt, commit=commit)
    r = resolve_checkpoint("org/tiny", cache, offline=True)
    assert r.source == "org/tiny"
    assert r.path == snapshot.resolve()
    assert r.revision == commit
    assert r.digest == checkpoint_digest(ckpt)  # same files, same identity, symlinks or not
    assert (r.size_bytes, r.file_count) == checkpoint_size(ckpt)
    # A commit hash resolves through snapshots/ directly; an unknown branch does not.
    assert resolve_checkpoint("org/tiny", cache, offline=True, revision=commit).path == r.path
    with pytest.raises(CheckpointError, match="not in the local cache"):
        resolve_checkpoint("org/tiny", cache, offline=True, revision="dev")


def test_offline_cache_holding_an_onnx_export_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.onnx").write_bytes(b"\x08\x07")
    fake_hub_cache(tmp_path / "cache", "org/onnx-only", src)
    with pytest.raises(CheckpointError, match="ONNX export"):
        resolve_checkpoint("org/onnx-only", tmp_path / "cache", offline=True)


def test_unreachable_hub(hub_online: str, tmp_path: Path) -> None:
    with pytest.raises(HubUnreachableError, match=r"org/tiny.*local checkpoint directory.*pre-populate"):
        resolve_checkpoint("org/tiny", tmp_path / "cache", offline=False)


def test_unreachable_hub_falls_back_to_cached_snapshot(hub_online: str, ckpt: Path, tmp_path: Path) -> None:
    snapshot = fake_hub_cache(tmp_path / "cache", "org/tiny", ckpt)
    r = resolve_checkpoint("org/tiny", tmp_path / "cache", offline=False)
    assert r.path == snapshot.resolve()
    assert r.digest == checkpoint_digest(ckpt)


def test_select_hub_files_prefers_safetensors_and_top_level() -> None:
    listing = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "original/params.json",
        "onnx/model.onnx",
        "tokenizer.json",
        "tokenizer.model",
        "merges.txt",
        "chat_template.jinja",
        "tf_model.h5",
    ]
    assert select_hub_files(listing) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer.model",
    ]
    assert select_hub_files(["config.json", "pytorch_model.bin", "flax_model.msgpack"]) == [
        "config.json",
        "pytorch_model.bin",
    ]
    assert "*.safetensors" in HUB_ALLOW_PATTERNS and "*.json" in HUB_ALLOW_PATTERNS


# --------------------------------------------------------------------------- resolve: hub online
# A loopback stand-in for the Hugging Face hub (an external service, not our code): just the
# routes snapshot_download uses. It records every request so tests can see what was fetched.

HUB_COMMIT = "c0ffee" + "0" * 34


class _FakeHub(ThreadingHTTPServer):
    repos: dict[str, dict[str, bytes]]
    errors: dict[str, tuple[int, str]]
    requests: list[tuple[str, str]]


class _FakeHubHandler(BaseHTTPRequestHandler):
    server: _FakeHub

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _serve(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.server.requests.append((self.command, path))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        m = api or tree or resolve
        repo_id = m.group(1) if m else ""
        if repo_id in self.server.errors:
            status, code = self.server.errors[repo_id]
            self._send(status, b'{"error": "nope"}', {"X-Error-Code": code, "X-Error-Message": "nope"}, body)
            return
        files = self.server.repos.get(repo_id)
        if files is None or m is None:
            self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
            return
        if api:
            info = {"id": repo_id, "sha": HUB_COMMIT, "siblings": [{"rfilename": f} for f in sorted(files)]}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        elif tree:
            entries = [
                {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for f, d in sorted(files.items())
            ]
            self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)
        else:
            assert resolve is not None
            data = files[resolve.group(2)]
            headers = {"X-Repo-Commit": HUB_COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            self._send(200, data, headers, body)


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[_FakeHub]:
    server = _FakeHub(("127.0.0.1", 0), _FakeHubHandler)
    server.repos, server.errors, server.requests = {}, {}, []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    # huggingface_hub derives these from HF_ENDPOINT at import time.
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_tests")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_online_download_fetches_one_weight_format_top_level_only(
    fake_hub: _FakeHub, ckpt: Path, tmp_path: Path
) -> None:
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    fake_hub.repos["org/tiny"] = {
        **files,
        "pytorch_model.bin": b"duplicate weights in another format",
        "original/consolidated.00.pth": b"yet another copy",
        "README.md": b"# tiny",
    }
    r = resolve_checkpoint("org/tiny", tmp_path / "cache", offline=False)
    assert r.revision == HUB_COMMIT
    assert r.path.parent.name == "snapshots" and r.path.name == HUB_COMMIT
    assert sorted(p.name for p in r.path.iterdir()) == sorted(files)
    assert r.digest == checkpoint_digest(ckpt)
    fetched = {p for method, p in fake_hub.requests if method == "GET" and "/resolve/" in p}
    assert not any(p.endswith((".bin", ".pth", ".md")) for p in fetched)
    # Now cached: offline resolution finds the same snapshot through refs/main.
    assert resolve_checkpoint("org/tiny", tmp_path / "cache", offline=True) == r


@pytest.mark.parametrize(
    "status,code,match",
    [
        (404, "RepoNotFound", "was not found on the hub"),
        (403, "GatedRepo", "is gated.*log in"),
        (404, "RevisionNotFound", "has no revision"),
    ],
)
def test_hub_refusals_are_checkpoint_errors(
    fake_hub: _FakeHub, tmp_path: Path, status: int, code: str, match: str
) -> None:
    fake_hub.errors["org/private"] = (status, code)
    with pytest.raises(CheckpointError, match=match) as e:
        resolve_checkpoint("org/private", tmp_path / "cache", offline=False, revision="v1")
    assert not isinstance(e.value, HubUnreachableError)
    assert "org/private" in str(e.value)
