"""The model pool end to end: one ``cachesvc serve`` process serving a catalog of three models.

Real server processes, the official ``openai`` client, real bundles of three tiny checkpoints of
different architectures (llama, qwen2, qwen3) built by the real builder. Greedy answers are
compared with ``transformers``; loads are counted from ``/metrics`` and the catalog's events.
The in-flight and forced unloads use the scripted engine (the hardware seam) so a request is
slow enough to be caught.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cachesvc.cache.manager import CacheManager
from inference.runtime.registry import memory_estimate
from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import ServerProcess, prepare_demo_checkpoints, run_cli, running_server
from tests.support.engines import EngineScript, Reply

ARCHS = ("llama", "qwen2", "qwen3")
PROMPT_IDS = [5, 17, 42, 7, 99, 3]
N_TOKENS = 6
PROFILE = ("--max-input-len", "64", "--max-kv-cache-capacity", "128")
SLOW = EngineScript(replies=(Reply("tick ", repeat=40),), delay=0.05)


class Catalog:
    """Three prepared checkpoints in one cache directory."""

    def __init__(self, cache_dir: Path, checkpoints: dict[str, Path], bundles: dict[str, str]) -> None:
        self.cache_dir = cache_dir
        self.checkpoints = checkpoints
        self.bundles = bundles

    def name(self, arch: str) -> str:
        """The served name of ``arch``'s checkpoint: its path as the catalog knows it."""
        return str(self.checkpoints[arch])


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    root = tmp_path_factory.mktemp("pool")
    cache_dir = root / "cache"
    checkpoints = prepare_demo_checkpoints(root, cache_dir, ARCHS, *PROFILE)
    bundles: dict[str, str] = {}
    manager = CacheManager.open(cache_dir, max_size_bytes=10**12)
    try:
        for b in manager.queries.list_bundles(state="ready").items:
            arch = next(a for a in ARCHS if Path(b.model).name == f"{a}-tiny")
            bundles[arch] = b.id
            checkpoints[arch] = Path(b.model)
    finally:
        manager.close()
    assert sorted(bundles) == sorted(ARCHS)
    return Catalog(cache_dir, checkpoints, bundles)


@pytest.fixture(scope="module")
def expected(catalog: Catalog) -> dict[str, str]:
    """transformers' greedy continuation of PROMPT_IDS for each checkpoint, decoded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out: dict[str, str] = {}
    for arch, ckpt in catalog.checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        model.eval()
        ids = torch.tensor([PROMPT_IDS])
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS, do_sample=False
            )
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        visible = [int(t) for t in gen[0, len(PROMPT_IDS) :] if int(t) not in eos_ids]
        out[arch] = load_tokenizer(ckpt).decode(visible)
    return out


def _complete(server: ServerProcess, name: str, **extra: Any) -> str:
    done = server.client().completions.create(
        model=name, prompt=PROMPT_IDS, max_tokens=N_TOKENS, temperature=0, extra_body=extra or None
    )
    return done.choices[0].text


def _engines(server: ServerProcess) -> list[dict[str, Any]]:
    with server.http() as h:
        r = h.get("/admin/engines")
        r.raise_for_status()
        engines: list[dict[str, Any]] = r.json()["engines"]
        return engines


def _loaded(server: ServerProcess) -> set[str]:
    return {e["bundle_id"] for e in _engines(server)}


def _metric(server: ServerProcess, prefix: str) -> float:
    with server.http() as h:
        text = h.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _events(cache_dir: Path, kind: str) -> list[Any]:
    manager = CacheManager.open(cache_dir, max_size_bytes=10**12)
    try:
        return list(manager.catalog.events.recent(kind=kind, limit=1000))
    finally:
        manager.close()


def _wait(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def pool_server(catalog: Catalog, tmp_path: Path) -> Iterator[ServerProcess]:
    flags = ("--max-loaded-models", "3", "--max-queued-requests", "32")
    with running_server(None, catalog.cache_dir, tmp_path, *flags) as server:
        yield server


# -- names and answers -----------------------------------------------------------------------------


def test_each_name_answers_with_its_model(
    pool_server: ServerProcess, catalog: Catalog, expected: dict[str, str]
) -> None:
    answers = {arch: _complete(pool_server, catalog.name(arch)) for arch in ARCHS}
    assert answers == expected
    # By bundle id as well: the same model, the same answer.
    assert _complete(pool_server, catalog.bundles["qwen3"]) == expected["qwen3"]
    assert _loaded(pool_server) == set(catalog.bundles.values())
    cards = {m.id: m for m in pool_server.client().models.list().data}
    # One entry per model, named by the last part of its checkpoint path (which also answers);
    # no server path and no bundle id is listed.
    assert sorted(cards) == sorted(f"{arch}-tiny" for arch in ARCHS)
    assert _complete(pool_server, "qwen3-tiny") == expected["qwen3"]
    for arch in ARCHS:
        card = cards[f"{arch}-tiny"].model_dump()
        assert card["bundle_id"] == catalog.bundles[arch] and card["loaded"] is True
        assert card["backend"] == "onnxruntime" and card["max_model_len"] == 128


def test_aliases_and_unknown_names(
    pool_server: ServerProcess, catalog: Catalog, expected: dict[str, str]
) -> None:
    with pool_server.http() as h:
        r = h.put("/admin/models/chat-small", json={"bundle_id": catalog.bundles["llama"]})
        assert r.status_code == 200, r.text
        r = h.put("/admin/models/chat-qwen", json={"model": catalog.name("qwen2")})
        assert r.status_code == 200, r.text
        assert {a["name"] for a in h.get("/admin/models").json()} == {"chat-small", "chat-qwen"}
    assert _complete(pool_server, "chat-small") == expected["llama"]
    assert _complete(pool_server, "chat-qwen") == expected["qwen2"]
    assert "chat-small" in {m.id for m in pool_server.client().models.list().data}
    with pytest.raises(openai.NotFoundError) as err:
        _complete(pool_server, "chat-smal")
    body = err.value.response.json()["error"]
    assert body["code"] == "model_not_found" and "chat-small" in body["message"]
    with pool_server.http() as h:
        assert h.delete("/admin/models/chat-small").status_code == 204
    with pytest.raises(openai.NotFoundError):
        _complete(pool_server, "chat-small")
    listed = run_cli(catalog.cache_dir, "models", "ls")
    assert "chat-qwen" in listed.stdout and "chat-small" not in listed.stdout
    assert run_cli(catalog.cache_dir, "models", "alias", "cli-name", catalog.bundles["qwen3"]).returncode == 0
    assert _complete(pool_server, "cli-name") == expected["qwen3"]
    assert run_cli(catalog.cache_dir, "models", "unalias", "cli-name").returncode == 0
    assert run_cli(catalog.cache_dir, "models", "unalias", "chat-qwen").returncode == 0


# -- loading ----------------------------------------------------------------------------------------


def test_twenty_concurrent_first_requests_load_once(
    pool_server: ServerProcess, catalog: Catalog, expected: dict[str, str]
) -> None:
    name = catalog.name("qwen2")
    results: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(_complete(pool_server, name))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert results == [expected["qwen2"]] * 20
    assert _metric(pool_server, "cachesvc_model_loads_total") == 1
    loads = [e for e in _events(catalog.cache_dir, "load") if e.bundle_id == catalog.bundles["qwen2"]]
    assert len(loads) >= 1


def test_max_loaded_models_one_alternates_with_correct_answers(
    catalog: Catalog, expected: dict[str, str], tmp_path: Path
) -> None:
    with running_server(None, catalog.cache_dir, tmp_path, "--max-loaded-models", "1") as server:
        for arch in ("llama", "qwen3", "llama", "qwen3"):
            assert _complete(server, catalog.name(arch)) == expected[arch]
            assert _loaded(server) == {catalog.bundles[arch]}
        assert _metric(server, "cachesvc_model_loads_total") == 4
        assert _metric(server, 'cachesvc_model_unloads_total{model="' + catalog.name("llama")) == 2


def test_keep_alive_two_seconds_and_zero(catalog: Catalog, tmp_path: Path) -> None:
    with running_server(None, catalog.cache_dir, tmp_path, "--keep-alive", "2") as server:
        _complete(server, catalog.name("llama"))
        (engine,) = _engines(server)
        assert engine["expires_at"] is not None and engine["keep_alive"] == 2
        assert _wait(lambda: not _loaded(server), timeout=10)
        # A request's keep_alive wins: 0 unloads as soon as it is idle.
        _complete(server, catalog.name("qwen2"), keep_alive=0)
        assert _wait(lambda: not _loaded(server), timeout=5)
        reasons = {e.reason for e in _events(catalog.cache_dir, "unload")}
        assert "idle" in reasons


def test_memory_budget_smaller_than_two_models_keeps_one(catalog: Catalog, tmp_path: Path) -> None:
    manager = CacheManager.open(catalog.cache_dir, max_size_bytes=10**12)
    try:
        sizes = [
            memory_estimate(
                manager.queries.bundle_dir(manager.catalog.bundles.require(catalog.bundles[a])), max_slots=1
            )
            for a in ("llama", "qwen2")
        ]
    finally:
        manager.close()
    # Each model's context-reuse record pool counts in its share of the budget.
    pool = max(sizes) // 4
    budget_gb = (max(sizes) + pool) * 1.5 / 1e9
    with running_server(
        None, catalog.cache_dir, tmp_path, "--memory-budget-gb", f"{budget_gb:.9f}",
        "--context-cache-partial-kv-snapshot-pool-bytes", str(pool),
    ) as server:
        _complete(server, catalog.name("llama"))
        _complete(server, catalog.name("qwen2"))
        assert _loaded(server) == {catalog.bundles["qwen2"]}
        assert (
            _metric(
                server, 'cachesvc_model_unloads_total{model="' + catalog.name("llama") + '",reason="memory"'
            )
            == 1
        )
    # A record pool as large as the model: one model alone is more than this budget.
    with running_server(
        None, catalog.cache_dir, tmp_path, "--memory-budget-gb", f"{budget_gb:.9f}",
        "--context-cache-partial-kv-snapshot-pool-bytes", str(max(sizes)),
    ) as server:
        with pytest.raises(openai.APIStatusError) as info:
            _complete(server, catalog.name("llama"))
        assert info.value.status_code == 503
        assert "context-reuse record pool" in str(info.value) and "--memory-budget-gb" in str(info.value)
        assert _loaded(server) == set()


def test_everything_busy_queues_then_429_with_retry_after(catalog: Catalog, tmp_path: Path) -> None:
    flags = ("--max-loaded-models", "1", "--queue-timeout", "1")
    with running_server(None, catalog.cache_dir, tmp_path, *flags, env=SLOW.to_env()) as server:
        busy = server.client().completions.create(
            model=catalog.name("llama"), prompt="go", max_tokens=40, stream=True
        )
        chunks = iter(busy)
        next(chunks)  # llama is loaded and busy: qwen2 cannot be loaded until it is idle
        with server.http() as h:
            r = h.post(
                "/v1/completions", json={"model": catalog.name("qwen2"), "prompt": "go", "max_tokens": 2}
            )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "server_overloaded" and int(r.headers["retry-after"]) >= 1
        list(chunks)
        # Idle again: the next request swaps the models.
        assert server.client().completions.create(model=catalog.name("qwen2"), prompt="go", max_tokens=2)


# -- operators -------------------------------------------------------------------------------------


def test_preload_unload_in_flight_and_forced(catalog: Catalog, tmp_path: Path) -> None:
    with running_server(None, catalog.cache_dir, tmp_path, env=SLOW.to_env()) as server, server.http() as h:
        name, bid = catalog.name("llama"), catalog.bundles["llama"]
        r = h.post("/admin/engines", json={"model": name, "keep_alive": -1})
        assert r.status_code == 200, r.text
        assert r.json()["bundle_id"] == bid and _loaded(server) == {bid}
        assert h.delete(f"/admin/engines/{bid}").status_code == 200
        assert not _loaded(server)

        # Unload with a request in flight: it finishes, then the engine goes.
        whole = server.client().completions.create(model=name, prompt="go", max_tokens=30).choices[0].text
        assert whole.startswith("tick tick")
        assert h.delete(f"/admin/engines/{bid}").status_code == 200
        stream = server.client().completions.create(model=name, prompt="go", max_tokens=30, stream=True)
        chunks = iter(stream)
        first = [next(chunks) for _ in range(2)]
        r = h.delete(f"/admin/engines/{bid}", params={"grace": 30}, timeout=60)
        seen = [*first, *chunks]
        text = "".join(c.choices[0].text for c in seen if c.choices)
        assert r.status_code == 200, r.text
        assert text == whole and seen[-1].choices[0].finish_reason == "length"
        assert not _loaded(server)

        # Forced: the stream ends with an error chunk and the slot is freed.
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json={"model": name, "prompt": "go", "max_tokens": 40, "stream": True},
            timeout=60,
        ) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            r = h.delete(f"/admin/engines/{bid}", params={"grace": 0, "force": "true"})
            got += list(lines)
        assert r.status_code == 200, r.text
        body = "\n".join(got)
        assert '"error"' in body and body.rstrip().endswith("data: [DONE]")
        assert not _loaded(server)
        # A new request loads the model again and gets a slot.
        assert (
            h.post("/v1/completions", json={"model": name, "prompt": "go", "max_tokens": 2}).status_code
            == 200
        )


def test_evicting_a_loaded_bundle_and_another_process_lease(catalog: Catalog, tmp_path: Path) -> None:
    bid = catalog.bundles["qwen3"]
    with running_server(None, catalog.cache_dir, tmp_path, env=SLOW.to_env()) as server, server.http() as h:
        h.post("/admin/engines", json={"model": bid}).raise_for_status()
        r = h.delete(f"/admin/bundles/{bid}")
        assert r.status_code == 409, r.text
        # Another serving process leases the llama bundle: unload_idle here cannot help.
        other = catalog.bundles["llama"]
        with running_server(
            catalog.name("llama"), catalog.cache_dir, tmp_path, *PROFILE, env=SLOW.to_env()
        ) as second:
            r = h.delete(f"/admin/bundles/{other}", params={"unload_idle": "true"})
            assert r.status_code == 409, r.text
            assert str(second.pid) in r.text
        r = h.delete(f"/admin/bundles/{bid}", params={"unload_idle": "true"})
        assert r.status_code == 200, r.text
        assert not _loaded(server)
        assert "evict" in {e.reason for e in _events(catalog.cache_dir, "unload") if e.bundle_id == bid}


def test_sigterm_with_three_models_loaded_exits_0_and_releases_every_lease(
    catalog: Catalog, tmp_path: Path
) -> None:
    # The previous test evicted qwen3: build it again (an operator action, never /v1's).
    again = run_cli(catalog.cache_dir, "prepare", str(catalog.checkpoints["qwen3"]), *PROFILE, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    remaining = list(ARCHS)
    with running_server(None, catalog.cache_dir, tmp_path, env=SLOW.to_env()) as server, server.http() as h:
        for arch in remaining:
            h.post("/admin/engines", json={"model": catalog.bundles[arch]}).raise_for_status()
        assert _loaded(server) == {catalog.bundles[a] for a in remaining}
        server.proc.send_signal(signal.SIGTERM)
        status = server.terminate()
    assert status == 0, server.log_tail()
    assert "shutdown" in {e.reason for e in _events(catalog.cache_dir, "unload")}
    cleared = run_cli(catalog.cache_dir, "clear", "--json")
    assert cleared.returncode == 0, cleared.stdout + cleared.stderr
    for arch in remaining:
        assert catalog.bundles[arch] in cleared.stdout
