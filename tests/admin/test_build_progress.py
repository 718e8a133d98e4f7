"""The build's progress as ``cachesvc prepare`` and a first ``serve`` show it (issue 30, item 14):
one bar redrawn in place on a terminal (a real pseudo-terminal here), a few plain lines
through a pipe; never one line per layer."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

import pytest

from tests.service.conftest import cachesvc_command, child_env, running_server
from tests.support.adapters import write_base

LAYERS = 24
SHAPE = ("--max-input-len", "16", "--max-kv-cache-capacity", "32")
#: A progress line: a builder stage and a percentage.
STAGE_LINE = re.compile(r"\b(build|read|graph|optimize|share|hash|publish|done)\s+\d+%$")


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with many layers (the graph stage reports once per layer) and a tokenizer."""
    from tests.gguf.ggufs import byte_level_tokenizer

    ckpt = write_base(tmp_path_factory.mktemp("deep") / "ckpt", num_hidden_layers=LAYERS)
    byte_level_tokenizer().save(str(ckpt / "tokenizer.json"))
    return ckpt


def _prepare_on_a_terminal(cache: Path, ckpt: Path) -> tuple[int, str]:
    """Run ``cachesvc prepare`` with stdout and stderr on a pseudo-terminal of 100 columns."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen([*cachesvc_command(), "--cache-dir", str(cache), "prepare", str(ckpt), *SHAPE],
                            stdin=slave, stdout=slave, stderr=slave, env=child_env(), close_fds=True)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=300), out.decode(errors="replace")


def test_prepare_on_a_terminal_draws_one_bar_in_place(tmp_path: Path, deep_checkpoint: Path) -> None:
    code, out = _prepare_on_a_terminal(tmp_path / "cache", deep_checkpoint)
    assert code == 0, out
    lines = out.replace("\r\n", "\n").split("\n")
    # Redrawn in place: the bar's states are separated by carriage returns, not new lines.
    bar_lines = [line for line in lines if "prepare: " in line]
    assert len(bar_lines) <= 2, lines
    redraws = re.findall(r"\rprepare: (\w+):\s+(\d+)%\|", out)
    assert {"graph", "optimize", "hash"} <= {stage for stage, _ in redraws}, out
    assert "INFO cachesvc.progress" not in out and "graph   4%" not in out
    assert " built in " in out  # the result still prints after the bar


def test_prepare_through_a_pipe_logs_a_few_lines(tmp_path: Path, deep_checkpoint: Path) -> None:
    r = subprocess.run([*cachesvc_command(), "--cache-dir", str(tmp_path / "cache"), "prepare",
                        str(deep_checkpoint), *SHAPE], env=child_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    progress = [line for line in r.stderr.splitlines() if STAGE_LINE.search(line)]
    graph = [line for line in progress if "graph" in line]
    assert len(graph) <= 4 and len(progress) <= 14, progress  # was one line per layer (24 + 9)
    assert "\r" not in r.stderr and "|" not in r.stderr


def test_a_first_serve_logs_the_same_few_lines(tmp_path: Path, deep_checkpoint: Path) -> None:
    with running_server(deep_checkpoint, tmp_path / "cache", tmp_path, *SHAPE) as server:
        log = server.log_tail(200_000)
    progress = [line for line in log.splitlines() if STAGE_LINE.search(line)]
    assert 0 < len(progress) <= 14 and len([p for p in progress if "graph" in p]) <= 4, progress
