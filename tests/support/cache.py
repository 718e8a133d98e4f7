"""Helpers for cache tests: fake-but-valid checkpoints and a deterministic test builder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from cachesvc.cache.builders import BuildJob

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path, *, seed: int = 0, hidden: int = 16) -> Path:
    """A directory that resolves as a checkpoint: config.json, tokenizer.json, one safetensors shard."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "seed": seed,
            }
        )
    )
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "seed": seed}))
    save_file(
        {"w": rng.standard_normal((hidden, hidden)).astype(np.float32)}, str(path / "model.safetensors")
    )
    return path


class FileBuilder:
    """Writes ``files`` deterministic files derived from the checkpoint into the staging dir.

    ``CACHESVC_TEST_KILL_AT=<n>`` makes the process SIGKILL itself after writing file n (crash
    tests); ``delay`` sleeps between files so concurrent tests overlap.
    """

    backend = "onnxruntime"
    version = "test-1"

    def __init__(self, files: int = 20, file_size: int = 1024, delay: float = 0.0) -> None:
        self.files = files
        self.file_size = file_size
        self.delay = delay
        self.calls = 0

    def versions(self) -> dict[str, str]:
        return {"builder": self.version}

    def build(self, job: BuildJob) -> dict[str, Any]:
        self.calls += 1
        kill_at = os.environ.get("CACHESVC_TEST_KILL_AT")
        seed = hashlib.sha256(
            (job.checkpoint_dir / "config.json").read_bytes() + job.options.digest.encode()
        ).digest()
        for i in range(self.files):
            data = (seed * (self.file_size // len(seed) + 1))[: self.file_size]
            (job.out_dir / f"part-{i:03d}.bin").write_bytes(data)
            job.progress("write", (i + 1) / self.files)
            if kill_at is not None and int(kill_at) == i:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.delay:
                time.sleep(self.delay)
        marker = os.environ.get("CACHESVC_TEST_BUILD_LOG")
        if marker:
            with open(marker, "a") as fh:
                fh.write(f"{os.getpid()}\n")
        return {"kind": "test", "files": self.files}


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child python processes that import cachesvc and tests.support."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class ServableFileBuilder(FileBuilder):
    """The file builder plus a tokenizer and an ``engine.json``, so the model pool can load its
    bundles (over a test engine given as the engine factory) like real ones."""

    def __init__(self, tokenizer_dir: Path, *, files: int = 2, file_size: int = 256) -> None:
        super().__init__(files=files, file_size=file_size)
        self.tokenizer_dir = tokenizer_dir

    def build(self, job: BuildJob) -> dict[str, Any]:
        engine = super().build(job)
        out_dir = job.out_dir
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        ):
            if (self.tokenizer_dir / name).is_file():
                shutil.copy2(self.tokenizer_dir / name, out_dir / name)
        (out_dir / "engine.json").write_text(json.dumps({"backend": "onnxruntime"}))
        return engine
