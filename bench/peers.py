"""Our server against llama.cpp's ``llama-server``: same checkpoint, same prompts, one run.

All servers run at once on loopback ports (idle ones sleep), each with 8 slots and the same
threads; the measurement rounds alternate between them (best of ``--repeats`` rounds), so a busy
spell of a shared machine hits all of them rather than one; before each server's round the
script waits until every server is quiet (none used over 5% of a CPU in half a second), and
each figure starts after a second of idle and a quiet server, so what a server does after its
requests (ours makes the last requests' context records once idle for 0.5 s) is counted in no
figure: each measures one thing from a settled server. Each is driven
through the OpenAI protocol (``/v1/completions``, streamed, prompts as token ids so that both
see exactly the same tokens; EOS suppressed with ``logit_bias`` and ``ignore_eos`` so every
request yields ``max_tokens``). Figures:

* ``decode@N``: batch-1 decode tok/s after an N-token prompt (tokens after the first, over the
  time from the first to the last token);
* ``ttft@N``: time to first token of a never-seen N-token prompt (prefill; N/ttft is prefill tok/s);
* ``ttft_seen``: time to first token of an N-token prompt whose first N-8 tokens the server saw in
  the previous request (context reuse), and ``cold/seen``, how many times faster that is;
* ``agg1`` / ``agg8``: aggregate completion tok/s of 1 and of 8 concurrent clients (distinct
  short prompts, from the first request sent to the last token received), their ratio, and
  ``ttft_p95@8``.

Servers: ours (``cachesvc serve CHECKPOINT --precision P --max-batch-size 8
--enable-context-reuse``) for each ``--precision``, and ``llama-server -m GGUF -np 8 -t T`` for
each ``--gguf``. Our checkpoint may be the GGUF file itself (``--checkpoint model.Q4_1.gguf``):
our fp32 bundle then holds its dequantized values, int8 re-quantizes them to 8 bits as
``llama-quantize`` does for Q8_0, and int4 keeps the file's own 4-bit blocks, so each pair runs
the same weights. llama.cpp is not part of this repository: build its ``llama-server`` yourself,
e.g. from the ``llama-cpp-python`` source distribution (its ``vendor/llama.cpp`` folder, CMake
Release build of the ``llama-server`` and ``llama-quantize`` targets; about 13 minutes on 2
cores), and pass its path with ``--llama-server`` or ``LLAMA_SERVER``. ``llama-quantize
--allow-requantize`` makes F32 / Q8_0 files from a Q4_1 GGUF so that both sides run the same
weights. A checkpoint directory for our side can be made from the GGUF with ``transformers``
(``from_pretrained(dir, gguf_file=...)``, then ``save_pretrained`` of a plain copy).

    PYTHONPATH=. .venv/bin/python bench/peers.py --checkpoint model-q4_1.gguf --precision fp32,int8,int4 \\
        --gguf F32=model-f32.gguf,Q8_0=model-q8_0.gguf,Q4_1=model-q4_1.gguf --llama-server PATH

A ``--precision`` item may name the kernels too (``int4:fast`` serves ``--precision int4 --kernels
fast``), and ``--checkpoint`` may give one file per precision (``int4=a.gguf,int8=b.gguf``).

**The real-size case** (``--model llama-1b``): a random-weight ~1B Llama (``bench/real_size.py``
makes it once outside the repository: transformers' ``save_pretrained``, llama.cpp's converter,
``llama-quantize``), ours int4 from its Q4_0 file, int8 from its Q8_0 file, each at ``auto`` and
``fast`` kernels, against llama.cpp's Q4_0, Q4_1 and Q8_0 of the same weights:

    PYTHONPATH=. .venv/bin/python bench/peers.py --model llama-1b --llama-server PATH

Besides the table it prints each of our bundles' kernel plan, build and gate seconds, and every
server's resident memory after the rounds (``rss``).

``--quick`` (CI, ``bench/run_quick.sh``): ours only, on the tiny random demo checkpoint unless
``--checkpoint`` is given, short prompts and answers, one round; llama.cpp is skipped with one
line when no ``llama-server`` is given.

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
EOS_BIAS = {"0": -100, "1": -100, "2": -100}


@dataclass
class Server:
    """One running server child."""

    label: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Figures:
    label: str
    values: dict[str, float] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(server: Server, paths: Sequence[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as h:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                tail = server.log.read_text()[-3000:]
                raise RuntimeError(f"{server.label} exited; see {server.log}\n{tail}")
            for path in paths:
                try:
                    if h.get(server.url + path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{server.label} not ready after {timeout:.0f} s; see {server.log}")


def _pin(args: argparse.Namespace) -> list[str]:
    """``taskset -c CPUS`` when ``--cpus`` is given (our engine takes its threads from it)."""
    return ["taskset", "-c", args.cpus] if args.cpus else []


def start_ours(checkpoint: Path, item: str, args: argparse.Namespace, work: Path) -> Server:
    """Our server for ``item``: a precision, optionally ``:KERNELS`` (``int4:fast``)."""
    precision, _, kernels = item.partition(":")
    port = _free_port()
    log = work / f"ours-{item.replace(':', '-')}.log"
    argv = [
        sys.executable,
        "-m",
        "cachesvc.cli",
        "serve",
        str(checkpoint),
        "--cache-dir",
        str(work / "cache"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--precision",
        precision,
        *(["--kernels", kernels] if kernels else []),
        "--max-batch-size",
        "8",
        "--max-input-len",
        str(args.max_input_len),
        "--max-kv-cache-capacity",
        str(args.ctx),
        "--enable-context-reuse",
        "--log-level",
        "warning",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    with log.open("wb") as fh:
        proc = subprocess.Popen([*_pin(args), *argv], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = Server(f"ours {item}", proc, port, log)
    _wait_ready(server, ["/health/ready"], args.start_timeout)
    return server


#: Seconds of idle before each figure (longer than the scheduler's ``SAVE_DELAY``).
SETTLE_PAUSE = 1.0


def _cpu_seconds(server: Server) -> float:
    """CPU time the server process used so far (all its threads), seconds."""
    try:
        fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_quiet(servers: Sequence[Server], window: float = 0.5, limit: float = 60.0) -> None:
    """Until no server used more than 5% of a CPU over ``window`` (up to ``limit`` s): a server
    still busy after its round (ours writes the context records of its last requests once idle)
    would take the CPUs from the next one's measurement (SmolLM2 int4 read 79 instead of 128
    tok/s at 400 tokens right after the int8 server's round)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = [_cpu_seconds(s) for s in servers]
        time.sleep(window)
        if all(_cpu_seconds(s) - b <= 0.05 * window for s, b in zip(servers, before, strict=True)):
            return
    print(f"warning: a server still busy after {limit:.0f} s; measuring anyway", file=sys.stderr, flush=True)


def rss_mb(server: Server) -> float:
    """The server process's resident memory now, MB (VmRSS)."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bundle_line(server: Server) -> str:
    """Our bundle's kernel plan, build and gate seconds, as the admin API reports them."""
    with httpx.Client(timeout=30) as h:
        bundle_id = h.get(server.url + "/health").json()["capabilities"]["bundle_id"]  # this server's own
        engine = h.get(f"{server.url}/admin/bundles/{bundle_id}").json()["manifest"]["engine"]
    quality = engine.get("quality") or {}
    tried = ", ".join(f"{c['plan']}{'/codes' if c.get('int8_layout') == 'codes' else ''} "
                      f"{c['greedy_agreement']:.3f}/{c['identical']}of{quality['prompts']}"
                      f"{'*' if c['passed'] else ''}" for c in quality.get("candidates", []))
    return (f"{server.label}: plan {quality.get('plan', '-')} ({tried}), "
            f"build {engine['build_seconds']:.0f} s of which gate {quality.get('seconds', 0):.0f} s "
            f"(fp32 reference {'kept' if quality.get('reference_cached') else 'computed'})")


def start_llama(binary: str, gguf: Path, quant: str, args: argparse.Namespace, work: Path) -> Server:
    port = _free_port()
    log = work / f"llama-{quant}.log"
    argv = [
        binary,
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        "8",
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-c",
        str(8 * args.ctx),
        "--alias",
        MODEL,
        "--no-webui",
        *args.llama_args.split(),
    ]
    with log.open("wb") as fh:
        proc = subprocess.Popen([*_pin(args), *argv], stdout=fh, stderr=subprocess.STDOUT)
    server = Server(f"llama.cpp {quant}", proc, port, log)
    _wait_ready(server, ["/health"], args.start_timeout)
    return server


class Prompts:
    """Random token-id prompts; every call gives fresh tokens unless a prefix is passed."""

    def __init__(self, seed: int, high: int = 40000) -> None:
        self.rng = np.random.default_rng(seed)
        self.high = high

    def make(self, n: int, prefix: Sequence[int] = ()) -> list[int]:
        extra = self.rng.integers(100, self.high, size=n - len(prefix))
        return [*prefix, *(int(t) for t in extra)]


async def stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, cache_prompt: bool = True
) -> tuple[float, float, int, float]:
    """(ttft, time of last token, tokens, start) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": EOS_BIAS,
        "ignore_eos": True,
        "cache_prompt": cache_prompt,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            if usage.get("completion_tokens"):
                tokens = int(usage["completion_tokens"])
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if not first:
                first = now
            last = now
    if not tokens:
        raise RuntimeError("the server reported no usage; cannot count tokens")
    return first - start, last - start, tokens, start


def _keep(best: dict[str, float], name: str, value: float, higher: bool) -> None:
    if name not in best or (value > best[name] if higher else value < best[name]):
        best[name] = value


async def settle(server: Server) -> None:
    """Start a figure from a quiet server: a pause longer than ours waits before it makes the
    last requests' context records (0.5 s idle), then until the server's CPU is quiet. Without it
    a figure pays for what the figure before it left (on this 2-core VM, copying four long
    contexts that had sat in their slots: SmolLM2 int4's 8 clients read 130 instead of 185 tok/s);
    docs/serving.md measures that case on its own."""
    await asyncio.sleep(SETTLE_PAUSE)
    await asyncio.to_thread(wait_quiet, [server])


async def one_round(
    server: Server, best: dict[str, float], prompts: Prompts, args: argparse.Namespace
) -> None:
    """One pass over every figure on ``server``, keeping the best values in ``best``."""
    # No keep-alive: a server may drop an idle connection while the others are measured.
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await stream(client, server.url, prompts.make(16), 4)  # warm-up
        for n in args.contexts:
            await settle(server)
            ttft, end, tokens, _ = await stream(client, server.url, prompts.make(n), args.decode_tokens)
            _keep(best, f"ttft@{n}", ttft, False)
            _keep(best, f"decode@{n}", (tokens - 1) / (end - ttft), True)
        n = max(args.contexts)
        base = prompts.make(n - 8)
        await settle(server)
        await stream(client, server.url, base, 1)  # the seen request follows it at once
        ttft, *_ = await stream(client, server.url, prompts.make(n, base), 1)
        _keep(best, "ttft_seen", ttft, False)
        for clients in (1, 8):
            batch = [prompts.make(args.concurrent_prompt) for _ in range(clients)]
            await settle(server)
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(stream(client, server.url, p, args.concurrent_tokens) for p in batch)
            )
            wall = max(start + end for _, end, _, start in results) - t0
            _keep(best, f"agg{clients}", sum(r[2] for r in results) / wall, True)
            if clients == 8:
                ttfts = sorted(r[0] + r[3] - t0 for r in results)
                _keep(best, "ttft_p95@8", ttfts[int(np.ceil(0.95 * len(ttfts))) - 1], False)


def finish(label: str, best: dict[str, float], args: argparse.Namespace) -> Figures:
    values = dict(best)
    values["cold/seen"] = best[f"ttft@{max(args.contexts)}"] / best["ttft_seen"]
    values["agg8/agg1"] = best["agg8"] / best["agg1"]
    return Figures(label, values)


def table(figs: list[Figures], args: argparse.Namespace) -> str:
    rows = [
        *(f"decode@{n}" for n in args.contexts),
        *(f"ttft@{n}" for n in args.contexts),
        "ttft_seen",
        "cold/seen",
        "agg1",
        "agg8",
        "agg8/agg1",
        "ttft_p95@8",
        "rss",
    ]
    units = {"decode": "tok/s", "ttft": "ms", "agg1": "tok/s", "agg8": "tok/s", "rss": "MB"}
    out = ["| figure | " + " | ".join(f.label for f in figs) + " |", "|---" * (len(figs) + 1) + "|"]
    for row in rows:
        cells = []
        for f in figs:
            v = f.values.get(row)
            if v is None:
                cells.append("-")
            elif row.startswith("ttft"):
                cells.append(f"{v * 1000:,.0f} ms")
            elif "/" in row:
                cells.append(f"{v:.1f}x")
            elif row == "rss":
                cells.append(f"{v:,.0f}")
            else:
                cells.append(f"{v:.1f}")
        unit = next((u for k, u in units.items() if row.startswith(k) and "/" not in row), "")
        name = f"{row} ({unit})" if unit else row
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ratios(figs: list[Figures], pairs: Sequence[tuple[str, str]]) -> str:
    by = {f.label: f.values for f in figs}
    lines = []
    for ours, theirs in pairs:
        if ours not in by or theirs not in by:
            continue
        a, b = by[ours], by[theirs]
        parts = []
        for key in a:
            if b.get(key) and key != "rss":
                r = a[key] / b[key]
                if key.startswith("ttft"):
                    r = 1 / r  # speed-up: > 1 means ours answers sooner
                parts.append(f"{key} {r:.2f}x")
        lines.append(f"{ours} vs {theirs}: " + ", ".join(parts))
    return "\n".join(lines)


def _checkpoint_for(spec: str, item: str) -> Path:
    """The checkpoint of ``item`` (``int4:fast`` -> ``int4``) in ``--checkpoint``: one path for
    all, or ``PREC=path`` items."""
    if "=" not in spec:
        return Path(spec)
    paths = dict(part.split("=", 1) for part in spec.split(",") if part)
    precision = item.partition(":")[0]
    if precision not in paths:
        raise SystemExit(f"--checkpoint names no file for {precision} (has {', '.join(paths)})")
    return Path(paths[precision])


def _cpu_list(spec: str) -> list[int]:
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus += list(range(int(lo), int(hi or lo) + 1))
    return cpus


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None,
                   help="our side: a checkpoint directory or GGUF file, or PREC=path items")
    p.add_argument("--model", choices=["llama-1b"], default=None,
                   help="the real-size case (bench/real_size.py): sets --checkpoint, --gguf and --pairs")
    p.add_argument("--model-dir", type=Path, default=None, help="where the real-size files live")
    p.add_argument("--precision", default="fp32", help="comma-separated precisions of ours")
    p.add_argument("--gguf", default="", help="comma-separated LABEL=path.gguf for llama-server")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="path of llama-server")
    p.add_argument("--llama-args", default="", help="extra llama-server arguments, e.g. '--poll 0'")
    p.add_argument("--pairs", default="fp32=F32,int8=Q8_0,int4=Q4_1", help="ours=theirs pairs for ratios")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama-server threads (default: the CPUs of --cpus, else all of this process)",
    )
    p.add_argument("--cpus", default="", help="pin every server to these CPUs (taskset -c), e.g. 0")
    p.add_argument("--contexts", default="400,1500")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--concurrent-prompt", type=int, default=64)
    p.add_argument("--concurrent-tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096, help="KV capacity per slot")
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=None,
                   help="prompt seed (default: from the clock, so a --work reused from an earlier run "
                        "holds no context records of these prompts)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--work", type=Path, default=None, help="cache and logs (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="CI: the tiny demo, short prompts, one round")
    args = p.parse_args(argv)
    args.token_high = 40000  # prompts draw token ids from 100 up to this
    if args.quick:
        args.contexts, args.decode_tokens, args.concurrent_prompt, args.concurrent_tokens = "32,64", 4, 16, 4
        args.ctx, args.max_input_len, args.repeats, args.start_timeout = 256, 128, 1, 300
    if args.quick and not args.gguf:
        print("llama.cpp: skipped (--quick without --gguf/--llama-server)")
    if args.model == "llama-1b":
        from bench.real_size import DEFAULT_DIR, prepare

        files = prepare(args.model_dir or DEFAULT_DIR, args.llama_server)
        args.checkpoint = f"int4={files['Q4_0']},int8={files['Q8_0']},fp32={files['F32']}"
        if args.precision == "fp32":  # the default: the real-size case's own set
            args.precision = "int4,int4:fast,int8,int8:fast"
        args.gguf = args.gguf or ",".join(f"{q}={files[q]}" for q in ("Q4_0", "Q4_1", "Q8_0"))
        args.pairs = "int4=Q4_0,int4:fast=Q4_0,int4=Q4_1,int4:fast=Q4_1,int8=Q8_0,int8:fast=Q8_0"
    if args.seed is None:
        args.seed = int(time.time()) % 1_000_000
    print(f"prompt seed {args.seed}", file=sys.stderr, flush=True)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    if args.threads is None:
        args.threads = len(_cpu_list(args.cpus)) if args.cpus else len(os.sched_getaffinity(0))
    from bench import scratch_dir

    work = args.work or scratch_dir("peers-")
    work.mkdir(parents=True, exist_ok=True)
    if args.quick and args.checkpoint is None:
        from inference.demo import write_demo_checkpoint

        args.checkpoint = str(write_demo_checkpoint(work / "demo", arch="llama", size="tiny"))
        args.token_high = 1000  # the demo's vocabulary has 1024 tokens
    runs: list[tuple[str, str]] = []
    if args.checkpoint:
        runs += [("ours", prec) for prec in args.precision.split(",") if prec]
    if args.gguf:
        if not args.llama_server:
            p.error("--gguf needs --llama-server (or LLAMA_SERVER)")
        runs += [("llama", item) for item in args.gguf.split(",") if item]
    # All servers run at once (idle ones sleep) and the rounds alternate between them, so a
    # busy spell of the machine hits every server instead of one.
    servers: list[Server] = []
    try:
        for kind, what in runs:
            if kind == "ours":
                servers.append(start_ours(_checkpoint_for(args.checkpoint, what), what, args, work))
            else:
                quant, _, path = what.partition("=")
                servers.append(start_llama(args.llama_server, Path(path), quant, args, work))
        bests: list[dict[str, float]] = [{} for _ in servers]
        for r in range(args.repeats):
            for server, best in zip(servers, bests, strict=True):
                wait_quiet(servers)
                print(f"round {r + 1}: {server.label} ...", file=sys.stderr, flush=True)
                asyncio.run(one_round(server, best, Prompts(args.seed + 1000 * r, args.token_high), args))
                print(json.dumps({server.label: best}), file=sys.stderr, flush=True)
        figs = [finish(server.label, best, args) for server, best in zip(servers, bests, strict=True)]
        for server, fig in zip(servers, figs, strict=True):
            fig.values["rss"] = rss_mb(server)
        built = [bundle_line(s) for s in servers if s.label.startswith("ours ") and not args.quick]
    finally:
        for server in servers:
            server.stop()
    pinned = f", pinned to CPUs {args.cpus}" if args.cpus else ""
    print(
        f"threads {args.threads}{pinned}, best of {args.repeats}, decode {args.decode_tokens} tokens, "
        f"8 clients x {args.concurrent_tokens} tokens after {args.concurrent_prompt}-token prompts\n"
    )
    print(table(figs, args))
    if built:
        print()
        print("\n".join(built))
    pairs = [(f"ours {a}", f"llama.cpp {b}") for a, _, b in (x.partition("=") for x in args.pairs.split(","))]
    print()
    print(ratios(figs, pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
